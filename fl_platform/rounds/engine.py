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
