"""Uplink compression in FL: any algorithm, real bytes, EF residuals in the client-state store."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fl_platform.compression import ErrorFeedback, Layout, RandomK, TopK, VectorCompressor
from fl_platform.compression.uplink import ROUND_KEY, UplinkCompression, make_uplink
from fl_platform.core import ClientUpdate, RoundContext
from fl_platform.experiment import build, run_experiment
from fl_platform.rounds.sampling import sample_clients
from fl_platform.training.flat import FlatModel

SMALL = ["rounds=3", "num_clients=8", "clients_per_round=4", "train.epochs=1", "save_model=false", "seed=1"]


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def _fm() -> FlatModel:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 20), torch.nn.BatchNorm1d(20), torch.nn.ReLU(), torch.nn.Linear(20, 3))
    return FlatModel(net)


def _ctx(r: int) -> RoundContext:
    return RoundContext(round=r, seed=5, clients=(0, 1), num_rounds=10, num_clients=2)


class _Client:  # stands in for a client half: only its declared contribution sizes matter here
    def __init__(self, sizes=None):
        if sizes is not None:
            self.contribution_sizes = lambda: sizes


def test_uplink_replaces_tensors_with_decoded_payload_and_keeps_the_residual():
    fm = _fm()
    up = make_uplink({"name": "topk", "ratio": 0.1}, fm, _Client())
    assert set(up.state_spec()) == {"ef.delta.residual", ROUND_KEY}
    assert up.state_spec()["ef.delta.residual"].size == fm.num_params
    own = None
    for r in range(3):
        x = torch.randn(len(fm), generator=torch.Generator().manual_seed(r)) * 7.0  # e.g. n_k * delta
        update = ClientUpdate(0, {"delta": x.clone(), "extra": torch.ones(5)}, {"n": 7.0}, 7)
        old = torch.zeros(fm.num_params) if own is None else own["ef.delta.residual"]
        own = up.apply(_ctx(r), 0, update, own)
        dec = update.tensors["delta"]
        # residual + what the server decodes = what was to be sent (+ the old residual)
        assert torch.allclose(own["ef.delta.residual"] + dec[: fm.num_params], x[: fm.num_params] + old, atol=1e-5)
        assert torch.equal(dec[fm.num_params:], x[fm.num_params:])  # BatchNorm statistics dense
        assert torch.equal(update.tensors["extra"], torch.ones(5))  # not listed: dense
        layout = Layout.from_slots(fm.slots, len(fm))
        expected = sum(TopK(0.1).payload_nbytes(s.numel) for s in layout.segments if s.compress) \
            + 4 * fm.num_buffers + 4 * 5
        assert update.bytes_up == expected
        assert float(own[ROUND_KEY]) == r + 1
    assert update.metrics.values["ef_age_rounds"] == [1.0, 1.0]


def test_uplink_compression_is_positively_homogeneous_so_scaling_does_not_matter():
    fm = _fm()
    x = torch.randn(len(fm), generator=torch.Generator().manual_seed(3))
    for conf in ({"name": "topk", "ratio": 0.2}, {"name": "qsgd", "bits": 2}, {"name": "efsign"},
                 {"name": "randomk", "ratio": 0.3}, {"name": "powersgd", "rank": 1}):
        up = make_uplink(conf, fm, _Client())
        a = ClientUpdate(0, {"delta": x * 13.0}, {}, 13)
        b = ClientUpdate(0, {"delta": x.clone()}, {}, 13)
        up.apply(_ctx(0), 0, a, None)
        up.apply(_ctx(0), 0, b, None)
        assert torch.allclose(a.tensors["delta"], 13.0 * b.tensors["delta"], rtol=1e-4, atol=1e-5), conf


def test_uplink_errors_are_clear():
    fm = _fm()
    with pytest.raises(NotImplementedError, match="acpsgd is not implemented for FL"):
        make_uplink({"name": "acpsgd"}, fm, _Client())
    with pytest.raises(ValueError, match=r"needs compressor\.scope=layer"):
        make_uplink({"name": "powersgd", "scope": "global"}, fm, _Client())
    with pytest.raises(ValueError, match="does not declare its size"):
        make_uplink({"name": "topk", "tensors": ["delta", "delta_c"]}, fm, _Client())
    assert make_uplink({"name": "none"}, fm, _Client()) is None

    class Own:
        compresses_uplink = True

    with pytest.raises(ValueError, match="compresses its own uplink"):
        make_uplink({"name": "topk"}, fm, Own())


def test_state_split_and_merge():
    alg, own = UplinkCompression.split_state({"c": torch.zeros(2), "ef.delta.residual": torch.ones(2)})
    assert set(alg) == {"c"} and set(own) == {"ef.delta.residual"}
    assert UplinkCompression.split_state(None) == (None, None)
    merged = UplinkCompression.merge_state({"c": torch.zeros(1)}, None, {"ef.round": torch.ones(1)})
    assert set(merged) == {"c", "ef.round"}  # the algorithm's unchanged state is kept
    assert UplinkCompression.merge_state(None, {"c": torch.ones(1)}, None) == {"c": torch.ones(1)}


def test_identity_compression_changes_nothing_but_runs_the_machinery(make_config, tmp_path):
    run_experiment(make_config(*SMALL), tmp_path / "none")
    run_experiment(make_config(*SMALL, "compressor=identity"), tmp_path / "identity")
    a, b = _rows(tmp_path / "none"), _rows(tmp_path / "identity")
    assert [r["test_accuracy"] for r in a] == [r["test_accuracy"] for r in b]
    assert [r["bytes_up"] for r in a] == [r["bytes_up"] for r in b]
    assert all(r["upload_ratio"] == 1.0 and r["compression_error"] == 0.0 for r in b)


def test_topk_fedavg_reports_real_bytes_and_stores_residuals(make_config):
    cfg = make_config(*SMALL, "compressor=topk", "compressor.ratio=0.05", "compressor.index=int32")
    exp = build(cfg)
    try:
        exp.simulation.run()
        worker = exp.engine.workers[0]
        rows = exp.simulation.history
        fm = worker.fm
        per_client = sum(8 * math.ceil(0.05 * s.numel) for s in fm.slots if s.is_param) + 4 * fm.num_buffers
        assert all(r["bytes_up"] == per_client * r["num_clients"] for r in rows)
        assert rows[0]["bytes_up"] < 0.15 * rows[0]["bytes_down"]
        sampled = {c for r in range(3) for c in sample_clients(1, r, 8, 4)}
        for c in sampled:
            state = worker.store.get(c)
            assert state["ef.delta.residual"].numel() == fm.num_params
            assert float(state["ef.delta.residual"].abs().sum()) > 0
    finally:
        exp.engine.close()


def test_randomk_is_deterministic_across_worker_counts(make_config, tmp_path):
    over = [*SMALL, "compressor=randomk", "compressor.ratio=0.2", "compressor.unbiased=false",
            "compressor.error_feedback=true"]
    run_experiment(make_config(*over), tmp_path / "one")
    run_experiment(make_config(*over, "engine.num_workers=2"), tmp_path / "two")
    a, b = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert [r["test_accuracy"] for r in a] == [r["test_accuracy"] for r in b]
    assert [r["bytes_up"] for r in a] == [r["bytes_up"] for r in b]


def test_randomk_summable_in_fl_sum_of_payloads_equals_sum_of_decodes():
    """The worker decodes per client then sums; for a summable compressor that is the same sum."""
    fm = _fm()
    vc = VectorCompressor(ErrorFeedback(RandomK(0.2, unbiased=False)), Layout.from_slots(fm.slots, len(fm)))
    xs = [torch.randn(len(fm), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    from fl_platform.compression import Key

    enc = [vc.encode(x, None, Key(5, 2, c)) for c, x in enumerate(xs)]
    total = enc[0][0]
    for p, _ in enc[1:]:
        total = vc.add(total, p)
    assert torch.allclose(vc.decode(total), sum(vc.decode(p) for p, _ in enc), atol=1e-5)


def test_scaffold_with_topk_compresses_the_model_delta_and_sends_the_control_delta_dense(make_config):
    cfg = make_config(*SMALL, "algorithm=scaffold", "compressor=topk", "compressor.ratio=0.1",
                      "compressor.index=int32")
    exp = build(cfg)
    try:
        exp.simulation.run()
        w = exp.engine.workers[0]
        fm = w.fm
        per_client = sum(8 * math.ceil(0.1 * s.numel) for s in fm.slots if s.is_param) + 4 * fm.num_buffers \
            + 4 * fm.num_params
        assert all(r["bytes_up"] == per_client * r["num_clients"] for r in exp.simulation.history)
        assert set(w.store.specs) == {"c", "ef.delta.residual", ROUND_KEY}
    finally:
        exp.engine.close()


@pytest.mark.parametrize("name", ["qsgd", "efsign", "powersgd"])
def test_other_compressors_learn_on_digits(make_config, tmp_path, name):
    extra = ["compressor.rank=4"] if name == "powersgd" else []
    summary = run_experiment(make_config("rounds=5", "num_clients=10", "clients_per_round=5", "train.epochs=1",
                                         "save_model=false", f"compressor={name}", *extra), tmp_path)
    rows = _rows(tmp_path)
    assert rows[0]["bytes_up"] < 0.5 * rows[0]["bytes_down"]
    assert summary["final_test_accuracy"] > 0.5  # 10 classes: chance is 0.1


def test_compressor_config_errors_name_the_key(make_config):
    with pytest.raises(Exception, match="ratoi"):
        make_config("compressor=topk", "compressor.ratoi=0.1")
    cfg = make_config(*SMALL, "compressor=topk", "compressor.ratio=0")
    with pytest.raises(ValueError, match=r"compressor\.ratio must be in \(0, 1\]"):
        build(cfg)
