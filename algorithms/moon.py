"""MOON (Li, He and Song, "Model-Contrastive Federated Learning", CVPR 2021).

Client k trains from the global model w with

    CE(f(x), y) + mu * l_con,   l_con = -log( e^{sim(z, z_glob)/tau} / (e^{sim(z, z_glob)/tau} + e^{sim(z, z_prev)/tau}) )

where ``sim`` is cosine similarity and ``z``, ``z_glob``, ``z_prev`` are the representations of the
same minibatch under the model being trained, the round's global model and the client's own model
from its previous round (per-client state; a client seen for the first time uses the global model,
as the reference code's pool of previous models starts from it, which makes l_con the constant
log 2). The representation is the model's penultimate feature (``StagedModel.features``: every
stage but the linear ``head``); the paper adds a 2-layer projection head on top of it, which the
model zoo has not, so ``z`` here is the head's input. The two frozen models run in eval mode
without gradients, as in the reference code. The server is FedAvg's (so ``server_opt`` applies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fl_platform.algorithms.base import AlgorithmSpec, LocalPlan, StateSpec, require
from fl_platform.algorithms.fedavg import FedAvgClient, FedAvgConf, FedAvgServer
from fl_platform.core import Broadcast, ClientUpdate, Metrics, RoundContext
from fl_platform.training.flat import FlatModel
from fl_platform.training.hooks import Batch, TrainHooks


@dataclass
class MoonConf(FedAvgConf):
    name: str = "moon"
    mu: float = 1.0  # weight of the model-contrastive loss (the paper: 1 on most tasks, 5 on CIFAR-10)
    temperature: float = 0.5  # tau

    def inactive_fields(self, run: Any) -> dict[str, str]:
        out = super().inactive_fields(run)
        if self.mu == 0:
            out["temperature"] = "it scales the contrastive loss, and algorithm.mu=0 turns that loss off"
        return out


def _check(cfg: MoonConf) -> None:
    require(cfg, (cfg.mu >= 0, "mu", ">= 0"), (cfg.temperature > 0, "temperature", "> 0"))


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, temperature: float) -> torch.Tensor:
    """MOON's l_con, averaged over the batch: the global model's representation is the positive, the
    previous local model's the negative."""
    pos = F.cosine_similarity(z, z_glob, dim=-1) / temperature
    neg = F.cosine_similarity(z, z_prev, dim=-1) / temperature
    return (torch.logsumexp(torch.stack([pos, neg], dim=-1), dim=-1) - pos).mean()


class MoonHook(TrainHooks):
    """The loss ``CE + mu * l_con`` on a split forward (features, then head)."""

    def __init__(self, mu: float, temperature: float, glob: nn.Module, prev: nn.Module) -> None:
        self.mu, self.temperature = mu, temperature
        self.glob, self.prev = glob, prev

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        z = model.features(batch.x)
        logits = model.head(z)
        loss = F.cross_entropy(logits, batch.y)
        if self.mu:
            with torch.no_grad():
                z_glob, z_prev = self.glob.features(batch.x), self.prev.features(batch.x)
            loss = loss + self.mu * contrastive_loss(z, z_glob, z_prev, self.temperature)
        return loss, logits


class MoonClient(FedAvgClient):
    def __init__(self, cfg: MoonConf, setup) -> None:
        super().__init__(cfg, setup)
        _check(cfg)
        self._frozen: tuple[FlatModel, FlatModel] | None = None

    def state_spec(self) -> dict[str, StateSpec]:
        return {"prev": StateSpec(self.setup.vector_size)}

    def frozen(self, device: torch.device) -> tuple[FlatModel, FlatModel]:
        """The global and the previous local model (built once per worker, in eval mode, no gradients)."""
        if self._frozen is None or self._frozen[0].device != device:
            with torch.random.fork_rng(devices=[]):  # building draws initial weights: not from the run's RNG
                models = tuple(FlatModel(self.setup.model_fn(), device) for _ in range(2))
            for fm in models:
                fm.model.eval()
                fm.model.requires_grad_(False)
            self._frozen = models  # type: ignore[assignment]
        return self._frozen  # type: ignore[return-value]

    def prepare(self, ctx: RoundContext, client_id: int, broadcast: Broadcast, state, data, trainer) -> LocalPlan:
        w = broadcast.tensors["weights"]
        glob, prev = self.frozen(trainer.fm.device)
        glob.load(w)
        prev.load(state["prev"] if state is not None else w)
        return LocalPlan(w, MoonHook(self.cfg.mu, self.cfg.temperature, glob.model, prev.model))

    def finish(self, ctx: RoundContext, client_id: int, broadcast: Broadcast, state, data, trainer,
               plan: LocalPlan, metrics: Metrics) -> ClientUpdate:
        update = super().finish(ctx, client_id, broadcast, state, data, trainer, plan, metrics)
        update.state = {"prev": trainer.fm.vector.detach().clone()}
        return update


class MoonServer(FedAvgServer):
    def __init__(self, cfg: MoonConf, setup, initial_weights: torch.Tensor) -> None:
        super().__init__(cfg, setup, initial_weights)
        _check(cfg)


SPEC = AlgorithmSpec("moon", MoonConf, MoonClient, MoonServer,
                     "MOON: model-contrastive loss pulls the representation to the global model's, away from the "
                     "client's previous one", staged_model=True)
