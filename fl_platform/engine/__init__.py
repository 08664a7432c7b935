"""Simulation engine: workers that train many clients each, scheduling, the round loop."""
