"""Personal parts of the model that never leave the client (FedBN, FedPer, FedRep).

A client keeps some entries of the flat ``[params | buffers]`` vector as its own: it starts each
round from the global vector with those entries replaced by its stored copy (on first use, the
global's own values, i.e. the initial model's), uploads a delta whose personal entries are zero,
and stores its trained personal entries in the client-state manager (``state_spec``), so they
persist across rounds on the memory, disk and distributed stores alike. The server half restores
the personal entries after its step, so nothing that reaches it (server momentum, DP noise on the
sum) ever moves them: the global model's personal entries stay the initial ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fl_platform.algorithms.base import LocalPlan, Setup, StateSpec
from fl_platform.algorithms.fedavg import FedAvgClient, FedAvgServer
from fl_platform.core import Aggregate, Broadcast, ClientUpdate, Metrics, RoundContext
from fl_platform.training.flat import FlatModel

#: The per-client state name of the personal entries.
PERSONAL = "personal"


def personal_indices(setup: Setup, select: Callable[[nn.Module], list[str]]) -> torch.Tensor:
    """Positions in the flat vector of the tensors named by ``select(model)`` (dotted names, as in
    ``named_parameters``/``named_buffers``), as an int64 tensor on the CPU, in vector order."""
    fm = FlatModel(setup.model_fn(), "cpu")
    names = set(select(fm.model))
    parts = [torch.arange(s.offset, s.offset + s.numel) for s in fm.slots if s.name in names]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


class PersonalPartClient(FedAvgClient):
    """FedAvg on the shared entries; the entries ``personal_index`` names stay with the client."""

    def __init__(self, cfg: Any, setup: Setup) -> None:
        super().__init__(cfg, setup)
        self.index = self.personal_index(setup)
        self._on: dict[torch.device, torch.Tensor] = {}

    #: model -> the dotted names of its tensors that stay local (a function, set by each algorithm).
    select: Callable[[nn.Module], list[str]]

    @classmethod
    def personal_index(cls, setup: Setup) -> torch.Tensor:
        return personal_indices(setup, cls.select)

    def _index(self, device: torch.device) -> torch.Tensor:
        index = self._on.get(device)
        if index is None:
            index = self._on[device] = self.index.to(device)
        return index

    def state_spec(self) -> dict[str, StateSpec]:
        return {PERSONAL: StateSpec(int(self.index.numel()))}

    def personal_model(self, ctx: RoundContext, client_id: int, broadcast: Broadcast,
                       state: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """The global vector with this client's personal entries (the global's own before its first round)."""
        weights = broadcast.tensors["weights"]
        if state is None:
            return weights
        out = weights.clone()
        out[self._index(out.device)] = state[PERSONAL].to(out.device, out.dtype)
        return out

    def prepare(self, ctx: RoundContext, client_id: int, broadcast: Broadcast, state, data, trainer) -> LocalPlan:
        return LocalPlan(self.personal_model(ctx, client_id, broadcast, state),
                         self.hooks(ctx, broadcast, state, trainer))

    def finish(self, ctx: RoundContext, client_id: int, broadcast: Broadcast, state, data, trainer,
               plan: LocalPlan, metrics: Metrics) -> ClientUpdate:
        vector = trainer.fm.vector
        index = self._index(vector.device)
        n = data.num_samples
        delta = vector - plan.start
        delta[index] = 0.0  # the personal entries never leave the client
        return ClientUpdate(client_id, {"delta": delta.mul_(n)}, {"n": float(n)}, n, metrics,
                            state={PERSONAL: vector[index].clone()})


class PersonalPartServer(FedAvgServer):
    """FedAvg's step on the shared entries; the personal entries keep their initial values."""

    client_class: type[PersonalPartClient] = PersonalPartClient

    def __init__(self, cfg: Any, setup: Setup, initial_weights: torch.Tensor) -> None:
        super().__init__(cfg, setup, initial_weights)
        self.index = self.client_class.personal_index(setup)
        self.check(setup, int(self.index.numel()))

    def check(self, setup: Setup, count: int) -> None:
        """Refuse, at start-up, a model without personal entries (the method would be plain FedAvg)."""

    def aggregate(self, ctx: RoundContext, result: Aggregate | list[ClientUpdate]) -> dict[str, float]:
        kept = self.weights[self.index].clone()
        out = super().aggregate(ctx, result)
        self.weights[self.index] = kept
        return out
