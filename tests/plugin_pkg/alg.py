"""An algorithm: FedAvg whose server clips the averaged update to ``max_norm`` and moves by ``server_lr``.

Written as a user would, against the public algorithm API only (docs/algorithm-api.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fl_platform.algorithms.base import AlgorithmSpec, ClientAlgorithm, ServerAlgorithm, ServerStepConf
from fl_platform.core import Aggregate, RoundContext


@dataclass
class ClipConf(ServerStepConf):
    name: str = "clipavg"
    max_norm: float = 0.0  # 0: no clipping
    warmup_rounds: int = 0  # rounds without clipping first

    def inactive_fields(self, run: Any) -> dict[str, str]:
        if self.max_norm == 0:
            return {"warmup_rounds": "it delays the clipping, and max_norm=0 turns clipping off"}
        return {}


class ClipServer(ServerAlgorithm):
    def aggregate(self, ctx: RoundContext, result: Aggregate | list) -> dict[str, float]:
        total = result.weights.get("n", 0.0)
        if total <= 0:
            return {}
        mean = (result.tensors["delta"] / total).to(torch.float32)
        norm = float(mean.norm())
        if self.cfg.max_norm > 0 and ctx.round >= self.cfg.warmup_rounds and norm > self.cfg.max_norm:
            mean = mean * (self.cfg.max_norm / norm)
        self.weights += self.cfg.server_lr * mean
        return {"update_norm": norm}


SPEC = AlgorithmSpec("clipavg", ClipConf, ClientAlgorithm, ClipServer, "FedAvg with a clipped server update")
