"""One-shot protocol and server-side methods: ensemble, averaging, caching, server split, distillation,
and the fairness options of docs/results/oneshot.md (calibration offered to the references, FedDF out of domain)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fl_platform.algorithms.base import Setup
from fl_platform.algorithms.fusefl import class_statistics, pool_statistics
from fl_platform.algorithms.oneshot.calibration import ensemble_head, features
from fl_platform.algorithms.oneshot.coboost import CoBoostConf
from fl_platform.algorithms.oneshot.datafree import BNStatLoss, DataFreeServer, augment
from fl_platform.algorithms.oneshot.distill import LogitEnsemble, kd_loss, predict_logits
from fl_platform.algorithms.oneshot.ensemble import EnsembleConf, EnsembleServer
from fl_platform.algorithms.oneshot.fedavg import OneShotFedAvgConf, OneShotFedAvgServer
from fl_platform.algorithms.oneshot.feddf import load_distill_set
from fl_platform.algorithms.oneshot.protocol import HoldoutFilter, build_module, server_split
from fl_platform.core import ClientUpdate, RoundContext
from fl_platform.experiment import build
from fl_platform.rounds.setup import ModelFactory
from fl_platform.training.flat import FlatModel
from fl_platform.training.loop import ClientData, TrainConfig

SHAPE = (1, 8, 8)


pytestmark = [
    pytest.mark.slow,  # one-shot methods train every client to the end, then distil
    pytest.mark.usefixtures("one_torch_thread"),  # tiny models: one torch thread (conftest)
    pytest.mark.xdist_group("oneshot"),  # one pytest worker: the clients in shared_cache train once
]


def _setup(clients: int = 3) -> Setup:
    model = ModelFactory("cnn", SHAPE, 10, {"channels": [4, 6], "hidden": 12, "norm": "batch"})
    fm = FlatModel(model())
    return Setup(model, fm.num_params, fm.num_buffers, 10, SHAPE, clients, 0, TrainConfig())


def _updates(setup: Setup, sizes: list[int], seed: int = 0) -> list[ClientUpdate]:
    out = []
    for cid, n in enumerate(sizes):
        torch.manual_seed(seed + cid)
        vec = FlatModel(setup.model_fn()).vector.detach().clone()
        vec[setup.num_params:] = torch.rand(setup.num_buffers) + 0.5  # non-trivial BN running stats
        out.append(ClientUpdate(cid, {"weights": vec}, {"n": float(n)}, n))
    return out


def _ctx(clients: int = 3) -> RoundContext:
    return RoundContext(round=0, seed=0, clients=tuple(range(clients)), num_rounds=1, num_clients=clients)


def test_ensemble_logits_equal_the_mean_of_the_clients_logits():
    setup = _setup()
    updates = _updates(setup, [30, 10, 60])
    x = torch.randn(50, *SHAPE)
    y = torch.randint(0, 10, (50,))
    client_logits = torch.stack([predict_logits(build_module(setup, u.tensors["weights"], "cpu"), x) for u in updates])
    ensemble = LogitEnsemble([build_module(setup, u.tensors["weights"], "cpu").eval() for u in updates])
    with torch.no_grad():
        torch.testing.assert_close(ensemble(x), client_logits.mean(0))
        weighted = LogitEnsemble(list(ensemble.models), torch.tensor([3.0, 1.0, 6.0]))
        torch.testing.assert_close(weighted(x), (client_logits * torch.tensor([0.3, 0.1, 0.6]).view(3, 1, 1)).sum(0))
    # The server half's final model is exactly that mean (test loss computed from it by hand).
    server = EnsembleServer(EnsembleConf(cache_dir=None), setup, updates[0].tensors["weights"])
    extras = server.aggregate(_ctx(), updates)
    assert extras["model_params"] == 3 * sum(p.numel() for p in setup.model_fn().parameters())
    metrics = server.evaluate(FlatModel(setup.model_fn()), x, y)
    mean = client_logits.mean(0)
    assert metrics["test_loss"] == pytest.approx(float(F.cross_entropy(mean.double(), y)), rel=1e-6)
    assert metrics["test_accuracy"] == pytest.approx(float((mean.argmax(1) == y).float().mean()))
    assert metrics["ensemble_agreement"] == 1.0


def test_oneshot_fedavg_is_the_sample_weighted_parameter_and_buffer_average():
    setup = _setup()
    updates = _updates(setup, [30, 10, 60])
    server = OneShotFedAvgServer(OneShotFedAvgConf(cache_dir=None), setup, updates[0].tensors["weights"])
    server.aggregate(_ctx(), updates)
    expected = sum(u.tensors["weights"].double() * u.num_samples for u in updates) / 100
    torch.testing.assert_close(server.weights, expected.float())
    uniform = OneShotFedAvgServer(OneShotFedAvgConf(cache_dir=None, weighting="uniform"), setup, server.weights)
    uniform.aggregate(_ctx(), updates)
    torch.testing.assert_close(uniform.weights, sum(u.tensors["weights"] for u in updates) / 3)


def test_server_split_is_held_out_from_every_client():
    split = server_split(1000, 0.1, seed=3)
    assert split.size == 100 and torch.equal(torch.from_numpy(split), torch.from_numpy(server_split(1000, 0.1, 3)))
    assert set(split.tolist()) != set(server_split(1000, 0.1, 4).tolist())  # depends on the seed
    data = ClientData(torch.zeros(1000, 1), torch.zeros(1000, dtype=torch.long), torch.arange(0, 1000, 2))
    kept = HoldoutFilter(0.1, seed=3)(data).indices
    assert not set(kept.tolist()) & set(split.tolist())
    assert set(kept.tolist()) | (set(split.tolist()) & set(range(0, 1000, 2))) == set(range(0, 1000, 2))
    with pytest.raises(ValueError, match="server_fraction"):
        server_split(10, 1.0, 0)


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory):
    """One client-checkpoint cache for the tests that do not inspect caching (saves retraining)."""
    return tmp_path_factory.mktemp("oneshot_cache")


def _config(make_config, algorithm: str, cache, *extra: str):
    return make_config(f"algorithm={algorithm}", "dataset=digits", "model=cnn", "model.channels=[6,8]",
                       "model.hidden=16", "model.norm=batch", "num_clients=4", "clients_per_round=4", "rounds=1",
                       "partition.alpha=0.5", "train.epochs=2", "train.batch_size=32", "train.lr=0.05",
                       "train.momentum=0.9", f"algorithm.cache_dir={cache}", *extra)


def _run(cfg):
    exp = build(cfg)
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    return exp.simulation.server, exp.simulation.history[-1]


def test_client_models_are_cached_once_and_shared_by_every_method(make_config, tmp_path):
    server_a, row_a = _run(_config(make_config, "oneshot_fedavg", tmp_path))
    assert row_a["cache_hit"] == 0.0 and len(list(tmp_path.glob("*.pt"))) == 4
    server_b, row_b = _run(_config(make_config, "oneshot_ensemble", tmp_path))
    assert row_b["cache_hit"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(server_a.teachers, server_b.teachers))
    assert row_b["fedavg_test_accuracy"] == row_a["test_accuracy"]
    assert row_b["ensemble_test_accuracy"] == row_b["test_accuracy"]
    assert row_a["bytes_up"] == row_b["bytes_up"] == 4 * 4 * server_a.teachers[0].numel()
    # Different local-training settings are different client models.
    _, row_c = _run(_config(make_config, "oneshot_fedavg", tmp_path, "train.epochs=1"))
    assert row_c["cache_hit"] == 0.0 and len(list(tmp_path.glob("*.pt"))) == 8


def test_multi_round_oneshot_fedavg_is_fedavg(make_config):
    common = ("dataset=digits", "model=mlp", "num_clients=4", "clients_per_round=4", "rounds=2", "train.epochs=1")
    fedavg, _ = _run(make_config("algorithm=fedavg", *common))
    oneshot, _ = _run(make_config("algorithm=oneshot_fedavg", "algorithm.server_fraction=0", "algorithm.cache_dir=null",
                                  *common))
    torch.testing.assert_close(oneshot.weights, fedavg.weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["oneshot_ensemble", "oneshot_feddf"])
def test_one_shot_methods_reject_more_rounds(make_config, shared_cache, algorithm):
    exp = build(_config(make_config, algorithm, shared_cache, "rounds=2"))
    try:
        with pytest.raises(ValueError, match=r"one-shot: it needs rounds=1, got rounds=2"):
            exp.simulation.run()
    finally:
        exp.engine.close()


def test_bad_settings_name_the_key(make_config, shared_cache):
    with pytest.raises(ValueError, match=r"algorithm.server_fraction must be > 0 \(FedDF distils on held-out server data\), got 0.0"):
        build(_config(make_config, "oneshot_feddf", shared_cache, "algorithm.server_fraction=0"))
    with pytest.raises(ValueError, match=r"H and W divisible by 4"):
        build(make_config("algorithm=oneshot_dense", "dataset=synthetic", "model=mlp", "num_clients=3",
                          "clients_per_round=3", "rounds=1"))
    with pytest.raises(ValueError, match=r"algorithm.weighting must be"):
        build(_config(make_config, "oneshot_ensemble", shared_cache, "algorithm.weighting=median"))


def test_feddf_distillation_improves_agreement_with_the_ensemble_on_held_out_inputs(make_config, shared_cache):
    extra = ("algorithm.server_fraction=0.3", "partition.alpha=0.2")
    _, before = _run(_config(make_config, "oneshot_fedavg", shared_cache, *extra))
    _, after = _run(_config(make_config, "oneshot_feddf", shared_cache, *extra, "algorithm.steps=150",
                            "algorithm.val_fraction=0"))
    # The test set: inputs neither the clients nor the distillation ever saw.
    assert after["ensemble_agreement"] > before["ensemble_agreement"] + 0.05
    assert after["distill_steps"] == 150


def test_dense_distillation_improves_a_fresh_students_agreement(make_config, shared_cache):
    # The card's generator loop at a tiny budget; the KD step is sped up (T 4, lr 0.05) so that 36
    # distillation steps move a fresh student, and digits are not flipped (8x8 digits are not symmetric).
    cfg = _config(make_config, "oneshot_dense", shared_cache, "algorithm.epochs=8", "algorithm.g_steps=30",
                  "algorithm.ngf=16", "algorithm.nz=64", "algorithm.synthesis_batch_size=64",
                  "algorithm.kd_batch_size=32", "algorithm.synthesis_augment=false", "algorithm.kd_augment=false",
                  "algorithm.kd_lr=0.05", "algorithm.kd_temperature=4")
    exp = build(cfg)
    try:
        exp.simulation.run()
        server, row = exp.simulation.server, exp.simulation.history[-1]
        x = exp.data.test_x
        teachers = server.teacher_modules("cpu")
        ensemble = torch.stack([predict_logits(m, x) for m in teachers]).mean(0)
        fresh = predict_logits(build_module(server.setup, server.fresh_student(), "cpu"), x)
    finally:
        exp.engine.close()
    before = float((fresh.argmax(1) == ensemble.argmax(1)).float().mean())
    assert row["ensemble_agreement"] > before + 0.2
    assert row["pool_samples"] == 8 * 64


def test_bn_statistics_term_and_augmentation():
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(3).eval()
    bn.running_mean.fill_(0.5)
    bn.running_var.fill_(2.0)
    hook = BNStatLoss([torch.nn.Sequential(bn)])
    x = torch.randn(8, 3, 4, 4)
    hook.active = True
    bn(x)
    term = hook.pop()
    expected = (torch.linalg.vector_norm(0.5 - x.mean((0, 2, 3)))
                + torch.linalg.vector_norm(2.0 - x.transpose(0, 1).reshape(3, -1).var(1, unbiased=False)))
    torch.testing.assert_close(term, expected)
    hook.close()
    low = torch.full((3, 1, 1), -1.0)
    out = augment(x, torch.Generator().manual_seed(1), low)
    again = augment(x, torch.Generator().manual_seed(1), low)
    assert out.shape == x.shape and torch.equal(out, again)
    assert kd_loss(x.flatten(1), x.flatten(1), 4.0) == pytest.approx(0.0, abs=1e-6)


def test_coboost_reweighting_moves_weight_to_the_member_that_fits_the_labels():
    setup = _setup(2)
    updates = _updates(setup, [10, 10])
    server = DataFreeServer(CoBoostConf(cache_dir=None), setup, updates[0].tensors["weights"])
    good = build_module(setup, updates[0].tensors["weights"], "cpu").eval()
    bad = build_module(setup, updates[1].tensors["weights"], "cpu").eval()
    x = torch.randn(64, *SHAPE)
    y = predict_logits(good, x).argmax(1)  # labels the first member fits exactly
    ensemble = LogitEnsemble([good, bad])
    w = server.reweight(0, ensemble, torch.tensor([0.5, 0.5]), [x], [y], torch.full((1, 1, 1), -1.0),
                        torch.Generator().manual_seed(0))
    assert w[0] > 0.5 > w[1]


# ----------------------------------------------------------------------------- fairness options (oneshot.md)


def _members(k: int = 3) -> list[torch.nn.Module]:
    setup = _setup(k)
    return [build_module(setup, u.tensors["weights"], "cpu").eval() for u in _updates(setup, [1] * k)]


def test_the_ensembles_calibration_head_starts_as_the_ensemble_itself():
    members = _members()
    x = torch.randn(40, *SHAPE)
    w = torch.tensor([3.0, 1.0, 6.0])
    head = ensemble_head(members, w)
    with torch.no_grad():
        torch.testing.assert_close(head(features(members, x)), LogitEnsemble(members, w)(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ensemble_head(members, torch.ones(3))(features(members, x)),
                                   LogitEnsemble(members)(x), rtol=1e-5, atol=1e-5)


def _run_fair(make_config, *extra: str):
    cfg = make_config("dataset=digits", "model=cnn", "model.channels=[6,8]", "model.hidden=16", "model.norm=batch",
                      "num_clients=3", "clients_per_round=3", "partition.alpha=0.5", "train.epochs=2",
                      "train.batch_size=32", "train.lr=0.05", "train.momentum=0.9", "algorithm.cache_dir=null",
                      "save_model=false", *extra)
    exp = build(cfg)
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    return exp, exp.simulation.history


@pytest.mark.parametrize("algorithm", ["oneshot_ensemble", "oneshot_fedavg"])
def test_calibration_round_sends_the_final_model_and_the_clients_exact_class_statistics(make_config, algorithm):
    exp, rows = _run_fair(make_config, f"algorithm={algorithm}", "rounds=2", "algorithm.calibrate=true",
                     "algorithm.sample_per_class=300")
    server = exp.simulation.server
    first, last = rows
    k, p = len(server.teachers), server.teachers[0].numel()
    # Round 2 downloads the final model (the ensemble: every member) to each client ...
    assert last["bytes_down"] == k * 4 * p * (k if algorithm == "oneshot_ensemble" else 1)
    # ... and uploads per-class counts, means and covariance triangles of its feature (D per member).
    d = (k if algorithm == "oneshot_ensemble" else 1) * 16
    assert last["bytes_up"] == k * 4 * 10 * (1 + d + d * (d + 1) // 2)
    # Before calibration the model is the plain ensemble / one-shot FedAvg of the same client models.
    before = "ensemble_test_accuracy" if algorithm == "oneshot_ensemble" else "fedavg_test_accuracy"
    assert last["uncalibrated_test_accuracy"] == first["test_accuracy"] == last[before]
    assert last["test_accuracy"] != last["uncalibrated_test_accuracy"] and last["calibration_samples"] == 3000


def test_pooled_statistics_equal_the_statistics_of_all_clients_features():
    """What the server pools from the clients' uploads is the class mean and covariance of the union."""
    members = _members()
    x, y = torch.randn(90, *SHAPE), torch.randint(0, 4, (90,))
    f = features(members, x)
    parts = [class_statistics(f[i::3], y[i::3], 4, correction=1) for i in range(3)]
    total, mu, cov = pool_statistics(*(torch.stack([p[j] for p in parts]) for j in range(3)))
    whole = class_statistics(f, y, 4, correction=1)
    torch.testing.assert_close(total, whole[0])
    torch.testing.assert_close(mu, whole[1])
    torch.testing.assert_close(cov, whole[2])


