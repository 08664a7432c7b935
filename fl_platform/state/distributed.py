"""Distributed client state: each client's state lives with its home worker.

Client ``c``'s home is worker ``c mod W``; the home worker's local store (memory or disk) holds
the state. When the scheduler places ``c`` on another worker for a round, the engine asks the
home for the state (``export``), lends it to the training worker for that round
(``begin_round``), collects the new state afterwards (``end_round``) and hands it back to the
home (``import_states``) before the home's next task. Each worker therefore touches only its own
files, which works without a shared filesystem (one home per node on a Ray cluster), and the
scheduler prefers home workers so that most clients never move.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fl_platform.algorithms.base import StateSpec
from fl_platform.state.store import State, StateStore, make_store


def home_worker(client_id: int, num_workers: int) -> int:
    """The worker that holds ``client_id``'s state."""
    return client_id % num_workers


class DistributedStore(StateStore):
    def __init__(self, local: StateStore, worker_id: int, num_workers: int) -> None:
        super().__init__(local.specs)
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"worker_id {worker_id} out of range for {num_workers} workers")
        self.local = local
        self.worker_id = worker_id
        self.num_workers = num_workers
        self._lent: dict[int, State | None] = {}
        self._outbox: dict[int, State] = {}

    @classmethod
    def create(cls, specs: dict[str, StateSpec], worker_id: int = 0, num_workers: int = 1,
               backend: str = "disk", directory: str | Path | None = None, **options: Any) -> DistributedStore:
        """A home store for ``worker_id``: ``backend`` (memory or disk) under ``directory/worker-<id>``."""
        if backend not in ("memory", "disk"):
            raise ValueError(f"engine.state_backend must be memory or disk, got {backend!r}")
        opts = dict(options)
        if backend == "disk" and directory is not None:
            opts["directory"] = Path(directory) / f"worker-{worker_id}"
        if backend == "memory":
            opts = {"filename": f"client_state-worker-{worker_id}.pt"}
        return cls(make_store(backend, specs, **opts), worker_id, num_workers)

    def is_home(self, client_id: int) -> bool:
        return home_worker(client_id, self.num_workers) == self.worker_id

    # ----------------------------------------------------------- the training worker's view

    def begin_round(self, foreign: dict[int, State | None] | None = None) -> None:
        self._lent = dict(foreign or {})
        self._outbox = {}

    def get(self, client_id: int) -> State | None:
        if client_id in self._lent:
            state = self._lent[client_id]
            return None if state is None else {k: v.clone() for k, v in state.items()}
        if not self.is_home(client_id):
            raise KeyError(f"client {client_id} lives on worker {home_worker(client_id, self.num_workers)}; "
                           f"its state was not lent to worker {self.worker_id} for this round")
        return self.local.get(client_id)

    def put(self, client_id: int, state: State) -> None:
        if client_id in self._lent:
            self._check(client_id, state)
            self._outbox[client_id] = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        elif self.is_home(client_id):
            self.local.put(client_id, state)
        else:
            raise KeyError(f"client {client_id} lives on worker {home_worker(client_id, self.num_workers)}; "
                           f"worker {self.worker_id} may not write its state")

    def stage(self, round: int, states: dict[int, State], tag: str = "") -> None:
        mine = {}
        for cid, state in states.items():
            if cid in self._lent:
                self.put(cid, state)  # goes to the outbox, back to the home worker
            else:
                mine[cid] = state
        self.local.stage(round, mine, tag)

    def apply_staged(self, round: int, tag: str = "") -> int:
        return self.local.apply_staged(round, tag)

    def end_round(self) -> dict[int, State]:
        out, self._outbox, self._lent = self._outbox, {}, {}
        return out

    # ----------------------------------------------------------- the home worker's side

    def export(self, client_ids: Iterable[int]) -> dict[int, State | None]:
        """Current states of home clients that train elsewhere this round (None: never trained)."""
        out: dict[int, State | None] = {}
        for cid in client_ids:
            if not self.is_home(cid):
                raise KeyError(f"worker {self.worker_id} was asked for client {cid}, which is not homed here")
            out[cid] = self.local.get(cid)
        return out

    def import_states(self, states: dict[int, State]) -> None:
        """Take back states of home clients that trained elsewhere."""
        for cid, state in states.items():
            if not self.is_home(cid):
                raise KeyError(f"worker {self.worker_id} was sent client {cid}, which is not homed here")
            self.local.put(cid, state)

    # ----------------------------------------------------------- durability: the local store's

    def flush(self) -> None:
        self.local.flush()

    def invalidate(self) -> None:
        self.local.flush()  # only this worker writes its home clients: its cache stays valid

    def checkpoint(self, directory: Path, round: int | None = None) -> None:
        self.local.checkpoint(directory, round)

    def commit(self, round: int) -> None:
        self.local.commit(round)

    def restore(self, directory: Path | None, round: int | None = None) -> None:
        self._lent, self._outbox = {}, {}
        self.local.restore(directory, round)

    def close(self) -> None:
        self.local.close()


def lending_plan(assignment: list[list[int]], num_workers: int) -> list[list[list[int]]]:
    """``plan[home][trainer]``: clients homed on ``home`` that ``trainer`` trains this round."""
    plan: list[list[list[int]]] = [[[] for _ in range(num_workers)] for _ in range(num_workers)]
    for trainer, clients in enumerate(assignment):
        for cid in clients:
            home = home_worker(cid, num_workers)
            if home != trainer:
                plan[home][trainer].append(cid)
    return plan
