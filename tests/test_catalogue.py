"""The standard catalogue (issue 29): FedAdam/FedYogi/FedAdagrad (``server_opt``), FedDyn, MOON, each
against a hand-computed step; buffers that no server step can corrupt; a non-finite test loss that
stops the run under ``engine.nonfinite=fail``."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fl_platform.algorithms.base import Setup
from fl_platform.algorithms.fedavg import FedAvgConf, FedAvgServer
from fl_platform.algorithms.feddyn import FedDynClient, FedDynConf, FedDynServer
from fl_platform.algorithms.moon import MoonHook, contrastive_loss
from fl_platform.algorithms.server_opt import ServerOptConf, ServerOptimizer
from fl_platform.core import Aggregate, Broadcast, RoundContext
from fl_platform.experiment import build
from fl_platform.rounds.simulation import is_timing_key
from fl_platform.training.flat import FlatModel
from fl_platform.training.hooks import Batch
from fl_platform.training.loop import ClientData, LocalTrainer, NonFiniteError, TrainConfig

from .conftest import compose_config, slot_mask

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BASE = ("num_clients=6", "clients_per_round=3", "rounds=2", "train.epochs=1", "train.batch_size=64", "save_model=false",
        "engine.threads_per_worker=1")
TINY = (*BASE, "model=mlp", "model.hidden=[8]")


def _setup(num_params: int, num_buffers: int, server_opt: ServerOptConf | None = None, num_clients: int = 4) -> Setup:
    return Setup(model_fn=lambda: nn.Linear(1, 1), num_params=num_params, num_buffers=num_buffers, num_classes=2,
                 input_shape=(1,), num_clients=num_clients, seed=0, train=TrainConfig(), server_opt=server_opt)


def _sum(*deltas: list[float]) -> Aggregate:
    agg = Aggregate()
    for d in deltas:
        agg.add({"delta": torch.tensor(d)}, {"n": 1.0, "clients": 1.0})
    return agg


CTX = RoundContext(round=0, seed=0, clients=(0, 1), num_rounds=1, num_clients=4)

# ---------------------------------------------------------------- server optimisers

# One step from m = [0.2, -0.1], v = [0.9, 0.01] with Delta = [0.5, 0.2] (Delta^2 = [0.25, 0.04]):
# v - Delta^2 = [0.65, -0.03] has both signs, so Yogi's v moves down in one coordinate and up in the other.
#   adagrad: v = v + Delta^2                          = [1.15, 0.05]
#   yogi:    v = v - 0.01 Delta^2 sign(v - Delta^2)  = [0.9 - 0.0025, 0.01 + 0.0004] = [0.8975, 0.0104]
#   adam:    v = 0.99 v + 0.01 Delta^2                = [0.891 + 0.0025, 0.0099 + 0.0004] = [0.8935, 0.0103]
# m = 0.9 m + 0.1 Delta = [0.23, -0.07]; step = lr m / (sqrt(v) + tau), lr = 0.1, tau = 1e-3.
HAND_V = {"adagrad": [1.15, 0.05], "yogi": [0.8975, 0.0104], "adam": [0.8935, 0.0103]}


@pytest.mark.parametrize("name", ["adam", "yogi", "adagrad"])
def test_server_optimiser_one_step_matches_the_paper_by_hand(name):
    opt = ServerOptimizer(ServerOptConf(name=name, lr=0.1, beta1=0.9, beta2=0.99, tau=1e-3), 2)
    assert torch.equal(opt.v, torch.full((2,), 1e-6))  # v starts at tau^2 (Algorithm 2: v_{-1} >= tau^2)
    opt.m, opt.v = torch.tensor([0.2, -0.1]), torch.tensor([0.9, 0.01])
    step = opt.step(torch.tensor([0.5, 0.2]))
    m = [0.23, -0.07]
    assert opt.m.tolist() == pytest.approx(m, abs=1e-7)
    assert opt.v.tolist() == pytest.approx(HAND_V[name], abs=1e-7)
    expected = [0.1 * mi / (math.sqrt(vi) + 1e-3) for mi, vi in zip(m, HAND_V[name])]
    assert step.tolist() == pytest.approx(expected, rel=1e-6)


def test_server_optimiser_steps_parameters_and_averages_buffers():
    """2 parameters, 1 buffer (a running variance): Adam moves the parameters by its step; the buffer
    takes the clients' mean exactly, whatever the step would have done to it."""
    w0 = torch.tensor([1.0, -1.0, 0.5])
    server = FedAvgServer(FedAvgConf(), _setup(2, 1, ServerOptConf(name="adam", lr=1.0)), w0)
    server.aggregate(CTX, _sum([0.4, 0.2, -0.3], [0.0, 0.2, -0.1]))
    # first step: m = 0.1 Delta, v = 0.99 tau^2 + 0.01 Delta^2, Delta = [0.2, 0.2]
    v = 0.99e-6 + 0.01 * 0.04
    step = 0.1 * 0.2 / (math.sqrt(v) + 1e-3)
    assert server.weights.tolist() == pytest.approx([1.0 + step, -1.0 + step, 0.5 - 0.2], abs=1e-6)
    assert set(server.state_dict()["server_opt"]) == {"m", "v"}


