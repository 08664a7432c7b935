"""The engine interface: run one round's clients on W workers and return W partial results."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fl_platform.core import Broadcast, RoundContext
from fl_platform.engine.worker import WorkerResult

if TYPE_CHECKING:
    from fl_platform.engine.simulation import LoopConfig


class Engine(ABC):
    num_workers: int

    @abstractmethod
    def run_round(self, ctx: RoundContext, broadcast: Broadcast) -> list[WorkerResult]:
        """Train ``ctx.clients``; results are returned in worker-id order."""

    def hosts_rounds(self) -> bool:
        """Whether ``run_rounds`` runs whole rounds, server step included, on a worker."""
        return False

    def run_rounds(self, loop: LoopConfig, start: int, stop: int,
                   server_state: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Rounds ``start..stop-1`` (or fewer, at least one) from ``server_state``, on a worker that
        runs the round loop itself: (their metrics rows, the server's state after the last)."""
        raise NotImplementedError(f"{type(self).__name__} runs one round at a time (hosts_rounds() is False)")

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
