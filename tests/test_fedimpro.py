"""FedImpro: the statistics maths, the split forward, and runs through the real experiment path."""

from __future__ import annotations

import math
import sys

import pytest
import torch
import torch.nn.functional as F

from fl_platform.algorithms.fedimpro import (
    ClassStats,
    FedImproConf,
    FedImproHook,
    SplitInfo,
    combine_label_size,
    default_split,
    label_size_contribution,
    loss_weights,
    privatise,
    split_info,
)
from fl_platform.core import Aggregate
from fl_platform.experiment import build
from fl_platform.models import build_model
from fl_platform.rounds.sampling import sample_clients
from fl_platform.rounds.simulation import is_timing_key
from fl_platform.training.hooks import Batch

from .conftest import REPO, compose_config

C, D = 4, 6


def _client_features(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three clients with different class sets and feature distributions (client 2 lacks class 3)."""
    g = torch.Generator().manual_seed(seed)
    clients = []
    for k, (n, classes) in enumerate([(40, [0, 1, 2, 3]), (25, [1, 3]), (33, [0, 1, 2])]):
        y = torch.tensor(classes)[torch.randint(0, len(classes), (n,), generator=g)]
        h = torch.randn(n, D, generator=g) * (1 + k) + 3.0 * k + y[:, None].float()
        clients.append((h, y))
    return clients


def _accumulate(stats: ClassStats, h: torch.Tensor, y: torch.Tensor, batch: int = 7) -> None:
    for start in range(0, h.shape[0], batch):
        stats.update(h[start : start + batch], y[start : start + batch])


def test_label_size_aggregation_equals_central_statistics_of_the_union():
    prev_mu, prev_sigma = torch.rand(C + 1, D), torch.full((C + 1, D), 0.1)  # class 4: nobody has it
    partial = [Aggregate(), Aggregate()]  # two workers' local sums, reduced as the engine does
    for k, (h, y) in enumerate(_client_features()):
        stats = ClassStats("exact", prev_mu, prev_sigma, sigma_max=0.1)  # the clip never touches estimates
        _accumulate(stats, h, y)
        mu, sigma = stats.mean_std(unbiased=False, dtype=torch.float64)
        partial[k % 2].add(label_size_contribution(mu, sigma, stats.count), {"clients": 1.0})
    agg = Aggregate.reduce(partial)
    mu, sigma = combine_label_size(agg.tensors["fedimpro_sum"], agg.tensors["fedimpro_sumsq"],
                                   agg.tensors["fedimpro_count"], prev_mu, prev_sigma)
    h_all = torch.cat([h for h, _ in _client_features()]).double()
    y_all = torch.cat([y for _, y in _client_features()])
    for c in range(C):
        feats = h_all[y_all == c]
        torch.testing.assert_close(mu[c].double(), feats.mean(0), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(sigma[c].double(), feats.std(0, unbiased=False), rtol=1e-5, atol=1e-5)
    assert torch.equal(mu[C], prev_mu[C]) and torch.equal(sigma[C], prev_sigma[C])
    assert float(sigma.max()) > 0.1  # the union's spread is not clipped


def test_uniform_aggregation_averages_client_estimates_with_the_global_for_absent_classes():
    prev_mu, prev_sigma = torch.rand(C, D), torch.full((C, D), 0.1)
    agg = Aggregate()
    estimates = []
    for h, y in _client_features():
        stats = ClassStats("exact", prev_mu, prev_sigma, sigma_max=0.1)
        _accumulate(stats, h, y)
        mu, sigma = stats.mean_std()
        estimates.append((mu, sigma))
        agg.add({"fedimpro_mu": mu, "fedimpro_sigma": sigma}, {"clients": 1.0})
        present = torch.bincount(y, minlength=C) > 0
        assert torch.equal(mu[~present], prev_mu[~present])  # absent classes upload the global values
        for c in torch.nonzero(present).flatten().tolist():
            if int((y == c).sum()) >= 2:
                torch.testing.assert_close(sigma[c], h[y == c].std(0))  # unbiased, as the reference
    mean_mu = torch.stack([m for m, _ in estimates]).mean(0)
    torch.testing.assert_close((agg.tensors["fedimpro_mu"] / 3).float(), mean_mu)


def test_last_batch_mode_keeps_the_last_minibatch_statistics_and_clips():
    """D >= 5000: the reference's weight min(1, D / 5000) is 1, so the last minibatch's statistics."""
    d = 5000
    mu0, sigma0 = torch.zeros(C, d), torch.full((C, d), 0.1)
    stats = ClassStats("last_batch", mu0, sigma0, sigma_max=0.1)
    h1, y1 = torch.randn(8, d) * 5, torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])
    h2, y2 = torch.randn(4, d) * 5 + 1, torch.tensor([0, 0, 0, 1])
    stats.update(h1, y1)
    stats.update(h2, y2)
    mu, sigma = stats.mean_std()
    torch.testing.assert_close(mu[0], h2[:3].mean(0))
    torch.testing.assert_close(mu[1], h2[3])  # one sample: the mean moves, the std is kept
    torch.testing.assert_close(mu[2], h1[5:].mean(0))
    torch.testing.assert_close(sigma[0], h2[:3].std(0).clamp(max=0.1))
    assert torch.equal(mu[3], mu0[3]) and float(sigma.max()) <= float(torch.tensor(0.1))


def test_last_batch_mode_is_the_reference_running_average_with_weight_d_over_5000():
    """D < 5000: mu <- (1 - a) mu + a m, sigma <- (1 - a) sigma + a s with a = D / 5000, then clipped."""
    d, sigma_max = 1000, 0.5
    a = d / 5000
    g = torch.Generator().manual_seed(3)
    mu0, sigma0 = torch.randn(C, d, generator=g), torch.full((C, d), 0.3)
    stats = ClassStats("last_batch", mu0, sigma0, sigma_max=sigma_max)
    batches = [(torch.randn(6, d, generator=g) * 2 + 1, torch.tensor([0, 0, 0, 1, 2, 2])),
               (torch.randn(5, d, generator=g) * 3, torch.tensor([0, 0, 2, 2, 2]))]
    mu, sigma = mu0.clone(), sigma0.clone()
    for h, y in batches:
        stats.update(h, y)
        for c in y.unique().tolist():
            rows = h[y == c]
            mu[c] = (1 - a) * mu[c] + a * rows.mean(0)
            if len(rows) >= 2:
                sigma[c] = (1 - a) * sigma[c] + a * rows.std(0)
        sigma = sigma.clamp(max=sigma_max)
    got_mu, got_sigma = stats.mean_std()
    torch.testing.assert_close(got_mu, mu)
    torch.testing.assert_close(got_sigma, sigma)
    assert not torch.allclose(got_mu[0], batches[1][0][:2].mean(0), atol=0.1)  # not the last batch


def test_privacy_noise_keeps_sigma_non_negative():
    mu, sigma = torch.zeros(C, D), torch.full((C, D), 0.01)
    noisy_mu, noisy_sigma = privatise(mu, sigma, 1.0, False, 0, 1)
    assert float(noisy_sigma.min()) >= 0.0 and float(noisy_mu.std()) > 0.5
    assert privatise(mu, sigma, 0.0, False, 0, 1) == (mu, sigma)


def test_a_deployed_clients_statistics_noise_is_not_derivable_from_the_seed():
    """Every client is sent the run's seed: seeded noise on the uploaded statistics could be regenerated and
    subtracted by anyone (an audit recovered the per-class means to 1e-7). In a ClientApp (Setup.secure_noise)
    the noise comes from the node's OS CSPRNG: the same (seed, round, client) twice gives other noise, with
    the configured std; the simulator's stays seeded."""
    mu, sigma = torch.zeros(200, 100, dtype=torch.float64), torch.full((200, 100), 5.0, dtype=torch.float64)
    seeded = [privatise(mu, sigma, 0.5, False, 3, 4, 5)[0] for _ in range(2)]
    assert torch.equal(seeded[0], seeded[1])
    secure = [privatise(mu, sigma, 0.5, True, 3, 4, 5)[0] for _ in range(2)]
    assert not torch.equal(secure[0], secure[1]) and not torch.equal(secure[0], seeded[0])
    assert float(secure[0].std()) == pytest.approx(0.5, rel=0.02)
    from fl_platform.flower import config as fc
    from fl_platform.flower.client_app import build_runtime

    rc = fc.flatten_config(fc.compose(["algorithm=fedimpro", "model=cnn", "num_clients=3", "clients_per_round=3",
                                       "algorithm.privacy_noise_std=0.001", "logger.progress=false"]),
                           fc.DeployConf(round_timeout=5.0, poll_interval=0.01, connect_timeout=5.0))
    assert build_runtime(rc, {"partition-id": 0, "num-partitions": 3}).client.setup.secure_noise


def test_weight_schedules_follow_the_reference():
    cfg = FedImproConf(weight_max_rounds=500)
    assert loss_weights(cfg, 0) == (1.0, 0.0)
    assert loss_weights(cfg, 250) == (1.0, 0.5)
    assert loss_weights(cfg, 1000) == (1.0, 2.0)  # gradual2half is not capped
    assert loss_weights(FedImproConf(weight_schedule="gradual", weight_max_rounds=10), 5) == (0.5, 0.5)
    assert loss_weights(FedImproConf(weight_schedule="gradualhalfhalf", weight_max_rounds=10), 10) == (0.5, 0.5)
    assert loss_weights(FedImproConf(weight_schedule="constant", constant_weight=0.3), 7) == (1.0, 0.3)


def test_default_split_points():
    cnn = build_model("cnn", (1, 28, 28), 10)
    assert default_split(cnn) == "conv2"
    assert split_info(cnn, "auto") == SplitInfo(1, (64, 7, 7))
    assert split_info(build_model("mlp", (1, 8, 8), 10, hidden=[32, 16]), "auto") == SplitInfo(1, (32,))
    resnet = build_model("resnet18", (3, 32, 32), 10, width=8)
    assert default_split(resnet) == "layer2"
    assert split_info(resnet, "auto").feature_shape == (16, 16, 16)  # 128 x 16 x 16 at width 64
    with pytest.raises(ValueError, match="no high-level part"):
        split_info(cnn, "head")
    with pytest.raises(ValueError, match="unknown stage"):
        split_info(cnn, "layer9")


def _hook(model, split, w_fake: float = 1.0, local: bool = False) -> FedImproHook:
    mu, sigma = torch.rand(10, split.dim), torch.full((10, split.dim), 0.1)
    stats = ClassStats("exact", mu, sigma, 0.1)
    return FedImproHook(split, mu, sigma, stats, (1.0, w_fake), torch.Generator().manual_seed(0), 0.1, local)


def test_sampled_features_carry_no_gradient_into_the_low_part():
    torch.manual_seed(0)
    model = build_model("cnn", (1, 28, 28), 10)
    split = split_info(model, "auto")
    low = [p for name, p in model.named_parameters() if name.startswith(("stages.conv1", "stages.conv2"))]
    high = [p for name, p in model.named_parameters() if not name.startswith(("stages.conv1", "stages.conv2"))]
    batch = Batch(torch.randn(12, 1, 28, 28), torch.randint(0, 10, (12,)), 0, 0)
    hook = _hook(model, split)
    h_fake, y_fake = hook.sample(12)
    assert not h_fake.requires_grad and h_fake.shape == (20, 64, 7, 7)  # R = 12 // 10 + 1 = 2 per class
    assert torch.equal(y_fake, torch.arange(10).repeat(2))
    _, fake, y_fake, _ = hook.forward(model, batch)
    fake_grads = torch.autograd.grad(F.cross_entropy(fake, y_fake), low + high, allow_unused=True)
    assert all(g is None or float(g.abs().max()) == 0.0 for g in fake_grads[: len(low)])
    assert any(g is not None and float(g.abs().max()) > 0 for g in fake_grads[len(low):])
    # the full loss gives the low part exactly the real term's gradient, whatever lambda is
    grads = []
    for w_fake in (0.0, 5.0):
        loss, _ = _hook(model, split, w_fake).loss(model, batch)
        grads.append(torch.autograd.grad(loss, low))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_sample_from_local_follows_the_clients_running_statistics():
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 10, hidden=[16, 8])
    split = split_info(model, "auto")
    hook = _hook(model, split, local=True)
    hook.stats.update(torch.full((4, split.dim), 50.0), torch.tensor([3, 3, 3, 3]))
    feats, labels = hook.sample(9)
    assert float(feats[labels == 3].mean()) == pytest.approx(50.0, abs=1e-4)  # sigma of a constant is 0
    assert float(feats[labels != 3].max()) < 2.0


