"""A worker trains many clients one after another in one reused model (Parrot-style).

Per round it receives the broadcast once and its list of clients; for each client it loads
the client's state, trains with the shared loop (which loads the global weights into the one
flat model), and folds the contribution into a running float64 sum (or keeps it whole when the
algorithm needs each client's output). It returns one partial aggregate. The same class runs
in-process (``engine=inline``) and as a Ray actor (``engine=ray``).

Client states are staged during the round and written to the store only after the last client
finished, so a worker that dies mid-round leaves every state untouched and the engine can rerun
the worker's clients from exactly the same inputs. Every stored state carries the round that wrote
it (``state/manifest.py``); given the manifest's rounds (``expect``), the worker refuses a missing
or stale state by name instead of training the client from zeros.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fl_platform.algorithms.base import FedAvgCohort, ServerAlgorithm
from fl_platform.algorithms.registry import get_algorithm
from fl_platform.compression.uplink import declared_sizes, make_uplink, uploads_of
from fl_platform.core import Aggregate, Broadcast, ClientUpdate, Metrics, RoundContext
from fl_platform.engine.scheduler import work_units
from fl_platform.engine.timing import DeviceClock
from fl_platform.privacy.setup import make_client_privacy
from fl_platform.rounds.client_eval import evaluate_client, to_host
from fl_platform.rounds.engine import WorkerResult
from fl_platform.rounds.setup import ExperimentSetup, resolve_device
from fl_platform.state.distributed import DistributedStore, home_worker
from fl_platform.state.manifest import ROUND_KEY, ROUND_SPEC, checked, stamp, stamp_of
from fl_platform.state.store import State, StateStore, make_store
from fl_platform.state.transfer import Prefetcher, offload
from fl_platform.system.model import client_stat
from fl_platform.training.flat import FlatModel
from fl_platform.training.loop import ClientData, LocalTrainer, NonFiniteError
from fl_platform.training.step import naming_deterministic_key, use_deterministic_algorithms
from fl_platform.training.vectorised import CohortTrainer, NotVectorisable, auto_cohort_size, free_memory

log = logging.getLogger(__name__)
_SEQUENTIAL_REASONS: set[str] = set()  # why vectorised cohorts fell back, each logged once


@dataclass
class WorkerOptions:
    """How the engine runs this worker (engine mechanics, not part of the experiment)."""

    num_workers: int = 1
    durable_rounds: bool = False  # flush the state store after every round (survives a crash of this process)
    drop_cache_each_round: bool = False  # other processes write the same store: do not trust cached reads
    device_share: float = 1.0  # the fraction of its device's memory this worker may use (cohort_size=auto)


@dataclass
class _Round:
    """What a worker accumulates while it trains its clients of one round."""

    aggregate: Aggregate = field(default_factory=Aggregate)
    updates: list[ClientUpdate] = field(default_factory=list)
    metrics: Metrics = field(default_factory=Metrics)
    seconds: dict[int, float] = field(default_factory=dict)
    rejected: dict[int, str] = field(default_factory=dict)
    staged: dict[int, State] = field(default_factory=dict)
    bytes_up: int = 0
    client_stats: dict[int, dict[str, float]] = field(default_factory=dict)
    # samples each client trained, read before local DP strips its counts from the update: the system
    # model's compute time is the device's own, not something the update tells the server
    samples: dict[int, float] = field(default_factory=dict)


class Worker:
    def __init__(self, worker_id: int, setup: ExperimentSetup, options: WorkerOptions | None = None,
                 store: StateStore | None = None) -> None:
        if setup.threads:
            torch.set_num_threads(setup.threads)
        if setup.deterministic:  # before the trainer, the model or any cuBLAS handle exists
            use_deterministic_algorithms()
        self.worker_id = worker_id
        self.setup = setup
        self.options = options or WorkerOptions()
        self.device = resolve_device(setup.device)
        self.data = setup.dataset.to(self.device)
        self.spec = get_algorithm(setup.algorithm)
        self.fm = FlatModel(setup.model(), self.device)
        self.trainer = LocalTrainer(self.fm, setup.train)
        alg_setup = setup.algorithm_setup(self.fm.num_params, self.fm.num_buffers)
        self.client = self.spec.client(setup.algorithm_conf, alg_setup)
        self.summable = self.spec.server.summable
        self.uplink = make_uplink(setup.compressor, self.fm, self.client)  # None: uplinks travel dense
        # What every update must hold (ClientUpdate.problem): a plug-in's update without its delta made each
        # round a silent no-op, an integer one was folded in, one of another size failed in the server step.
        self.uploads = tuple(uploads_of(self.client))
        self.expected = declared_sizes(self.client, self.fm)
        # Client-level DP (fl_platform/privacy): clip (and under local DP, noise) each update before its
        # compression; None for privacy=none.
        self.privacy = make_client_privacy(setup.privacy, self.spec, setup.algorithm_conf)
        self.store = store if store is not None else self.make_store()
        self.stateful = bool(self.store.specs)
        self._expect: dict[int, int] | None = None  # the manifest's rounds for this round's clients
        # Every state read goes through this: the next client's state loads (and, on CUDA, copies to the
        # device) on its one background thread while the current client trains.
        self._prefetch = Prefetcher(lambda cid: checked(cid, self.store.get(cid), self._expect, self.where(cid)),
                                    self.device)
        # engine.cohort_size > 1 or auto: clients train in vectorised chunks (docs/vectorised.md).
        self.cohort = CohortTrainer(self.fm, setup.train) if setup.cohort_size != 1 else None
        self._clock: DeviceClock | None = None  # this round's, while it runs
        self._pending: Iterator[tuple[int, ClientUpdate | NonFiniteError]] | None = None
        self._summed = False  # the pending chunk's contributions are in the aggregate already
        self._chunk_end = 0
        self._shares: dict[int, float] = {}
        self._per_client_bytes: int | None = None
        self._eval_fm: FlatModel | None = None  # the global model's evaluation, when the engine asks for it here

    def store_options(self) -> dict[str, Any]:
        """``make_store``'s options for this worker's store."""
        options = dict(self.setup.state_options)
        if self.setup.state_store == "distributed":
            options.update(worker_id=self.worker_id, num_workers=self.options.num_workers)
        return options

    def make_store(self) -> StateStore:
        options = self.store_options()
        specs = {**self.client.state_spec(), **(self.uplink.state_spec() if self.uplink else {})}
        if specs:  # each state is stored with the round that wrote it
            specs[ROUND_KEY] = ROUND_SPEC
        return make_store(self.setup.state_store, specs, **options)

    def client_data(self, client_id: int) -> ClientData:
        x, y, indices = self.data.client_view(client_id)
        return ClientData(x, y, indices, self.data.augment)

    # ------------------------------------------------------------------ one round

    def run_round(self, ctx: RoundContext, broadcast: Broadcast, client_ids: list[int],
                  *foreign: dict[int, State | None], expect: dict[int, int] | None = None) -> WorkerResult:
        """Train ``client_ids`` in order; ``foreign`` lends states of clients homed on other workers.

        ``expect`` (the manifest's client -> round for ``client_ids``; absent: no state yet) makes a
        missing or stale state an error; None skips the check (in-process use)."""
        start = time.perf_counter()
        self._expect = expect
        clock = self._clock = DeviceClock(self.device)  # training and state I/O (worker_train_s, worker_state_io_s)
        if self.stateful:
            if self.options.drop_cache_each_round:
                self.store.invalidate()
            lent: dict[int, State | None] = {}
            for part in foreign:
                lent.update(part)
            with clock.span("state_io"):
                self.store.begin_round(lent)
        bc = broadcast.to(self.device)
        acc = _Round()
        with self._training():
            for i, cid in enumerate(client_ids):
                if self.stateful and i + 1 < len(client_ids):
                    self._prefetch.prefetch(client_ids[i + 1])
                with clock.span("train"):  # (less the state I/O inside it, below)
                    acc.seconds[cid] = self._train_one(ctx, bc, client_ids, i, acc)
        outbox: dict[int, State] = {}
        with clock.span("state_io"):
            outbox = self._stage_states(ctx, acc)
        spent = clock.totals()
        self._clock = None
        timings = {"state_io_s": spent.get("state_io", 0.0),
                   "train_s": max(spent.get("train", 0.0) - spent.get("state_io_in_train", 0.0), 0.0)}
        timings["state_io_s"] += spent.get("state_io_in_train", 0.0)
        return WorkerResult(self.worker_id, acc.aggregate.to("cpu"), acc.updates, acc.metrics, acc.seconds,
                            time.perf_counter() - start, acc.bytes_up, broadcast.nbytes() * len(client_ids),
                            acc.rejected, outbox, acc.client_stats, states_written=sorted(acc.staged),
                            timings=timings)

    @contextlib.contextmanager
    def _training(self) -> Iterator[None]:
        """Around a round's (or an evaluation's) clients: torch's determinism error in the config's terms
        (engine.deterministic), and nothing prefetched outlives it (the store may be written next)."""
        try:
            with naming_deterministic_key():
                yield
        finally:
            self._prefetch.drop()

    def _stage_states(self, ctx: RoundContext, acc: _Round) -> dict[int, State]:
        """Write (or stage) the round's new states; returns the lent clients' states for their homes."""
        outbox: dict[int, State] = {}
        if self.stateful:
            # Written only now that the whole round succeeded (see the module docstring). In a
            # separate process the states are staged durably and applied by ``commit_round``
            # once the engine holds every result, so a crash at any point can be rerun exactly.
            staged = {cid: stamp(state, ctx.round) for cid, state in acc.staged.items()}
            if self.options.durable_rounds:
                self.store.stage(ctx.round, staged, tag=f"-w{self.worker_id}")
            else:
                for cid, state in staged.items():
                    self.store.put(cid, state)
            outbox = self.store.end_round()
        return outbox

    def commit_round(self, round: int) -> int:
        """Apply the states staged by ``run_round`` for ``round`` (idempotent; durable rounds only)."""
        applied = self.store.apply_staged(round, tag=f"-w{self.worker_id}") if self.stateful else 0
        if self.options.durable_rounds:
            self.store.flush()
        return applied

    def evaluate_global(self, server: ServerAlgorithm, x: torch.Tensor, y: torch.Tensor,
                        batch_size: int) -> dict[str, float]:
        """``server.evaluate`` of the global model on ``(x, y)`` (on this worker's device), in a model of
        its own: the training model's weights stay as the loop left them."""
        if self._eval_fm is None:
            with torch.random.fork_rng(devices=[]):  # its initial weights are overwritten: no run RNG drawn
                self._eval_fm = FlatModel(self.setup.model(), self.device)
        return server.evaluate(self._eval_fm, x, y, batch_size)

    def evaluate_clients(self, ctx: RoundContext, broadcast: Broadcast, client_ids: list[int],
                         expect: dict[int, int] | None = None) -> dict[int, dict[str, float]]:
        """Per-client evaluation on local test splits (fl_platform/rounds/client_eval.py): the global
        model, the personal one where the algorithm has one, after ``finetune_steps`` local steps if
        set. Reads each client's state (checked against ``expect``), writes none."""
        if self.data.local_test is None:
            raise ValueError("per-client evaluation needs a local test split (eval.local_test_fraction)")
        if self.stateful and self.options.drop_cache_each_round:
            self.store.invalidate()
        self._expect = expect
        bc = broadcast.to(self.device)
        scores = {}
        with self._training():
            for cid in client_ids:
                state = self._load_state(cid)
                if self.uplink is not None:
                    state, _ = self.uplink.split_state(state)
                x, y, rows = self.data.client_test_view(cid)
                scores[cid] = evaluate_client(self.client, self.trainer, ctx, cid, bc, state, self.client_data(cid),
                                              ClientData(x, y, rows), self.setup.finetune_steps)
        return to_host(scores)

    def _train_one(self, ctx: RoundContext, bc: Broadcast, client_ids: list[int], i: int, acc: _Round) -> float:
        """Train client ``client_ids[i]`` (its vectorised chunk first, at a chunk boundary) and fold its
        update into ``acc``; returns the client's seconds for the scheduler's runtime model (its share of
        a chunk's time, not the chunk's)."""
        t0 = time.perf_counter()
        chunk_seconds = self._train_chunk(ctx, bc, client_ids, i, acc.aggregate)
        update = self._train_client(ctx, bc, client_ids[i], acc)
        if update is not None:
            self._fold(update, acc)
        if self.device.type == "cuda":  # (also completes the fold's offload copies)
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0 - chunk_seconds + self._shares.get(client_ids[i], 0.0)

    def _train_client(self, ctx: RoundContext, bc: Broadcast, cid: int, acc: _Round) -> ClientUpdate | None:
        """Train one client; a non-finite update is rejected (None) or raised, by ``engine.nonfinite``."""
        state = self._load_state(cid)
        own = None
        if self.uplink is not None:  # the compressor's state (ef.*) is not the algorithm's
            state, own = self.uplink.split_state(state)
        try:
            if self._pending is not None:  # (the platform's vectorised step; a summed chunk's updates carry none)
                update = self._cohort_update(cid)
            else:
                update = self.client.train(ctx, cid, bc, state, self.client_data(cid), self.trainer)
                if not isinstance(update, ClientUpdate):
                    raise TypeError(f"{self.spec.name}: the client half's train returned {type(update).__name__}, "
                                    "not a ClientUpdate")
                why = update.problem(self.expected, self.uploads)
                if why:
                    raise ValueError(f"{self.spec.name}: client {cid}'s update in round {ctx.round + 1} {why}")
            if not update.is_finite():
                raise NonFiniteError(f"client {cid} in round {ctx.round + 1}: its update contains NaN/inf")
        except NonFiniteError as err:
            if self.setup.nonfinite != "skip":
                raise
            log.warning("rejected %s (engine.nonfinite=skip)", err)
            acc.rejected[cid] = str(err)
            return None
        if self.privacy is not None and not self._summed:  # (a chunk summed at once clipped each client)
            acc.samples[cid] = client_stat(update, self.setup.train)["samples"]
            self.privacy.apply(ctx, bc, update)  # clip first: what is clipped is what is compressed
        if self.uplink is not None:  # encode, count the real bytes, keep what the server decodes
            update.state = self.uplink.merge_state(state, update.state, self.uplink.apply(ctx, cid, update, own))
            if self.privacy is not None:
                self.privacy.bound(bc, update)  # central DP: what the server decodes is within C
        return update

    def _load_state(self, cid: int) -> State | None:
        """The client's state on this worker's device (stores keep CPU tensors), checked against the
        manifest when the engine sent one."""
        if not self.stateful:
            return None
        if self._clock is None:
            return self._read_state(cid)
        with self._clock.span("state_io_in_train"):
            return self._read_state(cid)

    def _read_state(self, cid: int) -> State | None:
        self._prefetch.prefetch(cid)  # (a no-op when in flight: every load runs on the prefetch thread)
        return self._prefetch.take(cid)

    def _train_chunk(self, ctx: RoundContext, bc: Broadcast, client_ids: list[int], i: int,
                     aggregate: Aggregate) -> float:
        """Vectorised path: at a chunk boundary, train the next ``cohort_size`` clients at once; their
        updates are then taken in order by ``_train_client`` (their contributions already summed into
        ``aggregate`` when the chunk can be summed at once). Returns the seconds it took (shared out
        over the chunk's clients by their work, for the scheduler's runtime model)."""
        if i == 0:
            self._pending, self._summed, self._chunk_end, self._shares = None, False, 0, {}
        if self.cohort is None or i < self._chunk_end:
            return 0.0
        t0 = time.perf_counter()
        cids = client_ids[i : i + self._cohort_size(len(client_ids) - i)]
        self._chunk_end = i + len(cids)
        states = []
        for cid in cids:
            state = self._load_state(cid)
            if self.uplink is not None:
                state, _ = self.uplink.split_state(state)
            states.append(state)
        datas = [self.client_data(cid) for cid in cids]
        self._pending, self._summed = None, False  # the previous chunk's results: freed before this chunk trains
        try:
            outcome = self.client.train_cohort(ctx, cids, bc, states, datas, self.trainer, self.cohort)
        except NotVectorisable as err:
            if str(err) not in _SEQUENTIAL_REASONS:  # one line per reason and process
                _SEQUENTIAL_REASONS.add(str(err))
                log.warning("engine.cohort_size=%s: clients train one by one: %s", self.setup.cohort_size, err)
            self.cohort = None
            return time.perf_counter() - t0
        # Summed at once when nothing needs each client's tensors (no list mode, no compression, no
        # local DP noise); under central DP each client is clipped inside the chunk.
        clip = self.privacy.cohort_clip(bc) if self.privacy is not None else None
        self._summed = (self.summable and self.uplink is None and isinstance(outcome, FedAvgCohort)
                        and (self.privacy is None or clip is not None))
        self._pending = iter(outcome.sum_into(aggregate, clip) if self._summed else outcome)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        work = [work_units(d.num_samples, self.setup.train) for d in datas]
        self._shares = {cid: seconds * (w / sum(work) if sum(work) else 1 / len(cids)) for cid, w in zip(cids, work)}
        return seconds

    def _cohort_size(self, remaining: int) -> int:
        """``engine.cohort_size``, or for ``auto`` what fits this worker's share of the free memory."""
        if self.setup.cohort_size != "auto":
            return int(self.setup.cohort_size)
        if self._per_client_bytes is None:
            state_numel = sum(spec.size for spec in self.store.specs.values())
            self._per_client_bytes = self.cohort.per_client_bytes(self.data.train_blocks[0], 4 * state_numel)
        return auto_cohort_size(self._per_client_bytes, remaining, self.memory_budget())

    def memory_budget(self) -> int:
        """Bytes of its device this worker may fill: its share of the GPU (``device_share``, e.g. the
        GPU fraction Ray gave it) but no more than is free now; on the CPU, its share of the free RAM."""
        free = free_memory(self.device)
        if self.device.type == "cuda":
            total = torch.cuda.mem_get_info(self.device)[1]
            return min(free, int(total * self.options.device_share))
        return int(free * self.options.device_share)

    def _cohort_update(self, cid: int) -> ClientUpdate:
        """The next update of the chunk in training (clients come in order); raises its NonFiniteError."""
        got, outcome = next(self._pending)
        if got != cid:
            raise RuntimeError(f"cohort yielded client {got} where client {cid} was expected")
        if isinstance(outcome, NonFiniteError):
            raise outcome
        return outcome

    def _fold(self, update: ClientUpdate, acc: _Round) -> None:
        """Add one accepted update into the round's running sums (or keep it, in list mode)."""
        if update.state is not None:  # off the device now, not at round end (completed by the client's sync)
            acc.staged[update.client_id] = offload(update.state, self.device)
            update.state = None
        if not update.bytes_up:
            update.bytes_up = sum(t.numel() * 4 for t in update.tensors.values())
        acc.bytes_up += update.bytes_up
        acc.client_stats[update.client_id] = client_stat(update, self.setup.train)
        if update.client_id in acc.samples:
            acc.client_stats[update.client_id]["samples"] = acc.samples[update.client_id]
        acc.metrics.merge(update.metrics)
        if not self.summable:
            update.tensors = {k: v.detach().to("cpu") for k, v in update.tensors.items()}
            acc.updates.append(update)
        elif not self._summed:  # (a chunk summed at once is in the aggregate already)
            acc.aggregate.add_update(update)

    # ------------------------------------------------------------------ distributed state

    def export_states(self, client_ids: list[int]) -> dict[int, State | None]:
        """States of home clients that another worker trains this round."""
        if not isinstance(self.store, DistributedStore):
            raise TypeError("export_states needs engine.state_store=distributed")
        return self.store.export(client_ids)

    def import_states(self, *parts: dict[int, State]) -> int:
        """Take back this worker's home clients' states from the workers that trained them."""
        if not isinstance(self.store, DistributedStore):
            raise TypeError("import_states needs engine.state_store=distributed")
        mine = {cid: st for part in parts for cid, st in part.items() if self.store.is_home(cid)}
        self.store.import_states(mine)
        if self.options.durable_rounds:
            self.store.flush()
        return len(mine)

    def put_states(self, *parts: dict[int, State]) -> int:
        """Load states (from a checkpoint) into this worker's store: with distributed homes only the
        clients homed here, else all of them. Returns how many were stored."""
        home = self.store if isinstance(self.store, DistributedStore) else None
        count = 0
        for part in parts:
            for cid, state in part.items():
                if home is None:
                    self.store.put(cid, state)
                elif home.is_home(cid):
                    home.local.put(cid, state)
                else:
                    continue
                count += 1
        self.store.flush()
        return count

    def stored_rounds(self) -> dict[int, int | None]:
        """client -> round stamp of every state this worker's store holds (checked against a manifest)."""
        store = self.store.local if isinstance(self.store, DistributedStore) else self.store
        return {cid: stamp_of(store.get(cid)) for cid in store.client_ids()}

    # ------------------------------------------------------------------ durability

    def flush(self) -> None:
        self.store.flush()

    def checkpoint_state(self, directory: str | Path, round: int) -> None:
        self.store.checkpoint(Path(directory), round)

    def commit_state(self, round: int) -> None:
        self.store.commit(round)

    def restore_state(self, directory: str | Path | None, round: int | None) -> None:
        self.store.restore(Path(directory) if directory is not None else None, round)

    def close(self) -> None:
        self._prefetch.close()
        self.store.close()

    def ping(self) -> int:
        return self.worker_id

    def name(self) -> str:
        return f"worker {self.worker_id}"

    def describe(self) -> dict[str, Any]:
        """Where this worker trains: its host, device and torch build (the start-up table, run.json)."""
        import socket

        return {"worker": self.worker_id, "host": socket.gethostname(), "device": str(self.device),
                "torch": torch.__version__, "cuda": torch.version.cuda}

    def where(self, client_id: int | None = None) -> str:
        """Where ``client_id``'s state is kept (its home, when that is another worker), for error messages."""
        here = self.name()
        if isinstance(self.store, DistributedStore) and client_id is not None and not self.store.is_home(client_id):
            return f"its home worker {home_worker(client_id, self.options.num_workers)} (lent to {here})"
        return here

    def state_nbytes(self) -> int:
        """Bytes of one client's state (what a checkpoint moves per client)."""
        return sum(spec.size * torch.empty((), dtype=spec.dtype).element_size() for spec in self.store.specs.values())
