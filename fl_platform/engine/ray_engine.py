"""``engine=ray``: W long-lived Ray actors, each a ``Worker`` holding one model and the data.

Created once per run: the experiment setup (dataset tensors included) goes through the object
store once, and each actor keeps it on its device. Per round the broadcast is put into the
object store once (or, when small, sent inside the call, which saves a round trip) and every
actor receives it with its list of clients (from the scheduler); each returns one partial
aggregate. No remote call is made per client.

Client state (``engine.state_store``):

* ``disk``: all workers share one directory (one machine or a shared filesystem); each stages its
  round's states durably and drops its read cache each round (another worker may have written).
* ``distributed``: each client's state lives on its home worker (``c mod W``, memory or disk per
  ``engine.state_backend``); a client scheduled elsewhere has its state exported by its home into
  the object store, lent to the trainer, and its new state sent back to the home, actor to actor
  (the driver only passes references). The scheduler prefers home workers.
* ``memory``: with W > 1 it is ``distributed`` with memory homes. A worker crash then loses its
  home clients' states, so the engine refuses to continue a stateful run after one (use disk).

Compiled graph (``engine.compiled_graph``, default ``auto``: on when Ray has a CPU beyond the
workers' for the driver): a round whose broadcast is small (at most
1 MiB) and whose state is not lent between workers goes through a Ray compiled graph: one
``execute`` writes (context, broadcast, plan) into shared-memory channels that every actor's
execution loop reads, instead of one RPC per actor. It saves about 1 ms of a round's fixed cost
(measured: an echo of a 9,610-float model 1.7 ms by RPC, 0.6 ms compiled), which is what bounds
short rounds. The graph is compiled on first use (about 70 ms) and torn down on a fault or at
close; other actor calls (state commits, checkpoints, pings) run as usual beside it. Its idle
actors poll their channels (about a quarter of a core each while the driver works between
rounds), and the driver spins on them while the workers train, so with no CPU to spare it slows
the workers down; ``engine.compiled_graph=false`` turns it off, ``true`` forces it.

One worker without client state and with a summing server (``engine.server_in_worker``) runs
whole rounds itself, many per call: see ``engine/hosted.py``.

Faults: when an actor dies (crash, OOM kill, ``os._exit``), the engine starts a new actor for the
same worker id and reruns that worker's clients with the same broadcast; since states are staged
and applied only after every result arrived, the rerun starts from unmodified states and the
round's result equals the fault-free one (a warning is logged). The CUDA path (workers sharing
GPUs through fractional ``gpus_per_worker``) follows Ray's resource model but is untested here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_platform.algorithms.registry import get_algorithm
from fl_platform.core import Broadcast, RoundContext
from fl_platform.rounds.engine import Engine
from fl_platform.engine.hosted import HostedLoop, RoundsCall, RoundsResult
from fl_platform.engine.scheduler import Plan, Scheduler
from fl_platform.rounds.setup import ExperimentSetup
from fl_platform.rounds.simulation import LoopConfig
from fl_platform.engine.worker import Worker, WorkerOptions, WorkerResult
from fl_platform.state.distributed import home_worker, lending_plan
from fl_platform.state.store import State

log = logging.getLogger(__name__)


# ------------------------------------------------------------------ tensor transport

_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool, torch.complex64, torch.complex128}


def _tensor_payload(t: torch.Tensor) -> tuple[int, Any, bool]:
    """A CPU tensor as a numpy array (pickle protocol 5 moves its buffer without a copy); anything
    numpy cannot hold (CUDA, sparse, bfloat16, quantized) through ``torch.save``."""
    if t.device.type == "cpu" and t.layout == torch.strided and t.dtype in _NUMPY_DTYPES and not t.is_quantized:
        return 0, t.detach().resolve_conj().resolve_neg().numpy(), t.requires_grad
    buffer = io.BytesIO()
    torch.save(t, buffer)
    return 1, buffer.getvalue(), False


def _tensor_from_payload(payload: tuple[int, Any, bool]) -> torch.Tensor:
    kind, data, requires_grad = payload
    if kind == 1:
        return torch.load(io.BytesIO(data), weights_only=False)
    t = torch.from_numpy(np.array(data))  # a writable copy: Ray hands out read-only zero-copy arrays
    return t.requires_grad_() if requires_grad else t


def use_fast_tensor_transport() -> None:
    """Ship CPU tensors between this process and the actors as numpy buffers.

    torch's own pickling of a tensor costs about 0.3 ms more per message than numpy's, paid on
    every round trip (broadcast in, partial aggregate out): measured 1.95 vs 1.22 ms for a call
    with a 9,610-parameter model each way, against a 5 ms round at 100/10 clients. Registered in
    the driver and in every actor (a reducer applies to what its process sends); the values are
    bit-identical.
    """
    import ray

    ray.util.register_serializer(torch.Tensor, serializer=_tensor_payload, deserializer=_tensor_from_payload)


class RayWorker(Worker):
    """The actor class: a Worker plus the split-result entry point used with distributed state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        use_fast_tensor_transport()
        super().__init__(*args, **kwargs)
        self._hosted: HostedLoop | None = None  # built by host_rounds when the engine hands it whole rounds

    def run_round_split(self, ctx: RoundContext, broadcast: Broadcast, client_ids: list[int],
                        *foreign: dict[int, State | None]) -> tuple[Any, ...]:
        """``run_round``, returning (result, states for home 0, ..., states for home W-1) as separate
        objects so that each home fetches only its own clients' states."""
        result = self.run_round(ctx, broadcast, client_ids, *foreign)
        parts: list[dict[int, State]] = [{} for _ in range(self.options.num_workers)]
        for cid, state in result.outbox.items():
            parts[home_worker(cid, self.options.num_workers)][cid] = state
        result.outbox = {}
        return (result, *parts)

    def is_stateful(self) -> bool:
        return self.stateful

    def run_round_planned(self, call: tuple[RoundContext, Broadcast, list[list[int]]]) -> WorkerResult:
        """The compiled graph's entry point: every actor reads the same input and takes its own clients."""
        ctx, broadcast, assignment = call
        return self.run_round(ctx, broadcast, assignment[self.worker_id])

    def host_rounds(self) -> None:
        """Build the server half and round loop that ``run_rounds`` uses (part of start-up)."""
        if self._hosted is None:
            self._hosted = HostedLoop(self)

    def run_rounds(self, call: RoundsCall) -> RoundsResult:
        """Whole rounds, server step included (``engine/hosted.py``)."""
        self.host_rounds()
        assert self._hosted is not None
        return self._hosted.run(call)


