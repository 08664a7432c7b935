"""Rounds with a schedule: train.lr_schedule's rates, and that local training uses the round's rate.

* ``LrSchedule.lr_at`` gives the documented rates (constant, step, cosine, linear warm-up);
* the shared loop and the vectorised cohort trainer step with the rate of the round they are given
  (one full-batch SGD step: the update is proportional to the rate);
* the rate depends on the round index only, so a run resumed from a checkpoint equals an
  uninterrupted one (tests/test_engine_resume.py covers resume in general; here with a schedule).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fl_platform.experiment import ConfigError, build
from fl_platform.training.flat import FlatModel
from fl_platform.training.loop import ClientData, LocalTrainer, TrainConfig
from fl_platform.training.schedule import LrSchedule
from fl_platform.training.vectorised import CohortMember, CohortTrainer

from .conftest import compose_config
from .interrupt import StopAfter
from .test_engine_determinism import run

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_rates_follow_the_documented_formulas():
    lr = 0.2
    assert [LrSchedule().lr_at(lr, r) for r in range(3)] == [lr] * 3
    step = LrSchedule("step", step_every=2, gamma=0.5)
    assert [step.lr_at(lr, r) for r in range(5)] == pytest.approx([0.2, 0.2, 0.1, 0.1, 0.05], rel=1e-12)
    warm = LrSchedule("step", warmup_rounds=3, step_every=2, gamma=0.5)
    assert [warm.lr_at(lr, r) for r in range(6)] == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.2, 0.1], rel=1e-12)
    cos = LrSchedule("cosine", min_lr=0.02, rounds=5)
    expected = [0.02 + 0.18 * 0.5 * (1 + math.cos(math.pi * r / 4)) for r in range(5)]
    assert [cos.lr_at(lr, r) for r in range(5)] == pytest.approx(expected, rel=1e-12)
    assert cos.lr_at(lr, 0) == pytest.approx(lr) and cos.lr_at(lr, 4) == pytest.approx(0.02)
    warm_cos = LrSchedule("cosine", warmup_rounds=1, rounds=4)
    assert [warm_cos.lr_at(lr, r) for r in range(4)] == pytest.approx([0.1, 0.2, 0.1, 0.0], abs=1e-12)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3))


def _data(n: int = 32) -> ClientData:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 5, generator=g)
    return ClientData(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long(), torch.arange(n))


# One full-batch step of plain SGD: the update is -lr_r * (the same gradient) whatever the round.
ONE_STEP = TrainConfig(steps=1, epochs=None, batch_size=32, lr=0.2,
                       lr_schedule=LrSchedule("step", step_every=1, gamma=0.5))


def _loop_update(round: int) -> torch.Tensor:
    fm = FlatModel(_model())
    start = fm.vector.detach().clone()
    LocalTrainer(fm, ONE_STEP).fit(_data(), seed=0, round=round, client=0)
    return fm.vector.detach() - start


def _cohort_update(round: int) -> torch.Tensor:
    fm = FlatModel(_model())
    start = fm.vector.detach().clone()
    res = CohortTrainer(fm, ONE_STEP).fit([CohortMember(0, _data(), start)], seed=0, round=round)
    return res[0].vector.detach() - start


@pytest.mark.parametrize("update", [_loop_update, _cohort_update], ids=["loop", "cohort"])
def test_local_training_steps_with_the_rounds_rate(update):
    first, later = update(0), update(2)  # rates 0.2 and 0.05
    assert float(first.norm()) > 1e-3
    torch.testing.assert_close(later, first * 0.25, rtol=1e-5, atol=1e-7)


TINY = ("dataset=digits", "num_clients=3", "clients_per_round=3", "rounds=3", "train.batch_size=64",
        "model=mlp", "model.hidden=[8]", "save_model=false", "engine.threads_per_worker=1")


def _run(*overrides: str, run_dir=None) -> tuple[torch.Tensor, list[dict]]:
    return run(*overrides, base=TINY, run_dir=run_dir)


def test_a_scheduled_run_resumes_to_the_uninterrupted_result(tmp_path):
    schedule = ("train.lr_schedule.name=cosine", "train.lr_schedule.warmup_rounds=1", "rounds=4",
                "checkpoint_every=2")
    whole, rows = _run(*schedule)
    constant, _ = _run("rounds=4")
    assert not torch.equal(whole, constant)
    exp = build(compose_config(*TINY, *schedule), tmp_path, reporter=StopAfter(3))
    try:
        with pytest.raises(KeyboardInterrupt):  # after round 3, checkpointed after round 2
            exp.simulation.run()
    finally:
        exp.engine.close()
    resumed, resumed_rows = _run(*schedule, run_dir=tmp_path)
    assert torch.equal(resumed, whole) and resumed_rows == rows


@pytest.mark.parametrize(("override", "message"), [
    ("train.lr_schedule.name=linear", "train.lr_schedule.name must be one of constant, step, cosine; got 'linear'"),
    ("train.lr_schedule.warmup_rounds=-1", "train.lr_schedule.warmup_rounds must be >= 0"),
    ("train.lr_schedule.gamma=0.5", "train.lr_schedule.gamma=0.5 has no effect in this run: a step schedule's"),
])
def test_bad_schedules_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace(".", "[.]").replace("(", r"\(")):
        build(compose_config(*TINY, override))
