"""The interface the round loop drives: train one round's clients on W workers, return W partial results.

Implemented by the simulation engines (``fl_platform/engine/``: inline and Ray) and by the Flower
ServerApp's adapter (``fl_platform/flower/strategy.py``), so the round loop in ``simulation.py``
runs unchanged on every runtime and imports nothing from any of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fl_platform.core import Aggregate, Broadcast, ClientUpdate, Metrics, RoundContext
from fl_platform.rounds.evaluation import DriverEvaluator, Evaluator
from fl_platform.training.flat import FlatModel

State = dict[str, torch.Tensor]


@dataclass
class WorkerResult:
    """One worker's share of a round: its partial aggregate (or list of updates) and bookkeeping."""

    worker_id: int
    aggregate: Aggregate
    updates: list[ClientUpdate]
    metrics: Metrics
    client_seconds: dict[int, float]
    busy_seconds: float
    bytes_up: int
    bytes_down: int
    rejected: dict[int, str] = field(default_factory=dict)
    outbox: dict[int, State] = field(default_factory=dict)  # new states of clients homed elsewhere
    client_stats: dict[int, dict[str, float]] = field(default_factory=dict)  # bytes_up, samples (system model)
    states_written: list[int] = field(default_factory=list)  # clients whose new state this round produced
    # seconds of the round on the worker's device: train_s (training, state reads excluded), state_io_s
    # (reading, staging and writing client states); engine/timing.py. Empty: not measured (Flower).
    timings: dict[str, float] = field(default_factory=dict)


WORKER_COLUMNS = ("worker", "node", "device", "gpu_ids", "gpu_share", "torch", "cuda")


def workers_table(rows: list[dict[str, Any]]) -> str:
    """``Engine.describe_workers()`` as an aligned text table (the start-up log)."""
    def cell(value: Any) -> str:
        return ",".join(map(str, value)) or "-" if isinstance(value, list) else f"{value:g}" if isinstance(
            value, float) else str(value)

    cells = [list(WORKER_COLUMNS)] + [[cell(row.get(c)) for c in WORKER_COLUMNS] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(WORKER_COLUMNS))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in cells)


def busy_columns(results: list[WorkerResult], num_workers: int, round_s: float, wall_s: float,
                 transport_s: list[float] | None = None) -> dict[str, Any]:
    """Where each worker's time went in a round, and how busy the workers were (metrics row columns).

    ``round_s``: the round's time before evaluation; ``wall_s``: until the next round can start
    (evaluation included: the workers wait for it). Per worker: ``worker_train_s``,
    ``worker_state_io_s``, ``worker_transport_s`` (the driver's call minus the worker's own time:
    messages and Ray's scheduling), ``worker_wait_s`` (the rest of ``wall_s``).
    ``worker_busy_frac`` = training time / (workers x wall time); ``beyond_slowest_s``: the round's
    time beyond its slowest worker's call (driver, reduction, server step)."""
    by_id = {r.worker_id: r for r in results}
    train = [by_id[w].timings.get("train_s", 0.0) if w in by_id else 0.0 for w in range(num_workers)]
    state_io = [by_id[w].timings.get("state_io_s", 0.0) if w in by_id else 0.0 for w in range(num_workers)]
    busy = [by_id[w].busy_seconds if w in by_id else 0.0 for w in range(num_workers)]
    transport = list(transport_s) if transport_s is not None else [0.0] * num_workers
    calls = [b + t for b, t in zip(busy, transport)]
    return {"worker_train_s": train, "worker_state_io_s": state_io, "worker_transport_s": transport,
            "worker_wait_s": [max(wall_s - c, 0.0) for c in calls],
            "worker_busy_frac": sum(train) / (num_workers * wall_s) if wall_s > 0 else 0.0,
            "beyond_slowest_s": max(round_s - max(calls, default=0.0), 0.0)}


class StateLost(RuntimeError):
    """Client states the run needs are gone (a node lost, node-local files removed, a memory home died).

    The round loop rolls back to its last checkpoint, whose states the engine restores, and reruns
    from there; without a checkpoint the run stops with this error, which names what was lost."""


class Engine(ABC):
    num_workers: int
    #: Where the driver evaluates, when the engine decides it (the Ray engine holds a GPU share for it);
    #: None: the driver's own choice.
    eval_device: torch.device | None = None

    @abstractmethod
    def run_round(self, ctx: RoundContext, broadcast: Broadcast) -> list[WorkerResult]:
        """Train ``ctx.clients``; results are returned in worker-id order."""

    def evaluator(self, model: FlatModel) -> Evaluator:
        """Where the global model is evaluated (fl_platform/rounds/evaluation.py): by default on the
        driver's ``model``; the Ray engine may evaluate on a worker instead."""
        return DriverEvaluator(model)

    def evaluate_clients(self, ctx: RoundContext, broadcast: Broadcast,
                         client_ids: list[int]) -> dict[int, dict[str, float]]:
        """Per-client evaluation on local test splits (``eval.clients``), where the clients train;
        client -> its metrics (fl_platform/rounds/client_eval.py). Reads client states, never writes."""
        raise NotImplementedError(f"per-client evaluation (eval.clients) is not implemented for "
                                  f"{type(self).__name__}; use engine=inline or engine=ray")

    def describe_workers(self) -> list[dict[str, Any]]:
        """One row per worker: worker, node, device, gpu_ids (Ray's assignment), gpu_share, torch, cuda
        (logged as a table at start-up and written to run.json)."""
        return []

    def round_stats(self) -> dict[str, float]:
        """Scheduling statistics of the last round (predicted vs actual makespan, balance)."""
        return {}

    def flush(self) -> None:
        """Make client state durable (before a checkpoint)."""

    def checkpoint_state(self, directory: Path, round: int) -> None:
        """Phase 1 of a checkpoint after ``round`` rounds: client state saved or set aside (see state/store.py)."""
        self.flush()

    def commit_state(self, round: int) -> None:
        """Phase 2, once the checkpoint for ``round`` is published."""

    def restore_state(self, directory: Path | None, round: int | None) -> None:
        """Resume: client state as of the checkpoint for ``round`` (None: no checkpoint, empty)."""

    def state_dict(self) -> dict[str, Any]:
        """Engine state worth checkpointing (the scheduler's runtime model)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    def close(self) -> None:
        """Release workers and what they hold."""