def test_server_optimiser_state_is_checkpointed():
    """A server resumed from state_dict() takes the next step exactly as the uninterrupted one."""
    conf = ServerOptConf(name="yogi", lr=0.1)
    first = FedAvgServer(FedAvgConf(), _setup(2, 1, conf), torch.tensor([1.0, -1.0, 0.5]))
    first.aggregate(CTX, _sum([0.4, 0.2, -0.3], [0.0, 0.2, -0.1]))
    resumed = FedAvgServer(FedAvgConf(), _setup(2, 1, conf), torch.zeros(3))
    resumed.load_state_dict(first.state_dict())
    for server in (first, resumed):
        server.aggregate(CTX, _sum([0.1, -0.3, 0.2], [0.3, 0.1, 0.0]))
    assert torch.equal(first.weights, resumed.weights)


def test_a_checkpoint_of_another_vector_length_is_refused_by_name():
    """A checkpoint written before the flat vector's tensors were 16-byte aligned (or for another
    model) is refused at resume with both lengths, not at the first copy into the model."""
    server = FedAvgServer(FedAvgConf(), _setup(2, 1), torch.zeros(4))
    old = FedAvgServer(FedAvgConf(), _setup(2, 1), torch.ones(3)).state_dict()
    with pytest.raises(ValueError, match=r"has 3 elements, this run's model 4.*16-byte aligned"):
        server.load_state_dict(old)
    assert torch.equal(server.weights, torch.zeros(4))


def test_no_server_step_scales_the_buffers():
    """FedAvgM with server_lr = 3: the parameters take the momentum step, the running variance the
    clients' mean (scaled by 3 it would be 0.5 - 3 * 0.6 < 0: NaN in every BatchNorm)."""
    w0 = torch.tensor([1.0, 0.5])
    server = FedAvgServer(FedAvgConf(server_lr=3.0, server_momentum=0.9), _setup(1, 1), w0)
    server.aggregate(CTX, _sum([0.1, -0.6]))
    server.aggregate(CTX, _sum([0.1, 0.2]))
    assert server.weights.tolist() == pytest.approx([1.0 + 3 * 0.1 + 3 * (0.9 * 0.1 + 0.1), 0.5 - 0.6 + 0.2])


def test_server_opt_on_a_batchnorm_model_keeps_running_variances_positive():
    overrides = (*BASE, "model=cnn", "model.channels=[2,2]", "model.hidden=4", "model.norm=batch",
                 "server_opt=adam", "server_opt.lr=3.0")
    exp = build(compose_config(*overrides))
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    fm = exp.simulation.eval_model
    fm.load(exp.simulation.server.weights)
    variances = [b for name, b in fm.model.named_buffers() if name.endswith("running_var")]
    assert variances and all(bool((v > 0).all()) for v in variances)
    assert math.isfinite(exp.simulation.history[-1]["test_loss"])


@pytest.mark.parametrize(("overrides", "message"), [
    (("algorithm=fusefl", "server_opt=adam"), "server_opt=adam needs a server step on a pseudo-gradient"),
    (("algorithm=feddyn", "server_opt=yogi"), "algorithm=feddyn has none"),
    (("server_opt=adam", "algorithm.server_lr=0.5"), "algorithm.server_lr=0.5 has no effect"),
    (("server_opt=adam", "algorithm.server_momentum=0.9"), "algorithm.server_momentum=0.9 has no effect"),
    (("server_opt=adagrad", "server_opt.beta2=0.5"), "server_opt.beta2=0.5 has no effect"),
    (("server_opt.lr=0.5",), "server_opt.lr=0.5 has no effect in this run: server_opt=none"),
    (("server_opt=yogi", "server_opt.tau=0"), "server_opt.tau must be > 0"),
])
def test_server_opt_misuse_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        build(compose_config(*TINY, *overrides))


