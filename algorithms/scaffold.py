"""SCAFFOLD (Karimireddy et al. 2020), option II control variates.

Client k with control variate c_k (kept across rounds in the client-state manager) trains with
gradient g + c - c_k for K local steps, then sets c_k+ = c_k - c + (w_global - w_k) / (K lr) and
sends delta_w = w_k - w_global and delta_c = c_k+ - c_k. The server moves the model by the
sample-weighted mean of delta_w (as FedAvg; the paper's uniform mean is ``weighting: uniform``)
and c by (|S| / N) times the uniform mean of delta_c. Both are sums, so hierarchical
aggregation is exact. Control variates cover trainable parameters, not BatchNorm buffers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fl_platform.algorithms.base import (
    AlgorithmSpec,
    ClientAlgorithm,
    LocalPlan,
    ServerAlgorithm,
    ServerStepConf,
    StateSpec,
)
from fl_platform.core import Aggregate, Broadcast, ClientUpdate, Metrics, RoundContext
from fl_platform.privacy.spec import PrivateUploads
from fl_platform.training.hooks import GradientCorrectionHook


@dataclass
class ScaffoldConf(ServerStepConf):
    name: str = "scaffold"
    weighting: str = "samples"  # "samples" (n_k-weighted model delta) or "uniform" (as in the paper)

    def inactive_fields(self, run: Any) -> dict[str, str]:
        out = super().inactive_fields(run)
        privacy = run.get("privacy")
        if privacy is not None and privacy.name != "none":
            out["weighting"] = f"under privacy={privacy.name} every client's clipped update counts once"
        return out


class ScaffoldClient(ClientAlgorithm):
    @classmethod
    def uploads(cls, cfg: ScaffoldConf) -> dict[str, str | None]:
        return {"delta": "n", "delta_c": None}

    @classmethod
    def private_uploads(cls, cfg: ScaffoldConf) -> PrivateUploads:
        """Under DP the control-variate delta is clipped and noised with the model delta: it is a function
        of the client's model delta and of its own control variate (so of its data)."""
        return PrivateUploads(("delta", "delta_c"), ("n", "clients"))

    def state_spec(self) -> dict[str, StateSpec]:
        return {"c": StateSpec(self.setup.num_params)}

    def contribution_sizes(self) -> dict[str, int]:
        return {"delta": self.setup.vector_size, "delta_c": self.setup.num_params}

    def prepare(self, ctx: RoundContext, client_id: int, broadcast: Broadcast, state, data, trainer) -> LocalPlan:
        c = broadcast.tensors["c"]
        c_i = state["c"] if state is not None else torch.zeros_like(c)
        return LocalPlan(broadcast.tensors["weights"], GradientCorrectionHook(c - c_i), {"c_i": c_i})

    def finish(self, ctx: RoundContext, client_id: int, broadcast: Broadcast, state, data, trainer,
               plan: LocalPlan, metrics: Metrics) -> ClientUpdate:
        c, c_i = broadcast.tensors["c"], plan.carry["c_i"]
        fm = trainer.fm
        steps = int(metrics.values["local_steps"][0])
        delta = fm.vector - plan.start
        n = data.num_samples
        if steps > 0:
            c_new = c_i - c - delta[: fm.num_params] / (steps * trainer.cfg.at_round(ctx.round).lr)
        else:
            c_new = c_i.clone()
        delta_c = c_new - c_i
        w = float(n) if self.cfg.weighting == "samples" else 1.0
        return ClientUpdate(client_id, {"delta": delta.mul_(w), "delta_c": delta_c},
                            {"n": w, "clients": 1.0}, n, metrics, state={"c": c_new})


class ScaffoldServer(ServerAlgorithm):
    pseudo_gradient = True  # the model part (server_opt acts on it; c moves as in the paper)

    def __init__(self, cfg: ScaffoldConf, setup, initial_weights: torch.Tensor) -> None:
        super().__init__(cfg, setup, initial_weights)
        if cfg.weighting not in ("samples", "uniform"):
            raise ValueError(f"algorithm.weighting must be 'samples' or 'uniform', got {cfg.weighting!r}")
        self.c = torch.zeros(setup.num_params)

    def broadcast(self, ctx: RoundContext) -> Broadcast:
        return Broadcast({"weights": self.weights, "c": self.c})

    def aggregate(self, ctx: RoundContext, result: Aggregate | list[ClientUpdate]) -> dict[str, float]:
        assert isinstance(result, Aggregate)
        k = result.weights.get("clients", 0.0)
        if k <= 0:
            return {}
        self.apply_mean_delta(result, "delta", "n")
        self.c += (result.tensors["delta_c"] / k).to(torch.float32) * (k / self.setup.num_clients)
        return {"control_norm": float(self.c.norm())}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "c": self.c.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.c = state["c"].clone()


SPEC = AlgorithmSpec("scaffold", ScaffoldConf, ScaffoldClient, ScaffoldServer,
                     "SCAFFOLD: control variates correct client drift (per-client state)")
