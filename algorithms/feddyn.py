"""FedDyn (Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021), Algorithm 1.

Client k, sampled in round t with the server model w, keeps ``g_k`` (its last gradient of the local
loss, zeros when first seen) and minimises

    L_k(theta) - <g_k, theta> + alpha/2 ||theta - w||^2

with the shared local loop (the linear term and the proximal term as gradient corrections, so it
also runs vectorised), then sets ``g_k <- g_k - alpha (theta_k - w)`` and sends ``theta_k - w``.
The server keeps ``h`` (zeros at first):

    h <- h - alpha/m sum_{k in P_t} (theta_k - w)       (m = num_clients)
    w <- mean_{k in P_t} theta_k - h / alpha

a uniform mean over the sampled clients, as in the paper. The dynamic regulariser covers the
trainable parameters; float buffers (BatchNorm statistics) take the clients' mean. The server
builds its model from h rather than stepping on a pseudo-gradient, so ``server_opt`` is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fl_platform.algorithms.base import (
    AlgorithmConf,
    AlgorithmSpec,
    ClientAlgorithm,
    LocalPlan,
    ServerAlgorithm,
    StateSpec,
    require,
)
from fl_platform.core import Aggregate, Broadcast, ClientUpdate, Metrics, RoundContext
from fl_platform.privacy.spec import PrivateUploads
from fl_platform.training.hooks import ComposedHooks, GradientCorrectionHook, ProximalHook


@dataclass
class FedDynConf(AlgorithmConf):
    name: str = "feddyn"
    alpha: float = 0.01  # the paper's alpha (it uses 1e-1 .. 1e-3; 1e-2 in most of its experiments)


def _check(cfg: FedDynConf) -> None:
    require(cfg, (cfg.alpha > 0, "alpha", "> 0 (FedDyn divides by it)"))


class FedDynClient(ClientAlgorithm):
    @classmethod
    def uploads(cls, cfg: FedDynConf) -> dict[str, str | None]:
        return {"delta": "clients"}  # theta_k - w, each client once (the paper's uniform mean)

    @classmethod
    def private_uploads(cls, cfg: FedDynConf) -> PrivateUploads:
        return PrivateUploads(("delta",), ("clients",))

    def state_spec(self) -> dict[str, StateSpec]:
        return {"grad_prev": StateSpec(self.setup.num_params)}

    def prepare(self, ctx: RoundContext, client_id: int, broadcast: Broadcast, state, data, trainer) -> LocalPlan:
        w = broadcast.tensors["weights"]
        p = self.setup.num_params
        g = state["grad_prev"] if state is not None else torch.zeros(p, dtype=w.dtype, device=w.device)
        hooks = ComposedHooks(ProximalHook(self.cfg.alpha, w[:p]), GradientCorrectionHook(-g))
        return LocalPlan(w, hooks, {"grad_prev": g})

    def finish(self, ctx: RoundContext, client_id: int, broadcast: Broadcast, state, data, trainer,
               plan: LocalPlan, metrics: Metrics) -> ClientUpdate:
        delta = trainer.fm.vector - plan.start
        g_new = plan.carry["grad_prev"] - self.cfg.alpha * delta[: self.setup.num_params]
        return ClientUpdate(client_id, {"delta": delta}, {"clients": 1.0}, data.num_samples, metrics,
                            state={"grad_prev": g_new})


class FedDynServer(ServerAlgorithm):
    def __init__(self, cfg: FedDynConf, setup, initial_weights: torch.Tensor) -> None:
        super().__init__(cfg, setup, initial_weights)
        _check(cfg)
        self.h = torch.zeros(setup.num_params)

    def aggregate(self, ctx: RoundContext, result: Aggregate | list[ClientUpdate]) -> dict[str, float]:
        assert isinstance(result, Aggregate)
        k = result.weights.get("clients", 0.0)
        if k <= 0:
            return {}
        total = result.tensors["delta"].to(torch.float32)  # sum over the sampled clients of theta_k - w
        p, alpha = self.setup.num_params, self.cfg.alpha
        self.h -= total[:p] * (alpha / self.setup.num_clients)
        self.weights += total / k  # the clients' mean model (buffers: their mean statistics)
        self.weights[:p] -= self.h / alpha
        return {"feddyn_h_norm": float(self.h.norm())}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "h": self.h.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.h = state["h"].clone()


SPEC = AlgorithmSpec("feddyn", FedDynConf, FedDynClient, FedDynServer,
                     "FedDyn: dynamic regulariser (per-client gradient state, server h) aligns local and global optima")