# ---------------------------------------------------------------- FedDyn


def test_feddyn_server_h_and_model_by_hand():
    """m = 4 clients, alpha = 0.1, 2 parameters + 1 buffer; two rounds of two clients each."""
    w0 = torch.tensor([1.0, 2.0, 0.5])
    server = FedDynServer(FedDynConf(alpha=0.1), _setup(2, 1, num_clients=4), w0)
    server.aggregate(CTX, _sum([0.4, -0.2, 0.1], [0.2, 0.0, -0.3]))
    h1 = [-0.1 / 4 * 0.6, -0.1 / 4 * -0.2]  # h - alpha/m sum(theta_k - w)
    assert server.h.tolist() == pytest.approx(h1, abs=1e-7)
    w1 = [1.0 + 0.3 - h1[0] / 0.1, 2.0 - 0.1 - h1[1] / 0.1, 0.5 - 0.1]  # mean(theta_k) - h / alpha; buffer: mean
    assert server.weights.tolist() == pytest.approx(w1, abs=1e-6)
    server.aggregate(CTX, _sum([0.1, 0.1, 0.0], [-0.3, 0.1, 0.2]))
    h2 = [h1[0] - 0.1 / 4 * -0.2, h1[1] - 0.1 / 4 * 0.2]
    assert server.h.tolist() == pytest.approx(h2, abs=1e-7)
    assert server.weights.tolist() == pytest.approx(
        [w1[0] - 0.1 - h2[0] / 0.1, w1[1] + 0.1 - h2[1] / 0.1, w1[2] + 0.1], abs=1e-6)


def test_feddyn_client_linear_term_and_state_by_hand():
    """One full-batch SGD step from w with state g: theta = w - lr (grad L(w) - g) (the proximal term is
    zero at w), and the new state is g - alpha (theta - w)."""
    torch.manual_seed(0)
    fm = FlatModel(nn.Linear(3, 2))
    x, y = torch.randn(8, 3), torch.tensor([0, 1] * 4)
    w = fm.vector.detach().clone()
    nn.functional.cross_entropy(fm.model(x), y).backward()
    grad = fm.grad.clone()  # (in the flat layout: weight 6 + 2 padding, bias 2 + 2)
    cfg = TrainConfig(epochs=None, steps=1, batch_size=8, lr=0.5)
    trainer = LocalTrainer(fm, cfg)
    setup = _setup(fm.num_params, 0)
    client = FedDynClient(FedDynConf(alpha=0.1), setup)
    g = torch.where(slot_mask(fm)[: fm.num_params], torch.linspace(-1, 1, fm.num_params), 0.0)  # (a state is zero in the alignment padding)
    ctx = RoundContext(round=0, seed=0, clients=(0,), num_rounds=1, num_clients=4)
    update = client.train(ctx, 0, Broadcast({"weights": w}), {"grad_prev": g}, ClientData(x, y, torch.arange(8)),
                          trainer)
    theta = w - 0.5 * (grad - g)
    assert update.tensors["delta"] == pytest.approx(theta - w, abs=1e-6)
    assert update.state["grad_prev"] == pytest.approx(g - 0.1 * (theta - w), abs=1e-6)
    assert update.weights == {"clients": 1.0}


def test_feddyn_trains_vectorised_as_sequentially():
    """Its two terms are gradient corrections with a functional form: the cohort path gives the same model."""
    weights = []
    for cohort in ("1", "auto"):
        exp = build(compose_config(*TINY, "algorithm=feddyn", f"engine.cohort_size={cohort}"))
        try:
            exp.simulation.run()
        finally:
            exp.engine.close()
        weights.append(exp.simulation.server.weights)
    assert float((weights[0] - weights[1]).abs().max()) <= 1e-6


# ---------------------------------------------------------------- MOON


def test_moon_contrastive_loss_on_hand_built_representations():
    """tau = 0.5. Sample 1: sim(z, z_glob) = 1, sim(z, z_prev) = 0: -log(e^2 / (e^2 + e^0)) = log(1 + e^-2).
    Sample 2: sim(z, z_glob) = 0, sim(z, z_prev) = 1/sqrt(2): log(1 + e^{sqrt 2})."""
    z = torch.tensor([[1.0, 0.0], [2.0, 0.0]])
    z_glob = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
    z_prev = torch.tensor([[0.0, 1.0], [1.0, 1.0]])
    expected = (math.log(1 + math.exp(-2)) + math.log(1 + math.exp(math.sqrt(2)))) / 2
    assert float(contrastive_loss(z, z_glob, z_prev, 0.5)) == pytest.approx(expected, rel=1e-6)


