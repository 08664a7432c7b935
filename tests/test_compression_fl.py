"""Uplink compression in FL: any algorithm, real bytes, EF residuals in the client-state store."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fl_platform.compression import (
    ErrorFeedback,
    Key,
    Layout,
    RandomK,
    TopK,
    VectorCompressor,
    build_compressor,
)
from fl_platform.compression.registry import compressor_names
from fl_platform.compression.uplink import ROUND_KEY, UplinkCompression, make_uplink
from fl_platform.core import Broadcast, ClientUpdate, RoundContext
from fl_platform.experiment import build, run_experiment
from fl_platform.rounds.sampling import sample_clients
from fl_platform.state.manifest import ROUND_KEY as STAMP
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


class _Client:  # stands in for a client half: only its declared uploads and sizes matter here
    def __init__(self, sizes=None, uploads=None):
        self.cfg = None
        if sizes is not None:
            self.contribution_sizes = lambda: sizes
        if uploads is not None:
            self.uploads = lambda cfg: uploads


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
        # residual + what the server decodes = what was to be sent (+ the old residual), per sample:
        # the hook compresses delta = x / n and the server receives n * decoded
        assert torch.allclose(own["ef.delta.residual"] + dec[: fm.num_params] / 7.0,
                              x[: fm.num_params] / 7.0 + old, atol=1e-5)
        assert torch.equal(dec[fm.num_params:], x[fm.num_params:])  # BatchNorm statistics dense
        assert torch.equal(update.tensors["extra"], torch.ones(5))  # not listed: dense
        layout = Layout.from_slots(fm.slots, len(fm))
        expected = sum(TopK(0.1).payload_nbytes(s.numel) for s in layout.segments if s.compress) \
            + 4 * fm.num_buffers + 4 * 5
        assert update.bytes_up == expected
        assert float(own[ROUND_KEY]) == r + 1
    assert update.metrics.values["ef_age_rounds"] == [1.0, 1.0]


# C(c x) = c C(x) for c > 0 with the same key and (scaled) state: every compressor but sign, whose
# +-1 message ignores the scale (C(c x) = C(x)). A new compressor must be placed in one of the two.
HOMOGENEOUS = {"identity": {}, "topk": {"ratio": 0.2}, "randomk": {"ratio": 0.3}, "qsgd": {"bits": 2},
               "efsign": {}, "powersgd": {"rank": 1}, "acpsgd": {"rank": 1}}
SCALE_FREE = {"sign": {}}


def _two_steps(comp, layout: Layout, x1: torch.Tensor, x2: torch.Tensor) -> list[torch.Tensor]:
    """Decoded messages of two consecutive encodes (EF residual / warm-start state carried)."""
    vc = VectorCompressor(comp, layout)
    out, state = [], None
    for step, x in enumerate((x1, x2)):
        payload, state = vc.encode(x, state, Key(5, step, 1))
        out.append(vc.decode(payload, state))
    return out


def test_every_compressor_is_positively_homogeneous_except_sign_which_is_scale_free():
    assert {*HOMOGENEOUS, *SCALE_FREE, "none"} == set(compressor_names())
    fm = _fm()
    layout = Layout.from_slots(fm.slots, len(fm))
    x1, x2 = (torch.randn(len(fm), generator=torch.Generator().manual_seed(s)) for s in (3, 4))
    for c in (8.0, 0.25):  # powers of two: c x is exact, so homogeneity holds bit for bit
        for name, options in HOMOGENEOUS.items():
            for ef in (False, True):
                comp = build_compressor(name, error_feedback=ef, **options)
                plain, scaled = _two_steps(comp, layout, x1, x2), _two_steps(comp, layout, c * x1, c * x2)
                for a, b in zip(plain, scaled):
                    assert torch.equal(b, c * a), (name, ef, c)
        for name, options in SCALE_FREE.items():
            comp = build_compressor(name, error_feedback=False, **options)
            plain, scaled = _two_steps(comp, layout, x1, x2), _two_steps(comp, layout, c * x1, c * x2)
            p = fm.num_params  # (BatchNorm buffers travel dense, so they scale)
            for a, b in zip(plain, scaled):
                assert torch.equal(b[:p], a[:p]) and not torch.equal(b[:p], c * a[:p]), (name, c)


def test_uplink_errors_are_clear():
    fm = _fm()
    with pytest.raises(NotImplementedError, match="acpsgd is not implemented for FL"):
        make_uplink({"name": "acpsgd"}, fm, _Client())
    with pytest.raises(ValueError, match=r"needs compressor\.scope=layer"):
        make_uplink({"name": "powersgd", "scope": "global"}, fm, _Client())
    with pytest.raises(ValueError, match="does not declare its size"):
        make_uplink({"name": "topk", "tensors": ["delta", "delta_c"]}, fm,
                    _Client(uploads={"delta": "n", "delta_c": None}))
    with pytest.raises(ValueError, match=r"compressor.tensors names \['weights'\], but _Client uploads only \['delta'\]"):
        make_uplink({"name": "topk", "tensors": ["weights"]}, fm, _Client())
    with pytest.raises(ValueError, match=r"compressor\.tensors is empty"):
        make_uplink({"name": "qsgd", "tensors": []}, fm, _Client())
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


def _compressed(fm):
    """The segments a layer-wise compressor compresses: each parameter tensor and its alignment padding."""
    return [s for s in Layout.from_slots(fm.slots, len(fm)).segments if s.compress]


def test_topk_fedavg_reports_real_bytes_and_stores_residuals(make_config):
    cfg = make_config(*SMALL, "compressor=topk", "compressor.ratio=0.05", "compressor.index=int32")
    exp = build(cfg)
    try:
        exp.simulation.run()
        worker = exp.engine.workers[0]
        rows = exp.simulation.history
        fm = worker.fm
        per_client = sum(8 * math.ceil(0.05 * s.numel) for s in _compressed(fm)) + 4 * fm.num_buffers
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
        per_client = sum(8 * math.ceil(0.1 * s.numel) for s in _compressed(fm)) + 4 * fm.num_buffers \
            + 4 * fm.num_params
        assert all(r["bytes_up"] == per_client * r["num_clients"] for r in exp.simulation.history)
        assert set(w.store.specs) == {"c", "ef.delta.residual", ROUND_KEY, STAMP}
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


def _scaled_sign(fm: FlatModel, d: torch.Tensor) -> torch.Tensor:
    """EF-SignSGD's message by hand, per layer: (||d_l||_1 / d_l) sign(d_l), zero sent as +1."""
    out = d.clone()  # buffers (none here) would travel dense
    for slot in fm.slots:
        if slot.is_param:
            seg = d[slot.offset : slot.offset + slot.numel]
            out[slot.offset : slot.offset + slot.numel] = seg.abs().mean() * torch.where(seg < 0, -1.0, 1.0)
    return out


