"""Deployment through Flower 1.42: a ServerApp and a ClientApp around our algorithms.

The ServerApp drives the same round loop as the simulator (``engine/simulation.py``) with an
engine that moves each round's broadcast and replies through a Flower ``Grid``; the ClientApp
runs the algorithm's client half with the shared ``LocalTrainer``. Nothing here knows any
particular algorithm: broadcasts and updates travel as generic named tensors (``records.py``).
See docs/deploy.md.
"""