def _run(*overrides: str):
    exp = build(compose_config("algorithm=fedimpro", "model=cnn", "rounds=2", "num_clients=10",
                               "clients_per_round=4", "train.epochs=1", "engine.threads_per_worker=1", *overrides))
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    rows = [{k: v for k, v in row.items() if not is_timing_key(k)} for row in exp.simulation.history]
    return exp, rows


def test_round_statistics_equal_the_central_statistics_of_the_sampled_clients():
    """With a (numerically) frozen model, one label-size round yields the exact stats of g(x) on the union."""
    exp, _ = _run("rounds=1", "algorithm.aggregation=label_size", "train.lr=1e-30", "partition.alpha=0.3")
    server = exp.simulation.server
    clients = sample_clients(exp.cfg.seed, 0, exp.data.num_clients, exp.cfg.clients_per_round)
    idx = torch.cat([exp.data.client_indices(c) for c in clients])
    model = exp.simulation.eval_model
    model.load(server.weights)  # unchanged by a 1e-30 step
    with torch.no_grad():
        h = model.model.forward_stages(exp.data.train_x[idx], stop=server.split.cut + 1).flatten(1).double()
    y = exp.data.train_y[idx]
    for c in torch.unique(y).tolist():
        torch.testing.assert_close(server.mu[c].double(), h[y == c].mean(0), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(server.sigma[c].double(), h[y == c].std(0, unbiased=False), rtol=1e-4, atol=1e-5)


def test_fedimpro_runs_deterministically_and_reports_its_terms():
    _, first = _run("algorithm.weight_max_rounds=1", "algorithm.privacy_noise_std=0.001")
    _, second = _run("algorithm.weight_max_rounds=1", "algorithm.privacy_noise_std=0.001")
    assert first == second
    assert all(math.isfinite(r["test_accuracy"]) for r in first if "test_accuracy" in r)
    assert first[1]["fedimpro_w_fake"] == 1.0 and math.isfinite(first[1]["fedimpro_fake_ce"])


def _final_weights(*overrides: str) -> torch.Tensor:
    exp = build(compose_config("model=cnn", "rounds=3", "num_clients=10", "clients_per_round=4", "train.epochs=1",
                               "engine.threads_per_worker=1", *overrides))
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    return exp.simulation.server.weights


@pytest.mark.slow
def test_with_the_sampled_feature_term_weighted_zero_fedimpro_is_fedavg_up_to_rounding():
    """The control of docs/results/heterogeneity.md: w_fake = 0 leaves FedAvg's training.

    Not bit-identical: f runs once on the concatenated [h; h_fake] batch, whose matrix shapes round
    differently from FedAvg's [h] (measured max |difference| 3e-8 to 6e-8 over seeds 0-4, 3 rounds;
    0 when f runs on h alone). A sampled-feature term of weight 1e-4 moves the weights by 1e-4 to 2e-3.
    """
    fedavg = _final_weights("algorithm=fedavg")
    off = _final_weights("algorithm=fedimpro", "algorithm.weight_schedule=constant", "algorithm.constant_weight=0")
    assert float((off - fedavg).abs().max()) <= 1e-6
    tiny = _final_weights("algorithm=fedimpro", "algorithm.weight_schedule=constant",
                          "algorithm.constant_weight=1e-4")
    assert float((tiny - fedavg).abs().max()) > 1e-5  # the tolerance above would see the term


def test_bad_config_values_name_the_key():
    with pytest.raises(ValueError, match=r"algorithm\.aggregation"):
        _run("algorithm.aggregation=median")
    with pytest.raises(ValueError, match=r"algorithm\.split_after"):
        _run("algorithm.split_after=head")


def _assert_rows_close(rows_a: list[dict], rows_b: list[dict]) -> None:
    assert len(rows_a) == len(rows_b)
    for a, b in zip(rows_a, rows_b):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-9), k


