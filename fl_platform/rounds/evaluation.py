"""Where the global model is evaluated: the driver's own model, or an engine's worker.

The round loop evaluates named sets (``test``; ``validation`` for early stopping) through one
``Evaluator``. ``DriverEvaluator`` runs the server half's ``evaluate`` on the driver's model (its
device: the CPU, a GPU of the driver's node). The Ray engine gives its own evaluator when the
evaluation belongs on a worker (``engine.eval_device=worker``, or ``auto`` when the workers train
on GPUs and the driver's node has none): the sets travel to the worker once, the server half at
each evaluation (its ``evaluate`` may use any of its state), and the worker evaluates on its device
between rounds, so a GPU run never evaluates on the driver's CPU.
"""

from __future__ import annotations

from typing import Protocol

import torch

from fl_platform.algorithms.base import ServerAlgorithm
from fl_platform.training.flat import FlatModel


class Evaluator(Protocol):
    def add(self, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Hold the evaluation set ``name`` (features, labels) for later ``evaluate`` calls."""

    def evaluate(self, server: ServerAlgorithm, name: str, batch_size: int) -> dict[str, float]:
        """``server.evaluate`` of the current global model on set ``name``."""


class DriverEvaluator:
    """Evaluates in this process, on ``model`` (and its device)."""

    where = "driver"

    def __init__(self, model: FlatModel) -> None:
        self.model = model
        self.sets: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def add(self, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        self.sets[name] = (x.to(self.model.device), y.to(self.model.device))

    def evaluate(self, server: ServerAlgorithm, name: str, batch_size: int) -> dict[str, float]:
        x, y = self.sets[name]
        return server.evaluate(self.model, x, y, batch_size)

