"""Fed-ADI (Adaptive DeepInversion of the client ensemble) against hand computations, on the tiny BN
teachers of test_oneshot_datafree.py: the loss of a synthesis step term by term (the BN-statistics term
alone, then every term), and that optimising the inputs moves them toward their target classes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fl_platform.algorithms.oneshot.adi import AdiConf, AdiServer
from fl_platform.algorithms.oneshot.datafree import BNStatLoss
from fl_platform.algorithms.oneshot.distill import LogitEnsemble
from fl_platform.algorithms.oneshot.protocol import build_module
from fl_platform.experiment import build

from .conftest import compose_config
from .test_oneshot_datafree import HIGH, LOW, SHAPE, B, C, _bn_input_stats_term, _ensemble, _setup, _vector

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _server(**kw):
    setup = _setup()
    cfg = replace(AdiConf(), cache_dir=None, input_low=LOW, input_high=HIGH, synthesis_batch_size=B, **kw)
    server = AdiServer(cfg, setup, _vector(setup, 9))
    server.teachers = [_vector(setup, seed) for seed in (1, 2, 3)]
    server.sizes = [10.0, 10.0, 10.0]
    student = build_module(setup, _vector(setup, 4), "cpu").eval()
    return server, server.teacher_modules("cpu"), student


def _synthesize(server, teachers, student, seed=5):
    bn = BNStatLoss(teachers) if server.cfg.lambda_bn else None
    try:
        return server.synthesize(None, LogitEnsemble(teachers), None, student, bn, torch.full((1, 1, 1), LOW),
                                 torch.full((1, 1, 1), HIGH), torch.Generator().manual_seed(seed))
    finally:
        if bn is not None:
            bn.close()


def _first_batch(seed=5) -> torch.Tensor:
    """The batch the first step sees: N(0, I) from the epoch's generator, clamped to the input range."""
    return torch.randn(B, *SHAPE, generator=torch.Generator().manual_seed(seed)).clamp(LOW, HIGH)


def _tv(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    diffs = (x[..., :, 1:] - x[..., :, :-1], x[..., 1:, :] - x[..., :-1, :], x[..., 1:, :-1] - x[..., :-1, 1:],
             x[..., 1:, 1:] - x[..., :-1, :-1])
    return sum(d.pow(2).sum().sqrt() for d in diffs)


def _one_minus_js(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """1 - [KL(M || P) + KL(M || Q)] / 2 per batch at T = 3, with P, Q, M clamped to [0.01, 0.99]."""
    p, q = torch.softmax(s.double() / 3, 1), torch.softmax(t.double() / 3, 1)
    m = (0.5 * (p + q)).clamp(0.01, 0.99)
    p, q = p.clamp(0.01, 0.99), q.clamp(0.01, 0.99)
    js = 0.5 * ((m * (m.log() - p.log())).sum() + (m * (m.log() - q.log())).sum()) / len(s)
    return 1 - js.clamp(0, 1)


def test_bn_statistics_term_is_every_clients_mean_and_variance_distance():
    server, teachers, student = _server(di_steps=1, jitter=0, lambda_oh=0.0, lambda_bn=1.0, lambda_tv=0.0,
                                        lambda_adi=0.0)
    x0 = _first_batch()
    best_x, _, cost = _synthesize(server, teachers, student)
    torch.testing.assert_close(best_x, x0, rtol=0, atol=0)  # one step: the kept batch is the initial one
    hand = float(sum(_bn_input_stats_term(m, x0) for m in teachers))
    assert hand > 1.0
    assert cost == pytest.approx(hand, rel=1e-5)


@pytest.mark.parametrize("jitter", [0, 2])
def test_loss_of_a_step_is_ce_bn_tv_l2_and_the_competition_term(jitter):
    lams = dict(lambda_oh=0.7, lambda_bn=0.3, lambda_tv=0.05, lambda_l2=0.02, lambda_adi=0.9)
    server, teachers, student = _server(di_steps=1, jitter=jitter, **lams)
    g = torch.Generator().manual_seed(5)  # the epoch's draws in order: the batch, then the step's roll
    x0 = torch.randn(B, *SHAPE, generator=g).clamp(LOW, HIGH)
    if jitter:
        dy, dx = torch.randint(-jitter, jitter + 1, (2,), generator=g).tolist()
        assert (dy, dx) != (0, 0)
        x0 = torch.roll(x0, shifts=(dy, dx), dims=(2, 3))  # the teachers see the rolled batch
    _, y, cost = _synthesize(server, teachers, student)
    assert y.tolist() == [i % C for i in range(B)]  # DeepInversion's cycling targets
    with torch.no_grad():
        t = _ensemble(teachers, x0, None)
        terms = {"lambda_oh": torch.nn.functional.cross_entropy(t, y),
                 "lambda_bn": sum(_bn_input_stats_term(m, x0) for m in teachers),
                 "lambda_tv": _tv(x0), "lambda_l2": x0.double().pow(2).sum().sqrt(),
                 "lambda_adi": _one_minus_js(student(x0), t)}
    assert 0 < float(terms["lambda_adi"]) < 1
    hand = sum(lams[k] * float(v) for k, v in terms.items())
    assert cost == pytest.approx(hand, rel=1e-5)


@pytest.mark.parametrize("terms", [
    dict(jitter=0, lambda_bn=0.0, lambda_tv=0.0, lambda_adi=0.0),  # the CE alone
    dict(jitter=2, lambda_bn=0.01, lambda_tv=1e-4, lambda_adi=0.2),  # with jitter, the priors and the competition
])
def test_synthesis_moves_the_inputs_toward_their_target_classes(terms):
    server, teachers, student = _server(di_steps=100, di_lr=0.1, **terms)
    x0 = _first_batch()
    x, y, _ = _synthesize(server, teachers, student)
    with torch.no_grad():
        t0, t1 = _ensemble(teachers, x0, None), _ensemble(teachers, x, None)
    p0, p1 = (torch.softmax(t, 1)[torch.arange(B), y] for t in (t0, t1))
    assert bool((p1 > p0).all())  # every sample's target class gained
    assert float((t0.argmax(1) == y).double().mean()) < 0.5
    if not terms["jitter"]:
        assert bool((t1.argmax(1) == y).all())  # the ensemble now labels every input with its target
    assert float(x.min()) >= LOW and float(x.max()) <= HIGH  # kept inside the teachers' input range


def test_refuses_inputs_it_cannot_synthesise():
    base = ("algorithm=oneshot_adi", "rounds=1", "num_clients=3", "clients_per_round=3", "algorithm.cache_dir=null",
            "save_model=false")
    with pytest.raises(ValueError, match="oneshot_adi synthesises"):
        build(compose_config(*base, "model=mlp", "model.hidden=[8]", "dataset=synthetic"))
    with pytest.raises(ValueError, match=r"algorithm\.jitter=8"):
        build(compose_config(*base, "model=cnn", "model.channels=[2,2]", "model.hidden=4", "algorithm.jitter=8"))
