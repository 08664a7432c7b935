"""A reporter that interrupts a run like Ctrl-C once it has logged a given number of rounds.

Plain Python (no pytest), so that scripts/gpu_smoke.py's resume check uses it as the resume tests do."""

from __future__ import annotations


class StopAfter:
    """Raises KeyboardInterrupt from ``round_done`` once ``rounds`` rows were logged."""

    def __init__(self, rounds: int) -> None:
        self.rounds, self.seen = rounds, 0

    def round_done(self, row: dict) -> None:
        self.seen += 1
        if self.seen == self.rounds:
            raise KeyboardInterrupt

    def close(self) -> None:
        pass
