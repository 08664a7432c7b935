"""Per-client state behind a tiny interface (DESIGN.md section 4).

An algorithm declares what it keeps per client (a ``StateSpec`` per name); the engine loads a
client's state before it trains and saves the new state after. ``get`` returns None for a
client that has no state yet; the algorithm then uses its initial value.

Checkpoints are two-phase so that a run killed at any moment resumes with every client's state
exactly as it was at the checkpoint: ``checkpoint(directory, round)`` makes the writes so far
durable and sets them aside for that round, the run then publishes its checkpoint, and
``commit(round)`` folds them into the committed state. ``restore(directory, round)`` (on resume)
keeps what belongs to rounds up to ``round`` and drops everything written after it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

import torch

from fl_platform.algorithms.base import StateSpec

State = dict[str, torch.Tensor]

STORE_KINDS = ("memory", "disk", "distributed")


class StateStore(ABC):
    def __init__(self, specs: dict[str, StateSpec]) -> None:
        self.specs = dict(specs)
        self._staged: dict[tuple[int, str], dict[int, State]] = {}

    @abstractmethod
    def get(self, client_id: int) -> State | None: ...

    @abstractmethod
    def put(self, client_id: int, state: State) -> None: ...

    def flush(self) -> None:
        """Make every ``put`` durable against a crash of this process (a checkpoint calls this)."""

    def invalidate(self) -> None:
        """Forget cached reads (another process may have written since); keeps nothing unflushed."""
        self.flush()

    def checkpoint(self, directory: Path, round: int | None = None) -> None:
        """Phase 1 of a checkpoint after ``round`` rounds: save what a resumed run needs."""
        self.flush()

    def commit(self, round: int) -> None:
        """Phase 2, after the run published its checkpoint for ``round``."""

    def restore(self, directory: Path | None, round: int | None = None) -> None:
        """Return to the state saved by the checkpoint for ``round`` (None: no checkpoint, start empty)."""

    def stage(self, round: int, states: dict[int, State], tag: str = "") -> None:
        """Set a round's new states aside, durably where the store is durable, without applying them.

        The engine applies them with ``apply_staged`` once it holds every worker's result for the
        round, so a worker that dies after ``stage`` but before its result arrived is rerun from
        the unmodified states, and one that dies after its result arrived is completed from the
        staged copy. The base version keeps them in RAM (nothing survives a crash there anyway).
        """
        self._staged[(round, tag)] = dict(states)

    def apply_staged(self, round: int, tag: str = "") -> int:
        """Write the states staged for ``round`` (idempotent; returns how many were applied)."""
        states = self._staged.pop((round, tag), {})
        for cid, state in states.items():
            self.put(cid, state)
        return len(states)

    def begin_round(self, foreign: dict[int, State | None] | None = None) -> None:
        """States of clients homed on other workers, lent for this round (distributed store)."""

    def end_round(self) -> dict[int, State]:
        """New states of lent clients, to send back to their home workers (distributed store)."""
        return {}

    def close(self) -> None:
        self.flush()

    def client_ids(self) -> list[int]:
        """Clients with a stored state (a resume compares them with the run's manifest)."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its clients")

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

    def __init__(self, specs: dict[str, StateSpec], filename: str = "client_state.pt") -> None:
        super().__init__(specs)
        self.filename = filename
        self._states: dict[int, State] = {}

    def get(self, client_id: int) -> State | None:
        state = self._states.get(client_id)
        return None if state is None else {k: v.clone() for k, v in state.items()}

    def put(self, client_id: int, state: State) -> None:
        self._check(client_id, state)
        self._states[client_id] = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    def checkpoint(self, directory: Path, round: int | None = None) -> None:
        from fl_platform.outputs import atomic_torch_save

        if self.specs:
            atomic_torch_save(self._states, Path(directory) / self.filename)

    def restore(self, directory: Path | None, round: int | None = None) -> None:
        self._staged.clear()
        if directory is None:
            self._states = {}
            return
        path = Path(directory) / self.filename
        if self.specs and not path.exists():  # never an empty store where the checkpoint had states
            raise FileNotFoundError(f"checkpoint {directory} has no client states for this store ({self.filename}); "
                                    f"it was made by another engine or state store")
        self._states = torch.load(path, map_location="cpu", weights_only=True) if path.exists() else {}

    def client_ids(self) -> list[int]:
        return sorted(self._states)

    def __len__(self) -> int:
        return len(self._states)


def make_store(kind: str, specs: dict[str, StateSpec], **options) -> StateStore:
    """``memory``, ``disk`` (options: directory, cache_mb, fsync) or ``distributed``
    (options: worker_id, num_workers, backend, and the backend's options)."""
    if kind == "memory":
        return MemoryStore(specs, **{k: v for k, v in options.items() if k == "filename"})
    if kind == "disk":
        from fl_platform.state.disk import DiskStore

        return DiskStore(specs, **{k: v for k, v in options.items() if k in ("directory", "cache_mb", "fsync")})
    if kind == "distributed":
        from fl_platform.state.distributed import DistributedStore

        return DistributedStore.create(specs, **options)
    raise ValueError(f"unknown state store {kind!r} (engine.state_store); valid choices: {', '.join(STORE_KINDS)}")
