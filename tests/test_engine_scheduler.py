"""Scheduler: LPT with measured per-worker speeds, bounded EMA, home-worker preference."""

from __future__ import annotations

import numpy as np
import pytest

from fl_platform.engine.scheduler import RuntimeModel, Scheduler, lpt_assign, work_units
from fl_platform.training.loop import TrainConfig


def test_lpt_balances_equal_workers_and_is_deterministic():
    clients = list(range(8))
    work = [8, 7, 6, 5, 4, 3, 2, 1]
    a1, loads = lpt_assign(clients, work, [1.0, 1.0])
    a2, _ = lpt_assign(clients, work, [1.0, 1.0])
    assert a1 == a2
    assert sorted(c for part in a1 for c in part) == clients
    assert loads == [18.0, 18.0]


def test_lpt_gives_a_faster_worker_more_work():
    clients = list(range(20))
    assignment, loads = lpt_assign(clients, [1.0] * 20, [1.0, 3.0])  # worker 1 is 3x slower
    assert len(assignment[0]) == 15 and len(assignment[1]) == 5
    assert max(loads) == pytest.approx(15.0)


def test_home_preference_keeps_clients_home_unless_it_costs_more_than_the_transfer():
    clients = list(range(10))
    work = [1.0] * 10
    home = lambda c: c % 2  # noqa: E731
    assignment, _ = lpt_assign(clients, work, [1.0, 1.0], home=home, transfer_cost=0.5)
    assert all(home(c) == w for w, part in enumerate(assignment) for c in part)
    # All clients homed on worker 0: balancing beats locality when the transfer is cheap...
    assignment, _ = lpt_assign(clients, work, [1.0, 1.0], home=lambda c: 0, transfer_cost=0.1)
    assert len(assignment[1]) >= 4
    # ...and locality wins when moving costs more than the imbalance.
    assignment, _ = lpt_assign(clients, work, [1.0, 1.0], home=lambda c: 0, transfer_cost=100.0)
    assert assignment[1] == []


def test_runtime_model_learns_rate_and_overhead_and_is_bounded():
    m = RuntimeModel(2, smoothing=0.5)
    assert m.seconds_per_unit() == [1.0, 1.0] and not m.calibrated
    m.observe(0, [10, 20, 40], [0.1 + 0.01 * 10, 0.1 + 0.01 * 20, 0.1 + 0.01 * 40])
    assert m.rate[0] == pytest.approx(0.01) and m.overhead[0] == pytest.approx(0.1)
    assert m.seconds_per_unit()[1] == pytest.approx(0.01)  # unmeasured: mean of the measured
    m.observe(0, [10, 20], [1000.0, 2000.0])  # one absurd round moves the rate by at most max_step
    assert m.rate[0] <= 0.01 * (0.5 + 0.5 * 4) + 1e-12
    m.observe(1, [5, 5], [0.5, 0.5])  # equal sizes: rate from the mean, overhead kept
    assert m.rate[1] == pytest.approx(0.1)
    with pytest.raises(ValueError, match="scheduler_smoothing"):
        RuntimeModel(1, smoothing=0.0)


def test_scheduler_adapts_to_a_slow_worker_and_reports_statistics():
    sizes = np.full(40, 10)
    sched = Scheduler(2, sizes, TrainConfig(epochs=1, batch_size=10))
    clients = list(range(20))
    plan = sched.plan(clients)
    assert [len(a) for a in plan.assignment] == [10, 10]
    # Worker 1 measured 4x slower per sample.
    secs = [{c: 0.001 * 10 for c in plan.assignment[0]}, {c: 0.004 * 10 for c in plan.assignment[1]}]
    stats = sched.record(plan, secs, [sum(s.values()) for s in secs])
    assert stats["sched_balance"] == pytest.approx(0.4 / 0.25)
    assert "sched_predicted_s" not in stats  # nothing was measured before this round
    plan2 = sched.plan(clients)
    assert len(plan2.assignment[0]) == 16 and len(plan2.assignment[1]) == 4
    assert plan2.predicted_makespan == pytest.approx(0.16, rel=1e-6)
    stats2 = sched.record(plan2, [{c: 0.01 for c in plan2.assignment[0]}, {c: 0.04 for c in plan2.assignment[1]}],
                          [0.16, 0.16])
    assert stats2["sched_predicted_s"] == pytest.approx(0.16) and stats2["sched_balance"] == pytest.approx(1.0)
    restored = Scheduler(2, sizes, TrainConfig())
    restored.load_state_dict(sched.state_dict())
    assert restored.model.rate == sched.model.rate


def test_work_units_follow_epochs_or_steps():
    assert work_units(25, TrainConfig(epochs=2, batch_size=10)) == 50
    assert work_units(25, TrainConfig(steps=3, batch_size=10)) == 30
    assert work_units(4, TrainConfig(steps=3, batch_size=10)) == 12


def test_scheduler_keeps_most_clients_home_when_balance_allows():
    sizes = np.full(200, 10)
    home = lambda c: c % 2  # noqa: E731
    sched = Scheduler(2, sizes, TrainConfig(epochs=1, batch_size=10), home=home)
    clients = list(range(0, 40, 2)) + list(range(1, 30, 2))  # 20 homed on worker 0, 15 on worker 1
    plan = sched.plan(clients)
    moved = sum(1 for w, part in enumerate(plan.assignment) for c in part if home(c) != w)
    assert moved <= 3  # only what balancing needs (2.5 clients), not half of them
    assert abs(len(plan.assignment[0]) - len(plan.assignment[1])) <= 1
    stats = sched.record(plan, [dict.fromkeys(part, 0.01) for part in plan.assignment], [0.18, 0.17])
    assert stats["sched_moved_clients"] == moved
