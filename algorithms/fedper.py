"""FedPer (Arivazhagan et al. 2019) and FedRep (Collins et al., ICML 2021): a personal head.

Both keep the model's classifier head (the ``head`` stage of every StagedModel) on the client,
across rounds, in the client-state manager, and average the body as in FedAvg; the head's entries
travel as zeros and the server restores them after its step (algorithms/personal.py).

* FedPer trains head and body together in each local round.
* FedRep first trains the head for ``head_epochs`` epochs with the body frozen (its own minibatch
  orders, ``Stream.PERSONAL``), then the body for the run's ``train.epochs``/``train.steps`` with
  the head frozen; only the body's update is uploaded.

A client's personalised model is the global body with its own head (``personal_*`` under
``eval.clients``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from fl_platform.algorithms.base import AlgorithmSpec
from fl_platform.algorithms.fedavg import FedAvgConf
from fl_platform.algorithms.personal import PersonalPartClient, PersonalPartServer
from fl_platform.core import Broadcast, ClientUpdate, RoundContext
from fl_platform.seeding import Stream
from fl_platform.training.loop import ClientData, LocalTrainer


def head_module(model: nn.Module) -> nn.Module:
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Linear):
        raise ValueError(f"{type(model).__name__} has no linear 'head' stage; FedPer/FedRep keep the head local "
                         "(use a StagedModel: every built-in model is one)")
    return head


def head_tensors(model: nn.Module) -> list[str]:
    """Dotted names of the head's parameters."""
    head = head_module(model)
    prefix = next(name for name, module in model.named_modules() if module is head)
    return [f"{prefix}.{n}" for n, _ in head.named_parameters(recurse=False)]


@dataclass
class FedPerConf(FedAvgConf):
    name: str = "fedper"


@dataclass
class FedRepConf(FedAvgConf):
    name: str = "fedrep"
    head_epochs: int = 10  # epochs of head-only training (body frozen) before the body's

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_epochs < 1:
            raise ValueError(f"algorithm.head_epochs must be >= 1, got {self.head_epochs}")


class FedPerClient(PersonalPartClient):
    select = staticmethod(head_tensors)


class FedPerServer(PersonalPartServer):
    client_class = FedPerClient


class FedRepClient(FedPerClient):
    def train(self, ctx: RoundContext, client_id: int, broadcast: Broadcast,
              state: dict[str, torch.Tensor] | None, data: ClientData, trainer: LocalTrainer) -> ClientUpdate:
        """Head first (body frozen), then body (head frozen); FedAvg's upload of the body's update."""
        plan = self.prepare(ctx, client_id, broadcast, state, data, trainer)
        fm = trainer.fm
        fm.load(plan.start)
        head = {id(p) for p in head_module(fm.model).parameters()}
        params = list(fm.model.parameters())
        try:
            for p in params:
                p.requires_grad_(id(p) in head)
            head_cfg = dataclasses.replace(trainer.cfg, epochs=self.cfg.head_epochs, steps=None)
            trainer.fit(data, plan.hooks, seed=ctx.seed, round=ctx.round, client=client_id, cfg=head_cfg,
                        stream=Stream.PERSONAL)
            for p in params:
                p.requires_grad_(id(p) not in head)
            metrics = trainer.fit(data, plan.hooks, seed=ctx.seed, round=ctx.round, client=client_id)
        finally:
            for p in params:
                p.requires_grad_(True)
        return self.finish(ctx, client_id, broadcast, state, data, trainer, plan, metrics)


class FedRepServer(PersonalPartServer):
    client_class = FedRepClient


SPEC = AlgorithmSpec("fedper", FedPerConf, FedPerClient, FedPerServer,
                     "FedPer: personal head kept on each client, body averaged (per-client state)",
                     staged_model=True)
FEDREP = AlgorithmSpec("fedrep", FedRepConf, FedRepClient, FedRepServer,
                       "FedRep: head trained first with the body frozen, then the body; head kept local",
                       staged_model=True)