@pytest.mark.slow
def test_inline_worker_count_does_not_change_fedimpro():
    exp_one, one = _run("algorithm.aggregation=label_size", "engine.num_workers=1")
    exp_two, two = _run("algorithm.aggregation=label_size", "engine.num_workers=2")
    _assert_rows_close(one, two)
    torch.testing.assert_close(exp_one.simulation.server.mu, exp_two.simulation.server.mu, rtol=1e-5, atol=1e-6)


@pytest.mark.ray
@pytest.mark.parametrize("aggregation", ["uniform", "label_size"])
def test_inline_and_ray_give_the_same_result(ray_session, aggregation):
    exp_i, rows_i = _run(f"algorithm.aggregation={aggregation}", "engine=inline")
    exp_r, rows_r = _run(f"algorithm.aggregation={aggregation}", "engine=ray", "engine.num_workers=2")
    si, sr = exp_i.simulation.server, exp_r.simulation.server
    assert float((si.weights - sr.weights).abs().max()) <= 1e-6
    torch.testing.assert_close(si.mu, sr.mu, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(si.sigma, sr.sigma, rtol=1e-5, atol=1e-6)
    _assert_rows_close(rows_i, rows_r)


@pytest.mark.parametrize(("preset", "dataset", "lr"), [("fedimpro_cifar10", "cifar10", 0.1),
                                                        ("fedimpro_fmnist", "fashion_mnist", 0.01)])
def test_paper_presets_compose(preset, dataset, lr):
    cfg = compose_config(f"+experiment={preset}")
    assert (cfg.dataset.name, cfg.model.name, cfg.algorithm.name) == (dataset, "resnet18", "fedimpro")
    assert (cfg.num_clients, cfg.clients_per_round, cfg.partition.alpha, cfg.train.batch_size) == (10, 5, 0.1, 128)
    assert (cfg.train.lr, cfg.train.momentum, cfg.algorithm.split_after) == (lr, 0.0, "layer2")
    assert (cfg.rounds, cfg.algorithm.weight_max_rounds) == (1000, 500)


def flower_equals_simulator(tmp_path, overrides: list[str]) -> None:
    """The Flower ServerApp/ClientApp (in-process LocalGrid, tests/flower_utils.py) trains the same model."""
    import importlib.util

    from fl_platform.experiment import run_experiment
    from fl_platform.flower import config as fc
    from fl_platform.flower.client_app import app as client_app
    from fl_platform.flower.server_app import run_server

    spec = importlib.util.spec_from_file_location("flower_utils", REPO / "tests" / "flower_utils.py")
    flower_utils = sys.modules.setdefault("flower_utils", importlib.util.module_from_spec(spec))
    if not hasattr(flower_utils, "LocalGrid"):
        spec.loader.exec_module(flower_utils)
    threads = torch.get_num_threads()
    try:  # one torch thread on both sides, so both do the same float arithmetic
        cfg = fc.compose(overrides)
        rc = fc.flatten_config(cfg, fc.DeployConf(round_timeout=5.0, poll_interval=0.01, connect_timeout=5.0))
        nodes = [{"partition-id": i, "num-partitions": cfg.num_clients, "threads": 1} for i in range(cfg.num_clients)]
        summary = run_server(flower_utils.LocalGrid(client_app, nodes, rc), rc, run_id=5, run_dir=tmp_path / "flower")
        torch.set_num_threads(1)
        sim = run_experiment(cfg, tmp_path / "sim")
    finally:
        torch.set_num_threads(threads)  # the ClientApp sets torch's threads for the whole process
    flower_w = torch.load(tmp_path / "flower" / "model.pt", weights_only=True)
    sim_w = torch.load(tmp_path / "sim" / "model.pt", weights_only=True)
    assert flower_w.keys() == sim_w.keys()
    assert max(float((flower_w[k] - sim_w[k]).abs().max()) for k in sim_w) < 1e-5
    assert summary["final_test_accuracy"] == pytest.approx(sim["final_test_accuracy"])


@pytest.mark.slow
def test_flower_run_equals_the_simulator(tmp_path):
    flower_equals_simulator(tmp_path, ["algorithm=fedimpro", "algorithm.aggregation=label_size",
                                       "algorithm.weight_max_rounds=1", "model=cnn", "model.channels=[8,16]",
                                       "model.hidden=32", "num_clients=3", "clients_per_round=3", "rounds=2",
                                       "partition=iid", "train.epochs=1", "logger.progress=false"])
