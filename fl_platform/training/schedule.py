"""The local learning rate across rounds (``train.lr_schedule``): a function of the round index only.

Every client of round r trains with the same ``lr_r``, computed from r alone (and the schedule's
fields), so a run is deterministic whatever the engine or worker count, and a resumed run continues
with exactly the rates an uninterrupted one uses. Within a round the rate is constant (the local
optimiser's steps are not scheduled).

* ``constant``: ``lr`` every round.
* ``step``: ``lr * gamma ** ((r - warmup_rounds) // step_every)``.
* ``cosine``: from ``lr`` at the first round after warm-up down to ``min_lr`` at the last round
  (``rounds``; None: the run's ``rounds``), half a cosine period.
* ``warmup_rounds = W`` (any schedule): rounds ``r < W`` use ``lr * (r + 1) / (W + 1)``, a linear
  ramp that reaches ``lr`` at round ``W`` (0-based), where the schedule proper starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULES = ("constant", "step", "cosine")


@dataclass
class LrSchedule:
    name: str = "constant"  # constant | step | cosine
    warmup_rounds: int = 0  # linear ramp to lr over the first rounds (any schedule)
    step_every: int = 10  # step: rounds between decays
    gamma: float = 0.1  # step: the factor of each decay
    min_lr: float = 0.0  # cosine: the rate of the last round
    rounds: int | None = None  # cosine: the horizon (None: the run's rounds, filled in at start-up)

    def lr_at(self, lr: float, round: int) -> float:
        """The rate of 0-based round ``round`` for base rate ``lr``."""
        w = self.warmup_rounds
        if round < w:
            return lr * (round + 1) / (w + 1)
        r = round - w
        if self.name == "step":
            return lr * self.gamma ** (r // self.step_every)
        if self.name == "cosine":
            if self.rounds is None:
                raise ValueError("train.lr_schedule.rounds is unset: the run fills it in at start-up")
            span = max(self.rounds - w - 1, 1)
            return self.min_lr + (lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * min(r / span, 1.0)))
        return lr

    def is_constant(self) -> bool:
        return self.name == "constant" and self.warmup_rounds == 0

    def problems(self, lr: float) -> list[tuple[str, str]]:
        """(field, why) of each invalid value, for start-up errors."""
        checks = [
            (self.name in SCHEDULES, "name", f"must be one of {', '.join(SCHEDULES)}; got {self.name!r}"),
            (self.warmup_rounds >= 0, "warmup_rounds", f"must be >= 0, got {self.warmup_rounds}"),
            (self.step_every >= 1, "step_every", f"must be >= 1, got {self.step_every}"),
            (0 < self.gamma <= 1, "gamma", f"must be in (0, 1], got {self.gamma}"),
            (0 <= self.min_lr < lr or self.name != "cosine", "min_lr",
             f"must be in [0, train.lr={lr}), got {self.min_lr}"),
            (self.rounds is None or self.rounds >= 1, "rounds", f"must be >= 1 (or null: the run's), got {self.rounds}"),
        ]
        return [(key, why) for ok, key, why in checks if not ok]

    def inactive_fields(self) -> dict[str, str]:
        """Fields the chosen schedule does not read (field -> why), refused when set."""
        step = dict.fromkeys(("step_every", "gamma"), f"a step schedule's setting, and the schedule is {self.name}")
        cosine = dict.fromkeys(("min_lr", "rounds"), f"a cosine schedule's setting, and the schedule is {self.name}")
        return {"constant": {**step, **cosine}, "step": cosine, "cosine": step}.get(self.name, {})
