"""FedAvg (McMahan et al. 2017): local SGD from the global model, sample-weighted average of deltas.

The server step is w <- w + server_lr * (sum_k n_k delta_k / sum_k n_k), with optional server
momentum (FedAvgM) when ``server_momentum`` > 0, on the parameters; float buffers (BatchNorm's running
statistics) take the clients' mean (``ServerAlgorithm.apply_update``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fl_platform.algorithms.base import (
    AlgorithmSpec,
    ClientAlgorithm,
    ServerAlgorithm,
    ServerStepConf,
    require,
)
from fl_platform.core import Aggregate, ClientUpdate, RoundContext


@dataclass
class FedAvgConf(ServerStepConf):
    name: str = "fedavg"
    server_momentum: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self, (0.0 <= self.server_momentum < 1.0, "server_momentum", "in [0, 1)"))

    def inactive_fields(self, run: Any) -> dict[str, str]:
        out = super().inactive_fields(run)
        if "server_lr" in out:
            out["server_momentum"] = out["server_lr"]
        elif run.rounds == 1:
            out["server_momentum"] = "the velocity first differs from the update in round 2, and rounds=1"
        return out


class FedAvgClient(ClientAlgorithm):
    pass


class FedAvgServer(ServerAlgorithm):
    pseudo_gradient = True

    def __init__(self, cfg: FedAvgConf, setup, initial_weights: torch.Tensor) -> None:
        super().__init__(cfg, setup, initial_weights)
        self.velocity: torch.Tensor | None = None

    def aggregate(self, ctx: RoundContext, result: Aggregate | list[ClientUpdate]) -> dict[str, float]:
        assert isinstance(result, Aggregate)
        self.apply_mean_delta(result, "delta", "n")
        return {}

    def server_step(self, grad: torch.Tensor) -> torch.Tensor:
        """server_lr times the update, or its velocity with server momentum (parameters only: the
        buffers take the clients' mean, ``apply_update``)."""
        momentum = getattr(self.cfg, "server_momentum", 0.0)
        if momentum:
            self.velocity = grad.clone() if self.velocity is None else self.velocity.mul_(momentum).add_(grad)
            grad = self.velocity
        return grad * self.cfg.server_lr

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.velocity is not None:
            state["velocity"] = self.velocity.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.velocity = state["velocity"].clone() if "velocity" in state else None


SPEC = AlgorithmSpec("fedavg", FedAvgConf, FedAvgClient, FedAvgServer,
                     "FedAvg: sample-weighted average of local updates")
