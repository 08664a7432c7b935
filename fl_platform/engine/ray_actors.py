"""The Ray actors that host workers, and what happens when one dies.

``RayWorker`` is a ``Worker`` whose results leave the actor as :class:`Packed` messages.
``ActorPool`` starts one actor per worker id, checks they are alive, and replaces a dead one
(crash, OOM kill, ``os._exit``, lost node) with a fresh actor for the same id: the engine then
reruns that worker's share of the round. A replacement starts with ``incarnation + 1``, which
switches test-only fault injection off so that a rerun succeeds.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from fl_platform.core import Broadcast, RoundContext
from fl_platform.engine.ray_placement import Placement
from fl_platform.engine.transport import Packed
from fl_platform.engine.worker import Worker, WorkerOptions
from fl_platform.state.distributed import home_worker
from fl_platform.state.store import State

log = logging.getLogger(__name__)


class RayWorker(Worker):
    """The actor class: every result that carries tensors leaves as a Packed message."""

    def run_round_packed(self, ctx: RoundContext, broadcast: Broadcast, client_ids: list[int],
                         *foreign: dict[int, State | None]) -> Packed:
        return Packed(self.run_round(ctx, broadcast, client_ids, *foreign))

    def run_round_split(self, ctx: RoundContext, broadcast: Broadcast, client_ids: list[int],
                        *foreign: dict[int, State | None]) -> tuple[Packed, ...]:
        """``run_round``, returning (result, states for home 0, ..., states for home W-1) as separate
        objects so that each home fetches only its own clients' states."""
        result = self.run_round(ctx, broadcast, client_ids, *foreign)
        parts: list[dict[int, State]] = [{} for _ in range(self.options.num_workers)]
        for cid, state in result.outbox.items():
            parts[home_worker(cid, self.options.num_workers)][cid] = state
        result.outbox = {}
        return tuple(Packed(x) for x in (result, *parts))

    def export_states_packed(self, client_ids: list[int]) -> Packed:
        return Packed(self.export_states(client_ids))

    def is_stateful(self) -> bool:
        return self.stateful


class ActorPool:
    """One live actor per worker id."""

    def __init__(self, placement: Placement, setup_ref: Any, options: Callable[[int, int], WorkerOptions]) -> None:
        """``options(worker_id, incarnation)`` gives each new actor its WorkerOptions."""
        import ray

        self._ray = ray
        self.placement = placement
        self._setup_ref = setup_ref
        self._options = options
        self._cls = ray.remote(RayWorker)
        self.incarnation = [0] * placement.num_workers
        self.restarts = 0
        self.actors = [self._spawn(w) for w in range(placement.num_workers)]

    def __getitem__(self, worker_id: int) -> Any:
        return self.actors[worker_id]

    def __iter__(self):
        return iter(self.actors)

    def _spawn(self, worker_id: int) -> Any:
        cls = self._cls.options(num_cpus=self.placement.cpus_per_worker, num_gpus=self.placement.gpus_per_worker,
                                max_restarts=0, max_task_retries=0)
        return cls.remote(worker_id, self._setup_ref, self._options(worker_id, self.incarnation[worker_id]))

    def ping_all(self) -> None:
        """Wait until every actor is up (its Worker built); a failure in a constructor is raised as is."""
        ray = self._ray
        try:
            ray.get([a.ping.remote() for a in self.actors])
        except ray.exceptions.RayTaskError as err:
            raise err.as_instanceof_cause() from None

    def alive(self, worker_id: int, timeout: float = 60.0) -> bool:
        ray = self._ray
        try:
            ray.get(self.actors[worker_id].ping.remote(), timeout=timeout)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def restart(self, worker_id: int, reason: str) -> None:
        """Replace worker ``worker_id``'s actor by a new one and wait until it is up."""
        ray = self._ray
        log.warning("Ray worker %d died (%s); starting a new one and rerunning its clients", worker_id, reason)
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self.actors[worker_id], no_restart=True)
        self.incarnation[worker_id] += 1
        self.actors[worker_id] = self._spawn(worker_id)
        ray.get(self.actors[worker_id].ping.remote())
        self.restarts += 1

    def close(self) -> None:
        ray = self._ray
        try:
            ray.get([a.close.remote() for a in self.actors], timeout=60)
        except Exception as err:  # closing must not hide the run's own outcome
            log.warning("closing Ray workers: %s", err)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
