"""DENSE and Co-Boosting maths (specs/oneshot.md, methods D and E) against hand computations.

Every loss, perturbation and weight update of ``DataFreeServer`` is recomputed here from the
card's formulas on tiny tensors, in float64, without the platform's helpers (``kd_loss``,
``combine_logits``, ``BNStatLoss``): the generator loss of both methods, which synthetic batch is
kept, Co-Boosting's ensemble reweighting and its diverse-sample (ODS) perturbation, and the
distillation loss at its temperature.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fl_platform.algorithms.base import Setup
from fl_platform.algorithms.oneshot.coboost import CoBoostConf
from fl_platform.algorithms.oneshot.datafree import BNStatLoss, DataFreeServer
from fl_platform.algorithms.oneshot.dense import DenseConf
from fl_platform.algorithms.oneshot.distill import LogitEnsemble
from fl_platform.algorithms.oneshot.protocol import build_module
from fl_platform.training.flat import FlatModel
from fl_platform.training.loop import TrainConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one torch thread (conftest)
SHAPE = (1, 8, 8)
C = 4  # classes
B = 12  # synthetic batch
LOW, HIGH = -1.0, 2.0  # the teachers' input range (a black and a white pixel)


class Tiny(nn.Module):
    """BN -> conv -> BN -> ReLU -> linear: two BatchNorm layers whose inputs the test can write down."""

    def __init__(self) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(1)
        self.conv = nn.Conv2d(1, 3, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(3)
        self.fc = nn.Linear(3 * 8 * 8, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(F.relu(self.bn2(self.conv(self.bn1(x)))).flatten(1))


def _setup() -> Setup:
    fm = FlatModel(Tiny())
    return Setup(Tiny, fm.num_params, fm.num_buffers, C, SHAPE, 3, 0, TrainConfig())


def _vector(setup: Setup, seed: int) -> torch.Tensor:
    """Random weights (scaled up so that the members disagree) and non-trivial BN running statistics."""
    g = torch.Generator().manual_seed(seed)
    slots = FlatModel(setup.model_fn()).slots
    params, buffers = [s for s in slots if s.is_param], [s for s in slots if not s.is_param]
    dense = torch.randn(sum(s.numel for s in params) + sum(s.numel for s in buffers), generator=g) * 0.3
    dense[sum(s.numel for s in params):] = torch.rand(sum(s.numel for s in buffers), generator=g) + 0.5
    vec = torch.zeros(setup.vector_size)  # the draws placed tensor by tensor (the layout pads between them)
    pos = 0
    for s in slots:  # running var (and mean) in [0.5, 1.5)
        vec[s.offset : s.offset + s.numel] = dense[pos : pos + s.numel]
        pos += s.numel
    return vec


def _server(cfg) -> tuple[DataFreeServer, list[nn.Module], nn.Module]:
    setup = _setup()
    server = DataFreeServer(replace(cfg, cache_dir=None, input_low=LOW, input_high=HIGH), setup, _vector(setup, 9))
    server.teachers = [_vector(setup, seed) for seed in (1, 2, 3)]
    server.sizes = [10.0, 10.0, 10.0]
    student = build_module(setup, _vector(setup, 4), "cpu").eval()
    return server, server.teacher_modules("cpu"), student


# ------------------------------------------------------------------ hand computations (float64)


def _bn_input_stats_term(m: Tiny, x: torch.Tensor) -> torch.Tensor:
    """sum over m's two BN layers of ||mu_batch - mu_run||_2 + ||var_batch - var_run||_2 (biased var)."""
    x = x.double()
    bn1_in = x
    bn1_out = F.batch_norm(x, m.bn1.running_mean.double(), m.bn1.running_var.double(), m.bn1.weight.double(),
                           m.bn1.bias.double(), False, 0.0, m.bn1.eps)
    bn2_in = F.conv2d(bn1_out, m.conv.weight.double(), m.conv.bias.double(), padding=1)
    total = torch.zeros((), dtype=torch.float64)
    for inp, bn in ((bn1_in, m.bn1), (bn2_in, m.bn2)):
        flat = inp.transpose(0, 1).reshape(inp.shape[1], -1)
        mean = flat.mean(1)
        var = ((flat - mean[:, None]) ** 2).mean(1)
        total = total + (mean - bn.running_mean.double()).norm() + (var - bn.running_var.double()).norm()
    return total


