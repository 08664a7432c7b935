"""Local SGD / post-local SGD: the bridge between S-SGD and FedAvg.

Each worker takes optimiser steps on its own shard without communicating; every ``period`` (H)
steps the replicas are replaced by their average: one all-reduce of the whole flat vector, the
parameters and the BatchNorm running statistics together (floating-point buffers live in the
FlatModel's vector; integer ``num_batches_tracked`` stays local). Momentum (and Adam) state stays
local, as in most local-SGD code (ssgd.md leaves the choice open; this is ours).

With ``start_step`` = t0 > 0 it is post-local SGD (Lin et al.): the first t0 steps are plain
S-SGD (the gradient all-reduced every step), then local SGD. Averaging a model every H steps
over W workers with IID shards is FedAvg with full participation and H local steps per round.
The run ends with a final average when the last step was not a sync point, so the saved model is
one model.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from fl_platform.ssgd.distributed import replica_max_abs_diff
from fl_platform.ssgd.stats import CommStats
from fl_platform.training.flat import FlatModel


class LocalSGD:
    name = "local"

    def __init__(self, fm: FlatModel, world_size: int, period: int, start_step: int = 0, group: Any = None,
                 stats: CommStats | None = None, check_replicas: bool = False) -> None:
        if period < 1:
            raise ValueError(f"ssgd.period must be >= 1, got {period}")
        if start_step < 0:
            raise ValueError(f"ssgd.local_start_step must be >= 0, got {start_step}")
        self.fm, self.module = fm, fm.model
        self.world_size, self.period, self.start_step, self.group = world_size, period, start_step, group
        self.stats = stats or CommStats(world_size)
        self.stats.world_size = world_size
        self.check_replicas = check_replicas
        self.divergence_before_sync: list[float] = []  # check_replicas: max |w_r - w_0| just before each average
        self._synced_at = -1

    def is_sync_step(self, step: int) -> bool:
        """Whether the model is averaged after (0-based) step ``step``."""
        done = step + 1 - self.start_step
        return done > 0 and done % self.period == 0

    def before_step(self, step: int) -> None:
        if step < self.start_step:  # post-local warm-up: S-SGD
            self._average(self.fm.grad)

    def after_step(self, step: int) -> bool:
        if step < self.start_step:
            return True
        if not self.is_sync_step(step):
            return False
        self._average_model(step)
        return True

    def finish(self, last_step: int) -> bool:
        """Average once more if ``last_step`` was not a sync point; True when it averaged."""
        if last_step < 0 or last_step < self.start_step or last_step == self._synced_at:
            return False
        self._average_model(last_step)
        return True

    def _average_model(self, step: int) -> None:
        if self.check_replicas:
            self.divergence_before_sync.append(replica_max_abs_diff(self.fm.vector, self.world_size))
        self._average(self.fm.vector)
        self._synced_at = step

    def _average(self, tensor) -> None:
        self.stats.all_reduce(tensor.numel() * tensor.element_size())
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)
            tensor.div_(self.world_size)

    def close(self) -> None:
        pass
