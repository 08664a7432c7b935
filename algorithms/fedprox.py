"""FedProx (Li et al. 2020): FedAvg whose local objective adds (mu/2)||w - w_global||^2.

The proximal term enters as a gradient correction mu * (w - w_global), which is exactly its
gradient, so the loss itself stays the model's cross-entropy.
"""

from __future__ import annotations

from dataclasses import dataclass

from fl_platform.algorithms.base import AlgorithmSpec, require
from fl_platform.algorithms.fedavg import FedAvgClient, FedAvgConf, FedAvgServer
from fl_platform.training.hooks import ProximalHook


@dataclass
class FedProxConf(FedAvgConf):
    name: str = "fedprox"
    mu: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self, (self.mu >= 0, "mu", ">= 0"))


class FedProxClient(FedAvgClient):
    def hooks(self, ctx, broadcast, state, trainer):
        num_params = trainer.fm.num_params
        return ProximalHook(self.cfg.mu, broadcast.tensors["weights"][:num_params])


SPEC = AlgorithmSpec("fedprox", FedProxConf, FedProxClient, FedAvgServer,
                     "FedProx: FedAvg with a proximal term mu/2 ||w - w_global||^2")
