"""Ditto (Li et al., ICML 2021): a personal model per client, regularised towards the global one.

The global model is trained exactly as FedAvg. Each sampled client also keeps a personal model v
(the whole ``[params | buffers]`` vector, in the client-state manager; on first use, the global
model it receives) and, after its FedAvg training, trains v for the same number of local steps on
the same data (its own minibatch orders, ``Stream.PERSONAL``) on the objective
``F_k(v) + lam/2 ||v - w||^2``, where w is the global model received this round: each step's
gradient is ``grad F_k(v) + lam (v - w)`` (``ProximalHook``). v never leaves the client; it is what
per-client evaluation (``eval.clients``) scores as ``personal_*``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fl_platform.algorithms.base import AlgorithmSpec, StateSpec, require
from fl_platform.algorithms.fedavg import FedAvgClient, FedAvgConf, FedAvgServer
from fl_platform.core import Broadcast, ClientUpdate, RoundContext
from fl_platform.seeding import Stream
from fl_platform.training.hooks import ProximalHook
from fl_platform.training.loop import ClientData, LocalTrainer


@dataclass
class DittoConf(FedAvgConf):
    name: str = "ditto"
    lam: float = 0.1  # the personal model's pull towards the global one

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self, (self.lam >= 0, "lam", ">= 0"))

    def inactive_fields(self, run: Any) -> dict[str, str]:
        out = super().inactive_fields(run)
        ev = run.get("eval")
        if ev is None or str(getattr(ev.clients, "value", ev.clients)) == "none":
            out["lam"] = ("it shapes only the personal models, which only per-client evaluation reads, and "
                          "eval.clients=none (set eval.clients=all or sample)")
        return out


class DittoClient(FedAvgClient):
    def state_spec(self) -> dict[str, StateSpec]:
        return {"v": StateSpec(self.setup.vector_size)}

    def personal_model(self, ctx: RoundContext, client_id: int, broadcast: Broadcast,
                       state: dict[str, torch.Tensor] | None) -> torch.Tensor:
        return broadcast.tensors["weights"] if state is None else state["v"]

    def train(self, ctx: RoundContext, client_id: int, broadcast: Broadcast,
              state: dict[str, torch.Tensor] | None, data: ClientData, trainer: LocalTrainer) -> ClientUpdate:
        update = super().train(ctx, client_id, broadcast, state, data, trainer)  # the global: FedAvg
        weights = broadcast.tensors["weights"]
        fm = trainer.fm
        fm.load(self.personal_model(ctx, client_id, broadcast, state))
        trainer.fit(data, ProximalHook(self.cfg.lam, weights[: fm.num_params]), seed=ctx.seed, round=ctx.round,
                    client=client_id, stream=Stream.PERSONAL)
        update.state = {"v": fm.vector.clone()}
        return update


SPEC = AlgorithmSpec("ditto", DittoConf, DittoClient, FedAvgServer,
                     "Ditto: FedAvg global model plus a personal model per client pulled towards it (lam)")