def _client_deltas(exp) -> tuple[torch.Tensor, list[tuple[float, torch.Tensor]]]:
    """The global weights and every client's (n_k, delta_k) of round 1, from the run's own client half."""
    worker = exp.engine.workers[0]
    w0 = exp.simulation.server.weights.clone()
    n = exp.cfg.num_clients
    ctx = RoundContext(round=0, seed=exp.cfg.seed, clients=tuple(range(n)), num_rounds=1, num_clients=n)
    out = []
    for c in range(n):
        u = worker.client.train(ctx, c, Broadcast({"weights": w0}), None, worker.client_data(c), worker.trainer)
        out.append((u.weights["n"], u.tensors["delta"] / u.weights["n"]))
    return w0, out


@pytest.mark.parametrize("cohort", [1, 3])
@pytest.mark.parametrize("name", ["sign", "efsign"])
def test_a_sign_fedavg_round_is_the_sample_weighted_mean_of_the_client_messages(make_config, name, cohort):
    """FedAvg sends n_k delta_k; the server must get sum_k n_k C(delta_k) / sum_k n_k, not
    sum_k C(n_k delta_k) / sum_k n_k (for sign: +-1 whatever n_k, a step shrunk by K / sum n_k).
    Also with the three clients trained as one vectorised chunk (compressed runs go client by client)."""
    exp = build(make_config("rounds=1", "num_clients=3", "clients_per_round=3", "train.epochs=1", "seed=2",
                            "model.hidden=[8]", "algorithm.server_lr=0.01", f"compressor={name}",
                            "save_model=false", f"engine.cohort_size={cohort}"))
    try:
        w0, clients = _client_deltas(exp)
        fm = exp.engine.workers[0].fm
        assert len({n for n, _ in clients}) == 3  # unequal sample counts, so the weighting matters
        message = (lambda d: torch.where(d < 0, -1.0, 1.0)) if name == "sign" else (lambda d: _scaled_sign(fm, d))
        expected = sum(n * message(d) for n, d in clients) / sum(n for n, _ in clients)
        exp.simulation.run()
        torch.testing.assert_close(exp.simulation.server.weights, w0 + 0.01 * expected, rtol=0, atol=1e-6)
    finally:
        exp.engine.close()


def test_efsign_residual_is_kept_per_sample_so_a_clients_weight_does_not_enter_it():
    """Two uploads of one client with n = 5: the message is 5 C(a), a = delta + e, e <- a - C(a)."""
    torch.manual_seed(0)
    fm = FlatModel(torch.nn.Sequential(torch.nn.Linear(6, 20), torch.nn.ReLU(), torch.nn.Linear(20, 3)))
    up = make_uplink({"name": "efsign"}, fm, _Client())
    d1, d2 = (torch.randn(len(fm), generator=torch.Generator().manual_seed(s)) for s in (7, 8))
    u1 = ClientUpdate(0, {"delta": 5.0 * d1}, {"n": 5.0}, 5)
    own = up.apply(_ctx(0), 0, u1, None)
    torch.testing.assert_close(u1.tensors["delta"], 5.0 * _scaled_sign(fm, d1))
    e1 = d1 - _scaled_sign(fm, d1)
    torch.testing.assert_close(own["ef.delta.residual"], e1)
    u2 = ClientUpdate(0, {"delta": 5.0 * d2}, {"n": 5.0}, 5)
    own = up.apply(_ctx(1), 0, u2, own)
    torch.testing.assert_close(u2.tensors["delta"], 5.0 * _scaled_sign(fm, d2 + e1))
    torch.testing.assert_close(own["ef.delta.residual"], d2 + e1 - _scaled_sign(fm, d2 + e1))


def test_a_zero_weight_client_contributes_zero_and_a_missing_weight_is_named():
    fm = _fm()
    up = make_uplink({"name": "sign"}, fm, _Client())
    u = ClientUpdate(0, {"delta": torch.zeros(len(fm))}, {"n": 0.0}, 0)
    up.apply(_ctx(0), 0, u, None)
    assert torch.equal(u.tensors["delta"], torch.zeros(len(fm)))  # not 0 * (+1) per element
    with pytest.raises(ValueError, match=r"scaled by weight 'n', but the update carries weights \['m'\]"):
        up.apply(_ctx(0), 0, ClientUpdate(0, {"delta": torch.ones(len(fm))}, {"m": 1.0}, 1), None)
