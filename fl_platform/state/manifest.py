"""Which clients have a state, and from which round: a missing or stale state is an error, never zeros.

Every state a worker writes carries a round stamp (``ROUND_KEY``, the 0-based round that produced
it), stored with the state by whatever store holds it. The Ray engine keeps a :class:`Manifest`
on the driver (client -> round of its latest state), updated from the clients each worker reports
as written, checkpointed with the engine's state, and sent with every round's plan: before a client
trains, its worker compares the state it finds with the manifest (``checked``). A client the
manifest lists whose state is gone (node-local files removed, a home restarted on another node, a
memory home that died) or older than the manifest says raises :class:`MissingClientState` naming
the client and the round, where a store alone would have answered "no state yet" and the client
would have restarted from zeros.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from fl_platform.algorithms.base import StateSpec
from fl_platform.state.store import State

#: The stamp's name inside a stored state (no algorithm declares a name with underscores around it).
ROUND_KEY = "__round__"
ROUND_SPEC = StateSpec(1, torch.int64)


class MissingClientState(LookupError):
    """A client's state that the manifest lists is missing or not the one it lists (names the client)."""

    def __init__(self, client_id: int, round: int | None, message: str) -> None:
        super().__init__(message)
        self.client_id = client_id
        self.round = round

    def __reduce__(self) -> tuple[Any, ...]:  # travels from a Ray worker to the driver intact
        return type(self), (self.client_id, self.round, str(self))


def stamp(state: State, round: int) -> State:
    """``state`` with its round stamp (the 0-based round whose training produced it)."""
    return {**state, ROUND_KEY: torch.tensor([round], dtype=torch.int64)}


def stamp_of(state: State | None) -> int | None:
    """The round a stored state was written in (None: no state, or a state without a stamp)."""
    if state is None or ROUND_KEY not in state:
        return None
    return int(state[ROUND_KEY].reshape(-1)[0])


def checked(client_id: int, state: State | None, expected: dict[int, int] | None, where: str) -> State | None:
    """The state without its stamp, after checking it against the manifest's ``expected`` rounds.

    ``expected`` None: nothing to check against (in-process use without a manifest).
    """
    if expected is not None:
        want, got = expected.get(client_id), stamp_of(state)
        if want is not None and state is None:
            raise MissingClientState(client_id, want, f"client {client_id}: its state from round {want + 1} is "
                                     f"missing on {where} (node-local files removed, or its home restarted on "
                                     f"another node); it would restart from zeros")
        if state is not None and got != want:
            found = "a state without a round stamp" if got is None else f"a state from round {got + 1}"
            listed = "no state" if want is None else f"its state from round {want + 1}"
            raise MissingClientState(client_id, want, f"client {client_id}: {where} holds {found}, but the "
                                     f"manifest lists {listed} (a stale or foreign state)")
    if state is not None and ROUND_KEY in state:
        state = {k: v for k, v in state.items() if k != ROUND_KEY}
    return state


class Manifest:
    """client -> round (0-based) of its latest state, kept by the driver."""

    def __init__(self) -> None:
        self.rounds: dict[int, int] = {}

    def record(self, round: int, client_ids: Iterable[int]) -> None:
        for cid in client_ids:
            self.rounds[int(cid)] = round

    def expected(self, client_ids: Iterable[int]) -> dict[int, int]:
        """The manifest's entries for ``client_ids`` (clients without a state are absent)."""
        return {cid: self.rounds[cid] for cid in client_ids if cid in self.rounds}

    def __len__(self) -> int:
        return len(self.rounds)

    def __contains__(self, client_id: int) -> bool:
        return client_id in self.rounds

    def state_dict(self) -> dict[str, torch.Tensor]:
        ids = sorted(self.rounds)
        return {"clients": torch.tensor(ids, dtype=torch.int64),
                "rounds": torch.tensor([self.rounds[c] for c in ids], dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.rounds = dict(zip(state["clients"].tolist(), state["rounds"].tolist()))

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor]) -> Manifest:
        m = cls()
        m.load_state_dict(state)
        return m
