"""``engine=inline``: the workers run in this process, one after another.

With the default single worker this is the plain sequential simulator (and the debugging
mode: any exception surfaces with its client id). Several in-process workers exist to test
that the number of workers never changes the result.
"""

from __future__ import annotations

import time

from fl_platform.core import Broadcast, RoundContext
from fl_platform.engine.base import Engine
from fl_platform.engine.scheduler import lpt_assign
from fl_platform.engine.setup import ExperimentSetup
from fl_platform.engine.worker import Worker, WorkerResult


class InlineEngine(Engine):
    def __init__(self, setup: ExperimentSetup, num_workers: int = 1) -> None:
        self.setup = setup
        self.num_workers = num_workers
        self.workers = [Worker(i, setup) for i in range(num_workers)]
        self.sizes = setup.dataset.client_sizes()
        self._stats: dict[str, float] = {}

    def run_round(self, ctx: RoundContext, broadcast: Broadcast) -> list[WorkerResult]:
        clients = list(ctx.clients)
        work = [float(self.sizes[c]) for c in clients]
        assignment, _ = lpt_assign(clients, work, [1.0] * self.num_workers)
        t0 = time.perf_counter()
        results = [w.run_round(ctx, broadcast, a) for w, a in zip(self.workers, assignment)]
        busy = [r.busy_seconds for r in results]
        self._stats = {"makespan_s": time.perf_counter() - t0,
                       "balance": max(busy) / (sum(busy) / len(busy)) if sum(busy) else 1.0}
        return results

    def round_stats(self) -> dict[str, float]:
        return dict(self._stats)

    def flush(self) -> None:
        for w in self.workers:
            w.flush()