class _Staged(nn.Module):
    def __init__(self, weight: list[list[float]]) -> None:
        super().__init__()
        self.body = nn.Linear(2, 2, bias=False)
        self.head = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.body.weight.copy_(torch.tensor(weight))
            self.head.weight.copy_(torch.eye(2))

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_moon_hook_adds_mu_times_the_contrastive_loss_on_the_models_features():
    x, y = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])
    model, glob, prev = _Staged([[1, 0], [0, 1]]), _Staged([[1, 1], [0, 1]]), _Staged([[0, 1], [1, 0]])
    loss, logits = MoonHook(2.0, 0.5, glob, prev).loss(model, Batch(x, y, 0, 0))
    ce = float(nn.functional.cross_entropy(x, y))  # body and head are the identity: the logits are x
    # z = x; z_glob = [1, 0], [1, 1]; z_prev = [0, 1], [1, 0]: cosines (1, 0) and (1/sqrt 2, 0), tau = 0.5
    con = (math.log(1 + math.exp(-2)) + math.log(1 + math.exp(-math.sqrt(2)))) / 2
    assert float(loss) == pytest.approx(ce + 2.0 * con, rel=1e-6)
    assert torch.equal(logits, model.head(model.features(x)))


def test_moon_first_round_term_is_constant_and_later_rounds_pull_apart():
    """A client seen for the first time compares against the global model twice: l_con = log 2 and MOON
    trains exactly as FedAvg in round 1 (same model); from round 2 on the states differ and so do the models."""
    runs = {}
    for alg in ("fedavg", "moon"):
        exp = build(compose_config(*TINY, "num_clients=3", f"algorithm={alg}", "rounds=1"))
        try:
            exp.simulation.run()
        finally:
            exp.engine.close()
        runs[alg] = exp.simulation.server.weights.clone()
    assert torch.allclose(runs["fedavg"], runs["moon"], atol=1e-6)
    two = build(compose_config(*TINY, "num_clients=3", "algorithm=moon", "rounds=2"))
    fedavg = build(compose_config(*TINY, "num_clients=3", "algorithm=fedavg", "rounds=2"))
    for exp in (two, fedavg):
        try:
            exp.simulation.run()
        finally:
            exp.engine.close()
    assert not torch.allclose(two.simulation.server.weights, fedavg.simulation.server.weights, atol=1e-4)


# ---------------------------------------------------------------- non-finite test loss


def test_a_non_finite_test_loss_stops_the_run_under_nonfinite_fail():
    """server_lr = 1e38 makes the global model infinite after round 1: its test loss is NaN. Under
    engine.nonfinite=fail the run stops naming it (before the row is written); under skip it is logged
    and the run carries on."""
    overrides = (*TINY, "rounds=1", "algorithm.server_lr=1e38")
    exp = build(compose_config(*overrides))
    try:
        with pytest.raises(NonFiniteError, match=r"round 1: the global model's test_(loss|accuracy) is nan"):
            exp.simulation.run()
    finally:
        exp.engine.close()
    assert exp.simulation.history == []
    exp = build(compose_config(*overrides, "engine.nonfinite=skip"))
    try:
        summary = exp.simulation.run()
    finally:
        exp.engine.close()
    assert summary["rounds"] == 1 and math.isnan(summary["final_test_loss"])


# ---------------------------------------------------------------- on Ray


@pytest.mark.ray
def test_feddyn_and_moon_state_travels_on_ray(ray_session):
    """Per-client state (FedDyn's gradient, MOON's previous model) on 2 Ray workers equals inline."""
    def run(*overrides: str):
        exp = build(compose_config(*TINY, "num_clients=4", "clients_per_round=2", "rounds=3", *overrides))
        try:
            exp.simulation.run()
        finally:
            exp.engine.close()
        rows = [{k: v for k, v in r.items() if not is_timing_key(k)} for r in exp.simulation.history]
        return exp.simulation.server.weights.clone(), rows

    for alg in ("feddyn", "moon"):
        w_inline, rows_inline = run(f"algorithm={alg}")
        w_ray, rows_ray = run(f"algorithm={alg}", "engine=ray", "engine.num_workers=2")
        assert float((w_inline - w_ray).abs().max()) <= 1e-6, alg
        assert [r["test_accuracy"] for r in rows_inline] == pytest.approx([r["test_accuracy"] for r in rows_ray])
