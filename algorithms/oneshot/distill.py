"""Knowledge-distillation pieces shared by the one-shot methods (FedDF, DENSE, Co-Boosting).

The server-side distillation loops differ from local training in what they need per step
(teacher targets on the fly, generator steps, input perturbations, per-step schedules and
validation-based early stopping), so they do not go through ``LocalTrainer``; what they share
lives here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float,
            reduction: str = "batchmean") -> torch.Tensor:
    """T^2 * KL(softmax(t / T) || softmax(s / T)): Hinton's loss as FedDF, DENSE and Co-Boosting use it.

    ``reduction="none"`` returns the per-sample KL (summed over classes), used by the generators'
    adversarial terms.
    """
    t = temperature
    log_q = F.log_softmax(student_logits / t, dim=1)
    p = F.softmax(teacher_logits / t, dim=1)
    if reduction == "none":
        return F.kl_div(log_q, p, reduction="none").sum(dim=1) * (t * t)
    return F.kl_div(log_q, p, reduction=reduction) * (t * t)


def check_ensemble_weights(weights: torch.Tensor) -> torch.Tensor:
    """``weights``, after checking that they sum to more than zero (``combine_logits`` divides by the sum).

    A host read: call it where weights are set (per reweighting, per round), never per step.
    """
    if not bool(weights.detach().sum() > 0):
        raise ValueError("ensemble weights sum to zero: every member was switched off")
    return weights


def combine_logits(logits: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """sum_k w_k logits_k / sum_k w_k over the first axis of ``[K, B, C]`` (plain mean when None).

    Called every distillation and generator step, so it reads nothing back: the weights were checked
    where they were set (:func:`check_ensemble_weights`).
    """
    if weights is None:
        return logits.mean(dim=0)
    w = weights.to(logits.device, logits.dtype).reshape(-1, *([1] * (logits.dim() - 1)))
    return (w * logits).sum(dim=0) / w.sum()


class LogitEnsemble(nn.Module):
    """f_E(x) = sum_k w_k f_k(x) / sum_k w_k on logits (card method B); uniform weights by default.

    ``weights`` may be a tensor that requires grad (Co-Boosting learns it); the teachers are
    plain modules held in a ModuleList so ``.to`` and ``.eval`` reach them.
    """

    def __init__(self, models: Sequence[nn.Module], weights: torch.Tensor | None = None) -> None:
        super().__init__()
        if not models:
            raise ValueError("an ensemble needs at least one model")
        self.models = nn.ModuleList(models)
        self.weights = None if weights is None else check_ensemble_weights(weights)

    def member_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Every member's logits, stacked: [K, B, C]."""
        return torch.stack([m(x) for m in self.models])

    def combine(self, logits: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Weighted mean over the first axis of stacked member logits."""
        return combine_logits(logits, self.weights if weights is None else weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.combine(self.member_logits(x))


@torch.no_grad()
def predict_logits(model: nn.Module, x: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
    """Logits of ``model`` in eval mode over ``x`` in large batches (the train flag is restored)."""
    was_training = model.training
    model.eval()
    device = next(iter(model.parameters())).device
    outs = [model(x[i : i + batch_size].to(device)) for i in range(0, x.shape[0], batch_size)]
    model.train(was_training)
    return torch.cat(outs).to(x.device)


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of inputs on which two sets of logits predict the same class."""
    return float((a.argmax(dim=1) == b.argmax(dim=1)).float().mean())
