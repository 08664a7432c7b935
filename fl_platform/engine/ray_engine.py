"""``engine=ray``: W long-lived Ray actors, each a ``Worker`` holding one model and the data.

Created once per run (``ray_cluster.py`` connects and ships the code, ``ray_placement.py``
decides W and each actor's CPUs/GPUs, ``ray_actors.py`` starts them spread over the nodes): the
experiment setup goes through the object store once, the training features one object per row
block (datasets/federated.py), and each actor keeps them on its device; the driver then reads the
blocks from those copies too, freeing each of its own as soon as it is copied.
Per round the broadcast is sent once (inside the call when small, else put into the object store
once and read by every actor), every actor trains its clients from the scheduler's plan and
returns one partial aggregate. No remote call is made per client. Messages
travel as ``transport.Packed`` values.

Client state belongs to a node. By default every worker is the home of clients ``c mod W`` and
keeps their states on its node, in memory (``state_store=memory``, or ``distributed`` with
``state_backend=memory``) or in node-local files (``disk``, or ``distributed`` with the disk
backend; ``state/nodes.py``); a client scheduled elsewhere borrows its state through the object
store for the round (``ray_state.py``), and the scheduler prefers home workers. Only
``state_store=disk`` with ``engine.state_dir_shared=true`` keeps one folder that every worker reads
and writes (a filesystem all nodes share). The driver keeps a manifest (client -> round of its
latest state, ``state/manifest.py``) and sends each worker its clients' rounds, so a missing or
stale state is an error naming the client, never a silent restart from zeros. Checkpoints gather
every home's states through the object store into the checkpoint (``state/gathered.py``); a
resume, on any set of nodes and any number of workers, restores them exactly or refuses.

Faults: when an actor dies, the engine starts a new actor for the same worker id (on its node
while the node lives) and reruns that worker's clients with the same broadcast; since states are
staged and applied only after every result arrived, the rerun starts from unmodified states and
the round's result equals the fault-free one (a warning is logged). When the dead worker's states
died with it (its node was lost, or it kept them in memory), or a worker finds a state missing,
the engine raises :class:`StateLost`: the round loop rolls back to its last checkpoint and reruns
from there, or stops with that error when there is none.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from fl_platform.algorithms.base import ServerAlgorithm
from fl_platform.core import Aggregate, Broadcast, RoundContext
from fl_platform.engine.faults import Faults
from fl_platform.engine.ray_actors import START_TIMEOUT_S, ActorPool, hold_eval_gpu
from fl_platform.engine.ray_cluster import connect
from fl_platform.engine.ray_placement import (
    GpuGroup,
    conf_value,
    evaluates_on_gpu,
    evaluates_on_worker,
    plan_placement,
    whole_gpus,
)
from fl_platform.engine.ray_state import Lending
from fl_platform.engine.scheduler import Scheduler
from fl_platform.engine.transport import Packed, received_bytes
from fl_platform.engine.worker import WorkerOptions
from fl_platform.rounds.client_eval import assignment
from fl_platform.rounds.engine import Engine, StateLost, WorkerResult
from fl_platform.rounds.evaluation import DriverEvaluator, Evaluator
from fl_platform.rounds.setup import ExperimentSetup
from fl_platform.state.distributed import home_worker
from fl_platform.state.gathered import FOLDER, checked_stamp, iter_states, part_path, save_part, state_files
from fl_platform.state.manifest import Manifest, MissingClientState, checked
from fl_platform.training.flat import FlatModel

log = logging.getLogger(__name__)

#: A broadcast up to this size travels inside each call (below Ray's 100 KiB limit for inlined
#: arguments); a larger one is put into the object store once and every worker reads that copy.
INLINE_BYTES = 64 * 1024
#: Ray returns a task's result inside its reply to the caller up to this size (max_direct_call_object_size).
INLINE_RETURN_BYTES = 100 * 1024
#: At most this many bytes of client states travel in one message of a checkpoint or a restore.
PART_BYTES = 64 * 2**20


def driver_cuda_device(gpu: int, setting: str = "auto") -> torch.device:
    """This process's torch device for the physical GPU ``gpu`` of its node (as Ray numbers them). When this
    process has no CUDA: ``engine.eval_device=cuda`` stops the run (asked for, and not there), ``auto`` (the
    workers' GPUs chose it) evaluates on the CPU with a warning."""
    import os

    if not torch.cuda.is_available():
        if setting == "cuda":
            raise RuntimeError(f"engine.eval_device=cuda: Ray holds GPU {gpu} of the driver's node for the "
                               f"evaluation, but this process cannot use CUDA (torch {torch.__version__}, "
                               f"torch.version.cuda={torch.version.cuda}); set engine.eval_device=cpu or worker")
        log.warning("Ray holds GPU %d for the driver's evaluation, but this process has no CUDA: evaluating "
                    "on the CPU", gpu)
        return torch.device("cpu")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [v.strip() for v in visible.split(",")] if visible else None
    if ids is not None and str(gpu) not in ids:
        raise RuntimeError(f"Ray reserved GPU {gpu} for the driver's evaluation, but this process sees only "
                           f"CUDA_VISIBLE_DEVICES={visible}")
    return torch.device(f"cuda:{ids.index(str(gpu)) if ids is not None else gpu}")


def leave_probe(directory: Path, sub: str = "") -> Path:
    """A new empty file in ``directory``'s subfolder ``sub`` (returned relative to ``directory``): a worker that
    finds it knows its node sees the folder, and writes or reads checkpoint parts there itself."""
    probe = Path(sub) / f".reach-{uuid.uuid4().hex}"
    (directory / probe).parent.mkdir(parents=True, exist_ok=True)
    (directory / probe).write_bytes(b"")
    return probe


class WorkerEvaluator:
    """Evaluates the global model on worker 0 (``engine.eval_device=worker``, or ``auto`` with GPU workers and
    no GPU on the driver's node): each set goes into the object store once and is moved to the worker's
    device on its first use there; the server half travels at each evaluation, since its ``evaluate``
    may read any of its state (the weights; VHL's, FuseFL's and the one-shot family's own). A worker
    that died is replaced and the evaluation made again, as for a round (``engine.max_restarts``)."""

    where = "worker 0"

    def __init__(self, engine: RayEngine) -> None:
        self.engine = engine
        self.sets: dict[str, Any] = {}

    def add(self, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        self.sets[name] = self.engine._ray.put(Packed((x.cpu(), y.cpu())))

    def evaluate(self, server: ServerAlgorithm, name: str, batch_size: int) -> dict[str, float]:
        ref, message = self.sets[name], Packed(server)

        def calls() -> list[tuple[int, Any]]:
            return [(0, self.engine.pool[0].evaluate_global_ref.remote(message, name, [ref], batch_size))]

        (out,) = self.engine._get_all(calls, f"evaluating the global model on the {name} set")
        return out


class RayEngine(Engine):
    def __init__(self, setup: ExperimentSetup, cfg: Any) -> None:
        import ray

        self._ray = ray
        self._owns_ray = connect(cfg)
        self._eval_slot: Any = None
        self.group: GpuGroup | None = None
        self.pool: ActorPool | None = None
        try:
            self._start(setup, cfg)
        except BaseException:  # leave no actor, held GPU share or Ray we started behind (a notebook goes on)
            self.close()
            raise

    def _start(self, setup: ExperimentSetup, cfg: Any) -> None:
        ray = self._ray
        eval_setting = str(conf_value(cfg, "eval_device", "auto"))
        if eval_setting.startswith("cuda:"):
            raise ValueError(f"engine.eval_device={eval_setting}: with engine=ray say cuda, and Ray picks the GPU "
                             f"whose share it holds for the driver")
        self.start_timeout_s = float(conf_value(cfg, "start_timeout_s", START_TIMEOUT_S))
        driver = ray.get_runtime_context().get_node_id()
        driver_gpus = sum(whole_gpus([n for n in ray.nodes() if n["NodeID"] == driver]))
        gpu_workers = setup.device != "cpu" and ray.cluster_resources().get("GPU", 0) > 0
        on_gpu = evaluates_on_gpu(eval_setting, gpu_workers, driver_gpus)
        # The driver's node has no GPU while the workers train on GPUs (or the user says so): worker 0
        # evaluates on its device between rounds, never the driver's CPU (fl_platform/rounds/evaluation.py).
        self.eval_on_worker = evaluates_on_worker(eval_setting, gpu_workers, driver_gpus)
        if self.eval_on_worker and eval_setting == "auto":
            log.info("the workers train on GPUs and the driver's node has none: worker 0 evaluates the global "
                     "model on its GPU between rounds (eval_time_s in metrics.jsonl)")
        self.placement = plan_placement(cfg, setup.device, ray.cluster_resources(), eval_on_gpu=on_gpu,
                                        node_gpus=whole_gpus(ray.nodes()), driver_gpus=driver_gpus)
        if self.placement.uses_gpu:  # one bundle per GPU: every GPU used before any hosts two workers
            self.group = GpuGroup(self.placement, self.start_timeout_s, driver)
        self.eval_device = torch.device("cpu")  # cpu, or auto with CPU workers: the driver's CPU
        if self.placement.eval_gpus:
            self._eval_slot, gpu = hold_eval_gpu(self.placement.eval_gpus, self.start_timeout_s, self.group)
            self.eval_device = driver_cuda_device(gpu, eval_setting)
        num_workers = self.num_workers = self.placement.num_workers
        self.max_restarts = int(conf_value(cfg, "max_restarts", 3))
        timeout = conf_value(cfg, "round_timeout_s")
        self.round_timeout_s = None if timeout is None else float(timeout)
        self.shared = bool(conf_value(cfg, "state_dir_shared", False))
        options = dict(setup.state_options)
        if self.shared:  # one folder that every node sees
            if setup.state_store != "disk":
                raise ValueError(f"engine.state_dir_shared=true shares a disk store's folder; it needs "
                                 f"engine.state_store=disk, got {setup.state_store!r}")
            if not options.get("directory"):
                raise ValueError("engine.state_dir_shared=true needs engine.state_dir (a folder every node sees) "
                                 "or a run dir")
            kind, self.state_backend = "disk", "shared disk"
        else:  # homes on the nodes
            kind = "distributed"
            self.state_backend = {"memory": "memory", "disk": "disk"}.get(setup.state_store) or \
                conf_value(cfg, "state_backend", "disk")
            if setup.state_store == "disk" and num_workers > 1:
                log.info("engine.state_store=disk with %d Ray workers: each worker keeps its home clients' states "
                         "in node-local files (engine.state_dir_shared=true shares one folder instead)", num_workers)
            options.update(backend=self.state_backend, node_run=f"run-{uuid.uuid4().hex[:12]}")
        self.setup = dataclasses.replace(setup, state_store=kind, state_options=options)
        # TEST ONLY (engine.fault_injection): None unless a fault is asked for; then the actors are FaultyRayWorkers.
        faults = Faults.from_conf(conf_value(cfg, "fault_injection"), num_workers)
        t0 = time.perf_counter()
        # The training features go into the object store one row block at a time, and from then on the
        # driver reads each block from the store's copy, as its node's workers do, its own freed: the
        # node holds the data once, during the shipping too. The rest of the set-up follows in one
        # object, without the test set, which only the driver evaluates on.
        data = self.setup.dataset
        blocks = []  # the pool keeps the references (replacement actors receive them too)
        for i in range(len(data.train_blocks)):  # no loop variable keeps a shipped block alive
            blocks.append(ray.put(Packed(data.train_blocks[i], views=True)))
            data.hold_block(i, ray.get(blocks[-1]))
        setup_ref = ray.put(Packed(dataclasses.replace(self.setup, dataset=data.without_training_features())))
        data.hold_copy(ray.get(setup_ref).dataset)
        self.pool = ActorPool(self.placement, setup_ref, self._options, self.start_timeout_s, blocks, self.group,
                              faults)
        self.pool.ping_all()
        self.stateful = bool(ray.get(self.pool[0].is_stateful.remote()))
        self.state_nbytes = int(ray.get(self.pool[0].state_nbytes.remote())) if self.stateful else 0
        # A partial aggregate small enough to travel inside its task's reply reaches the driver, its
        # owner, whatever the reduction does (Ray inlines returns up to 100 KiB): the driver sums those
        # itself; larger ones are reduced among the workers (_reduction_tree).
        self.tree = int(ray.get(self.pool[0].partial_nbytes.remote())) > INLINE_RETURN_BYTES and num_workers > 1
        self.startup_s = time.perf_counter() - t0
        self.lend = self.stateful and not self.shared and num_workers > 1
        home = (lambda c: home_worker(c, num_workers)) if self.lend else None
        self.scheduler = Scheduler(num_workers, setup.dataset.client_sizes(), setup.train, home=home,
                                   smoothing=float(conf_value(cfg, "scheduler_smoothing", 0.5)),
                                   policy=str(conf_value(cfg, "scheduler", "lpt")))
        self.manifest = Manifest()
        self._loaded: dict[str, Any] | None = None  # a checkpoint's client_states, until restore_state
        self._lost: str | None = None  # why states were lost: no round runs until restore_state
        self._stats: dict[str, Any] = {}
        self._arrived: list[WorkerResult | None] = []  # the round in flight's results, until applied
        self.checkpoint_driver_bytes: int | None = None  # client-state bytes the last checkpoint sent through the driver
        self.restore_driver_bytes: int | None = None  # and the last restore (resume, rollback) read on the driver

    def _options(self, worker_id: int) -> WorkerOptions:
        return WorkerOptions(
            num_workers=self.num_workers,
            durable_rounds=True,
            drop_cache_each_round=self.shared and self.num_workers > 1,
            device_share=self.group.share(worker_id) if self.group is not None else 1.0 / self.num_workers,
        )

    def describe_workers(self) -> list[dict[str, Any]]:
        rows = []
        for w, info in enumerate(self.pool.infos):
            rows.append({"worker": w, "node": f"{info['node_id'][:12]} ({info['host']})", "device": info["device"],
                         "gpu_ids": info["gpu_ids"], "gpu_share": self.group.share(w) if self.group else 0.0,
                         "torch": info["torch"], "cuda": info["cuda"]})
        return rows

    @property
    def restarts(self) -> int:
        return self.pool.restarts

    # ------------------------------------------------------------------ faults

    def _recover(self, reason: str, rerun: bool = False) -> list[int]:
        """Replace every dead actor; raise StateLost when client states died with one of them. Returns
        the dead workers' ids. ``rerun``: the caller reruns every dead worker's share of the round in
        flight, so the new states of one whose result had arrived are made again, not lost."""
        dead = self.pool.dead()
        alive_nodes = self.pool.alive_nodes()
        lost_node = {w for w in dead if self.pool.nodes[w] not in alive_nodes}
        names = {w: self.pool.node_name(w) for w in dead}
        for w in dead:
            self.pool.restart(w, f"{reason}, {names[w]} lost" if w in lost_node else reason)
            if rerun and self._arrived:
                self._arrived[w] = None
        if not self.stateful or self.shared:
            return dead
        # A worker's states are gone with it when they lived in its memory or on its lost node, and only
        # if it holds some: it is home to a client with a committed state (a crash in round 1 loses
        # nothing: rerun it), or its result arrived and the new states it staged are not yet applied.
        # The new states of clients it trained for other homes wait as objects on its node: lost with
        # the node only.
        homes = {home_worker(c, self.num_workers) for c in self.manifest.rounds}
        staged, lent = self._uncommitted()
        lost = [w for w in dead if ((w in lost_node or self.state_backend == "memory") and w in homes | staged)
                or (w in lost_node and w in lent)]
        if lost:
            where = "in memory" if self.state_backend == "memory" else "in node-local files"
            nodes = sorted({names[w] for w in lost if w in lost_node})
            pending = sorted(set(lost) & (staged | lent))
            self._mark_lost(f"{reason}: Ray workers {lost} died{' with ' + ', '.join(nodes) if nodes else ''}; "
                            f"the client states they kept {where} are gone"
                            + (f" (workers {pending} held this round's new states, not yet applied)" if pending
                               else ""))
        return dead

    def _uncommitted(self) -> tuple[set[int], set[int]]:
        """(workers whose result arrived with new states of their own clients, staged on them and not yet
        applied; workers whose result holds new states of clients homed elsewhere, not yet returned home),
        for the round in flight (``_arrived``)."""
        staged: set[int] = set()
        lent: set[int] = set()
        for w, result in enumerate(self._arrived):
            if result is None:
                continue
            for cid in result.states_written:
                (lent if self.lend and home_worker(cid, self.num_workers) != w else staged).add(w)
        return staged, lent

    def _mark_lost(self, message: str, cause: BaseException | None = None) -> None:
        self._lost = message
        raise StateLost(message) from cause

    def _dead_or_raise(self, err: BaseException) -> None:
        """Return when ``err`` means an actor (or an object it held) is gone; raise anything else."""
        ray = self._ray
        if isinstance(err, ray.exceptions.RayActorError | ray.exceptions.ObjectLostError):
            return
        if isinstance(err, ray.exceptions.RayTaskError):
            cause = getattr(err, "cause", None)
            if isinstance(cause, MissingClientState):
                self._mark_lost(str(cause), cause)
            if isinstance(cause, ray.exceptions.RayActorError | ray.exceptions.ObjectLostError):
                return  # a home it needed died
            raise err.as_instanceof_cause() from None
        raise err

    def _get_all(self, make_calls: Callable[[], list[tuple[int, Any]]], reason: str) -> list[Any]:
        """The results of the calls ``make_calls()`` makes ((worker id, reference) pairs), in order; when
        actors died, or hung (no answer ``engine.round_timeout_s`` after the calls were made: they are
        killed), replace them and make the calls again (at most ``max_restarts`` times). The calls must
        be idempotent."""
        for attempt in range(self.max_restarts + 1):
            calls = make_calls()
            t_submit = time.perf_counter()
            results: list[Any] = [None] * len(calls)
            pending = {ref: i for i, (_, ref) in enumerate(calls)}
            failed = False
            for i, ref in self._arrivals(pending, t_submit):
                try:
                    results[i] = self._ray.get(ref)
                except Exception as err:  # sorted out by _dead_or_raise
                    self._dead_or_raise(err)
                    failed = True
            if pending:
                self._kill_hung(sorted({calls[i][0] for i in pending.values()}), reason)
                failed = True
            if not failed:
                return results
            if attempt == self.max_restarts:
                raise RuntimeError(f"{reason}: Ray workers kept dying ({self.max_restarts} restarts, "
                                   f"engine.max_restarts)")
            self._recover(reason)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ one round

    def run_round(self, ctx: RoundContext, broadcast: Broadcast) -> list[WorkerResult]:
        if self._lost is not None:
            raise StateLost(f"{self._lost}; the engine needs restore_state (a checkpoint) before another round")
        t0 = time.perf_counter()
        plan = self.scheduler.plan(ctx.clients)
        lending = Lending(plan.assignment, self.num_workers) if self.lend else None
        expect = [self.manifest.expected(clients) if self.stateful else None for clients in plan.assignment]
        results: list[WorkerResult | None] = [None] * self.num_workers
        self._arrived = results  # (until the round's states are applied: _recover's states at risk)
        try:
            return self._run_round(ctx, broadcast, plan, lending, expect, results, t0)
        finally:
            self._arrived = []

    def _run_round(self, ctx: RoundContext, broadcast: Broadcast, plan: Any, lending: Lending | None,
                   expect: list[dict[int, int] | None], results: list[WorkerResult | None],
                   t0: float) -> list[WorkerResult]:
        ray = self._ray
        # A small broadcast travels inside each worker's call; a large one is put into the object
        # store once and every worker reads the same copy.
        bc_ref = ray.put(Packed(broadcast)) if broadcast.nbytes() > INLINE_BYTES else None
        inbound = received_bytes()
        partials: list[Any] = [None] * self.num_workers  # with the tree: references to the partial aggregates
        todo = list(range(self.num_workers))
        arrived = [0.0] * self.num_workers  # seconds from submitting a worker's call to its result here
        for attempt in range(self.max_restarts + 1):
            t_submit = time.perf_counter()
            refs = self._submit(ctx, broadcast, bc_ref, plan.assignment, expect, lending, todo, partials)
            # Submitted now, the tree's steps run as soon as their two partials exist: most of the
            # reduction overlaps with the slowest workers' training.
            root = self._reduction_tree(partials) if self.tree else None
            failed = self._collect(refs, results, arrived, t_submit)
            t_reduce = time.perf_counter()
            if not failed and root is not None:
                total = self._fetch_root(root)
                if total is None:
                    failed = set(range(self.num_workers))  # a partial died with its node: the round again
            if not failed:
                break
            if attempt == self.max_restarts:
                raise RuntimeError(f"round {ctx.round + 1}: Ray workers {sorted(failed)} kept failing after "
                                   f"{self.max_restarts} restarts (engine.max_restarts)")
            for w in failed:
                results[w] = None
            # A worker that died after its result arrived is rerun too (_recover clears its result): its
            # new states, staged on it or waiting on its node for their homes, may have died with it, and
            # nothing of the round is applied yet. Every worker without a result runs its share again.
            self._recover(f"round {ctx.round + 1}", rerun=True)
            todo = [w for w, result in enumerate(results) if result is None]
        t_commit = time.perf_counter()
        self._finish_round(ctx, lending)
        done = [r for r in results if r is not None]
        if root is not None:
            done[0].aggregate = total  # the others' partials are inside it
        for r in done:
            self.manifest.record(ctx.round, r.states_written)
        self._stats = self.scheduler.record(plan, [r.client_seconds for r in done], [r.busy_seconds for r in done])
        self._stats["sched_engine_s"] = time.perf_counter() - t0
        self._stats["sched_reduce_s"] = t_commit - t_reduce
        self._stats["sched_commit_s"] = time.perf_counter() - t_commit  # staged states applied, manifest
        self._stats["sched_driver_in_bytes"] = received_bytes() - inbound  # tensors the driver received
        # Transport: a call's time here beyond the worker's own (messages, object store, Ray's scheduling).
        self._stats["worker_transport_s"] = [max(arrived[r.worker_id] - r.busy_seconds, 0.0) for r in done]
        return done

    def _reduction_tree(self, partials: list[Any]) -> Any:
        """The sum of the workers' partial aggregates, reduced among the workers in a fixed binary tree
        ((0 + 1) + (2 + 3)) + ..., each step on the lower worker, which fetches its partner's partial
        through the object store (so the driver receives one float64 aggregate, whatever W); returns
        the reference to the sum."""
        refs = list(partials)
        step = 1
        while step < len(refs):
            for a in range(0, len(refs) - step, 2 * step):
                refs[a] = self.pool[a].merge.remote(refs[a], refs[a + step], 2 * step >= len(refs))
            step *= 2
        return refs[0]

    def _fetch_root(self, ref: Any) -> Aggregate | None:
        """The tree's sum, or None when a partial was lost (its worker's node died)."""
        try:
            return self._ray.get(ref)
        except Exception as err:  # sorted out by _dead_or_raise
            self._dead_or_raise(err)
            return None

    def _submit(self, ctx: RoundContext, broadcast: Broadcast, bc_ref: Any, assignment: list[list[int]],
                expect: list[dict[int, int] | None], lending: Lending | None, todo: list[int],
                partials: list) -> dict[int, Any]:
        """Start ``todo`` workers' shares (``bc_ref``: the broadcast in the object store, or None when
        it travels inside each call); returns the references to their results. With the reduction
        tree the partial aggregates travel apart (``partials`` receives their references); without,
        inside the results, which the driver sums (Simulation.run_round)."""
        refs: dict[int, Any] = {}
        # Every export is queued before any round task, so no actor's round waits on another's.
        lent = {w: lending.exports(self.pool, w) for w in todo} if lending is not None else {}
        shared = () if bc_ref is None else (bc_ref,)
        packed = Packed(broadcast) if bc_ref is None else None  # (RayWorker.run_round_parts' arguments)
        for w in todo:
            args = (ctx, assignment[w], packed, expect[w], self.num_workers if lending is not None else 0, self.tree)
            if lending is not None:
                refs[w], partials[w] = lending.submit(self.pool, w, args, *shared, *lent[w], split=self.tree)
            elif self.tree:
                refs[w], partials[w] = self.pool[w].run_round_parts.options(num_returns=2).remote(*args, *shared)
            else:
                refs[w] = self.pool[w].run_round_parts.remote(*args, *shared)
        return refs

    def _arrivals(self, pending: dict[Any, Any], t_submit: float) -> Iterator[tuple[Any, Any]]:
        """(key, reference) of each of ``pending``'s references (reference -> key) as it arrives,
        popped from it; stops when ``engine.round_timeout_s`` after ``t_submit`` passes, leaving those
        without an answer in ``pending``."""
        while pending:
            left = None if self.round_timeout_s is None else self.round_timeout_s - (time.perf_counter() - t_submit)
            ready, _ = self._ray.wait(list(pending), num_returns=1, timeout=None if left is None else max(left, 0.0))
            if not ready:
                return
            for ref in ready:
                yield pending.pop(ref), ref

    def _kill_hung(self, workers: list[int], what: str) -> None:
        """Kill workers that did not answer within ``engine.round_timeout_s`` (``what``: the call); the
        caller then replaces them as dead ones."""
        log.warning("Ray workers %s sent no result within engine.round_timeout_s=%g s (%s): killing them, to "
                    "replace them and make their calls again", workers, self.round_timeout_s, what)
        for w in workers:
            self._ray.kill(self.pool[w], no_restart=True)

    def _collect(self, refs: dict[int, Any], results: list, arrived: list[float], t_submit: float) -> set[int]:
        """The results into ``results`` as they arrive (``arrived[w]``: seconds since ``t_submit``);
        returns the ids of workers whose actor (or a home it needed) died, or that hung: still without
        a result ``engine.round_timeout_s`` after ``t_submit``, they are killed (then replaced as dead)."""
        failed: set[int] = set()
        pending = {ref: w for w, ref in refs.items()}
        for w, ref in self._arrivals(pending, t_submit):
            arrived[w] = time.perf_counter() - t_submit
            try:
                results[w] = self._ray.get(ref)
            except Exception as err:  # sorted out by _dead_or_raise
                self._dead_or_raise(err)
                failed.add(w)
        if pending:
            hung = sorted(pending.values())
            self._kill_hung(hung, "their share of the round's training")
            failed |= set(hung)
        return failed

    def _finish_round(self, ctx: RoundContext, lending: Lending | None) -> None:
        """Apply every worker's staged states, and return lent states to their homes (both idempotent:
        staged states are durable on their worker's node, lent ones are objects the driver owns)."""
        if not self.stateful:
            return

        def calls() -> list[tuple[int, Any]]:
            out = []
            for w, actor in enumerate(self.pool):
                incoming = lending.returns_to(w) if lending is not None else []
                if incoming:
                    out.append((w, actor.import_states.remote(*incoming)))
                out.append((w, actor.commit_round.remote(ctx.round)))
            return out

        self._get_all(calls, f"saving client states after round {ctx.round + 1}")

    def evaluator(self, model: FlatModel) -> Evaluator:
        return WorkerEvaluator(self) if self.eval_on_worker else DriverEvaluator(model)

    def evaluate_clients(self, ctx: RoundContext, broadcast: Broadcast,
                         client_ids: list[int]) -> dict[int, dict[str, float]]:
        """Per-client evaluation on the workers: each client on its home worker when states live with
        their homes (nothing is lent), else spread over the workers; states checked against the manifest."""
        if self._lost is not None:
            raise StateLost(f"{self._lost}; the engine needs restore_state (a checkpoint) before evaluating")
        parts = assignment(client_ids, self.num_workers, self.lend)
        bc = Packed(broadcast)

        def calls() -> list[tuple[int, Any]]:
            return [(w, self.pool[w].evaluate_clients_packed.remote(
                ctx, bc, cids, self.manifest.expected(cids) if self.stateful else None))
                for w, cids in enumerate(parts) if cids]

        out: dict[int, dict[str, float]] = {}
        for part in self._get_all(calls, f"evaluating clients after round {ctx.round + 1}"):
            out.update(part)
        return {c: out[c] for c in sorted(out)}

    def round_stats(self) -> dict[str, Any]:
        return dict(self._stats)

    # ------------------------------------------------------------------ durability

    def flush(self) -> None:
        self._get_all(lambda: [(w, a.flush.remote()) for w, a in enumerate(self.pool)], "flushing client states")

    def checkpoint_state(self, directory: Path, round: int) -> None:
        if self._lost is not None:
            raise StateLost(f"{self._lost}; nothing to checkpoint")
        self.flush()
        if not self.stateful:
            return
        if self.shared:  # the folder's own two-phase checkpoint
            self._get_all(lambda: [(0, self.pool[0].checkpoint_state.remote(str(directory), round))],
                          f"checkpoint after round {round}")
        else:
            self._gather(Path(directory), round)

    def _gather(self, directory: Path, round: int) -> None:
        """Every home's states, checked against the manifest, into ``directory`` (a part of at most
        PART_BYTES at a time): each home worker writes its own parts when its node sees the folder (the
        driver's node, or a filesystem the nodes share: the driver leaves a probe file there and each
        worker looks for it); the driver gathers the others' through the object store
        (``checkpoint_driver_bytes``, logged per checkpoint)."""
        per_part = max(1, PART_BYTES // max(self.state_nbytes, 1))
        homes: dict[int, list[list[int]]] = {}
        cids_of: dict[int, list[int]] = {}
        for cid in sorted(self.manifest.rounds):
            cids_of.setdefault(home_worker(cid, self.num_workers), []).append(cid)
        for home, cids in cids_of.items():
            homes[home] = [cids[s : s + per_part] for s in range(0, len(cids), per_part)]
        probe = leave_probe(directory, FOLDER)
        try:
            order = sorted(homes)
            written = self._get_all(lambda: [(h, self.pool[h].write_checkpoint_parts.remote(
                str(directory), str(probe), homes[h], self.manifest.expected(cids_of[h]), round)) for h in order],
                f"checkpoint after round {round}")
        finally:
            (directory / probe).unlink(missing_ok=True)
        through_driver = 0
        for home, done in zip(order, written):
            if done is None:  # its node does not see the folder
                through_driver += self._gather_home(directory, round, home, homes[home])
        self.checkpoint_driver_bytes = through_driver
        log.info("checkpoint after round %d: client states of %d home workers written by their nodes, %d through "
                 "the driver (%d bytes)", round, sum(w is not None for w in written),
                 sum(w is None for w in written), through_driver)

    def _gather_home(self, directory: Path, round: int, home: int, chunks: list[list[int]]) -> int:
        """``home``'s states through the driver into ``directory``; returns the bytes written."""
        nbytes = 0
        for index, chunk in enumerate(chunks):
            (states,) = self._get_all(lambda c=chunk: [(home, self.pool[home].export_states_packed.remote(c))],
                                      f"checkpoint after round {round}")
            try:
                for cid in chunk:
                    checked(cid, states.get(cid), self.manifest.rounds, self.pool.node_name(home))
            except MissingClientState as err:
                self._mark_lost(f"checkpoint after round {round}: {err}", err)
            save_part(directory, home, index, states)
            nbytes += part_path(directory, home, index).stat().st_size
        return nbytes

    def commit_state(self, round: int) -> None:
        if self.stateful and self.shared:
            self._get_all(lambda: [(0, self.pool[0].commit_state.remote(round))], f"checkpoint after round {round}")

    def restore_state(self, directory: Path | None, round: int | None) -> None:
        """Every worker's store as of the checkpoint (a fresh start: empty), on the nodes there are now."""
        loaded, self._loaded = self._loaded, None
        for w in self.pool.dead():  # an actor lost since: replaced (its states are reset below)
            self.pool.restart(w, "restoring a checkpoint")
        self._lost = None
        self.manifest = Manifest()
        if not self.stateful:
            return
        actors = list(self.pool) if not self.shared else [self.pool[0]]
        files = state_files(directory)
        if directory is None or files or not self.shared:
            self._get_all(lambda: [(w, a.restore_state.remote(None, None)) for w, a in enumerate(actors)],
                          "resetting client states")
        if directory is None:
            return
        manifest = Manifest.from_state_dict(loaded["manifest"]) if loaded is not None else None
        if files:
            self.manifest = self._import(directory, files, manifest, (loaded or {}).get("homes"))
        elif self.shared:  # the folder's own checkpoint, compared with the manifest
            self._get_all(lambda: [(0, self.pool[0].restore_state.remote(str(directory), round))],
                          "restoring client states")
            (stored,) = self._get_all(lambda: [(0, self.pool[0].stored_rounds.remote())], "restoring client states")
            if manifest is not None and stored != manifest.rounds:
                diff = sorted(set(stored.items()) ^ set(manifest.rounds.items()))
                raise RuntimeError(f"checkpoint {directory}: the shared folder's client states differ from its "
                                   f"manifest (client, round): {diff[:5]}; was engine.state_dir changed?")
            self.manifest.rounds = {c: r for c, r in stored.items() if r is not None}
        elif manifest is None or len(manifest):
            layout = (loaded or {}).get("layout")
            hint = ("its states are in the shared folder engine.state_dir: resume with engine.state_dir_shared=true "
                    "and the same engine.state_dir" if layout == "folder" else
                    "it was made with engine=inline and state_store=disk, whose states stay in their folder: "
                    "resume it with engine=inline, or engine.state_dir_shared=true and that folder as "
                    "engine.state_dir")
            raise RuntimeError(f"checkpoint {directory} holds no client states, and this run keeps some; {hint}")

    def _import(self, directory: Path, files: list[Path], manifest: Manifest | None,
                homes_then: int | None = None) -> Manifest:
        """Load a checkpoint's states into their homes (or the shared folder); every state must carry
        the round its manifest lists (without a manifest, an in-process engine's checkpoint: its stamps).
        Each home worker reads its own states when its node sees the checkpoint folder (only its own
        parts when the checkpoint had as many homes, ``homes_then``); otherwise the driver reads every
        part and sends each state to its home (``restore_driver_bytes``)."""
        directory, found = Path(directory), Manifest()
        read: list[dict[int, int] | None] = [None]  # the driver reads, unless every home's node sees the folder
        if not self.shared:
            W = self.num_workers
            names = [str(f) for f in files]

            def own(h: int) -> list[str]:
                return [n for n in names if Path(n).name.startswith(f"part-{h:05d}-")] if homes_then == W else names

            expected: dict[int, dict[int, int]] = {h: {} for h in range(W)}  # each home's manifest entries
            for c, r in (manifest.rounds if manifest is not None else {}).items():
                expected[home_worker(c, W)][c] = r

            def expect(h: int) -> dict[int, int] | None:
                return None if manifest is None else expected[h]

            probe = leave_probe(directory)
            try:
                read = self._get_all(lambda: [(h, self.pool[h].read_checkpoint_parts.remote(
                    str(directory), str(probe), own(h), expect(h))) for h in range(W)], "restoring client states")
            finally:
                (directory / probe).unlink(missing_ok=True)
        if all(r is not None for r in read):
            for r in read:
                found.rounds.update(r or {})
            self.restore_driver_bytes = 0
        else:  # (states some workers stored already are put again, the same)
            self.restore_driver_bytes = sum(f.stat().st_size for f in files)
            for part in iter_states(files):
                routed: dict[int, dict[int, Any]] = {}
                for cid, state in part.items():
                    found.rounds[cid] = checked_stamp(directory, cid, state, None if manifest is None
                                                      else manifest.rounds)
                    routed.setdefault(0 if self.shared else home_worker(cid, self.num_workers), {})[cid] = state
                self._get_all(lambda r=routed: [(h, self.pool[h].put_states.remote(Packed(s))) for h, s in r.items()],
                              "restoring client states")
        log.info("client states restored from %s: %d bytes read by the driver", directory, self.restore_driver_bytes)
        if manifest is not None and manifest.rounds.keys() - found.rounds.keys():
            missing = sorted(manifest.rounds.keys() - found.rounds.keys())
            raise RuntimeError(f"checkpoint {directory} lacks the states of {len(missing)} clients its manifest "
                               f"lists (e.g. {missing[:5]}); it cannot be restored exactly")
        return found

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict(),
                "client_states": {"layout": "folder" if self.shared else "gathered", "homes": self.num_workers,
                                  "manifest": self.manifest.state_dict()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])
        self._loaded = state.get("client_states")

    def close(self) -> None:
        """Workers, the evaluation slot, the placement group, then the Ray this engine started: each is
        released even when one before it raises (an unreachable cluster), which is then re-raised."""
        with contextlib.ExitStack() as stack:  # callbacks run last-in first-out
            if self._owns_ray:
                stack.callback(self._ray.shutdown)
            if self.group is not None:
                stack.callback(self.group.close)
            if self._eval_slot is not None:
                stack.callback(self._ray.kill, self._eval_slot)
            if self.pool is not None:
                stack.callback(self.pool.close)
