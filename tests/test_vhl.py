"""VHL: the virtual dataset (seeded, bit-identical everywhere), the loss terms, PredShift, engines."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from fl_platform.algorithms.base import Setup
from fl_platform.algorithms.vhl import VHLConf, VHLHook, VHLServer, virtual_spec
from fl_platform.algorithms.vhl_data import (
    VirtualBatches,
    VirtualDataSpec,
    augment,
    generate_virtual_dataset,
    virtual_dataset,
)
from fl_platform.experiment import build
from fl_platform.models import build_model
from fl_platform.rounds.simulation import is_timing_key
from fl_platform.training.flat import FlatModel
from fl_platform.training.hooks import Batch
from fl_platform.training.loop import TrainConfig
from fl_platform.training.supcon import supcon_loss

from .conftest import REPO, compose_config
from .test_fedimpro import flower_equals_simulator

SPEC = VirtualDataSpec(seed=3, num_classes=4, samples_per_class=6, image_shape=(1, 28, 28), channels=16)


@pytest.mark.slow
def test_virtual_dataset_is_bit_identical_across_processes_and_thread_counts():
    data = generate_virtual_dataset(SPEC)
    code = textwrap.dedent(f"""
        import torch
        torch.set_num_threads(2)
        from fl_platform.algorithms.vhl_data import VirtualDataSpec, generate_virtual_dataset
        print(generate_virtual_dataset(VirtualDataSpec(**{SPEC.__dict__!r})).fingerprint())
    """)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == data.fingerprint()
    assert torch.equal(generate_virtual_dataset(SPEC).images, data.images)  # a second "worker" here


def test_virtual_dataset_shape_labels_seed_and_cache():
    data = generate_virtual_dataset(SPEC)
    assert data.images.dtype == torch.uint8 and data.images.shape == (24, 1, 28, 28)
    assert torch.equal(data.labels, torch.arange(4).repeat_interleave(6))
    rgb = generate_virtual_dataset(VirtualDataSpec(**{**SPEC.__dict__, "image_shape": (3, 32, 32)}))
    assert rgb.images.shape == (24, 3, 32, 32)
    other = generate_virtual_dataset(VirtualDataSpec(**{**SPEC.__dict__, "seed": 4}))
    assert other.fingerprint() != data.fingerprint()
    assert virtual_dataset(SPEC) is virtual_dataset(SPEC)  # generated once per process
    with pytest.raises(ValueError, match="image inputs"):
        VirtualDataSpec(seed=0, num_classes=2, samples_per_class=2, image_shape=(60,))


def test_virtual_classes_come_from_the_per_class_latent_means():
    """Held-out virtual images are classified by the nearest class-mean image far above chance."""
    data = generate_virtual_dataset(VirtualDataSpec(seed=0, num_classes=10, samples_per_class=20,
                                                    image_shape=(3, 16, 16), channels=16))
    x = data.images.float().flatten(1).view(10, 20, -1)
    means = x[:, :10].mean(1)
    held_out = x[:, 10:].reshape(100, -1)
    pred = torch.cdist(held_out, means).argmin(1)
    accuracy = float((pred == torch.arange(10).repeat_interleave(10)).float().mean())
    assert accuracy >= 0.6  # chance is 0.1


def test_augment_crops_and_flips_like_torchvision():
    x = torch.arange(2 * 1 * 5 * 5, dtype=torch.uint8).view(2, 1, 5, 5)
    gen = torch.Generator().manual_seed(0)
    out = augment(x, gen, padding=2)
    assert out.shape == x.shape and out.dtype == torch.uint8
    for b in range(2):  # every output is a (possibly flipped) window of the zero-padded image
        padded = F.pad(x[b], [2] * 4)
        windows = [padded[:, i : i + 5, j : j + 5] for i in range(5) for j in range(5)]
        assert any(torch.equal(out[b], w) or torch.equal(out[b], w.flip(-1)) for w in windows)


def test_supcon_matches_a_direct_implementation_and_edge_cases():
    g = torch.Generator().manual_seed(0)
    u = F.normalize(torch.randn(9, 5, generator=g), dim=1)
    y = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3, 0])
    expected = []
    for a in range(9):
        others = [q for q in range(9) if q != a]
        denom = torch.logsumexp(torch.stack([u[a] @ u[q] / 0.07 for q in others]), 0)
        pos = [p for p in others if y[p] == y[a]]
        expected.append(-sum((u[a] @ u[p] / 0.07 - denom for p in pos), torch.zeros(())) / max(len(pos), 1))
    torch.testing.assert_close(supcon_loss(u, y), torch.stack(expected).mean())
    assert float(supcon_loss(u, torch.arange(9))) == 0.0  # no positives: zero, not NaN
    aligned = F.normalize(torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]), dim=1)
    assert float(supcon_loss(aligned, torch.tensor([0, 0, 1, 1]))) < float(supcon_loss(aligned, torch.tensor([0, 1, 0, 1])))


def _hook(cfg: VHLConf, num_classes: int = 4, seed: int = 0) -> VHLHook:
    data = virtual_dataset(virtual_spec(cfg, 0, num_classes, (1, 8, 8)))
    batches = VirtualBatches(data, data.images, cfg.virtual_batch_size, torch.Generator().manual_seed(seed))
    return VHLHook(cfg, num_classes, batches)


def _model(num_classes: int = 4):
    torch.manual_seed(0)
    return build_model("cnn", (1, 8, 8), 2 * num_classes, channels=[4, 8], hidden=16)


CFG = VHLConf(virtual_batch_size=6, samples_per_class=5, generator_channels=8)


def test_loss_terms_are_finite_and_switch_off_after_the_alignment_epochs():
    model = _model()
    batch = Batch(torch.randn(5, 1, 8, 8), torch.tensor([0, 1, 1, 2, 3]), 0, 0)
    terms, logits = _hook(CFG).terms(model, batch)
    assert set(terms) == {"ce_real", "ce_virtual", "align", "noise_supcon"} and logits.shape == (5, 8)
    assert all(math.isfinite(float(t.detach())) and float(t.detach()) > 0 for t in terms.values())
    late = Batch(batch.x, batch.y, 10, CFG.align_local_epochs)
    assert set(_hook(CFG).terms(model, late)[0]) == {"ce_real", "ce_virtual"}
    with_dom = _hook(VHLConf(**{**CFG.__dict__, "domain_weight": 1.0})).terms(model, batch)[0]
    assert math.isfinite(float(with_dom["domain"]))
    loss, _ = _hook(CFG).loss(model, batch)
    expected = terms["ce_real"] + terms["ce_virtual"] + terms["align"] + 0.1 * terms["noise_supcon"]
    torch.testing.assert_close(loss, expected)


def test_virtual_labels_are_shifted_to_the_extra_logits():
    model = _model()
    batch = Batch(torch.randn(5, 1, 8, 8), torch.tensor([0, 1, 1, 2, 3]), 0, 0)
    terms, _ = _hook(CFG).terms(model, batch)
    grads = torch.autograd.grad(terms["ce_virtual"], model.head.weight)[0]
    # CE(virtual, y_v + C): the target rows C..2C-1 get the negative (pull-up) gradient
    assert float(grads[4:].sum(1).abs().sum()) > 0 and bool((grads[4:].norm(dim=1) > 0).all())


def test_alignment_does_not_backpropagate_through_virtual_features():
    model = _model()
    batch = Batch(torch.randn(5, 1, 8, 8), torch.tensor([0, 1, 1, 2, 3]), 0, 0)
    terms, _ = _hook(CFG, seed=1).terms(model, batch)
    got = torch.autograd.grad(terms["align"], list(model.parameters()), allow_unused=True)
    # the same term with the virtual features computed apart as constants
    xv, yv = _hook(CFG, seed=1).batches.next()
    z_real = model.features(batch.x)
    with torch.no_grad():
        z_virt = model.features(xv)
    ref = supcon_loss(F.normalize(torch.cat([z_real, z_virt]), dim=1), torch.cat([batch.y, yv]), 0.07)
    want = torch.autograd.grad(ref, list(model.parameters()), allow_unused=True)
    for a, b in zip(got, want):
        if a is None or b is None:
            assert (a is None or float(a.abs().max()) == 0) and (b is None or float(b.abs().max()) == 0)
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _server(strict: bool) -> tuple[VHLServer, FlatModel]:
    model = _model()
    with torch.no_grad():  # a head that predicts virtual class y + C for an input encoding y
        model.head.weight.zero_()
        model.head.bias.zero_()
    fm = FlatModel(model)
    setup = Setup(model_fn=lambda: _model(), num_params=fm.num_params, num_buffers=fm.num_buffers, num_classes=4,
                  input_shape=(1, 8, 8), num_clients=1, seed=0, train=TrainConfig())
    return VHLServer(VHLConf(predshift_strict=strict, samples_per_class=1), setup, fm.vector.clone()), fm


def test_predshift_maps_every_virtual_prediction_back():
    for strict, want in ((False, 1.0), (True, 0.75)):
        server, fm = _server(strict)
        y = torch.tensor([0, 1, 2, 3])
        bias = torch.zeros(8)
        results = []
        for c in y.tolist():  # evaluate one class at a time: the bias makes virtual class c + 4 win
            bias.zero_()
            bias[c + 4] = 10.0
            fm.model.head.bias.data.copy_(bias)
            server.weights = fm.vector.clone()
            results.append(server.evaluate(fm, torch.randn(1, 1, 8, 8), y[c : c + 1]))
        assert all(r["test_accuracy"] == 0.0 for r in results)
        assert sum(r["test_accuracy_predshift"] for r in results) / 4 == want


def _predicting(preds: list[int], outputs: int, num_virtual: int, strict: bool) -> tuple[VHLServer, FlatModel]:
    """A linear model whose prediction for the one-hot input e_i is ``preds[i]`` (real or virtual)."""
    def make() -> torch.nn.Module:
        return torch.nn.Linear(len(preds), outputs)

    model = make()
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
        for i, p in enumerate(preds):
            model.weight[p, i] = 3.0
    fm = FlatModel(model)
    setup = Setup(model_fn=make, num_params=fm.num_params, num_buffers=fm.num_buffers, num_classes=4,
                  input_shape=(len(preds),), num_clients=1, seed=0, train=TrainConfig())
    cfg = VHLConf(predshift_strict=strict, num_virtual_classes=num_virtual, samples_per_class=1)
    return VHLServer(cfg, setup, fm.vector.clone()), fm


@pytest.mark.parametrize(("num_virtual", "preds", "labels", "plain", "shifted", "strict_shifted"), [
    # C = 4 real classes, 4 virtual (4..7): a real hit, a real miss, virtual hits 5->1, 4->0, 7->3, 6->2,
    # a virtual miss (6->2 for label 0), a real miss; the strict reference quirk leaves 4 (= C) unmapped
    (4, [1, 2, 5, 6, 4, 7, 3, 6], [1, 0, 1, 0, 0, 3, 2, 2], 1 / 8, 5 / 8, 4 / 8),
    # 2 virtual classes (4, 5 -> 0, 1)
    (2, [4, 5, 5, 0, 3], [0, 1, 0, 0, 2], 1 / 5, 3 / 5, 2 / 5),
])
def test_predshift_counts_a_virtual_prediction_as_its_real_class_and_nothing_else(
        num_virtual, preds, labels, plain, shifted, strict_shifted):
    x, y = torch.eye(len(preds)), torch.tensor(labels)
    for strict, want in ((False, shifted), (True, strict_shifted)):
        server, fm = _predicting(preds, 4 + num_virtual, num_virtual, strict)
        with torch.no_grad():
            assert fm.model(x).argmax(1).tolist() == preds
            loss = float(F.cross_entropy(fm.model(x).double(), y))
        out = server.evaluate(fm, x, y, batch_size=3)  # three batches
        assert out["test_accuracy"] == pytest.approx(plain)
        assert out["test_accuracy_predshift"] == pytest.approx(want)
        assert out["test_loss"] == pytest.approx(loss, rel=1e-6)


def _run(*overrides: str):
    exp = build(compose_config("algorithm=vhl", "model=cnn", "model.channels=[8,16]", "model.hidden=32", "rounds=2",
                               "num_clients=10", "clients_per_round=4", "train.epochs=1", "train.batch_size=16",
                               "algorithm.virtual_batch_size=16", "algorithm.samples_per_class=20",
                               "algorithm.generator_channels=16", "engine.threads_per_worker=1", *overrides))
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    rows = [{k: v for k, v in row.items() if not is_timing_key(k)} for row in exp.simulation.history]
    return exp, rows


def _assert_same(a, b) -> None:
    (exp_a, rows_a), (exp_b, rows_b) = a, b
    assert float((exp_a.simulation.server.weights - exp_b.simulation.server.weights).abs().max()) <= 1e-6
    assert len(rows_a) == len(rows_b)
    for x, y in zip(rows_a, rows_b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == pytest.approx(y[k], rel=1e-6, abs=1e-9), k


def test_vhl_builds_a_2c_head_and_reports_both_accuracies():
    exp, rows = _run("rounds=1", "algorithm.num_virtual_classes=3")
    assert exp.simulation.eval_model.model.head.out_features == exp.data.num_classes + 3
    assert {"test_accuracy", "test_accuracy_predshift", "vhl_align", "vhl_ce_virtual"} <= rows[-1].keys()
    # Both accuracies recomputed by hand from the final model (the mapping itself: the test above).
    fm, c = exp.simulation.eval_model, exp.data.num_classes
    fm.load(exp.simulation.server.weights)
    with torch.no_grad():
        pred = fm.model(exp.data.test_x).argmax(1)
    y = exp.data.test_y
    assert rows[-1]["test_accuracy"] == pytest.approx(float((pred == y).float().mean()))
    assert rows[-1]["test_accuracy_predshift"] == pytest.approx(float(((pred % c) == y).float().mean()))
    with pytest.raises(ValueError, match=r"algorithm\.virtual_batch_size"):
        _run("algorithm.virtual_batch_size=1000")


def test_inline_worker_count_does_not_change_vhl():
    _assert_same(_run("engine.num_workers=1"), _run("engine.num_workers=2"))


@pytest.mark.ray
def test_inline_and_ray_give_the_same_result(ray_session):
    _assert_same(_run("engine=inline"), _run("engine=ray", "engine.num_workers=2"))


@pytest.mark.parametrize(("preset", "dataset"), [("vhl_cifar10", "cifar10"), ("vhl_fmnist", "fashion_mnist")])
def test_paper_presets_compose(preset, dataset):
    cfg = compose_config(f"+experiment={preset}")
    assert (cfg.dataset.name, cfg.model.name, cfg.algorithm.name) == (dataset, "resnet18", "vhl")
    assert (cfg.num_clients, cfg.clients_per_round, cfg.partition.alpha, cfg.train.batch_size) == (10, 5, 0.1, 128)
    assert (cfg.train.lr, cfg.train.momentum, cfg.train.weight_decay) == (0.01, 0.9, 1e-4)
    assert (cfg.algorithm.virtual_batch_size, cfg.algorithm.generator_channels, cfg.rounds) == (128, 512, 1000)


@pytest.mark.slow
def test_flower_run_equals_the_simulator(tmp_path):
    flower_equals_simulator(tmp_path, ["algorithm=vhl", "algorithm.virtual_batch_size=8",
                                       "algorithm.samples_per_class=10", "algorithm.generator_channels=8",
                                       "model=cnn", "model.channels=[8,16]", "model.hidden=32", "num_clients=3",
                                       "clients_per_round=3", "rounds=2", "partition=iid", "train.epochs=1",
                                       "logger.progress=false"])
