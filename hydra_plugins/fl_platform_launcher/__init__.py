"""Hydra launcher plugins shipped with fl_platform (``hydra/launcher=ray_cluster``)."""
