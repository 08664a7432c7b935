"""A worker trains many clients one after another in one reused model (Parrot-style).

Per round it receives the broadcast once and its list of clients; for each client it loads
the client's state, loads the global weights, trains with the shared loop, and folds the
contribution into a running float64 sum (or keeps it whole when the algorithm needs each
client's output). It returns one partial aggregate. The same class runs in-process
(``engine=inline``) and as a Ray actor.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from fl_platform.algorithms.registry import get_algorithm
from fl_platform.core import Aggregate, Broadcast, ClientUpdate, Metrics, RoundContext
from fl_platform.engine.setup import ExperimentSetup, resolve_device
from fl_platform.state.store import make_store
from fl_platform.training.flat import FlatModel
from fl_platform.training.loop import ClientData, LocalTrainer, NonFiniteError

log = logging.getLogger(__name__)


@dataclass
class WorkerResult:
    worker_id: int
    aggregate: Aggregate
    updates: list[ClientUpdate]
    metrics: Metrics
    client_seconds: dict[int, float]
    busy_seconds: float
    bytes_up: int
    bytes_down: int
    rejected: dict[int, str] = field(default_factory=dict)


class Worker:
    def __init__(self, worker_id: int, setup: ExperimentSetup) -> None:
        if setup.threads:
            torch.set_num_threads(setup.threads)
        self.worker_id = worker_id
        self.setup = setup
        self.device = resolve_device(setup.device)
        self.data = setup.dataset.to(self.device)
        self.spec = get_algorithm(setup.algorithm)
        self.fm = FlatModel(setup.model(), self.device)
        self.trainer = LocalTrainer(self.fm, setup.train)
        alg_setup = setup.algorithm_setup(self.fm.num_params, self.fm.num_buffers)
        self.client = self.spec.client(setup.algorithm_conf, alg_setup)
        self.summable = self.spec.server.summable
        self.store = make_store(setup.state_store, self.client.state_spec(), **setup.state_options)

    def client_data(self, client_id: int) -> ClientData:
        return ClientData(self.data.train_x, self.data.train_y, self.data.client_indices(client_id))

    def run_round(self, ctx: RoundContext, broadcast: Broadcast, client_ids: list[int]) -> WorkerResult:
        start = time.perf_counter()
        bc = broadcast.to(self.device)
        agg = Aggregate()
        updates: list[ClientUpdate] = []
        metrics = Metrics()
        seconds: dict[int, float] = {}
        rejected: dict[int, str] = {}
        staged: dict[int, dict[str, torch.Tensor]] = {}
        bytes_up = 0
        down_each = broadcast.nbytes()
        for cid in client_ids:
            t0 = time.perf_counter()
            state = self.store.get(cid) if self.store.specs else None
            try:
                update = self.client.train(ctx, cid, bc, state, self.client_data(cid), self.trainer)
                if not update.is_finite():
                    raise NonFiniteError(f"client {cid} in round {ctx.round + 1}: its update contains NaN/inf")
            except NonFiniteError as err:
                if self.setup.nonfinite != "skip":
                    raise
                log.warning("rejected %s (engine.nonfinite=skip)", err)
                rejected[cid] = str(err)
                continue
            if update.state is not None:
                staged[cid] = update.state
            update.state = None
            if not update.bytes_up:
                update.bytes_up = sum(t.numel() * 4 for t in update.tensors.values())
            bytes_up += update.bytes_up
            metrics.merge(update.metrics)
            if self.summable:
                agg.add_update(update)
            else:
                update.tensors = {k: v.detach().to("cpu") for k, v in update.tensors.items()}
                updates.append(update)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            seconds[cid] = time.perf_counter() - t0
        # Client states are written only once the whole round succeeded, so a rerun of this
        # worker's clients after a crash starts from their unmodified state.
        for cid, st in staged.items():
            self.store.put(cid, st)
        return WorkerResult(self.worker_id, agg.to("cpu"), updates, metrics, seconds,
                            time.perf_counter() - start, bytes_up, down_each * (len(client_ids)))

    def flush(self) -> None:
        self.store.flush()

    def ping(self) -> int:
        return self.worker_id
