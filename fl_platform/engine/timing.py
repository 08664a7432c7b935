"""Where a worker's round time goes: training, state I/O (and, on the driver, transport and waiting).

A ``DeviceClock`` times spans of a worker's round on its device. On the CPU a span is
``perf_counter`` around it. On CUDA it is a pair of CUDA events recorded on the stream, read once
when the round ends (``totals``): the spans then measure the GPU's time, not when the host queued
the work, and timing adds no host synchronisation per client or step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class DeviceClock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._seconds: dict[str, float] = {}
        self._events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}

    @contextmanager
    def span(self, kind: str) -> Iterator[None]:
        """Time the body as ``kind`` (spans of one kind add up; a span may contain spans of another)."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.setdefault(kind, []).append((start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._seconds[kind] = self._seconds.get(kind, 0.0) + time.perf_counter() - t0

    def totals(self) -> dict[str, float]:
        """Seconds per kind (on CUDA: waits for the last event, once)."""
        out = dict(self._seconds)
        for kind, pairs in self._events.items():
            pairs[-1][1].synchronize()
            out[kind] = out.get(kind, 0.0) + sum(s.elapsed_time(e) for s, e in pairs) / 1000.0
        return out
