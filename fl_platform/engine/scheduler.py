"""Assign a round's clients to workers so that the slowest worker finishes as early as possible.

Cost of client c on worker w = work(c) * seconds_per_sample(w) + overhead(w) (+ a state-transfer
cost when w is not c's home worker), where work(c) is the number of samples local training
processes (epochs x samples, or steps x batch size). Each worker's seconds-per-sample and
per-client overhead are measured every round and smoothed by a bounded exponential moving
average: O(1) memory per worker (never a growing history) and a single noisy round can move the
estimate by at most a fixed factor. Before any measurement all workers count as equally fast.

Policies (``engine.scheduler``):

* ``lpt`` (default), longest-processing-time-first: clients in decreasing work order (ties by id),
  each to the worker whose predicted load after taking it is smallest (ties: the client's home
  worker, then the lowest id).
* ``round_robin``: the i-th sampled client goes to worker ``i mod W``, whatever the measurements.
  The baseline LPT is measured against, and a placement that is the same in every run (LPT's
  follows measured timings), e.g. to reproduce which worker trained which client.

Both are deterministic given their inputs and never change the round's outcome, only its wall
time. Whatever the policy, the runtime model keeps learning and every round reports the predicted
makespan of the plan next to the measured one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fl_platform.training.loop import TrainConfig

POLICIES = ("lpt", "round_robin")


def lpt_assign(clients: Sequence[int], work: Sequence[float], seconds_per_unit: Sequence[float],
               overhead: Sequence[float] | None = None, home: Callable[[int], int] | None = None,
               transfer_cost: float = 0.0) -> tuple[list[list[int]], list[float]]:
    """Return (clients per worker, predicted busy seconds per worker).

    ``home(c)`` names the worker holding client c's state; placing c elsewhere costs
    ``transfer_cost`` seconds more, and among equal loads the home worker wins.
    """
    num_workers = len(seconds_per_unit)
    overhead = overhead if overhead is not None else [0.0] * num_workers
    loads = [0.0] * num_workers
    assignment: list[list[int]] = [[] for _ in range(num_workers)]
    order = sorted(range(len(clients)), key=lambda i: (-work[i], clients[i]))
    for i in order:
        c = clients[i]
        h = home(c) if home is not None else -1

        def cost(w: int, i: int = i, h: int = h) -> float:
            return work[i] * seconds_per_unit[w] + overhead[w] + (transfer_cost if h >= 0 and w != h else 0.0)

        best = min(range(num_workers), key=lambda w: (loads[w] + cost(w), w != h, w))
        loads[best] += cost(best)
        assignment[best].append(c)
    return assignment, loads


def round_robin_assign(clients: Sequence[int], num_workers: int) -> list[list[int]]:
    """The i-th client to worker ``i mod num_workers`` (in the given order)."""
    return [list(clients[w::num_workers]) for w in range(num_workers)]


def work_units(num_samples: int, train: TrainConfig) -> float:
    """Samples processed by local training: the scheduler's measure of a client's cost."""
    if train.steps is not None:
        return float(train.steps * min(train.batch_size, max(num_samples, 1)))
    return float(train.epochs * num_samples)


@dataclass
class RuntimeModel:
    """Per-worker linear runtime model t(client) = a_w * work + b_w, fitted round by round.

    Each round's observations of one worker give a fresh estimate (a least-squares line when its
    clients had at least two distinct sizes, else the mean rate with the previous overhead); the
    estimate is clipped to [1/max_step, max_step] times the current one and blended in with
    weight ``smoothing``.
    """

    num_workers: int
    smoothing: float = 0.5
    max_step: float = 4.0
    rate: list[float | None] = field(default_factory=list)
    overhead: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"engine.scheduler_smoothing must be in (0, 1], got {self.smoothing}")
        self.rate = self.rate or [None] * self.num_workers
        self.overhead = self.overhead or [0.0] * self.num_workers

    @property
    def calibrated(self) -> bool:
        return all(r is not None for r in self.rate)

    def seconds_per_unit(self) -> list[float]:
        """Current rates; workers never measured get the mean of the measured ones (1.0 if none)."""
        known = [r for r in self.rate if r is not None]
        default = sum(known) / len(known) if known else 1.0
        return [default if r is None else r for r in self.rate]

    def overheads(self) -> list[float]:
        return list(self.overhead)

    def predict(self, worker: int, work: float) -> float:
        return work * self.seconds_per_unit()[worker] + self.overhead[worker]

    def observe(self, worker: int, works: Sequence[float], seconds: Sequence[float]) -> None:
        pairs = [(w, s) for w, s in zip(works, seconds) if w > 0 and math.isfinite(s) and s >= 0]
        if not pairs:
            return
        xs, ys = [p[0] for p in pairs], [p[1] for p in pairs]
        n = len(pairs)
        b_prev = self.overhead[worker]
        a, b = None, b_prev
        if len(set(xs)) >= 2:
            mx, my = sum(xs) / n, sum(ys) / n
            sxx = sum((x - mx) ** 2 for x in xs)
            sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
            a_fit = sxy / sxx
            b_fit = my - a_fit * mx
            if a_fit > 0 and b_fit >= 0:
                a, b = a_fit, b_fit
        if a is None:
            a = max(sum(ys) - n * b, 0.0) / sum(xs)
            if a <= 0:  # the overhead estimate explains everything: re-split it as a pure rate
                a, b = sum(ys) / sum(xs), 0.0
        current = self.rate[worker]
        if current is None:
            self.rate[worker], self.overhead[worker] = a, b
            return
        a = min(max(a, current / self.max_step), current * self.max_step)
        beta = self.smoothing
        self.rate[worker] = (1 - beta) * current + beta * a
        self.overhead[worker] = (1 - beta) * b_prev + beta * b

    def state_dict(self) -> dict[str, Any]:
        return {"rate": list(self.rate), "overhead": list(self.overhead)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if len(state["rate"]) == self.num_workers:
            self.rate, self.overhead = list(state["rate"]), list(state["overhead"])


@dataclass
class Plan:
    assignment: list[list[int]]
    predicted: list[float]  # busy seconds per worker
    work: list[float] = field(default_factory=list)  # work units (samples processed) per worker

    @property
    def predicted_makespan(self) -> float:
        return max(self.predicted) if self.predicted else 0.0


class Scheduler:
    """Plans each round (LPT on the measured runtime model, or round-robin) and reports how good the
    plan was: predicted against measured makespan."""

    def __init__(self, num_workers: int, sizes: Sequence[int] | Any, train: TrainConfig, *,
                 home: Callable[[int], int] | None = None, transfer_cost: float | None = None,
                 smoothing: float = 0.5, policy: str = "lpt") -> None:
        policy = str(policy)
        if policy not in POLICIES:
            raise ValueError(f"engine.scheduler must be one of {', '.join(POLICIES)}; got {policy!r}")
        self.policy = policy
        self.num_workers = num_workers
        self.sizes = sizes
        self.train = train
        self.home = home
        self.transfer_cost = transfer_cost
        self.model = RuntimeModel(num_workers, smoothing=smoothing)
        self.last: dict[str, Any] = {}

    def work(self, client_id: int) -> float:
        return work_units(int(self.sizes[client_id]), self.train)

    def plan(self, clients: Sequence[int]) -> Plan:
        work = [self.work(c) for c in clients]
        rates, overheads = self.model.seconds_per_unit(), self.model.overheads()
        transfer = self.transfer_cost
        if transfer is None:  # auto: moving a client must save more than a tenth of an average client
            mean_rate, mean_overhead = sum(rates) / len(rates), sum(overheads) / len(overheads)
            transfer = 0.1 * (mean_rate * sum(work) / max(len(work), 1) + mean_overhead)
        transfer = transfer if self.home is not None else 0.0
        if self.policy == "lpt":
            assignment, loads = lpt_assign(list(clients), work, rates, overheads, home=self.home,
                                           transfer_cost=transfer)
        else:
            assignment = round_robin_assign(list(clients), self.num_workers)
            loads = [sum(self.work(c) * rates[w] + overheads[w]
                         + (transfer if self.home is not None and self.home(c) != w else 0.0) for c in part)
                     for w, part in enumerate(assignment)]
        return Plan(assignment, loads, [sum(self.work(c) for c in part) for part in assignment])

    def record(self, plan: Plan, client_seconds: Sequence[Mapping[int, float]],
               busy_seconds: Sequence[float]) -> dict[str, Any]:
        """Update the runtime model from a finished round; return its scheduling statistics."""
        calibrated = self.model.calibrated
        for w, seconds in enumerate(client_seconds):
            cids = [c for c in plan.assignment[w] if c in seconds]
            self.model.observe(w, [self.work(c) for c in cids], [seconds[c] for c in cids])
        busy = [float(b) for b in busy_seconds]
        mean = sum(busy) / len(busy) if busy else 0.0
        stats: dict[str, Any] = {
            "sched_makespan_s": max(busy) if busy else 0.0,
            "sched_busy_s": busy,
            "sched_balance": max(busy) / mean if mean > 0 else 1.0,
            "sched_work": list(plan.work),
        }
        if calibrated:  # before the first measurement the "prediction" is in work units, not seconds
            stats["sched_predicted_s"] = plan.predicted_makespan
        if self.home is not None:
            moved = sum(1 for w, cids in enumerate(plan.assignment) for c in cids if self.home(c) != w)
            stats["sched_moved_clients"] = moved
        self.last = stats
        return stats

    def state_dict(self) -> dict[str, Any]:
        return self.model.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state)


#: Below this predicted busy fraction a run warns at start-up that its rounds cannot keep every worker busy.
BUSY_WARN = 0.85


def predicted_busy_frac(client_sets: Sequence[Sequence[int]], sizes: Sequence[int] | Any, train: TrainConfig,
                        num_workers: int) -> float:
    """The busy fraction the LPT plan allows at best, averaged over ``client_sets`` (rounds' samples):
    sum of work / (W x the most loaded worker's work), with equal worker speeds and no overhead. A
    client is the smallest unit of work, so few or uneven clients per worker leave workers waiting."""
    fracs = []
    for clients in client_sets:
        work = [work_units(int(sizes[c]), train) for c in clients]
        if not work or sum(work) == 0:
            continue
        _, loads = lpt_assign(list(clients), work, [1.0] * num_workers)
        fracs.append(sum(loads) / (num_workers * max(loads)))
    return sum(fracs) / len(fracs) if fracs else 1.0


def balance_warning(client_sets: Sequence[Sequence[int]], sizes: Sequence[int] | Any, train: TrainConfig,
                    num_workers: int) -> str | None:
    """A warning when the rounds' clients are too few (or too uneven) for ``num_workers`` workers to stay
    busy (``predicted_busy_frac`` below ``BUSY_WARN``), with the prediction and the remedies; else None."""
    if num_workers < 2 or not client_sets:
        return None
    frac = predicted_busy_frac(client_sets, sizes, train, num_workers)
    if frac >= BUSY_WARN:
        return None
    per_worker = sum(len(c) for c in client_sets) / len(client_sets) / num_workers
    return (f"{per_worker:.1f} clients per round per worker: even the scheduler's best (LPT) plan keeps the "
            f"{num_workers} workers busy only {frac:.0%} of the training time (predicted from the sizes of the first "
            f"{len(client_sets)} rounds' clients, equal worker speeds; worker_busy_frac in metrics.jsonl measures it). "
            f"Sample more clients per round (clients_per_round), use fewer workers (engine.num_workers), or train "
            f"several clients at once (engine.cohort_size); docs/engine.md, Busy time")
