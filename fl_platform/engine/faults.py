"""TEST ONLY: faults injected into workers (``engine.fault_injection``), outside the production ``Worker``.

The engine installs them only when the key asks for one: it then builds its workers from the
subclasses here (``FaultyWorker`` in-process, ``FaultyRayWorker`` as Ray actors), which wrap the
``Worker``'s per-client step; every other run builds plain ``Worker``/``RayWorker`` objects, which
hold no test code.

* ``client``/``round``: the worker's process exits (``os._exit``, like an OOM kill: no cleanup,
  no exception) when it starts training that client in that round (any round when None), in its
  first incarnation only, so that the replacement actor's rerun succeeds (Ray only: the recovery
  under test is the Ray engine's). ``at`` moves the exit later in the round, after the worker's
  result has reached the driver: ``merge`` when the reduction tree asks that worker to add a
  partner's partial aggregate, ``commit`` when the engine asks it to apply the round's new states;
  ``hang`` makes it sleep (an hour) at that client instead, ``hang_commit`` when asked to apply the
  round's new states, for ``engine.round_timeout_s``.
* ``slow_worker``/``slow_factor``: that worker sleeps ``slow_factor - 1`` times each client's
  measured time after training it, and reports the client as that much slower, like slower
  hardware (the scheduler's tests and ``scripts/bench/scheduler.py``); results are unchanged.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from fl_platform.config import FAULT_STEPS
from fl_platform.core import Broadcast, RoundContext
from fl_platform.engine.ray_actors import RayWorker
from fl_platform.engine.ray_placement import conf_value
from fl_platform.engine.worker import Worker, _Round

log = logging.getLogger(__name__)

#: A hung worker's sleep: longer than any test waits (engine.round_timeout_s kills it first).
HANG_S = 3600.0


@dataclass(frozen=True)
class Faults:
    """A run's ``engine.fault_injection`` (``round`` 0-based here, 1-based in the config)."""

    client: int | None = None
    round: int | None = None
    at: str = "train"
    slow_worker: int | None = None
    slow_factor: float = 1.0

    @classmethod
    def from_conf(cls, conf: Any, num_workers: int) -> Faults | None:
        """The faults ``conf`` (``engine.fault_injection``: a mapping, a dataclass or None) asks for;
        None when it asks for none (then the engine builds plain workers). A ``slow_worker`` the run
        does not have is refused."""
        if conf is None:
            return None
        client, slow_worker = conf_value(conf, "client"), conf_value(conf, "slow_worker")
        if client is None and slow_worker is None:
            return None
        if slow_worker is not None and not 0 <= int(slow_worker) < num_workers:
            raise ValueError(f"engine.fault_injection.slow_worker={slow_worker} names no worker: the run has "
                             f"engine.num_workers={num_workers} (ids 0..{num_workers - 1})")
        round_, at = conf_value(conf, "round"), str(conf_value(conf, "at", "train"))
        if at not in FAULT_STEPS:
            raise ValueError(f"engine.fault_injection.at must be one of {', '.join(FAULT_STEPS)}, got {at!r}")
        return cls(client=None if client is None else int(client),
                   round=None if round_ is None else int(round_) - 1, at=at,
                   slow_worker=None if slow_worker is None else int(slow_worker),
                   slow_factor=float(conf_value(conf, "slow_factor", 1.0)))


class FaultInjection:
    """The mixin: ``faults`` and ``incarnation`` (0 for a worker id's first actor, +1 per
    replacement) as keyword arguments; the rest goes to the worker class."""

    worker_id: int

    def __init__(self, *args: Any, faults: Faults, incarnation: int = 0, **kwargs: Any) -> None:
        self.faults = faults
        self.incarnation = incarnation
        self._doomed: int | None = None  # the round whose ``faults.at`` step this worker exits at
        super().__init__(*args, **kwargs)

    def _exit(self, what: str, round: int) -> None:
        log.warning("fault injection: worker %d exits %s in round %d", self.worker_id, what, round + 1)
        os._exit(17)

    def _train_one(self, ctx: RoundContext, bc: Broadcast, client_ids: list[int], i: int, acc: _Round) -> float:
        f, cid = self.faults, client_ids[i]
        if f.client == cid and self.incarnation == 0 and f.round in (None, ctx.round):
            if f.at == "train":
                self._exit(f"on client {cid}", ctx.round)
            if f.at == "hang":
                log.warning("fault injection: worker %d hangs on client %d in round %d", self.worker_id, cid,
                            ctx.round + 1)
                time.sleep(HANG_S)
            self._doomed = ctx.round
        seconds = super()._train_one(ctx, bc, client_ids, i, acc)  # type: ignore[misc]
        if f.slow_worker != self.worker_id or f.slow_factor == 1.0:
            return seconds
        t0 = time.perf_counter()
        time.sleep(max(seconds, 0.0) * (f.slow_factor - 1.0))
        return seconds + time.perf_counter() - t0


class FaultyWorker(FaultInjection, Worker):
    """An in-process worker with ``engine.fault_injection`` (``engine=inline``)."""


class FaultyRayWorker(FaultInjection, RayWorker):
    """A Ray actor with ``engine.fault_injection`` (``engine=ray``)."""

    def merge(self, own: Any, other: Any, last: bool) -> Any:
        if self.faults.at == "merge" and self._doomed is not None:
            self._exit("when asked to merge partial aggregates", self._doomed)
        return super().merge(own, other, last)

    def commit_round(self, round: int) -> int:
        if self.faults.at == "commit" and self._doomed == round:
            self._exit("when asked to apply its new client states", round)
        if self.faults.at == "hang_commit" and self._doomed == round:
            log.warning("fault injection: worker %d hangs when asked to apply its new client states in round %d",
                        self.worker_id, round + 1)
            time.sleep(HANG_S)
        return super().commit_round(round)
