"""The Ray actors that host workers, where they run, and what happens when one dies.

``RayWorker`` is a ``Worker`` whose results leave the actor as :class:`Packed` messages; a home
worker keeps its clients' states in its node's own folder (``state/nodes.py``). ``ActorPool``
starts one actor per worker id, spread over the cluster's nodes, records each one's node, checks
they are alive, and replaces a dead one (crash, OOM kill, ``os._exit``, lost node) with a fresh
actor for the same id: on the same node while that node lives (so a home finds its node-local
states again), else on a node that has room. The engine then reruns that worker's share of the
round, or rolls the run back to its last checkpoint when states were lost with the node. With
``engine.fault_injection`` (test only) the actors are ``faults.FaultyRayWorker``s, told their
incarnation (0, +1 per replacement) so that a replacement's rerun succeeds.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fl_platform.algorithms.base import ServerAlgorithm
from fl_platform.compression.uplink import contribution_sizes
from fl_platform.core import Aggregate, Broadcast, RoundContext
from fl_platform.engine.ray_placement import GpuGroup, Placement
from fl_platform.engine.transport import Packed
from fl_platform.engine.worker import Worker, WorkerOptions
from fl_platform.state.distributed import home_worker
from fl_platform.state.gathered import checked_stamp, iter_states, part_path, save_part
from fl_platform.state.manifest import MissingClientState, checked
from fl_platform.state.nodes import node_state_dir
from fl_platform.state.store import State

if TYPE_CHECKING:
    from fl_platform.engine.faults import Faults

log = logging.getLogger(__name__)

#: Seconds a new actor may take to start (a fresh node may first install the job's runtime_env).
START_TIMEOUT_S = 600.0


def node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def worker_device(device: str, gpu_ids: Sequence[str]) -> str:
    """The device a worker trains on, decided by the GPU ids Ray assigned it (``gpu_ids``), never by the
    CUDA devices the process can see; or the run stops here saying why.

    Without GPU ids, ``auto`` is the CPU: Ray hides a node's GPUs from an actor without GPUs only through
    an override of CUDA_VISIBLE_DEVICES that it is retiring (``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0``), and
    such a worker would otherwise train on a GPU the placement never gave it, beside the workers that hold
    it; ``cuda`` cannot happen through the placement (it gives every worker of a CUDA run a GPU bundle)
    and is refused. With GPU ids the worker trains on CUDA, or (fail loud) the run stops naming the node,
    the torch build and what is missing (``engine.device=cpu`` asks for CPU training explicitly, and then
    Ray gives no GPU); before, ``auto`` on a node whose torch has no CUDA trained on the CPU unnoticed."""
    import os
    import socket

    import torch

    if not gpu_ids:
        if device in ("cpu", "auto"):
            return "cpu"
        raise RuntimeError(f"engine.device={device} but Ray assigned this worker no GPU (host {socket.gethostname()}): "
                           "a worker trains only on the GPUs its placement gave it")
    if device == "cpu" or torch.cuda.is_available():
        return device
    if torch.version.cuda is None:
        missing = "this torch is a CPU-only build (install a CUDA build of torch on that node)"
    else:
        missing = (f"this CUDA build sees no device (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}; "
                   f"check the NVIDIA driver on that node)")
    raise RuntimeError(
        f"Ray gave this worker GPU(s) {[str(g) for g in gpu_ids]} on node {node_id()[:12]} ({socket.gethostname()}), "
        f"but it cannot train on CUDA: torch {torch.__version__}, torch.version.cuda={torch.version.cuda}: {missing}. "
        f"engine.device={device}; set engine.device=cpu to train on the CPUs instead")


class RayWorker(Worker):
    """The actor class: every result that carries tensors leaves as a Packed message."""

    _node_dir: Path | None = None  # this run's node-local state folder (removed on close)

    def __init__(self, worker_id: int, setup: Any, options: WorkerOptions, *blocks: Any) -> None:
        """``blocks``: the training features' row blocks, shipped apart from ``setup`` (views of the
        node's object-store copies)."""
        import ray

        setup = replace(setup, device=worker_device(setup.device, ray.get_gpu_ids()))
        setup.dataset.attach_training_features(blocks)
        super().__init__(worker_id, setup, options)
        self._eval_sets: dict[str, tuple[str, Any, Any]] = {}  # name -> (object id, features, labels) here

    def store_options(self) -> dict[str, Any]:
        """``node_run`` (the run's id) asks for node-local folders: resolved here, on the node."""
        options = super().store_options()
        run_id = options.pop("node_run", None)
        if run_id is not None:
            self._node_dir = node_state_dir(options.get("directory"), run_id, node_id())
            options["directory"] = self._node_dir
        elif options.get("directory"):  # engine.state_dir as given (a shared folder): expanded here, on the node
            options["directory"] = str(Path(options["directory"]).expanduser())
        return options

    def node_info(self) -> dict[str, Any]:
        """Where this actor runs (node, device, the GPU ids Ray assigned, torch build) and which copy
        of the code it imported."""
        import os

        import ray

        import fl_platform

        return {"node_id": node_id(), "code": fl_platform.__file__, "pid": os.getpid(),
                "state_dir": str(self._node_dir) if self._node_dir is not None else None,
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "eval_sets": sorted(self._eval_sets),
                **self.describe()}

    def name(self) -> str:
        return f"worker {self.worker_id} on node {node_id()[:12]}"

    def run_round_parts(self, ctx: RoundContext, client_ids: list[int], broadcast: Broadcast | None,
                        expect: dict[int, int] | None, homes: int, split: bool,
                        *refs: Any) -> Packed | tuple[Packed, ...]:
        """``run_round``, returned as separate objects: the result; with ``split``, its partial
        aggregate apart (it goes to the worker that reduces it, not to the driver); with ``homes`` > 0
        (the number of workers, when lent clients' states go back to their homes), the new states of
        lent clients for each home worker (each home fetches only its own). ``broadcast``: None when
        it is too large to travel in every call; then it comes first in ``refs``, which Ray resolves,
        followed by the states lent to this worker by their homes. ``expect``: the manifest's rounds
        of these clients (stateful runs)."""
        broadcast, foreign = (broadcast, refs) if broadcast is not None else (refs[0], refs[1:])
        result = self.run_round(ctx, broadcast, client_ids, *foreign, expect=expect)
        out = [Packed(result)]
        if split:
            out.append(Packed(result.aggregate, views=True))
            result.aggregate = Aggregate()
        parts: list[dict[int, State]] = [{} for _ in range(homes)]
        for cid, state in result.outbox.items():
            parts[home_worker(cid, homes)][cid] = state
        result.outbox = {}
        out += [Packed(part) for part in parts]
        return tuple(out) if len(out) > 1 else out[0]

    def merge(self, own: Aggregate, other: Aggregate, last: bool) -> Packed:
        """``own + other`` into a new float64 aggregate: one step of the reduction tree among the
        workers (both arrive as read-only views of the object store; ``last``: the sum goes to the
        driver, which gets writable tensors)."""
        return Packed(Aggregate().merge(own).merge(other), views=not last)

    def evaluate_clients_packed(self, ctx: RoundContext, broadcast: Broadcast, client_ids: list[int],
                                expect: dict[int, int] | None) -> dict[int, dict[str, float]]:
        """``evaluate_clients``; the broadcast arrives packed (a view), the result is plain floats."""
        return self.evaluate_clients(ctx, broadcast, client_ids, expect)

    def evaluate_global_ref(self, server: ServerAlgorithm, name: str, data: list[Any],
                            batch_size: int) -> dict[str, float]:
        """``evaluate_global`` on the set ``name``, whose object reference comes in ``data`` (in a list, so
        Ray does not resolve it): fetched and moved to this worker's device on first use only."""
        import ray

        (ref,) = data
        held = self._eval_sets.get(name)
        if held is None or held[0] != ref.hex():
            x, y = ray.get(ref)
            held = self._eval_sets[name] = (ref.hex(), x.to(self.device), y.to(self.device))
        return self.evaluate_global(server, held[1], held[2], batch_size)

    def write_checkpoint_parts(self, directory: str, probe: str, chunks: list[list[int]], expect: dict[int, int],
                               round: int) -> int | None:
        """This home's states of ``chunks`` (one part each) written by this process into the checkpoint folder
        ``directory``, checked against the manifest's ``expect`` first, when this node sees that folder: the
        driver left the file ``probe`` in it (this is its node, or the folder is on a filesystem every node
        shares). None when this node does not see it: the driver then gathers the states. Returns the bytes
        written."""
        folder = Path(directory)
        if not (folder / probe).is_file():
            return None
        written = 0
        for index, chunk in enumerate(chunks):
            states = self.export_states(chunk)
            for cid in chunk:
                try:
                    checked(cid, states.get(cid), expect, self.name())
                except MissingClientState as err:
                    raise MissingClientState(err.client_id, err.round, f"checkpoint after round {round}: {err}") from None
            save_part(folder, self.worker_id, index, states)
            written += part_path(folder, self.worker_id, index).stat().st_size
        return written

    def read_checkpoint_parts(self, directory: str, probe: str, files: list[str],
                              expect: dict[int, int] | None) -> dict[int, int] | None:
        """The states of this worker's home clients in the checkpoint ``files`` into its store, read by this
        process when its node sees the checkpoint folder ``directory`` (the driver left the file ``probe``
        in it), else None (the driver then reads and sends them). Each state must carry the round the
        manifest's ``expect`` lists for it (this home's clients; None: a checkpoint without a manifest,
        whose stamps stand). Returns {client: round} of the states stored."""
        if not (Path(directory) / probe).is_file():
            return None
        found: dict[int, int] = {}
        for part in iter_states([Path(f) for f in files]):
            mine = {cid: state for cid, state in part.items() if self.store.is_home(cid)}
            for cid, state in mine.items():
                found[cid] = checked_stamp(directory, cid, state, expect)
            self.put_states(mine)
        return found

    def export_states_packed(self, client_ids: list[int]) -> Packed:
        return Packed(self.export_states(client_ids))

    def is_stateful(self) -> bool:
        return self.stateful

    def partial_nbytes(self) -> int:
        """Bytes of this worker's partial aggregate (float64 sums of the contribution's tensors; 0 for
        a server that takes each update whole)."""
        return 8 * sum(contribution_sizes(self.client, self.fm).values()) if self.summable else 0

    def close(self) -> None:
        super().close()
        if self._node_dir is not None:  # a run's working copy: checkpoints hold what must survive
            # The whole node folder of this run: also what workers that died here left behind.
            shutil.rmtree(self._node_dir, ignore_errors=True)
            with contextlib.suppress(OSError):  # the run's folder, once no node folder is left
                self._node_dir.parent.rmdir()