def test_calibrate_needs_its_extra_round(make_config):
    for algorithm, rounds in (("oneshot_ensemble", 1), ("oneshot_ensemble", 3), ("oneshot_fedavg", 1)):
        with pytest.raises(ValueError, match=r"calibrate=true trains, then runs one calibration round"):
            _run_fair(make_config, f"algorithm={algorithm}", f"rounds={rounds}", "algorithm.calibrate=true")


def test_out_of_domain_images_take_the_tasks_shape_and_input_range():
    low, high = torch.tensor([-0.5, -1.0, -2.0]), torch.tensor([2.0, 1.5, 0.5])
    gen = torch.Generator().manual_seed(0)
    x = load_distill_set("digits", 100, (3, 12, 12), low, high, gen)
    assert x.shape == (100, 3, 12, 12)
    # raw 0 (background) lands on low, the brightest raw pixel on high, channel by channel
    assert torch.equal(x.amin(dim=(0, 2, 3)), low) and torch.allclose(x.amax(dim=(0, 2, 3)), high, atol=1e-6)
    raw = (x - low.view(1, 3, 1, 1)) / (high - low).view(1, 3, 1, 1)  # one grey channel, repeated
    assert torch.allclose(raw[:, 1], raw[:, 0], atol=1e-6) and torch.allclose(raw[:, 2], raw[:, 0], atol=1e-6)
    same = load_distill_set("digits", 100, (3, 12, 12), low, high, torch.Generator().manual_seed(0))
    assert torch.equal(x, same)  # drawn from the generator only
    with pytest.raises(ValueError, match="exceeds"):
        load_distill_set("digits", 10**6, (1, 8, 8), low[:1], high[:1], gen)
    with pytest.raises(ValueError, match="image source"):
        load_distill_set("synthetic", 10, (1, 8, 8), low[:1], high[:1], gen)


