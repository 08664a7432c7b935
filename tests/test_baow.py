"""BAOW: BCRS keep ratios, the client's Top-k upload, OPWA aggregation, and runs with a system model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fl_platform.algorithms.baow import BAOWClient, BAOWConf, BAOWServer, keep_ratios
from fl_platform.algorithms.base import Setup
from fl_platform.compression import TopK
from fl_platform.compression.vector import Layout
from fl_platform.core import Aggregate, Broadcast, RoundContext
from fl_platform.experiment import build, run_experiment
from fl_platform.state.manifest import ROUND_KEY as STAMP
from fl_platform.training.flat import FlatModel
from fl_platform.training.loop import ClientData, LocalTrainer, TrainConfig

SMALL = ["algorithm=baow", "num_clients=10", "clients_per_round=5", "train.epochs=1", "save_model=false", "seed=3"]


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_keep_ratios_straggler_and_budget_rules():
    bw = {1: 1.0, 2: 4.0, 3: 1000.0}
    assert keep_ratios(0.01, bw) == {1: 0.01, 2: 0.04, 3: 1.0}
    budget = keep_ratios(0.1, bw, "budget")
    assert budget[1] == pytest.approx(0.1 * 3 / 1005) and budget[3] == pytest.approx(0.1 * 3 * 1000 / 1005)
    assert keep_ratios(0.05, dict.fromkeys(range(4), 2.0)) == dict.fromkeys(range(4), 0.05)


def _setup(fm: FlatModel, system=None) -> Setup:
    return Setup(model_fn=lambda: None, num_params=fm.num_params, num_buffers=fm.num_buffers, num_classes=3,
                 input_shape=(6,), num_clients=4, seed=0, train=TrainConfig(), extra={"system": system} if system else {})


def _model() -> FlatModel:
    torch.manual_seed(0)
    return FlatModel(torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                         torch.nn.Linear(32, 3)))


def test_client_uploads_topk_per_layer_and_contributes_masked_sums():
    fm = _model()
    cfg = BAOWConf(rho0=0.1)
    client = BAOWClient(cfg, _setup(fm))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 6, generator=g), torch.randint(0, 3, (40,), generator=g)
    weights = fm.vector.detach().clone()
    trainer = LocalTrainer(fm, TrainConfig(epochs=1, batch_size=8, lr=0.1))
    ctx = RoundContext(round=0, seed=0, clients=(2,), num_rounds=1, num_clients=4)
    bc = Broadcast({"weights": weights}, per_client={2: {"ratio": 0.25}})
    up = client.train(ctx, 2, bc, None, ClientData(x, y, torch.arange(40)), trainer)
    delta = fm.vector - weights
    mask, masked = up.tensors["mask"] / 40, up.tensors["masked_delta"] / 40
    segments = Layout.from_slots(fm.slots, len(fm), "layer").segments
    assert [s.name for s in segments] == ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias",
                                          "3.bias.padding", "buffers"]  # 387 parameters, aligned to 388
    for s in segments:
        m = mask[s.offset:s.end]
        if s.compress:  # exactly the ceil(rho * d_l) largest |delta| of each layer (and of its padding)
            k = math.ceil(0.25 * s.numel)
            assert int(m.sum()) == k
            top = delta[s.offset:s.end].abs().topk(k).indices
            assert set(m.nonzero().squeeze(1).tolist()) == set(top.tolist())
        else:
            assert bool((m == 1).all())  # BatchNorm statistics dense
    assert torch.allclose(masked, mask * delta)
    assert up.weights["n"] == 40.0 and up.weights["kept"] == sum(
        math.ceil(0.25 * s.numel) for s in segments if s.compress)
    assert up.bytes_up == sum(TopK(0.25).payload_nbytes(s.numel) for s in segments if s.compress) + 4 * fm.num_buffers
    with pytest.raises(ValueError, match="no keep ratio for client 3"):
        client.train(ctx, 3, bc, None, ClientData(x, y, torch.arange(40)), trainer)


def _aggregate(parts: list[tuple[float, torch.Tensor, torch.Tensor]]) -> Aggregate:
    agg = Aggregate()
    for n, delta, mask in parts:
        agg.add({"masked_delta": n * mask * delta, "mask": n * mask}, {"n": n, "kept": float(mask.sum())})
    return agg


def test_opwa_renormalises_each_coordinate_by_the_weight_of_clients_that_sent_it():
    fm = _model()
    d = len(fm)
    g = torch.Generator().manual_seed(2)
    parts = [(float(n), torch.randn(d, generator=g), (torch.rand(d, generator=g) < 0.4).float()) for n in (10, 30, 60)]
    w0 = fm.vector.detach().clone()
    server = BAOWServer(BAOWConf(), _setup(fm), w0)
    ctx = RoundContext(round=0, seed=0, clients=(0, 1, 2), num_rounds=1, num_clients=4)
    out = server.aggregate(ctx, _aggregate(parts))
    num = sum(n * m * dl for n, dl, m in parts)
    den = sum(n * m for n, _, m in parts)
    expected = torch.where(den > 0, num / den.clamp(min=1e-30), torch.zeros(d))
    assert torch.allclose(server.weights - w0, expected, atol=1e-6)
    p = fm.num_params
    assert out["baow_coverage"] == pytest.approx(float((den[:p] > 0).float().mean()))
    # one coordinate kept only by the 10-sample client gets that client's value, not a tenth of it
    only0 = ((parts[0][2] == 1) & (parts[1][2] == 0) & (parts[2][2] == 0)).nonzero()[0, 0]
    assert float((server.weights - w0)[only0]) == pytest.approx(float(parts[0][1][only0]), rel=1e-5)
    # plain: Top-k FedAvg (divide by the total weight); gamma_max caps the amplification
    plain = BAOWServer(BAOWConf(aggregation="plain"), _setup(fm), w0)
    plain.aggregate(ctx, _aggregate(parts))
    assert torch.allclose(plain.weights - w0, num / 100.0, atol=1e-6)
    capped = BAOWServer(BAOWConf(gamma_max=2.0), _setup(fm), w0)
    capped.aggregate(ctx, _aggregate(parts))
    assert float((capped.weights - w0)[only0]) == pytest.approx(float(10 * parts[0][1][only0] / 50), rel=1e-5)


def test_config_errors_name_the_key():
    fm = _model()
    for bad, key in [({"rho0": 0.0}, "algorithm.rho0"), ({"ratio_rule": "fast"}, "algorithm.ratio_rule"),
                     ({"aggregation": "mean"}, "algorithm.aggregation"), ({"gamma_max": 0.5}, "algorithm.gamma_max")]:
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            BAOWServer(BAOWConf(**bad), _setup(fm), fm.vector.detach())


def test_without_a_system_model_every_client_gets_rho0(make_config):
    exp = build(make_config(*SMALL, "rounds=1", "algorithm.rho0=0.05"))
    try:
        ctx = RoundContext(round=0, seed=3, clients=(1, 4, 7), num_rounds=1, num_clients=10)
        assert exp.simulation.server.ratios(ctx) == {1: 0.05, 4: 0.05, 7: 0.05}
    finally:
        exp.engine.close()


def test_baow_equalises_upload_times_and_is_exact_under_hierarchical_aggregation(make_config, tmp_path):
    common = [*SMALL[1:], "rounds=3", "system=heterogeneous", "system.latency_s=0"]
    over = ["algorithm=baow", *common, "algorithm.rho0=0.01", "algorithm.index=int32"]
    run_experiment(make_config(*over), tmp_path / "one")
    run_experiment(make_config(*over, "engine.num_workers=2"), tmp_path / "two")
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert [r["test_accuracy"] for r in one] == [r["test_accuracy"] for r in two]
    assert [r["bytes_up"] for r in one] == [r["bytes_up"] for r in two]
    assert len(one) == 3
    for r in one:
        # rho0 = 0.01 over a 100x bandwidth range caps no client at dense (every rho_k < 1), so every
        # upload must take as long as the straggler's rho0 upload: measured spread 1.02-1.03 (the
        # per-layer ceil); uniform Top-k spreads ~100x (below), BCRS without the b_k / b_min factor too.
        assert r["baow_max_ratio"] < 1.0
        assert r["sim_upload_max_s"] / r["sim_upload_min_s"] < 1.1
        assert r["baow_mean_ratio"] > 0.01
    # uniform Top-k at rho0: the slow link sends as much as the fast ones, so uploads spread ~100x
    run_experiment(make_config(*common, "compressor=topk", "compressor.ratio=0.01", "compressor.index=int32",
                               "compressor.error_feedback=false"), tmp_path / "topk")
    topk = _rows(tmp_path / "topk")
    assert max(r["sim_upload_max_s"] / r["sim_upload_min_s"] for r in topk) > 5


def test_baow_with_error_feedback_keeps_a_residual_and_learns(make_config):
    exp = build(make_config(*SMALL, "rounds=4", "system=heterogeneous", "algorithm.rho0=0.05",
                            "algorithm.error_feedback=true"))
    try:
        summary = exp.simulation.run()
        store = exp.engine.workers[0].store
        assert set(store.specs) - {STAMP} == {"residual"}  # (STAMP: the round stamp every stored state carries)
        assert summary["final_test_accuracy"] > 0.5
    finally:
        exp.engine.close()


def test_baow_refuses_a_generic_uplink_compressor(make_config):
    with pytest.raises(ValueError, match="compresses its own uplink"):
        build(make_config(*SMALL, "rounds=1", "compressor=topk"))
