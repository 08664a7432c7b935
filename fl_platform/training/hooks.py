"""The only ways an algorithm changes local training (DESIGN.md section 9).

The loop knows no algorithm. FedProx and SCAFFOLD correct the gradient in ``before_step``;
FedImpro and VHL replace ``loss`` (split forward, extra virtual batches); hooks compose so
that, e.g., VHL can be stacked on FedProx.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fl_platform.training.flat import FlatModel


@dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor
    step: int  # global step index within this client's local training
    epoch: int


class TrainHooks:
    """Default behaviour: cross-entropy on the model's logits, no gradient correction."""

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (loss to minimise, logits of the real batch for the accuracy metric)."""
        logits = model(batch.x)
        return F.cross_entropy(logits, batch.y), logits

    def before_step(self, fm: FlatModel) -> None:
        """Called after backward, before clipping and the optimiser step: correct ``fm.grad``."""

    def after_step(self, fm: FlatModel, batch: Batch) -> None:
        """Called after the optimiser step (e.g. to update running statistics)."""


class ComposedHooks(TrainHooks):
    """Chain hooks: the first hook that overrides ``loss`` provides it; corrections all apply."""

    def __init__(self, *hooks: TrainHooks) -> None:
        self.hooks = [h for h in hooks if h is not None]
        overriding = [h for h in self.hooks if type(h).loss is not TrainHooks.loss]
        if len(overriding) > 1:
            names = ", ".join(type(h).__name__ for h in overriding)
            raise ValueError(f"only one hook may replace the loss, got: {names}")
        self._loss_hook = overriding[0] if overriding else TrainHooks()

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        return self._loss_hook.loss(model, batch)

    def before_step(self, fm: FlatModel) -> None:
        for h in self.hooks:
            h.before_step(fm)

    def after_step(self, fm: FlatModel, batch: Batch) -> None:
        for h in self.hooks:
            h.after_step(fm, batch)


class ProximalHook(TrainHooks):
    """FedProx: the gradient of (mu/2)||w - w_global||^2 added to the parameter gradient."""

    def __init__(self, mu: float, global_params: torch.Tensor) -> None:
        self.mu = mu
        self.global_params = global_params

    def before_step(self, fm: FlatModel) -> None:
        if self.mu:
            fm.grad.add_(fm.params - self.global_params, alpha=self.mu)


class GradientCorrectionHook(TrainHooks):
    """Add a constant vector to the parameter gradient (SCAFFOLD: c - c_i)."""

    def __init__(self, correction: torch.Tensor) -> None:
        self.correction = correction

    def before_step(self, fm: FlatModel) -> None:
        fm.grad.add_(self.correction)
