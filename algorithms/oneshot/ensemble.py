"""Logit ensemble (card method B): the reference upper bound, K models at inference.

f_E(x) = (1/K) sum_k f_k(x) on logits (``weighting: uniform``, the card's default), or the
n_k-weighted mean (``weighting: samples``). It is not one model: its size is K client models
and its inference cost K forward passes, both reported. ``self.weights`` (what a run saves as
``model.pt``) holds the one-shot FedAvg model; the ensemble itself is the list of client
models in the server state. ``calibrate: true`` adds FuseFL's classifier calibration as one more
round (calibration.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fl_platform.algorithms.base import AlgorithmSpec
from fl_platform.algorithms.oneshot.calibration import (
    MEMBERS,
    CalibratedConf,
    CalibratedServer,
    concat_logits,
    ensemble_head,
    head_vector,
    linear_from,
    staged,
)
from fl_platform.algorithms.oneshot.distill import combine_logits
from fl_platform.algorithms.oneshot.protocol import OneShotClient, build_module, count_model
from fl_platform.core import RoundContext
from fl_platform.training.flat import FlatModel


@dataclass
class EnsembleConf(CalibratedConf):
    name: str = "oneshot_ensemble"
    weighting: str = "uniform"  # uniform (1 / K) or samples (n_k / sum n)


class EnsembleServer(CalibratedServer):
    """With ``calibrate: true`` (calibration.py) the last round calibrates one linear head on the members'
    concatenated features, starting from the map that equals the ensemble."""

    def __init__(self, cfg: EnsembleConf, setup, initial_weights) -> None:
        if cfg.weighting not in ("samples", "uniform"):
            raise ValueError(f"algorithm.weighting must be 'samples' or 'uniform', got {cfg.weighting!r}")
        super().__init__(cfg, setup, initial_weights)
        self.head: torch.Tensor | None = None  # the calibrated head on the concatenated features

    def member_weights(self) -> torch.Tensor:
        if self.cfg.weighting == "samples":
            return torch.tensor(self.sizes, dtype=torch.float32)
        return torch.ones(len(self.teachers))

    def build(self, ctx: RoundContext) -> dict[str, float]:
        self.weights = self.fedavg_vector()
        return {"ensemble_members": float(len(self.teachers))}

    def final_logits(self, x: torch.Tensor, teacher_logits: list[torch.Tensor], fm: FlatModel,
                     batch_size: int) -> torch.Tensor:
        if self.head is not None:
            return concat_logits(self.teacher_modules(fm.device), self._head(), x, batch_size)
        return self.uncalibrated_logits(x, teacher_logits, fm, batch_size)

    def final_size(self) -> tuple[int, int]:
        member = build_module(self.setup, self.teachers[0], "cpu")
        params, nbytes = count_model(member)
        k = len(self.teachers)
        if self.head is None:
            return params * k, nbytes * k
        swap = self.head.numel() - k * sum(p.numel() for p in staged(member).head.parameters())  # K heads -> one
        return params * k + swap, nbytes * k + 4 * swap

    # -- calibration (calibrate: true)
    def _head(self) -> nn.Linear:
        assert self.head is not None
        members = len(self.teachers)
        dim = build_module(self.setup, self.teachers[0], "cpu")
        return linear_from(self.head, members * staged(dim).feature_dim, self.setup.num_classes)

    def calibration_tensors(self) -> dict[str, torch.Tensor]:
        return {MEMBERS: torch.stack(self.teachers)}

    def initial_head(self) -> nn.Linear:
        return ensemble_head([staged(m) for m in self.teacher_modules("cpu")], self.member_weights())

    def set_head(self, head: nn.Linear) -> None:
        self.head = head_vector(head)

    def uncalibrated_logits(self, x: torch.Tensor, teacher_logits: list[torch.Tensor], fm: FlatModel,
                            batch_size: int) -> torch.Tensor:
        return combine_logits(torch.stack(teacher_logits), self.member_weights())

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "head": None if self.head is None else self.head.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.head = None if state.get("head") is None else state["head"].clone()


SPEC = AlgorithmSpec("oneshot_ensemble", EnsembleConf, OneShotClient, EnsembleServer,
                     "Logit ensemble of the one-shot client models (reference upper bound)")