def test_an_out_of_domain_set_on_a_task_without_images_is_refused_naming_the_key(make_config):
    cfg = make_config("dataset=synthetic", "model=mlp", "num_clients=3", "clients_per_round=3", "train.epochs=1",
                      "algorithm=oneshot_feddf", "rounds=1", "algorithm.distill_set=digits", "algorithm.cache_dir=null",
                      "save_model=false")
    with pytest.raises(ValueError, match=r"algorithm\.distill_set='digits': .* needs an image task"):
        build(cfg).engine.close()


def test_feddf_distils_on_the_out_of_domain_set(make_config):
    exp, rows = _run_fair(make_config, "algorithm=oneshot_feddf", "rounds=1", "algorithm.steps=20",
                     "algorithm.val_fraction=0", "algorithm.distill_set=digits", "algorithm.distill_size=77")
    server = exp.simulation.server
    assert rows[-1]["distill_set_size"] == 77 and server.distill_x.shape == (77, 1, 8, 8)


@pytest.mark.parametrize("algorithm", ["oneshot_ensemble", "fusefl"])
def test_a_hold_out_refuses_training_features_in_row_blocks(make_config, monkeypatch, algorithm):
    """The server's hold-out split is drawn over one training tensor: features held in row blocks
    (Synthetic at scale) are refused at start-up, not split per block."""
    from fl_platform.datasets.sources import synthetic

    monkeypatch.setattr(synthetic, "BLOCK_BYTES", 30_000)
    extra = ("algorithm.server_fraction=0.1", "algorithm.blocks=1") if algorithm == "fusefl" else ()
    with pytest.raises(NotImplementedError, match=r"hold-out split needs the training features in one tensor"):
        build(make_config(f"algorithm={algorithm}", "dataset=synthetic", "partition=natural", "model=mlp",
                          "num_clients=1000",
                          "dataset.size_mean=1", "dataset.size_sigma=1", "dataset.min_size=10",
                          "clients_per_round=3", "rounds=1", *extra))