def _conf(cfg: Any, key: str, default: Any = None) -> Any:
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def _enum(value: Any) -> Any:
    return getattr(value, "value", value)


class RayEngine(Engine):
    def __init__(self, setup: ExperimentSetup, cfg: Any) -> None:
        import ray

        self._ray = ray
        self._owns_ray = False
        if not ray.is_initialized():
            address = _conf(cfg, "address")
            ray.init(address=address, include_dashboard=False, log_to_driver=False,
                     configure_logging=True, logging_level=logging.WARNING)
            self._owns_ray = True
        resources = ray.cluster_resources()
        cpus_per_worker = float(_conf(cfg, "cpus_per_worker", 1.0))
        total_gpus = float(resources.get("GPU", 0.0))
        use_gpu = setup.device != "cpu" and total_gpus > 0
        if setup.device.startswith("cuda") and total_gpus == 0:
            raise RuntimeError(f"engine.device={setup.device!r} but the Ray cluster has no GPUs")
        num_workers = _conf(cfg, "num_workers")
        if num_workers is None:
            num_workers = int(total_gpus) if use_gpu else int(resources.get("CPU", 1.0) // max(cpus_per_worker, 1e-9))
        num_workers = int(num_workers)
        if num_workers < 1:
            raise ValueError(f"engine.num_workers must be >= 1, got {num_workers} "
                             f"(Ray sees {resources.get('CPU', 0)} CPUs and {total_gpus} GPUs)")
        gpus = 0.0
        if use_gpu:
            gpus = _conf(cfg, "gpus_per_worker")
            if gpus is None:  # share the GPUs evenly: W workers on G GPUs get G/W each (at most 1)
                gpus = min(1.0, total_gpus / num_workers)
            gpus = float(gpus)
        total_cpus = float(resources.get("CPU", 0.0))
        if num_workers * cpus_per_worker > total_cpus + 1e-9 or num_workers * gpus > total_gpus + 1e-9:
            raise ValueError(
                f"engine.num_workers={num_workers} x (engine.cpus_per_worker={cpus_per_worker}, "
                f"engine.gpus_per_worker={gpus}) needs more than the Ray cluster has ({total_cpus:g} CPUs, "
                f"{total_gpus:g} GPUs); the actors would wait forever. Lower num_workers or the per-worker resources.")
        self.num_workers = num_workers
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = gpus
        self.max_restarts = int(_conf(cfg, "max_restarts", 3))
        self.inline_bytes = 64 * 1024  # below Ray's 100 KiB limit for objects passed inside a call
        # The driver spins on the graph's channels while the workers train: with no CPU to spare it
        # takes one from them (2 workers on 2 cores: 45-86 ms rounds instead of 32-35 ms by RPC).
        mode = _conf(cfg, "compiled_graph", "auto")
        self.compiled = mode is True or (mode == "auto" and total_cpus - num_workers * cpus_per_worker >= 1)
        self.compiled_max_bytes = 1 << 20  # channels copy through the driver: slower than the object store for large ones
        self._dag: Any = None
        kind = setup.state_store
        backend = _conf(cfg, "state_backend", "disk")
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
        fault = _conf(cfg, "fault_injection", {}) or {}
        self.fault_client = _conf(fault, "client")
        fault_round = _conf(fault, "round")  # 1-based in the config, as in metrics.jsonl
        self.fault_round = None if fault_round is None else int(fault_round) - 1
        self._incarnation = [0] * num_workers
        use_fast_tensor_transport()  # before the dataset tensors travel
        self._setup_ref = ray.put(self.setup)
        self._actor_cls = ray.remote(RayWorker)
        t0 = time.perf_counter()
        self.actors = [self._spawn(w) for w in range(num_workers)]
        self._ping_all()
        self.stateful = bool(ray.get(self.actors[0].is_stateful.remote()))
        self.startup_s = time.perf_counter() - t0
        home = (lambda c: home_worker(c, num_workers)) if self.distributed and self.stateful else None
        self.scheduler = Scheduler(num_workers, setup.dataset.client_sizes(), setup.train, home=home,
                                   smoothing=float(_conf(cfg, "scheduler_smoothing", 0.5)))
        self._stats: dict[str, Any] = {}
        self.restarts = 0
        # One stateless worker runs whole rounds itself, many per call (engine/hosted.py). List-mode
        # servers (one-shot ensembles and distillation, FuseFL) keep their heavy server step on the
        # driver, with its threads rather than the worker's.
        self.server_in_worker = (bool(_conf(cfg, "server_in_worker", True)) and num_workers == 1
                                 and not self.stateful and get_algorithm(setup.algorithm).server.summable)
        self.hosted_calls = 0
        if self.server_in_worker:
            ray.get(self.actors[0].host_rounds.remote())

    # ------------------------------------------------------------------ actors

    def _options(self, worker_id: int) -> WorkerOptions:
        return WorkerOptions(
            num_workers=self.num_workers,
            durable_rounds=True,
            drop_cache_each_round=self.state_kind == "disk" and self.num_workers > 1,
            incarnation=self._incarnation[worker_id],
            fault_client=self.fault_client,
            fault_round=self.fault_round,
        )

    def _spawn(self, worker_id: int) -> Any:
        cls = self._actor_cls.options(num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker,
                                      max_restarts=0, max_task_retries=0)
        return cls.remote(worker_id, self._setup_ref, self._options(worker_id))

    def _ping_all(self) -> None:
        ray = self._ray
        try:
            ray.get([a.ping.remote() for a in self.actors])
        except ray.exceptions.RayTaskError as err:
            raise err.as_instanceof_cause() from None

    def _alive(self, worker_id: int) -> bool:
        ray = self._ray
        try:
            ray.get(self.actors[worker_id].ping.remote(), timeout=60)
            return True
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False

    def _restart(self, worker_id: int, reason: str) -> None:
        ray = self._ray
        if self.stateful and self.state_backend == "memory":
            raise RuntimeError(
                f"Ray worker {worker_id} died ({reason}); it held its home clients' state in memory, "
                f"which is lost. Use engine.state_store=disk or engine.state_backend=disk to survive worker faults.")
        log.warning("Ray worker %d died (%s); starting a new one and rerunning its clients", worker_id, reason)
        self._teardown_dag()  # it binds the dead actor; recompiled with the new one on next use
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self.actors[worker_id], no_restart=True)
        self._incarnation[worker_id] += 1
        self.actors[worker_id] = self._spawn(worker_id)
        ray.get(self.actors[worker_id].ping.remote())
        self.restarts += 1

    # ------------------------------------------------------------------ one round

    def run_round(self, ctx: RoundContext, broadcast: Broadcast) -> list[WorkerResult]:
        ray = self._ray
        t0 = time.perf_counter()
        plan = self.scheduler.plan(ctx.clients)
        needs = lending_plan(plan.assignment, self.num_workers) if self.distributed and self.stateful else None
        results: list[WorkerResult | None] = [None] * self.num_workers
        parts: list[list[Any]] = [[] for _ in range(self.num_workers)]  # parts[trainer][home]: refs
        todo = list(range(self.num_workers))
        if self.compiled and needs is None and broadcast.nbytes() <= self.compiled_max_bytes:
            done = self._compiled_round(ctx, broadcast, plan)
            if done is not None:
                results[:], todo = done, []
        # By RPC, a small broadcast travels inside each call; a large one is put into the object
        # store once and every worker reads the same copy (an extra fetch, paid once per worker).
        bc_ref = ray.put(broadcast) if todo and broadcast.nbytes() > self.inline_bytes else broadcast
        for attempt in range(self.max_restarts + 1):
            failed = self._submit_and_gather(ctx, bc_ref, plan, needs, todo, results, parts) if todo else set()
            if not failed:
                break
            if attempt == self.max_restarts:
                raise RuntimeError(f"round {ctx.round + 1}: Ray workers {sorted(failed)} kept failing after "
                                   f"{self.max_restarts} restarts (engine.max_restarts)")
            for w in range(self.num_workers):
                if not self._alive(w):
                    self._restart(w, f"round {ctx.round + 1}")
            todo = sorted(failed)
        self._finish_round(ctx, needs, parts)
        done = [r for r in results if r is not None]
        self._stats = self.scheduler.record(plan, [r.client_seconds for r in done], [r.busy_seconds for r in done])
        self._stats["sched_engine_s"] = time.perf_counter() - t0
        return done

    def hosts_rounds(self) -> bool:
        return self.server_in_worker

    def run_rounds(self, loop: LoopConfig, start: int, stop: int,
                   server_state: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        ray = self._ray
        call = RoundsCall(loop, start, stop, server_state, self.scheduler.state_dict(),
                          eval_threads=torch.get_num_threads())
        for attempt in range(self.max_restarts + 1):
            try:
                out = ray.get(self.actors[0].run_rounds.remote(call))
                break
            except ray.exceptions.RayActorError:
                if attempt == self.max_restarts:
                    raise RuntimeError(f"rounds {start + 1}..{stop}: Ray worker 0 kept failing after "
                                       f"{self.max_restarts} restarts (engine.max_restarts)") from None
                # Every call starts from the driver's server state: the rerun equals the lost call.
                self._restart(0, f"in the call for rounds {start + 1}..{stop}, rerun from round {start + 1}")
            except ray.exceptions.RayTaskError as err:
                raise err.as_instanceof_cause() from None
        self.hosted_calls += 1
        self.scheduler.load_state_dict(out.scheduler)
        return out.rows, out.server

    def _compiled_round(self, ctx: RoundContext, broadcast: Broadcast, plan: Plan) -> list[WorkerResult] | None:
        """Every worker's result through the compiled graph, or None when an actor died (the graph is
        torn down; the caller reruns the round by RPC, which restarts the dead worker)."""
        ray = self._ray
        if self._dag is None:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as inp:
                graph = MultiOutputNode([actor.run_round_planned.bind(inp) for actor in self.actors])
            try:
                self._dag = graph.experimental_compile(_submit_timeout=-1)  # -1: no timeout (rounds may be long)
            except Exception as err:  # e.g. a cluster whose nodes cannot share channels
                log.warning("Ray compiled graph unavailable (%s: %s); every round goes by RPC "
                            "(engine.compiled_graph=false silences this)", type(err).__name__, err)
                self.compiled = False
                return None
        try:
            refs = self._dag.execute((ctx, broadcast, plan.assignment))
            return [ref.get(timeout=-1) for ref in refs]
        except (ray.exceptions.RayActorError, ray.exceptions.RayChannelError) as err:
            log.warning("round %d: a Ray worker died in the compiled graph (%s); rerunning the round by RPC",
                        ctx.round + 1, type(err).__name__)
            self._teardown_dag()
            return None
        except ray.exceptions.RayTaskError as err:
            raise err.as_instanceof_cause() from None

    def _teardown_dag(self) -> None:
        if self._dag is None:
            return
        dag, self._dag = self._dag, None
        # Ray logs each dead actor's cancelled loop at ERROR level; the death is already reported.
        dag_log = logging.getLogger("ray.dag.compiled_dag_node")
        level = dag_log.level
        dag_log.setLevel(logging.CRITICAL)
        try:
            dag.teardown()
        except Exception as err:  # a dead actor's loop cannot be cancelled: nothing left to free
            log.debug("compiled graph teardown: %s", err)
        finally:
            dag_log.setLevel(level)

    def _submit_and_gather(self, ctx: RoundContext, bc_ref: Any, plan: Plan, needs: list | None,
                           todo: list[int], results: list, parts: list[list[Any]]) -> set[int]:
        ray = self._ray
        refs: dict[int, Any] = {}
        # Every export is queued before any round task, so no actor's round waits on another's.
        lent = {w: [self.actors[h].export_states.remote(needs[h][w]) for h in range(self.num_workers)
                    if needs[h][w]] if needs is not None else [] for w in todo}
        for w in todo:
            if needs is not None:
                out = self.actors[w].run_round_split.options(num_returns=1 + self.num_workers).remote(
                    ctx, bc_ref, plan.assignment[w], *lent[w])
                refs[w], parts[w] = out[0], list(out[1:])
            else:
                refs[w] = self.actors[w].run_round.remote(ctx, bc_ref, plan.assignment[w])
        failed: set[int] = set()
        for w in todo:
            try:
                results[w] = ray.get(refs[w])
            except ray.exceptions.RayActorError:
                failed.add(w)
            except ray.exceptions.RayTaskError as err:
                cause = err.cause if hasattr(err, "cause") else None
                if isinstance(cause, ray.exceptions.RayActorError):  # a home it depended on died
                    failed.add(w)
                else:
                    raise err.as_instanceof_cause() from None
        return failed

    def _finish_round(self, ctx: RoundContext, needs: list | None, parts: list[list[Any]]) -> None:
        """Apply every worker's staged states, and return lent states to their homes."""
        ray = self._ray
        for attempt in range(self.max_restarts + 1):
            calls = []
            for w, actor in enumerate(self.actors):
                if needs is not None:
                    incoming = [parts[t][w] for t in range(self.num_workers) if t != w and needs[w][t]]
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
        return self.actors if self.state_kind == "distributed" else self.actors[:1]

    def flush(self) -> None:
        self._ray.get([a.flush.remote() for a in self.actors])

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
        ray = self._ray
        self._teardown_dag()
        try:
            ray.get([a.close.remote() for a in self.actors], timeout=60)
        except Exception as err:  # closing must not hide the run's own outcome
            log.warning("closing Ray workers: %s", err)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        if self._owns_ray:
            ray.shutdown()
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