def _ensemble(teachers: list[nn.Module], x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    logits = torch.stack([t(x).double() for t in teachers])
    w = torch.ones(len(teachers), dtype=torch.float64) if w is None else w.double()
    return (w[:, None, None] * logits).sum(0) / w.sum()


def _kl_t(teacher: torch.Tensor, student: torch.Tensor, temp: float) -> torch.Tensor:
    """Per-sample T^2 KL(softmax(t / T) || softmax(s / T))."""
    p = torch.softmax(teacher.double() / temp, 1)
    return temp**2 * (p * (p.log() - torch.log_softmax(student.double() / temp, 1))).sum(1)


def _generator_loss(teachers, student, x, y, *, lam_oh, lam_bn, lam_adv, temp, masked, power, w=None):
    """L_G of the card: lam_oh mean((1 - p_y)^h CE) + lam_bn sum_BN(...) - lam_adv mean(KL_T * mask)."""
    with torch.no_grad():
        t = _ensemble(teachers, x, w)
        s = student(x).double()
        logp = torch.log_softmax(t, 1)
        ce = -logp[torch.arange(len(y)), y]
        focal = (1 - logp.exp()[torch.arange(len(y)), y]) ** power * ce
        mask = (t.argmax(1) != s.argmax(1)).double() if masked else torch.ones(len(y), dtype=torch.float64)
        bn = sum(_bn_input_stats_term(m, x) for m in teachers) if lam_bn else 0.0
        loss = lam_oh * focal.mean() + lam_bn * bn - lam_adv * (_kl_t(t, s, temp) * mask).mean()
    return float(loss), mask


class Scripted(nn.Module):
    """A 'generator' that emits fixed [0, 1] images, one batch per call, so each step's loss is known."""

    def __init__(self, images: list[torch.Tensor]) -> None:
        super().__init__()
        self.images = images
        self.calls = 0
        self.p = nn.Parameter(torch.zeros(()))  # something for Adam to hold

    def reset(self, gen: torch.Generator) -> None:
        self.calls = 0

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        out = self.images[self.calls] + 0.0 * (self.p + z.sum())
        self.calls += 1
        return out


def _candidates(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(B, *SHAPE, generator=g) ** (i + 1) for i in range(3)]  # three different batches


def _synthesize(server, teachers, student, images, weights=None, bn=None, seed=5):
    return server.synthesize(Scripted(images), LogitEnsemble(teachers), weights, student, bn,
                             torch.full((1, 1, 1), LOW), torch.full((1, 1, 1), HIGH),
                             torch.Generator().manual_seed(seed))


def _check_keeps_the_lowest_loss_batch(server, teachers, student, loss_fn, weights=None, bn=None):
    """Order three batches so the lowest loss is the middle one; the kept batch and cost must be it."""
    images = _candidates(0)
    _, y, _ = _synthesize(server, teachers, student, images, weights, bn)  # the labels come from the seed
    xs = [LOW + (HIGH - LOW) * im for im in images]
    losses = [loss_fn(x, y)[0] for x in xs]
    order = sorted(range(3), key=lambda i: losses[i])
    order = [order[1], order[0], order[2]]  # middle, lowest, highest: neither the first nor the last is kept
    best_x, y2, best_cost = _synthesize(server, teachers, student, [images[i] for i in order], weights, bn)
    assert torch.equal(y2, y)
    lo = losses[order[1]]
    assert min(abs(lo - losses[order[0]]), abs(lo - losses[order[2]])) > 1e-3 * abs(lo)  # distinct costs
    assert best_cost == pytest.approx(lo, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(best_x, xs[order[1]], rtol=0, atol=1e-6)
    return xs[order[1]], y


def test_dense_generator_loss_and_the_lowest_loss_batch():
    """DENSE (card D): CE + BN statistics over every BN of every client - KL_{T=1} where student and ensemble disagree."""
    cfg = DenseConf(g_steps=3, synthesis_batch_size=B, synthesis_augment=False, lambda_oh=0.7, lambda_bn=0.3,
                    lambda_adv=1.9)
    server, teachers, student = _server(cfg)
    bn = BNStatLoss(teachers)
    assert len(bn) == 6  # two BN layers in each of the three clients

    def loss_fn(x, y):
        return _generator_loss(teachers, student, x, y, lam_oh=0.7, lam_bn=0.3, lam_adv=1.9, temp=1.0,
                               masked=True, power=0)

    try:
        x, y = _check_keeps_the_lowest_loss_batch(server, teachers, student, loss_fn, bn=bn)
    finally:
        bn.close()
    _, mask = loss_fn(x, y)
    assert 0 < float(mask.sum()) < B  # the batch has agreeing and disagreeing samples: the mask matters


@pytest.mark.parametrize("power", [1.0, 2.0])
def test_coboost_generator_loss_is_focal_ce_minus_unmasked_kl_at_t3_on_the_weighted_ensemble(power):
    """Co-Boosting (card E1): (1 - p_y)^h CE - KL_{T=3}(f_w || s) over every sample, no BN term, f_w weighted."""
    cfg = CoBoostConf(g_steps=3, synthesis_batch_size=B, lambda_oh=0.7, lambda_adv=1.9, hard_sample_power=power)
    server, teachers, student = _server(cfg)
    weights = torch.tensor([0.2, 0.5, 0.3])

    def loss_fn(x, y):
        return _generator_loss(teachers, student, x, y, lam_oh=0.7, lam_bn=0.0, lam_adv=1.9, temp=3.0,
                               masked=False, power=power, w=weights)

    x, _ = _check_keeps_the_lowest_loss_batch(server, teachers, student, loss_fn, weights=weights)
    with torch.no_grad():  # a disagreement mask would change the loss on this batch
        t, s = _ensemble(teachers, x, weights), student(x)
    assert bool((t.argmax(1) == s.argmax(1)).any())


def test_coboost_reweighting_is_the_clipped_signed_gradient_step():
    """w <- clip(w - mu delta^e sign(d CE(f_w(x), y) / dw), 0, 1), f_w = sum w_k f_k / sum w_k, per pass."""
    cfg = CoBoostConf(kd_augment=False, kd_batch_size=64, reweight_steps=2)
    server, teachers, _ = _server(cfg)
    g = torch.Generator().manual_seed(6)
    pool_x = [LOW + (HIGH - LOW) * torch.rand(8, *SHAPE, generator=g) for _ in range(2)]
    x = torch.cat(pool_x)
    with torch.no_grad():
        y = teachers[0](x).argmax(1)  # labels the first member fits
        member = torch.stack([t(x).double() for t in teachers])
    pool_y = [y[:8], y[8:]]
    w0 = torch.tensor([0.996, 0.003, 0.5])
    epoch = 5
    step = 0.01 * 0.99**epoch
    want, clipped = w0.double(), False
    for _ in range(2):  # one signed step per pass over the (single-batch) pool
        wv = want.clone().requires_grad_()
        loss = F.cross_entropy((wv[:, None, None] * member).sum(0) / wv.sum(), y)
        (grad,) = torch.autograd.grad(loss, wv)
        free = want - step * grad.sign()
        want = free.clamp(0.0, 1.0)
        clipped |= bool((free != want).any())
    assert clipped  # the case exercises the clip to [0, 1]
    got = server.reweight(epoch, LogitEnsemble(teachers), w0, pool_x, pool_y, torch.full((1, 1, 1), LOW),
                          torch.Generator().manual_seed(0))
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


def test_coboost_diverse_sample_perturbation_and_distillation_loss_at_t4():
    """ODS (card E3): x <- x + eta sign(grad_x sum r * softmax(f_w(x) / 4)), r ~ U(-1, 1); then T^2 KL_{T=4}(f_w || s)."""
    cfg = CoBoostConf(kd_augment=False, kd_batch_size=64, kd_clip=None)
    server, teachers, student = _server(cfg)
    weights = torch.tensor([0.2, 0.5, 0.3])
    g = torch.Generator().manual_seed(7)
    pool_x = [LOW + (HIGH - LOW) * torch.rand(10, *SHAPE, generator=g)]
    seen: dict[str, torch.Tensor] = {}

    def record(module, inputs, output):
        seen["x"], seen["s"] = inputs[0].detach().clone(), output.detach().clone()

    handle = student.register_forward_hook(record)
    gen = torch.Generator().manual_seed(8)
    replay = torch.Generator().set_state(gen.get_state())  # the same draws, in the loop's order
    opt = torch.optim.SGD(student.parameters(), lr=0.0)
    kd = server.distill(LogitEnsemble(teachers), weights, student, opt, pool_x, torch.full((1, 1, 1), LOW), gen)
    handle.remove()
    # By hand: the shuffled batch, r, the input gradient and the signed step of 8/255.
    order = torch.randperm(10, generator=replay)
    xb = pool_x[0][order].clone().requires_grad_()
    r = torch.rand((10, C), generator=replay) * 2.0 - 1.0
    (grad,) = torch.autograd.grad((r.double() * torch.softmax(_ensemble(teachers, xb, weights) / 4.0, 1)).sum(), xb)
    assert bool((grad != 0).all())
    want = xb.detach() + (8.0 / 255.0) * grad.sign()
    torch.testing.assert_close(seen["x"], want, rtol=0, atol=1e-6)
    with torch.no_grad():
        t = _ensemble(teachers, want, weights)
    assert kd == pytest.approx(float(_kl_t(t, seen["s"], 4.0).mean()), rel=1e-5)