class EvalSlot:
    """Holds the GPU share the driver evaluates on (``engine.eval_device=cuda``), on the driver's node,
    so that Ray gives it to no worker. It does nothing but say which GPU Ray assigned it."""

    def gpu_ids(self) -> list[int]:
        import ray

        return [int(i) for i in ray.get_gpu_ids()]


def hold_eval_gpu(share: float, timeout: float = START_TIMEOUT_S, group: GpuGroup | None = None) -> tuple[Any, int]:
    """(the slot actor, the physical GPU id Ray reserved for the driver's evaluation): in ``group``'s
    bundle on the driver's node when the workers hold GPUs, else ``share`` of a GPU of that node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    options = group.eval_options() if group is not None else {
        "num_cpus": 0, "num_gpus": share,
        "scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)}
    slot = ray.remote(EvalSlot).options(**options).remote()
    try:
        ids = ray.get(slot.gpu_ids.remote(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        ray.kill(slot)
        raise RuntimeError(f"the driver's node has no free {share:g} GPU for evaluation (engine.eval_device=cuda) "
                           f"within {timeout:g} s; free now: {ray.available_resources()}") from None
    return slot, ids[0]


class ActorPool:
    """One live actor per worker id, each pinned to a node once it started there."""

    def __init__(self, placement: Placement, setup_ref: Any, options: Callable[[int], WorkerOptions],
                 start_timeout_s: float = START_TIMEOUT_S, blocks: Sequence[Any] = (),
                 group: GpuGroup | None = None, faults: Faults | None = None) -> None:
        """``options(worker_id)`` gives each new actor its WorkerOptions; an actor not up within
        ``start_timeout_s`` (engine.start_timeout_s), first or replacement, is an error. ``blocks``: the
        object references of the training features' row blocks, which every actor receives. ``group``:
        the GPU bundles (GPU workers), each worker in its own GPU's bundle. ``faults``: TEST ONLY
        (engine.fault_injection), the actors are then ``faults.FaultyRayWorker``s."""
        import ray

        self._ray = ray
        self.group = group
        self.start_timeout_s = start_timeout_s
        self.placement = placement
        self._setup_ref = setup_ref
        self._blocks = list(blocks)
        self._options = options
        self._faults = faults
        if faults is None:
            self._cls = ray.remote(RayWorker)
        else:
            from fl_platform.engine.faults import FaultyRayWorker  # (it imports this module)

            self._cls = ray.remote(FaultyRayWorker)
        self.incarnation = [0] * placement.num_workers
        self.restarts = 0
        self.nodes: list[str | None] = [None] * placement.num_workers  # node id of each worker's actor
        self.infos: list[dict[str, Any]] = []  # each actor's node_info at start-up (the workers table)
        self.actors = [self._spawn(w) for w in range(placement.num_workers)]

    def __getitem__(self, worker_id: int) -> Any:
        return self.actors[worker_id]

    def __iter__(self):
        return iter(self.actors)

    def _spawn(self, worker_id: int, node: str | None = None) -> Any:
        """A new actor for ``worker_id``: in its GPU bundle (which is on one node), else on ``node``
        (hard affinity), or spread over the nodes."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self.group is not None:
            placed = self.group.actor_options(worker_id)
        else:
            placed = {"num_cpus": self.placement.cpus_per_worker, "num_gpus": 0,
                      "scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False) if node is not None
                      else "SPREAD"}
        cls = self._cls.options(max_restarts=0, max_task_retries=0, **placed)
        faults = {} if self._faults is None else {"faults": self._faults, "incarnation": self.incarnation[worker_id]}
        return cls.remote(worker_id, self._setup_ref, self._options(worker_id), *self._blocks, **faults)

    def ping_all(self) -> None:
        """Wait until every actor is up (its Worker built) and record its node; a failure in a
        constructor is raised as is. Actors still pending after ``timeout`` seconds (no node has the
        resources one asks for) raise an error naming what they ask and what the nodes have."""
        ray, timeout = self._ray, self.start_timeout_s
        refs = [a.node_info.remote() for a in self.actors]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if pending:
            reason = self.unplaceable()
            for actor in self.actors:  # none is left waiting for resources
                ray.kill(actor, no_restart=True)
            raise RuntimeError(f"Ray workers {sorted(refs.index(r) for r in pending)} did not start within {timeout:g} s "
                               f"(engine.start_timeout_s): {reason}")
        infos = []
        for w, ref in enumerate(refs):
            try:
                infos.append(ray.get(ref))
            except ray.exceptions.RayTaskError as err:
                raise err.as_instanceof_cause() from None
            except ray.exceptions.RayActorError as err:  # its constructor raised: that error's own line
                if not err.actor_init_failed:
                    raise
                raise RuntimeError(f"Ray worker {w} failed to start: {str(err).strip().splitlines()[-1]}") from None
        self.nodes = [info["node_id"] for info in infos]
        self.infos = infos

    def unplaceable(self) -> str:
        """What a worker asks for and what each alive node has free (why actors stay pending)."""
        p = self.placement
        nodes = [f"{n['NodeID'][:12]}: {n['Resources'].get('CPU', 0):g} CPUs, {n['Resources'].get('GPU', 0):g} GPUs"
                 for n in self._ray.nodes() if n.get("Alive")]
        free = self._ray.available_resources()
        gpus = max((self.group.share(w) for w in range(p.num_workers)), default=0.0) if self.group else 0.0
        return (f"each asks for {p.cpus_per_worker:g} CPUs and {gpus:g} GPUs on one node"
                f"{f', the driver evaluation {p.eval_gpus:g} GPU on the driver node' if p.eval_gpus else ''}; free "
                f"now: {free.get('CPU', 0):g} CPUs, {free.get('GPU', 0):g} GPUs; nodes: {'; '.join(nodes)}. Lower "
                f"engine.num_workers or the per-worker resources, or add nodes")

    def alive_nodes(self) -> set[str]:
        return {n["NodeID"] for n in self._ray.nodes() if n.get("Alive")}

    def node_name(self, worker_id: int) -> str:
        node = self.nodes[worker_id]
        return "an unknown node" if node is None else f"node {node[:12]}"

    def dead(self, timeout: float = 60.0) -> list[int]:
        """Ids of the workers whose actor does not answer a ping within ``timeout`` seconds; every actor
        is pinged at once, so W dead actors cost one timeout, not W."""
        ray = self._ray
        refs = [a.ping.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        answered = set()
        for ref in ready:
            try:
                ray.get(ref)
                answered.add(refs.index(ref))
            except ray.exceptions.RayActorError:
                pass
        return [w for w in range(len(refs)) if w not in answered]

    def restart(self, worker_id: int, reason: str) -> None:
        """Replace worker ``worker_id``'s actor by a new one and wait until it is up: on its node while
        that node is alive, else on another node with room (refused, with the numbers, when none has)."""
        ray = self._ray
        node = self.nodes[worker_id]
        if node not in self.alive_nodes():
            node = None
        log.warning("Ray worker %d died (%s); starting a new one %s and rerunning its clients", worker_id, reason,
                    f"on its node {self.nodes[worker_id][:12]}" if node is not None else "on another node")
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self.actors[worker_id], no_restart=True)
        self.incarnation[worker_id] += 1
        try:
            self.nodes[worker_id] = self._start(worker_id, node)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError):
            if node is None or node in self.alive_nodes():
                raise
            self.nodes[worker_id] = self._start(worker_id, None)  # its node died meanwhile: like a lost node
        self.restarts += 1

    def _start(self, worker_id: int, node: str | None) -> str:
        """Spawn worker ``worker_id`` (on ``node`` or anywhere) and wait for it; returns its node id."""
        ray = self._ray
        if node is None and self.group is None:  # (a GPU worker goes back into its bundle)
            self._check_room(worker_id)
        self.actors[worker_id] = self._spawn(worker_id, node)
        try:
            return ray.get(self.actors[worker_id].node_info.remote(), timeout=self.start_timeout_s)["node_id"]
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"a new actor for Ray worker {worker_id} did not start within {self.start_timeout_s:g} s "
                               f"(cluster resources now: {ray.available_resources()})") from None

    def _check_room(self, worker_id: int) -> None:
        """Refuse to wait forever for a replacement that no node left can host."""
        free = self._ray.available_resources()
        cpus, gpus = self.placement.cpus_per_worker, self.group.share(worker_id) if self.group else 0.0
        if free.get("CPU", 0.0) + 1e-9 < cpus or free.get("GPU", 0.0) + 1e-9 < gpus:
            raise RuntimeError(
                f"cannot replace Ray worker {worker_id}: the nodes left ({len(self.alive_nodes())} alive) have "
                f"{free.get('CPU', 0.0):g} CPUs and {free.get('GPU', 0.0):g} GPUs free, a worker needs "
                f"engine.cpus_per_worker={cpus:g} and {gpus:g} GPUs. Declare resources so that the nodes that "
                f"remain after a loss can host all engine.num_workers workers.")

    def close(self, timeout: float = 60.0) -> None:
        """Every live actor closes (its node folder removed) before any is killed: each close is awaited
        on its own, so a dead actor does not cut the others' short (closing must not hide the run's own
        outcome: failures are logged)."""
        ray = self._ray
        refs = [a.close.remote() for a in self.actors]
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        for ref in ready:
            try:
                ray.get(ref)
            except Exception as err:
                log.warning("closing Ray worker %d: %s", refs.index(ref), err)
        if pending:
            log.warning("Ray workers %s did not close within %g s", sorted(refs.index(r) for r in pending), timeout)
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
