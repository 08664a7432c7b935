"""Per-client state behind a tiny interface (DESIGN.md section 4).

An algorithm declares what it keeps per client (a ``StateSpec`` per name); the engine loads a
client's state before it trains and saves the new state after. ``get`` returns None for a
client that has no state yet; the algorithm then uses its initial value.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch

from fl_platform.algorithms.base import StateSpec

State = dict[str, torch.Tensor]


class StateStore(ABC):
    def __init__(self, specs: dict[str, StateSpec]) -> None:
        self.specs = dict(specs)

    @abstractmethod
    def get(self, client_id: int) -> State | None: ...

    @abstractmethod
    def put(self, client_id: int, state: State) -> None: ...

    def flush(self) -> None:
        """Make every ``put`` durable (a checkpoint calls this)."""

    def checkpoint(self, directory: Path) -> None:
        """Save what a resumed run needs into ``directory`` (stores on disk only flush)."""
        self.flush()

    def restore(self, directory: Path) -> None:
        """Load what ``checkpoint`` saved."""

    def close(self) -> None:
        self.flush()

    def _check(self, client_id: int, state: State) -> None:
        unknown = set(state) - set(self.specs)
        if unknown:
            raise KeyError(f"client {client_id}: state names {sorted(unknown)} were not declared; "
                           f"declared: {sorted(self.specs)}")
        for name, t in state.items():
            if t.numel() != self.specs[name].size:
                raise ValueError(f"client {client_id}: state {name!r} has {t.numel()} elements, "
                                 f"the spec says {self.specs[name].size}")


class MemoryStore(StateStore):
    """Everything in RAM (CPU tensors): fine for small runs and tests."""

    def __init__(self, specs: dict[str, StateSpec]) -> None:
        super().__init__(specs)
        self._states: dict[int, State] = {}

    def get(self, client_id: int) -> State | None:
        state = self._states.get(client_id)
        return None if state is None else {k: v.clone() for k, v in state.items()}

    def put(self, client_id: int, state: State) -> None:
        self._check(client_id, state)
        self._states[client_id] = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def checkpoint(self, directory: Path) -> None:
        from fl_platform.outputs import atomic_torch_save

        atomic_torch_save(self._states, Path(directory) / "client_state.pt")

    def restore(self, directory: Path) -> None:
        path = Path(directory) / "client_state.pt"
        self._states = torch.load(path, weights_only=True) if path.exists() else {}

    def __len__(self) -> int:
        return len(self._states)


def make_store(kind: str, specs: dict[str, StateSpec], **options) -> StateStore:
    if kind == "memory":
        return MemoryStore(specs)
    raise ValueError(f"unknown state store {kind!r}; valid choices: memory")
