"""Data-centre S-SGD on torch.distributed: the platform's models, data and compressors, data-parallel.

Launched by torchrun (``torchrun --nproc_per_node=N -m fl_platform.ssgd [overrides]``, or the
``fl-ssgd`` console script); gloo on CPU, NCCL on GPU. Gradients are synchronised every step by
DDP, with a communication hook built from our compressors (hooks.py), or by the ACP-SGD optimiser
wrapper (acp.py); local SGD (localsgd.py) averages models every H steps. docs/ssgd.md has the rest.
"""
