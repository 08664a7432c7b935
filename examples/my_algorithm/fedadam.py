"""FedAdam (Reddi et al., "Adaptive Federated Optimization", ICLR 2021): FedAvg with Adam on the server.

Your algorithm in one file (docs/tutorial-algorithm.md). Clients train exactly as in FedAvg and
send ``n_k * delta_k`` with weight ``n_k``; the server treats the sample-weighted mean update
``Delta`` as a pseudo-gradient and takes an Adam step (the paper's Algorithm 2, no bias correction):

    m <- beta1 * m + (1 - beta1) * Delta
    v <- beta2 * v + (1 - beta2) * Delta^2
    w <- w + server_lr * m / (sqrt(v) + tau)

``tau`` (the paper's adaptivity, 1e-3 by default) bounds the step where ``v`` is tiny. Adam acts on
the parameters; float buffers (BatchNorm statistics) take the plain mean update, as in FedAvg.
The file imports only the platform's public algorithm API; register it with
``algorithm=plugin algorithm._target_=fedadam:SPEC`` or, installed, ``algorithm=fedadam``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fl_platform.algorithms.base import AlgorithmSpec, ClientAlgorithm, ServerAlgorithm, ServerStepConf
from fl_platform.core import Aggregate, ClientUpdate, RoundContext


@dataclass
class FedAdamConf(ServerStepConf):
    """The config section ``algorithm.*``; Hydra validates every key against these fields."""

    name: str = "fedadam"
    server_lr: float = 0.01  # eta: the paper tunes it on a grid, 10^-2 .. 10^-0.5 for FedAdam
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3


class FedAdamServer(ServerAlgorithm):
    def __init__(self, cfg: FedAdamConf, setup: Any, initial_weights: torch.Tensor) -> None:
        super().__init__(cfg, setup, initial_weights)
        n = setup.num_params  # weights = [parameters | float buffers]
        self.m = torch.zeros(n, dtype=torch.float32)
        self.v = torch.zeros(n, dtype=torch.float32)

    def aggregate(self, ctx: RoundContext, result: Aggregate | list[ClientUpdate]) -> dict[str, float]:
        total = result.weights.get("n", 0.0)
        if total <= 0:
            return {}
        delta = (result.tensors["delta"] / total).to(torch.float32)  # the pseudo-gradient Delta
        n, cfg = self.m.numel(), self.cfg
        grad = delta[:n]
        self.m.mul_(cfg.beta1).add_(grad, alpha=1 - cfg.beta1)
        self.v.mul_(cfg.beta2).addcmul_(grad, grad, value=1 - cfg.beta2)
        step = cfg.server_lr * self.m / (self.v.sqrt() + cfg.tau)
        self.weights[:n] += step
        self.weights[n:] += delta[n:]  # buffers: FedAvg's mean
        return {"server_step_norm": float(step.norm())}

    def state_dict(self) -> dict[str, Any]:  # everything a resumed run needs
        return {**super().state_dict(), "m": self.m.clone(), "v": self.v.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.m, self.v = state["m"].clone(), state["v"].clone()


# The client half is FedAvg's (ClientAlgorithm's default: local training, then n * delta with weight n).
SPEC = AlgorithmSpec("fedadam", FedAdamConf, ClientAlgorithm, FedAdamServer,
                     "FedAdam: FedAvg clients, Adam on the server (Reddi et al. 2021)")
