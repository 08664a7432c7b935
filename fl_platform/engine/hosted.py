"""Rounds hosted by the one Ray worker: the server step runs in the worker, many rounds per call.

With a single worker, no client state and a server that sums contributions (a light step), a
round is a function of the server's state at its start, so nothing requires the driver between
rounds. Sending (context, broadcast, plan) to the
actor and its partial aggregate back costs about 1 ms per round even through a compiled graph,
a fifth of a 100-clients/10-per-round round. So ``RayEngine`` with one worker
(``engine.server_in_worker``, default on) asks the actor for up to about a second of rounds per
call, ending at the next checkpoint round: the actor runs the shared round loop
(``Simulation.run_round``, evaluation included) around an ``InlineEngine`` of itself, and returns
the metrics rows and the server's state, which the driver loads before it logs the rows and
checkpoints. Each call starts by loading the driver's server state, exactly like a resume, so a
worker that dies mid-call is replaced and the call rerun with the same result.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from fl_platform.engine.inline import InlineEngine
from fl_platform.engine.simulation import LoopConfig, Simulation
from fl_platform.engine.worker import Worker
from fl_platform.seeding import Stream, seed_torch_global
from fl_platform.training.flat import FlatModel

#: A call returns after the round that takes it past this many seconds (progress stays live).
CALL_SECONDS = 1.0


@dataclass
class RoundsCall:
    loop: LoopConfig
    start: int
    stop: int  # exclusive; the worker may stop earlier (after CALL_SECONDS), never before start + 1
    server: dict[str, Any]
    scheduler: dict[str, Any]
    max_seconds: float = CALL_SECONDS
    eval_threads: int = 0  # the driver's torch threads (0: the worker's own), for evaluation


@dataclass
class RoundsResult:
    rows: list[dict[str, Any]]
    server: dict[str, Any]
    scheduler: dict[str, Any]


class _WorkerSimulation(Simulation):
    """Evaluates with the driver's torch threads: the driver idles during the call, and on the
    per-round path it would have evaluated with them (the worker trains with its own few)."""

    eval_threads = 0

    def evaluate(self) -> dict[str, float]:
        own = torch.get_num_threads()
        if self.eval_threads < 1 or self.eval_threads == own:
            return super().evaluate()
        torch.set_num_threads(self.eval_threads)
        try:
            return super().evaluate()
        finally:
            torch.set_num_threads(own)


class HostedLoop:
    """The server half and the round loop, built inside a worker the way ``experiment.build`` builds
    them in the driver (same seed for the initial model, same server-side data)."""

    def __init__(self, worker: Worker) -> None:
        setup = worker.setup
        seed_torch_global(setup.seed, Stream.INIT)
        self.eval_model = FlatModel(setup.model(), worker.device)
        alg_setup = setup.algorithm_setup(self.eval_model.num_params, self.eval_model.num_buffers)
        self.server = worker.spec.server(setup.algorithm_conf, alg_setup,
                                         self.eval_model.vector.detach().cpu().clone())
        self.server.attach_data(worker.data)
        self.engine = InlineEngine(setup, workers=[worker])
        self.data = worker.data
        self.system = setup.system
        self.sim: _WorkerSimulation | None = None

    def run(self, call: RoundsCall) -> RoundsResult:
        if self.sim is None or self.sim.loop != call.loop:
            self.sim = _WorkerSimulation(call.loop, self.data, self.server, self.engine, self.eval_model)
            self.sim.system = self.system
        self.sim.eval_threads = call.eval_threads
        self.server.load_state_dict(call.server)
        self.engine.load_state_dict({"scheduler": call.scheduler})
        rows = []
        t0 = time.perf_counter()
        for r in range(call.start, call.stop):
            rows.append(self.sim.run_round(r))
            if time.perf_counter() - t0 >= call.max_seconds:
                break
        return RoundsResult(rows, self.server.state_dict(), self.engine.state_dict()["scheduler"])
