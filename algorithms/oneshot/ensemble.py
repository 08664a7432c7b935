"""Logit ensemble (card method B): the reference upper bound, K models at inference.

f_E(x) = (1/K) sum_k f_k(x) on logits (``weighting: uniform``, the card's default), or the
n_k-weighted mean (``weighting: samples``). It is not one model: its size is K client models
and its inference cost K forward passes, both reported. ``self.weights`` (what a run saves as
``model.pt``) holds the one-shot FedAvg model; the ensemble itself is the list of client
models in the server state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from fl_platform.algorithms.base import AlgorithmSpec
from fl_platform.algorithms.oneshot.distill import combine_logits
from fl_platform.algorithms.oneshot.protocol import (
    OneShotClient,
    OneShotConf,
    OneShotServer,
    build_module,
    count_model,
)

from fl_platform.core import RoundContext
from fl_platform.training.flat import FlatModel


@dataclass
class EnsembleConf(OneShotConf):
    name: str = "oneshot_ensemble"
    weighting: str = "uniform"  # uniform (1 / K) or samples (n_k / sum n)


class EnsembleServer(OneShotServer):
    def __init__(self, cfg: EnsembleConf, setup, initial_weights) -> None:
        if cfg.weighting not in ("samples", "uniform"):
            raise ValueError(f"algorithm.weighting must be 'samples' or 'uniform', got {cfg.weighting!r}")
        super().__init__(cfg, setup, initial_weights)

    def member_weights(self) -> torch.Tensor:
        if self.cfg.weighting == "samples":
            return torch.tensor(self.sizes, dtype=torch.float32)
        return torch.ones(len(self.teachers))

    def build(self, ctx: RoundContext) -> dict[str, float]:
        self.weights = self.fedavg_vector()
        return {"ensemble_members": float(len(self.teachers))}

    def final_logits(self, x: torch.Tensor, teacher_logits: list[torch.Tensor], fm: FlatModel,
                     batch_size: int) -> torch.Tensor:
        return combine_logits(torch.stack(teacher_logits), self.member_weights())

    def final_size(self) -> tuple[int, int]:
        params, nbytes = count_model(build_module(self.setup, self.teachers[0], "cpu"))
        return params * len(self.teachers), nbytes * len(self.teachers)


SPEC = AlgorithmSpec("oneshot_ensemble", EnsembleConf, OneShotClient, EnsembleServer,
                     "Logit ensemble of the one-shot client models (reference upper bound)")
