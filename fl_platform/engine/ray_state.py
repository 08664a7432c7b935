"""Moving client states between Ray workers for one round (``engine.state_store=distributed``).

A client's state lives on its home worker, on that worker's node. When the scheduler places a client on another worker
(the trainer), its home exports the state into the object store, the trainer borrows it for the
round, and the trainer's new state goes back to the home as a separate object, so each home
fetches only its own clients' states. The driver passes references only; states move actor to
actor.
"""

from __future__ import annotations

from typing import Any

from fl_platform.state.distributed import lending_plan


class Lending:
    """One round's loans: ``needs[home][trainer]`` lists the clients ``home`` lends to ``trainer``."""

    def __init__(self, assignment: list[list[int]], num_workers: int) -> None:
        self.num_workers = num_workers
        self.needs = lending_plan(assignment, num_workers)
        self.parts: list[list[Any]] = [[] for _ in range(num_workers)]  # parts[trainer][home]: refs

    def exports(self, actors: Any, trainer: int) -> list[Any]:
        """References to the states ``trainer`` borrows, one per lending home."""
        return [actors[h].export_states_packed.remote(self.needs[h][trainer])
                for h in range(self.num_workers) if self.needs[h][trainer]]

    def submit(self, actors: Any, trainer: int, args: tuple, *refs: Any, split: bool = False) -> Any:
        """Start ``trainer``'s round (``args``: ``RayWorker.run_round_parts``' arguments, ``homes`` set;
        ``refs``: the broadcast's when it travels apart, then the borrowed states); returns the
        references to its result and, with ``split``, to its partial aggregate."""
        extra = 1 if split else 0
        out = actors[trainer].run_round_parts.options(num_returns=1 + extra + self.num_workers).remote(*args, *refs)
        self.parts[trainer] = list(out[1 + extra:])
        return out[0], (out[1] if split else None)

    def returns_to(self, home: int) -> list[Any]:
        """References to the new states of ``home``'s clients that trained elsewhere."""
        return [self.parts[t][home] for t in range(self.num_workers) if t != home and self.needs[home][t]]
