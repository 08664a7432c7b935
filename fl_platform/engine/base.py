"""The engine interface: run one round's clients on W workers and return W partial results."""

from __future__ import annotations

from abc import ABC, abstractmethod

from fl_platform.core import Broadcast, RoundContext
from fl_platform.engine.worker import WorkerResult


class Engine(ABC):
    num_workers: int

    @abstractmethod
    def run_round(self, ctx: RoundContext, broadcast: Broadcast) -> list[WorkerResult]:
        """Train ``ctx.clients``; results are returned in worker-id order."""

    def round_stats(self) -> dict[str, float]:
        """Scheduling statistics of the last round (predicted vs actual makespan, balance)."""
        return {}

    def flush(self) -> None:
        """Make client state durable (before a checkpoint)."""

    def close(self) -> None:
        """Release workers and what they hold."""
