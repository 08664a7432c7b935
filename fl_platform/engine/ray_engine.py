"""``engine=ray``: W long-lived Ray actors, each a ``Worker`` holding one model and the data.

Created once per run (``ray_placement.py`` decides W and each actor's CPUs/GPUs,
``ray_actors.py`` starts them): the experiment setup, dataset tensors included, goes through the
object store once and each actor keeps it on its device. Per round the broadcast is sent once
(inside the call when small, else put into the object store once and read by every actor),
every actor trains its clients from the scheduler's plan and returns one partial aggregate. No
remote call is made per client. Messages travel as ``transport.Packed`` values.

Client state (``engine.state_store``):

* ``disk``: all workers share one directory (one machine or a shared filesystem); each stages its
  round's states durably and drops its read cache each round (another worker may have written).
* ``distributed``: each client's state lives on its home worker (``c mod W``, memory or disk per
  ``engine.state_backend``); a client scheduled elsewhere borrows it for the round
  (``ray_state.py``). The scheduler prefers home workers.
* ``memory``: with W > 1 it is ``distributed`` with memory homes. A worker crash then loses its
  home clients' states, so the engine refuses to continue a stateful run after one (use disk).

Faults: when an actor dies, the engine starts a new actor for the same worker id and reruns that
worker's clients with the same broadcast; since states are staged and applied only after every
result arrived, the rerun starts from unmodified states and the round's result equals the
fault-free one (a warning is logged).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from fl_platform.core import Broadcast, RoundContext
from fl_platform.engine.ray_actors import ActorPool
from fl_platform.engine.ray_placement import conf_value, plan_placement
from fl_platform.engine.ray_state import Lending
from fl_platform.engine.scheduler import Scheduler
from fl_platform.engine.transport import Packed
from fl_platform.engine.worker import WorkerOptions
from fl_platform.rounds.engine import Engine, WorkerResult
from fl_platform.rounds.setup import ExperimentSetup
from fl_platform.state.distributed import home_worker

log = logging.getLogger(__name__)

#: A broadcast up to this size travels inside each call (below Ray's 100 KiB limit for inlined
#: arguments); a larger one is put into the object store once and every worker reads that copy.
INLINE_BYTES = 64 * 1024


class RayEngine(Engine):
    def __init__(self, setup: ExperimentSetup, cfg: Any) -> None:
        import ray

        self._ray = ray
        self._owns_ray = False
        if not ray.is_initialized():
            ray.init(address=conf_value(cfg, "address"), include_dashboard=False, log_to_driver=False,
                     configure_logging=True, logging_level=logging.WARNING)
            self._owns_ray = True
        self.placement = plan_placement(cfg, setup.device, ray.cluster_resources())
        num_workers = self.num_workers = self.placement.num_workers
        self.max_restarts = int(conf_value(cfg, "max_restarts", 3))
        kind = setup.state_store
        backend = conf_value(cfg, "state_backend", "disk")
        if kind == "memory" and num_workers > 1:
            kind, backend = "distributed", "memory"
        self.state_kind = kind
        options = dict(setup.state_options)
        if kind == "distributed":
            options["backend"] = backend
        self._tmpdir: str | None = None
        if kind in ("disk", "distributed") and not options.get("directory"):
            # A shared root: disk workers share one folder, and a restarted home worker finds its own.
            self._tmpdir = options["directory"] = tempfile.mkdtemp(prefix="fl_state_")
        self.state_backend = backend if kind == "distributed" else kind
        self.setup = dataclasses.replace(setup, state_store=kind, state_options=options)
        self.distributed = kind == "distributed" and num_workers > 1
        fault = conf_value(cfg, "fault_injection", {}) or {}
        self.fault_client = conf_value(fault, "client")
        fault_round = conf_value(fault, "round")  # 1-based in the config, as in metrics.jsonl
        self.fault_round = None if fault_round is None else int(fault_round) - 1
        t0 = time.perf_counter()
        self.pool = ActorPool(self.placement, ray.put(Packed(self.setup)), self._options)
        self.pool.ping_all()
        self.stateful = bool(ray.get(self.pool[0].is_stateful.remote()))
        self.startup_s = time.perf_counter() - t0
        home = (lambda c: home_worker(c, num_workers)) if self.distributed and self.stateful else None
        self.scheduler = Scheduler(num_workers, setup.dataset.client_sizes(), setup.train, home=home,
                                   smoothing=float(conf_value(cfg, "scheduler_smoothing", 0.5)))
        self._stats: dict[str, Any] = {}

    def _options(self, worker_id: int, incarnation: int) -> WorkerOptions:
        return WorkerOptions(
            num_workers=self.num_workers,
            durable_rounds=True,
            drop_cache_each_round=self.state_kind == "disk" and self.num_workers > 1,
            incarnation=incarnation,
            fault_client=self.fault_client,
            fault_round=self.fault_round,
        )

    @property
    def restarts(self) -> int:
        return self.pool.restarts

    def _restart(self, worker_id: int, reason: str) -> None:
        if self.stateful and self.state_backend == "memory":
            raise RuntimeError(
                f"Ray worker {worker_id} died ({reason}); it held its home clients' state in memory, "
                f"which is lost. Use engine.state_store=disk or engine.state_backend=disk to survive worker faults.")
        self.pool.restart(worker_id, reason)

    # ------------------------------------------------------------------ one round

    def run_round(self, ctx: RoundContext, broadcast: Broadcast) -> list[WorkerResult]:
        ray = self._ray
        t0 = time.perf_counter()
        plan = self.scheduler.plan(ctx.clients)
        lending = Lending(plan.assignment, self.num_workers) if self.distributed and self.stateful else None
        results: list[WorkerResult | None] = [None] * self.num_workers
        packed = Packed(broadcast)
        bc_ref = ray.put(packed) if broadcast.nbytes() > INLINE_BYTES else packed
        todo = list(range(self.num_workers))
        for attempt in range(self.max_restarts + 1):
            failed = self._submit_and_gather(ctx, bc_ref, plan.assignment, lending, todo, results)
            if not failed:
                break
            if attempt == self.max_restarts:
                raise RuntimeError(f"round {ctx.round + 1}: Ray workers {sorted(failed)} kept failing after "
                                   f"{self.max_restarts} restarts (engine.max_restarts)")
            for w in range(self.num_workers):
                if not self.pool.alive(w):
                    self._restart(w, f"round {ctx.round + 1}")
            todo = sorted(failed)
        self._finish_round(ctx, lending)
        done = [r for r in results if r is not None]
        self._stats = self.scheduler.record(plan, [r.client_seconds for r in done], [r.busy_seconds for r in done])
        self._stats["sched_engine_s"] = time.perf_counter() - t0
        return done

    def _submit_and_gather(self, ctx: RoundContext, bc_ref: Any, assignment: list[list[int]],
                           lending: Lending | None, todo: list[int], results: list) -> set[int]:
        """Run ``todo`` workers' shares; returns the ids of workers whose actor died."""
        ray = self._ray
        refs: dict[int, Any] = {}
        # Every export is queued before any round task, so no actor's round waits on another's.
        lent = {w: lending.exports(self.pool, w) for w in todo} if lending is not None else {}
        for w in todo:
            if lending is not None:
                refs[w] = lending.submit(self.pool, w, ctx, bc_ref, assignment[w], lent[w])
            else:
                refs[w] = self.pool[w].run_round_packed.remote(ctx, bc_ref, assignment[w])
        failed: set[int] = set()
        for w in todo:
            try:
                results[w] = ray.get(refs[w])
            except ray.exceptions.RayActorError:
                failed.add(w)
            except ray.exceptions.RayTaskError as err:
                if isinstance(getattr(err, "cause", None), ray.exceptions.RayActorError):  # a home it needed died
                    failed.add(w)
                else:
                    raise err.as_instanceof_cause() from None
        return failed

    def _finish_round(self, ctx: RoundContext, lending: Lending | None) -> None:
        """Apply every worker's staged states, and return lent states to their homes."""
        ray = self._ray
        for attempt in range(self.max_restarts + 1):
            calls = []
            for w, actor in enumerate(self.pool):
                incoming = lending.returns_to(w) if lending is not None else []
                if incoming:
                    calls.append((w, actor.import_states.remote(*incoming)))
                if self.stateful:
                    calls.append((w, actor.commit_round.remote(ctx.round)))
            failed = set()
            for w, ref in calls:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    failed.add(w)
            if not failed:
                return
            if attempt == self.max_restarts:
                raise RuntimeError(f"round {ctx.round + 1}: Ray workers {sorted(failed)} died while saving "
                                   f"client state {self.max_restarts + 1} times (engine.max_restarts)")
            for w in sorted(failed):  # both calls are idempotent: the staged files are on disk
                self._restart(w, f"saving state after round {ctx.round + 1}")

    def round_stats(self) -> dict[str, Any]:
        return dict(self._stats)

    # ------------------------------------------------------------------ durability

    def _state_actors(self) -> list[Any]:
        """Actors that own a store: all with distributed homes, one for a shared directory."""
        if not self.stateful:
            return []
        return list(self.pool) if self.state_kind == "distributed" else [self.pool[0]]

    def flush(self) -> None:
        self._ray.get([a.flush.remote() for a in self.pool])

    def checkpoint_state(self, directory: Path, round: int) -> None:
        self.flush()
        self._ray.get([a.checkpoint_state.remote(str(directory), round) for a in self._state_actors()])

    def commit_state(self, round: int) -> None:
        self._ray.get([a.commit_state.remote(round) for a in self._state_actors()])

    def restore_state(self, directory: Path | None, round: int | None) -> None:
        d = str(directory) if directory is not None else None
        self._ray.get([a.restore_state.remote(d, round) for a in self._state_actors()])

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])

    def close(self) -> None:
        self.pool.close()
        if self._owns_ray:
            self._ray.shutdown()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
