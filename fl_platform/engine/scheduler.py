"""Assign a round's clients to workers so that the slowest worker finishes as early as possible.

Cost of client c on worker w = samples(c) * epochs * seconds_per_sample(w) (+ a per-client
overhead). Longest-processing-time-first: clients in decreasing cost order, each to the worker
whose load after taking it is smallest (ties: lowest worker id). Deterministic, and the result
never changes the round's outcome, only its wall time.
"""

from __future__ import annotations

from collections.abc import Sequence


def lpt_assign(clients: Sequence[int], work: Sequence[float], seconds_per_unit: Sequence[float],
               overhead: Sequence[float] | None = None) -> tuple[list[list[int]], list[float]]:
    """Return (clients per worker, predicted busy seconds per worker)."""
    num_workers = len(seconds_per_unit)
    overhead = overhead if overhead is not None else [0.0] * num_workers
    loads = [0.0] * num_workers
    assignment: list[list[int]] = [[] for _ in range(num_workers)]
    order = sorted(range(len(clients)), key=lambda i: (-work[i], clients[i]))
    for i in order:
        best = min(range(num_workers),
                   key=lambda w: (loads[w] + work[i] * seconds_per_unit[w] + overhead[w], w))
        loads[best] += work[i] * seconds_per_unit[best] + overhead[best]
        assignment[best].append(clients[i])
    return assignment, loads
