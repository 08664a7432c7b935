"""System model: per-client devices from (seed, client id), traces, and simulated round time."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fl_platform.experiment import run_experiment
from fl_platform.system import DistConf, SystemConf, SystemModel, build_system
from fl_platform.system.model import MBPS


def _sampled(**kw) -> SystemConf:
    return SystemConf(name="sampled", **kw)


def test_profiles_depend_only_on_seed_and_client():
    conf = _sampled(uplink_mbps=DistConf(dist="loguniform", low=0.5, high=50.0),
                    compute_sps=DistConf(dist="lognormal", median=500.0, sigma=0.5))
    a, b = SystemModel(conf, seed=3), SystemModel(conf, seed=3)
    forward = [a.profile(c) for c in range(20)]
    backward = [b.profile(c) for c in reversed(range(20))][::-1]
    assert forward == backward  # query order (scheduling) does not matter
    assert SystemModel(conf, seed=4).profile(0) != forward[0]
    # another quantity's distribution does not move this one's draws (one stream per quantity)
    other = SystemModel(_sampled(uplink_mbps=conf.uplink_mbps, compute_sps=DistConf(value=7.0)), seed=3)
    assert [other.profile(c).uplink_Bps for c in range(20)] == [p.uplink_Bps for p in forward]


def test_distributions_have_their_parameters():
    n = 3000
    m = SystemModel(_sampled(compute_sps=DistConf(dist="uniform", low=100.0, high=300.0),
                             uplink_mbps=DistConf(dist="loguniform", low=1.0, high=100.0),
                             downlink_mbps=DistConf(dist="lognormal", median=20.0, sigma=0.7)), seed=0)
    ps = [m.profile(c) for c in range(n)]
    sps = np.array([p.compute_sps for p in ps])
    up = np.log(np.array([p.uplink_Bps for p in ps]) / MBPS)
    down = np.log(np.array([p.downlink_Bps for p in ps]) / MBPS)
    assert sps.min() >= 100 and sps.max() <= 300 and abs(sps.mean() - 200) < 5 * 57.7 / math.sqrt(n)
    assert up.min() >= 0 and up.max() <= math.log(100)
    assert abs(up.mean() - math.log(10)) < 5 * (math.log(100) / math.sqrt(12)) / math.sqrt(n)
    assert abs(down.mean() - math.log(20)) < 5 * 0.7 / math.sqrt(n)
    assert abs(down.std() - 0.7) < 0.05
    const = SystemModel(_sampled(), seed=0).profile(5)
    assert const.compute_sps == 1000.0 and const.uplink_Bps == 10 * MBPS and const.downlink_Bps == 50 * MBPS


def test_downlink_can_follow_the_uplink():
    m = SystemModel(_sampled(uplink_mbps=DistConf(dist="loguniform", low=0.5, high=50.0), downlink_per_uplink=10.0), 0)
    for c in range(5):
        p = m.profile(c)
        assert p.downlink_Bps == pytest.approx(10 * p.uplink_Bps)
    with pytest.raises(ValueError, match=r"system\.downlink_per_uplink"):
        SystemModel(_sampled(downlink_per_uplink=0.0), 0)


def test_jitter_varies_bandwidth_by_round_deterministically():
    m = SystemModel(_sampled(jitter_sigma=0.5), seed=1)
    assert m.profile(2, 0) == SystemModel(_sampled(jitter_sigma=0.5), seed=1).profile(2, 0)
    assert m.profile(2, 0).uplink_Bps != m.profile(2, 1).uplink_Bps
    assert m.profile(2, 0).compute_sps == m.profile(2).compute_sps
    assert SystemModel(_sampled(), seed=1).profile(2, 7) == SystemModel(_sampled(), seed=1).profile(2)


def test_round_time_is_the_slowest_clients_download_compute_and_upload():
    m = SystemModel(_sampled(compute_sps=DistConf(dist="uniform", low=100.0, high=1000.0),
                             uplink_mbps=DistConf(dist="uniform", low=1.0, high=10.0), latency_s=0.1), seed=0)
    stats = {c: {"samples": 100.0 * (c + 1), "bytes_up": 1e5 * (3 - c), "bytes_down": 4e5} for c in range(3)}
    out = m.round_metrics(0, stats)
    totals = {}
    for c, s in stats.items():
        p = m.profile(c)
        totals[c] = (0.1 + s["bytes_down"] / p.downlink_Bps) + s["samples"] / p.compute_sps + \
            (0.1 + s["bytes_up"] / p.uplink_Bps)
    straggler = max(totals, key=totals.get)
    assert out["sim_straggler"] == straggler
    assert out["simulated_time_s"] == pytest.approx(totals[straggler])
    p = m.profile(straggler)
    assert out["sim_upload_s"] == pytest.approx(0.1 + stats[straggler]["bytes_up"] / p.uplink_Bps)
    assert out["sim_upload_max_s"] >= out["sim_upload_min_s"]
    assert m.round_metrics(0, {}) == {"simulated_time_s": 0.0}


def test_trace_file(tmp_path):
    path = tmp_path / "devices.csv"
    path.write_text("compute_sps,uplink_mbps,downlink_mbps,latency_s\n100,1,10,0.2\n200,2,20,\n")
    m = SystemModel(SystemConf(name="trace", trace=str(path), latency_s=0.05), seed=0)
    assert m.profile(0).compute_sps == 100 and m.profile(0).latency_s == 0.2
    assert m.profile(3).uplink_Bps == 2 * MBPS and m.profile(3).latency_s == 0.05  # row 3 mod 2
    rnd = SystemModel(SystemConf(name="trace", trace=str(path), trace_assign="random"), seed=0)
    assert {rnd.profile(c).compute_sps for c in range(40)} == {100.0, 200.0}
    ids = tmp_path / "ids.csv"
    ids.write_text("client_id,compute_sps,uplink_mbps,downlink_mbps\n7,50,1,1\n")
    mid = SystemModel(SystemConf(name="trace", trace=str(ids)), seed=0)
    assert mid.profile(7).compute_sps == 50
    with pytest.raises(KeyError, match="no row for client_id 8"):
        mid.profile(8)


@pytest.mark.parametrize("text,match", [
    ("compute_sps,uplink_mbps\n1,2\n", r"lacks column\(s\) \['downlink_mbps'\]"),
    ("compute_sps,uplink_mbps,downlink_mbps\n1,0,1\n", "must be > 0"),
    ("compute_sps,uplink_mbps,downlink_mbps\n1,x,1\n", "line 2"),
    ("compute_sps,uplink_mbps,downlink_mbps\n", "no rows"),
])
def test_bad_trace_files_are_named(tmp_path, text, match):
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        SystemModel(SystemConf(name="trace", trace=str(path)), seed=0)


def test_bad_config_names_the_key():
    with pytest.raises(ValueError, match=r"system\.uplink_mbps\.dist must be one of"):
        SystemModel(_sampled(uplink_mbps=DistConf(dist="pareto")), 0)
    with pytest.raises(ValueError, match=r"system\.compute_sps needs 0 < low <= high"):
        SystemModel(_sampled(compute_sps=DistConf(dist="uniform", low=5.0, high=1.0)), 0)
    with pytest.raises(ValueError, match=r"system=trace needs system\.trace"):
        SystemModel(SystemConf(name="trace"), 0)
    with pytest.raises(FileNotFoundError, match=r"system\.trace"):
        SystemModel(SystemConf(name="trace", trace="/nonexistent.csv"), 0)
    assert build_system(SystemConf(), 0) is None and build_system(None, 0) is None


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_metrics_report_simulated_time_independent_of_workers(make_config, tmp_path):
    base = ["rounds=3", "num_clients=12", "clients_per_round=4", "train.epochs=1", "system=lognormal", "seed=2",
            "save_model=false"]
    run_experiment(make_config(*base), tmp_path / "one")
    run_experiment(make_config(*base, "engine.num_workers=2"), tmp_path / "two")
    one, two = _rows(tmp_path / "one"), _rows(tmp_path / "two")
    assert [r["simulated_time_s"] for r in one] == [r["simulated_time_s"] for r in two]
    # recompute round 1 from the model: every client downloads and uploads the dense vector
    cfg = make_config(*base)
    model = build_system(cfg.system, cfg.seed)
    from fl_platform.experiment import load_data
    from fl_platform.rounds.sampling import sample_clients
    from fl_platform.run_config import read_config

    data = load_data(read_config(cfg))
    vec_bytes = one[0]["bytes_down"] // 4
    assert one[0]["bytes_up"] == 4 * vec_bytes
    sizes = data.client_sizes()
    expected = max(model.client_time(c, 0, float(sizes[c]), vec_bytes, vec_bytes).total_s
                   for c in sample_clients(cfg.seed, 0, cfg.num_clients, cfg.clients_per_round))
    assert one[0]["simulated_time_s"] == pytest.approx(expected)


def test_no_system_model_no_simulated_time(make_config, tmp_path):
    run_experiment(make_config("rounds=1", "num_clients=6", "clients_per_round=2", "train.epochs=1",
                                  "save_model=false"), tmp_path)
    assert "simulated_time_s" not in _rows(tmp_path)[0]


def test_plot_accumulates_simulated_time():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("plot", Path(__file__).resolve().parents[1] / "scripts" / "plot.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    run = {"rows": [{"simulated_time_s": 2.0, "test_accuracy": 0.1}, {"simulated_time_s": 3.0},
                    {"simulated_time_s": 1.0, "test_accuracy": 0.3}]}
    assert plot._series(run, "simulated_time_s", "test_accuracy") == ([2.0, 6.0], [0.1, 0.3])
