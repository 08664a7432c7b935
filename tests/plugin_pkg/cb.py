"""Round callbacks as a user writes them (``callbacks=[{_target_: plugin_pkg.cb:StopAt, round: 2}]``)."""

from __future__ import annotations

from typing import Any

from torch import nn


class StopAt:
    """Stops the run after round ``round`` (1-based); remembers what it saw."""

    def __init__(self, round: int, note: str = "") -> None:
        self.round, self.note = round, note
        self.seen: list[tuple[int, float | None, int]] = []

    def on_round_end(self, round: int, metrics: dict[str, Any], model: nn.Module) -> bool:
        self.seen.append((round, metrics.get("test_accuracy"), sum(p.numel() for p in model.parameters())))
        return round >= self.round


def never(round: int, metrics: dict[str, Any], model: nn.Module) -> bool:
    return False
