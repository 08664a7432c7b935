"""``engine=inline``: the workers run in this process, one after another.

With the default single worker this is the plain sequential simulator (and the debugging
mode: any exception surfaces with its client id). Several in-process workers exist to test
that the number of workers, the schedule and the state store never change the result; they
follow exactly the protocol of the Ray engine (scheduler, home workers, lending of states).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from fl_platform.core import Broadcast, RoundContext
from fl_platform.engine.faults import Faults, FaultyWorker
from fl_platform.engine.scheduler import Scheduler
from fl_platform.engine.worker import Worker, WorkerOptions
from fl_platform.rounds.client_eval import assignment
from fl_platform.rounds.engine import Engine, WorkerResult
from fl_platform.rounds.setup import ExperimentSetup
from fl_platform.state.distributed import home_worker, lending_plan
from fl_platform.state.gathered import FOLDER, iter_states, state_files


class InlineEngine(Engine):
    def __init__(self, setup: ExperimentSetup, num_workers: int = 1, *, scheduler_smoothing: float = 0.5,
                 scheduler: str = "lpt", slow_worker: int | None = None, slow_factor: float = 1.0) -> None:
        """``slow_worker``/``slow_factor``: TEST ONLY, that worker's clients take ``slow_factor`` times
        as long (``engine.fault_injection.slow_worker``; the workers are then ``faults.FaultyWorker``)."""
        if num_workers < 1:
            raise ValueError(f"engine.num_workers must be >= 1, got {num_workers}")
        faults = Faults.from_conf({"slow_worker": slow_worker, "slow_factor": slow_factor}, num_workers)
        # The workers run in this process and set its torch threads (engine.threads_per_worker) and
        # deterministic algorithms (engine.deterministic): put back on close, for the caller's next code.
        self._process_settings = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
                                  torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
        self.setup = setup
        self.num_workers = num_workers
        self.distributed = setup.state_store == "distributed"

        def worker(i: int, store: Any = None) -> Worker:
            options = WorkerOptions(num_workers=num_workers, device_share=1.0 / num_workers)
            if faults is None:
                return Worker(i, setup, options, store=store)
            return FaultyWorker(i, setup, options, store=store, faults=faults)

        first = worker(0)
        workers = [first]
        for i in range(1, num_workers):
            # One shared store unless each worker is the home of its own clients.
            workers.append(worker(i, store=None if self.distributed else first.store))
        self.workers = workers
        self.stateful = first.stateful
        home = (lambda c: home_worker(c, num_workers)) if self.distributed and self.stateful else None
        self.scheduler = Scheduler(num_workers, setup.dataset.client_sizes(), setup.train, home=home,
                                   smoothing=scheduler_smoothing, policy=scheduler)
        self._stats: dict[str, Any] = {}

    def run_round(self, ctx: RoundContext, broadcast: Broadcast) -> list[WorkerResult]:
        t0 = time.perf_counter()
        plan = self.scheduler.plan(ctx.clients)
        lent: list[list[dict]] = [[] for _ in self.workers]
        if self.distributed and self.stateful and self.num_workers > 1:
            needs = lending_plan(plan.assignment, self.num_workers)
            for home, per_trainer in enumerate(needs):
                for trainer, cids in enumerate(per_trainer):
                    if cids:
                        lent[trainer].append(self.workers[home].export_states(cids))
        results = [w.run_round(ctx, broadcast, plan.assignment[i], *lent[i]) for i, w in enumerate(self.workers)]
        if self.distributed and self.stateful and self.num_workers > 1:
            outboxes = [r.outbox for r in results if r.outbox]
            for w in self.workers:
                w.import_states(*outboxes)
        for r in results:
            r.outbox = {}
        self._stats = self.scheduler.record(plan, [r.client_seconds for r in results],
                                            [r.busy_seconds for r in results])
        self._stats["sched_engine_s"] = time.perf_counter() - t0
        return results

    def evaluate_clients(self, ctx: RoundContext, broadcast: Broadcast,
                         client_ids: list[int]) -> dict[int, dict[str, float]]:
        """Each client on its home worker (distributed states) or spread over the workers; client order."""
        by_home = self.distributed and self.stateful
        parts = assignment(client_ids, self.num_workers, by_home)
        out: dict[int, dict[str, float]] = {}
        for w, cids in zip(self.workers, parts):
            if cids:
                out.update(w.evaluate_clients(ctx, broadcast, cids))
        return {c: out[c] for c in sorted(out)}

    def describe_workers(self) -> list[dict[str, Any]]:
        rows = []
        for w in self.workers:
            info = w.describe()
            rows.append({"worker": info["worker"], "node": info["host"], "device": info["device"], "gpu_ids": [],
                         "gpu_share": 0.0, "torch": info["torch"], "cuda": info["cuda"]})
        return rows

    def round_stats(self) -> dict[str, Any]:
        return dict(self._stats)

    def _stores(self) -> list[Worker]:
        """Workers whose store is their own (one shared store is handled once)."""
        return self.workers if self.distributed else self.workers[:1]

    def flush(self) -> None:
        for w in self._stores():
            w.flush()

    def checkpoint_state(self, directory: Path, round: int) -> None:
        for w in self._stores():
            w.checkpoint_state(directory, round)

    def commit_state(self, round: int) -> None:
        for w in self._stores():
            w.commit_state(round)

    def restore_state(self, directory: Path | None, round: int | None) -> None:
        files = state_files(directory) if self.stateful else []
        in_memory = self.setup.state_store == "memory" or self.setup.state_options.get("backend") == "memory"
        if files and (in_memory or files[0].parent.name == FOLDER):
            # States saved as files in the checkpoint (memory stores, or gathered by the Ray engine):
            # each goes to the store of its home worker for this run's number of workers.
            for w in self._stores():
                w.restore_state(None, None)
            for part in iter_states(files):
                for w in self._stores():
                    w.put_states(part)
            return
        for w in self._stores():
            w.restore_state(directory, round)

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])

    def close(self) -> None:
        for w in self._stores():
            w.close()
        threads, deterministic, cudnn_deterministic, benchmark = self._process_settings
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_deterministic, benchmark
