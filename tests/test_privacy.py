"""Client-level differential privacy (fl_platform/privacy, docs/privacy.md).

Every contribution the server adds is within the clip norm (sequential, vectorised MLP and CNN
chunks, after compression); the server's noise has the configured standard deviation; epsilon is
dp-accounting's own for the same events; inline, Ray with 2 workers and Flower give the same run;
a target-epsilon run stops at the right round; what the mechanism does not cover is refused.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import sys
from pathlib import Path

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from dp_accounting import pld, rdp

from fl_platform.algorithms.base import FedAvgCohort
from fl_platform.compression.uplink import UplinkCompression
from fl_platform.core import Aggregate, Broadcast, ClientUpdate, RoundContext
from fl_platform.engine.worker import Worker
from fl_platform.experiment import ConfigError, build, run_experiment
from fl_platform.privacy.accounting import Accountant, noise_multiplier_for
from fl_platform.privacy.clipping import BELOW, CLIP_KEY, ClientPrivacy, joint_norm
from fl_platform.privacy.config import AdaptiveClipConf, PrivacyConf
from fl_platform.privacy.server import ServerPrivacy
from fl_platform.privacy.spec import PrivateUploads
from fl_platform.rounds.sampling import sample_clients
from fl_platform.rounds.simulation import is_timing_key
from fl_platform.training.vectorised import CohortTrainer

from .conftest import compose_config
from .test_engine_determinism import assert_same as same

COMMON = ("dataset=digits", "num_clients=20", "clients_per_round=8", "rounds=3", "train.epochs=1",
          "train.batch_size=16", "partition=iid", "engine.threads_per_worker=1", "save_model=false", "seed=3")
MLP = ("model=mlp", "model.hidden=[16]")
CLIP = 0.05  # below every client's update norm here, so every update is clipped
DP = ("privacy=central", f"privacy.clip={CLIP}", "privacy.noise_multiplier=0.8", "privacy.delta=1e-3")
REL = 1e-6  # float32 rounding of a clipped vector's norm


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one torch thread (conftest)


def run(*overrides: str, run_dir: Path | None = None):
    model = () if any(o.startswith("model=") for o in overrides) else MLP
    exp = build(compose_config(*COMMON, *model, *overrides), run_dir)
    try:
        summary = exp.simulation.run()
    finally:
        exp.engine.close()
    rows = [{k: v for k, v in row.items() if not is_timing_key(k)} for row in exp.simulation.history]
    return exp.simulation.server.weights.clone(), rows, summary, exp


def assert_same(a, b) -> None:
    """Same final model (1e-6) and metric rows (relative 1e-6), as tests/test_engine_determinism.py asks."""
    same(a[:2], b[:2])


# ---------------------------------------------------------------- clipping


def _record_folds(monkeypatch) -> list[float]:
    """The joint norm of the private tensors of every update a worker adds to its sum."""
    norms: list[float] = []
    fold = Worker._fold

    def recording(self, update, acc):
        if self.privacy is not None and update.tensors:
            norms.append(joint_norm(update.tensors[n] for n in self.privacy.private.tensors))
        return fold(self, update, acc)

    monkeypatch.setattr(Worker, "_fold", recording)
    return norms


@pytest.mark.parametrize("extra", [(), ("algorithm=scaffold",), ("compressor=topk", "compressor.ratio=0.3"),
                                   ("compressor=randomk", "compressor.ratio=0.3"), ("compressor=qsgd",)],
                         ids=["fedavg", "scaffold-joint", "topk-ef", "randomk-unbiased", "qsgd"])
def test_every_sequential_contribution_is_within_the_clip_norm(monkeypatch, extra):
    """Each client's update, as the server adds it (after compression: unbiased random-k and QSGD
    lengthen vectors, error feedback adds its residual), has norm <= C; what the compressor is given
    is already clipped (what is clipped is what is compressed)."""
    norms = _record_folds(monkeypatch)
    compressed: list[float] = []
    apply = UplinkCompression.apply

    def recording(self, ctx, client_id, update, own):
        compressed.append(joint_norm(t for k, t in update.tensors.items() if k != BELOW))
        return apply(self, ctx, client_id, update, own)

    monkeypatch.setattr(UplinkCompression, "apply", recording)
    _, rows, *_ = run(*DP, *extra)
    assert len(norms) == sum(row["num_clients"] for row in rows) > 3 * 4  # (Poisson: about 8 per round)
    assert max(norms) <= CLIP * (1 + REL)
    assert min(norms) > 0.5 * CLIP  # clipped to C, not zeroed
    assert all(row["dp_clipped_fraction"] == 1.0 and row["dp_update_norm"] > CLIP for row in rows)
    if any(e.startswith("compressor") for e in extra):
        assert len(compressed) == len(norms) and max(compressed) <= CLIP * (1 + REL)


@pytest.mark.parametrize("model", [("model=mlp", "model.hidden=[16]"),
                                   ("model=cnn", "model.channels=[2,4]", "model.hidden=8", "model.norm=batch")],
                         ids=["mlp", "cnn-batchnorm"])
def test_vectorised_chunks_clip_each_client(monkeypatch, model):
    """A chunk summed at once clips every client inside it (each contribution weight x ||delta|| <= C,
    BatchNorm buffers included in the norm) and the run equals the sequential one."""
    seen: list[float] = []
    weighted_sum = CohortTrainer.weighted_sum

    def recording(self, results, weights):
        for res, w in zip(results, weights):
            start = self._dp_starts[res.client_id]
            seen.append(w * float((res.vector - start).double().norm()))
        return weighted_sum(self, results, weights)

    sum_into = FedAvgCohort.sum_into

    def remember_starts(self, agg, clip=None):
        self.cohort._dp_starts = {r.client_id: p.start for r, p in zip(self.results, self.plans)}
        return sum_into(self, agg, clip)

    monkeypatch.setattr(CohortTrainer, "weighted_sum", recording)
    monkeypatch.setattr(FedAvgCohort, "sum_into", remember_starts)
    vectorised = run(*DP, *model, "engine.cohort_size=3")
    assert len(seen) == sum(row["num_clients"] for row in vectorised[1]) > 3 * 4
    assert max(seen) <= CLIP * (1 + REL) and min(seen) > 0.5 * CLIP
    assert_same(vectorised, run(*DP, *model))


# ---------------------------------------------------------------- noise


def _server(conf: PrivacyConf, size: int = 10, clients_per_round: int = 100, num_clients: int = 1000):
    return ServerPrivacy(conf, PrivateUploads(("delta",), ("n",)), {"delta": size}, num_clients=num_clients,
                         clients_per_round=clients_per_round, rounds=10, seed=4)


def _ctx(r: int) -> RoundContext:
    return RoundContext(round=r, seed=4, clients=(), num_rounds=10, num_clients=1000)


def test_server_noise_has_the_configured_standard_deviation():
    """200,000 draws: the sample std is within 1% of z C (about 6 standard errors; +-10% is far
    outside), the mean within 4 standard errors of 0; (seed, round) fixes the draw."""
    z, clip, n = 1.3, 0.7, 200_000
    sp = _server(PrivacyConf(name="central", clip=clip, noise_multiplier=z), size=n)
    agg = Aggregate()
    row = sp.privatise(_ctx(2), agg)
    x = agg.tensors["delta"]
    assert row["dp_noise_std"] == pytest.approx(z * clip)
    assert float(x.std()) == pytest.approx(z * clip, rel=0.01)
    assert abs(float(x.mean())) < 4 * z * clip / math.sqrt(n)
    assert agg.weights == {"n": 100.0}  # the public denominator, not the number of contributions
    again = Aggregate()
    sp.privatise(_ctx(2), again)
    assert torch.equal(again.tensors["delta"], x)
    other = Aggregate()
    sp.privatise(_ctx(3), other)
    assert float((other.tensors["delta"] - x).abs().max()) > 0


def test_noise_is_added_once_whatever_the_number_of_workers():
    assert_same(run(*DP), run(*DP, "engine.num_workers=3"))


def test_local_noise_has_the_configured_standard_deviation_and_is_each_clients_own():
    z, clip, n = 0.9, 2.0, 200_000
    privacy = ClientPrivacy(PrivacyConf(name="local", clip=clip, noise_multiplier=z),
                            PrivateUploads(("delta",), ("n",)), {"delta": "n"})
    bc = Broadcast({}, {CLIP_KEY: clip})
    ctx = RoundContext(round=1, seed=5, clients=(0, 1), num_rounds=3, num_clients=2)

    def upload(cid: int) -> torch.Tensor:
        update = ClientUpdate(cid, {"delta": torch.zeros(n)}, {"n": 7.0}, 7)
        privacy.apply(ctx, bc, update)
        assert update.weights == {"n": 1.0}
        return update.tensors["delta"]

    a = upload(0)
    assert float(a.std()) == pytest.approx(z * clip, rel=0.01)
    assert torch.equal(a, upload(0)) and not torch.equal(a, upload(1))


def test_adaptive_clipping_follows_andrew_et_al():
    """z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2); C <- C exp(-lr (b_hat - gamma)) with b_hat the noised
    fraction of unclipped clients; the count's noise has std sigma_b (3,000 rounds, within 5%)."""
    z, sigma_b = 1.0, 4.0
    conf = PrivacyConf(name="central", clip=2.0, noise_multiplier=z,
                       adaptive=AdaptiveClipConf(enabled=True, quantile=0.6, lr=0.3, count_stddev=sigma_b))
    sp = _server(conf, clients_per_round=80)
    assert sp.update_multiplier == pytest.approx((z ** -2 - (2 * sigma_b) ** -2) ** -0.5)
    row = sp.privatise(_ctx(0), Aggregate())
    assert row["dp_noise_std"] == pytest.approx(sp.update_multiplier * 2.0)
    draws = []
    for r in range(3000):
        agg = Aggregate()
        agg.add({"delta": torch.zeros(10), BELOW: torch.tensor([0.0])}, {"n": 1.0})
        draws.append((sp.privatise(_ctx(r), agg)["dp_unclipped_estimate"] - 0.5) * 80)
    assert float(np.std(draws)) == pytest.approx(sigma_b, rel=0.05)
    exact = _server(PrivacyConf(name="central", clip=2.0, noise_multiplier=0.0,
                                adaptive=AdaptiveClipConf(enabled=True, quantile=0.6, lr=0.3)), clients_per_round=4)
    agg = Aggregate()
    for b in (1, 1, 1, 0):  # 3 of 4 clients unclipped
        agg.add({"delta": torch.zeros(10), BELOW: torch.tensor([b - 0.5])}, {"n": 1.0})
    assert exact.privatise(_ctx(0), agg)["dp_unclipped_estimate"] == pytest.approx(0.75)
    assert exact.clip == pytest.approx(2.0 * math.exp(-0.3 * (0.75 - 0.6)))


def test_adaptive_clip_norm_moves_by_the_rule_and_survives_a_resume(tmp_path):
    overrides = (*DP, "privacy.adaptive.enabled=true", "privacy.adaptive.count_stddev=2", "checkpoint_every=1")
    _, rows, summary, exp = run(*overrides, run_dir=tmp_path)
    for a, b in itertools.pairwise(rows):
        assert b["dp_clip"] == pytest.approx(a["dp_clip"] * math.exp(-0.2 * (a["dp_unclipped_estimate"] - 0.5)))
    assert rows[-1]["dp_clip"] != CLIP and summary["dp_final_clip"] == exp.simulation.privacy.clip
    resumed = build(compose_config(*COMMON, *MLP, *overrides), tmp_path)  # continues after round 3: the clip it had
    resumed.engine.close()
    assert resumed.simulation.start_round == 3
    assert resumed.simulation.privacy.clip == exp.simulation.privacy.clip


# ---------------------------------------------------------------- accounting


def _direct(kind: str, event: dpa.DpEvent, delta: float, relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE):
    acc = rdp.RdpAccountant(neighboring_relation=relation) if kind == "rdp" else \
        pld.PLDAccountant(neighboring_relation=relation)
    acc.compose(event)
    return acc.get_epsilon(delta)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["poisson-rdp", "fixed-rdp", "poisson-pld", "all-rdp"])
def test_epsilon_equals_dp_accounting_directly(case):
    n, k, z, rounds, delta = 1000, 50, 1.1, 40, 1e-5
    sampling, kind = case.split("-")
    if kind == "pld":
        rounds = 8  # PLD composes round by round (~0.4 s each)
    if sampling == "all":
        k, sampling = n, "fixed"
    q = k / n
    if sampling == "poisson":
        expected = _direct(kind, dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), rounds),
                           delta)
    elif k == n:  # replace-one, no subsampling: sensitivity 2C
        expected = _direct(kind, dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z / 2), rounds), delta)
    else:  # replace-one: the sum of clipped updates moves by up to 2C, so the noise multiplier is z/2
        event = dpa.SampledWithoutReplacementDpEvent(n, k, dpa.GaussianDpEvent(z / 2))
        expected = _direct(kind, dpa.SelfComposedDpEvent(event, rounds), delta, dpa.NeighboringRelation.REPLACE_ONE)
    ours = Accountant("central", kind, z, delta, n, k, sampling, seed=0)
    assert ours.epsilon(rounds) == pytest.approx(expected, rel=1e-9 if kind == "rdp" else 1e-3)
    assert 0 < ours.epsilon(1) < ours.epsilon(rounds // 2) < ours.epsilon(rounds)


def test_local_epsilon_is_the_worst_clients_over_its_participations():
    n, k, z, rounds, delta = 30, 6, 2.0, 12, 1e-5
    counts = np.zeros(n, dtype=int)
    for r in range(rounds):
        counts[list(sample_clients(7, r, n, k))] += 1
    expected = _direct("rdp", dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z / 2), int(counts.max())), delta)
    ours = Accountant("local", "rdp", z, delta, n, k, "fixed", seed=7)
    assert ours.epsilon(rounds) == pytest.approx(expected, rel=1e-9)
    assert ours.participations(rounds) == counts.max() < rounds


def test_logged_epsilon_equals_dp_accounting_directly():
    _, rows, summary, _ = run(*DP, "privacy.sampling=poisson")
    q, z = 8 / 20, 0.8
    for r, row in enumerate(rows, start=1):
        event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z)), r)
        assert row["dp_epsilon"] == pytest.approx(_direct("rdp", event, 1e-3), rel=1e-9)
    assert summary["dp_epsilon"] == rows[-1]["dp_epsilon"]


def test_target_epsilon_stops_before_the_round_that_would_exceed_it():
    acc = Accountant("central", "rdp", 0.8, 1e-3, 20, 8, "poisson", seed=3)
    target = (acc.epsilon(4) + acc.epsilon(5)) / 2  # 4 rounds fit, the 5th would exceed it
    _, rows, summary, _ = run(*DP, "rounds=9", "eval_every=3", f"privacy.target_epsilon={target}")
    assert [row["round"] for row in rows] == [1, 2, 3, 4]
    assert rows[-1]["dp_epsilon"] <= target < acc.epsilon(5)
    assert ["test_accuracy" in row for row in rows] == [False, False, True, True]  # the last round run: evaluated
    assert summary["rounds"] == 4 and "round 5 would raise epsilon" in summary["stop_reason"]


def test_a_target_below_one_rounds_epsilon_is_refused_at_start_up():
    one = Accountant("central", "rdp", 0.8, 1e-3, 20, 8, "poisson", seed=3).epsilon(1)
    with pytest.raises(ValueError, match=r"privacy\.target_epsilon=.* is below the epsilon of a single round"):
        run(*DP, f"privacy.target_epsilon={one / 2}")


@pytest.mark.slow
def test_noise_multiplier_helper_meets_the_target_tightly():
    kwargs = dict(num_clients=1000, clients_per_round=50, sampling="poisson", accountant="rdp")
    z = noise_multiplier_for(2.0, 1e-5, 60, **kwargs)
    acc = Accountant("central", "rdp", z, 1e-5, 1000, 50, "poisson", seed=0)
    assert acc.epsilon(60) <= 2.0
    assert Accountant("central", "rdp", z - 2e-4, 1e-5, 1000, 50, "poisson", seed=0).epsilon(60) > 2.0
    # a run with noise_multiplier=null takes that z and runs all its rounds within the target
    _, rows, summary, _ = run(*DP, "privacy.noise_multiplier=null", "privacy.target_epsilon=8", "privacy.sampling=poisson")
    assert len(rows) == 3 and rows[-1]["dp_epsilon"] <= 8
    assert summary["dp_noise_multiplier"] == noise_multiplier_for(8, 1e-3, 3, num_clients=20, clients_per_round=8,
                                                                  sampling="poisson")


@pytest.mark.parametrize("mode", [("privacy=local",), ("privacy.adaptive.enabled=true", "privacy.adaptive.lr=0.5")],
                         ids=["local", "central-adaptive"])
def test_a_calibrated_run_is_the_run_with_that_noise_multiplier_given(mode):
    """noise_multiplier=null is resolved once, before any party is built: each client's local noise and
    adaptive clipping's count noise use the calibrated z exactly as if it had been given (they used to
    read null as 0: local DP without noise, the count of unclipped clients published exact)."""
    target = ("privacy.target_epsilon=40", "privacy.sampling=poisson")
    kwargs = dict(num_clients=20, clients_per_round=8, sampling="poisson", mode=mode[0].split("=")[1]
                  if mode[0].startswith("privacy=") else "central")
    z = noise_multiplier_for(40, 1e-3, 3, seed=3, **kwargs)
    assert z > 0
    calibrated = run(*DP, *mode, "privacy.noise_multiplier=null", *target)
    given = run(*DP, *mode, f"privacy.noise_multiplier={z!r}", *target)
    assert calibrated[3].setup.privacy.noise_multiplier == z
    assert_same(calibrated, given)
    louder = run(*DP, *mode, f"privacy.noise_multiplier={2 * z!r}", *target)  # the noise does act
    assert not torch.allclose(calibrated[0], louder[0], atol=1e-4)


def test_poisson_sampling_draws_each_client_with_probability_q():
    sizes, hits = [], np.zeros(50)
    for r in range(2000):
        clients = sample_clients(1, r, 50, 10, "poisson")
        sizes.append(len(clients))
        hits[list(clients)] += 1
    assert np.mean(sizes) == pytest.approx(10, rel=0.02) and np.var(sizes) == pytest.approx(50 * 0.2 * 0.8, rel=0.1)
    assert np.all(np.abs(hits / 2000 - 0.2) < 0.04)
    assert sample_clients(1, 5, 50, 10, "poisson") == sample_clients(1, 5, 50, 10, "poisson")


# ---------------------------------------------------------------- runtimes


def _flower_utils():
    spec = importlib.util.spec_from_file_location("flower_utils", Path(__file__).with_name("flower_utils.py"))
    module = sys.modules.setdefault("flower_utils", importlib.util.module_from_spec(spec))
    if not hasattr(module, "LocalGrid"):
        spec.loader.exec_module(module)
    return module


# Without noise: a deployment draws its noise from the OS CSPRNG (tests/test_privacy_guarantees.py), so only
# the noiseless mechanism can equal the simulator's run: clipping, the server's second clip, adaptive C.
# Every client in every round: under DP a deployment draws its cohorts from a secret, not from the seed.
FLOWER_DP = ("num_clients=5", "clients_per_round=5", "partition=iid", "privacy=central", f"privacy.clip={CLIP}",
             "privacy.noise_multiplier=0", "privacy.adaptive.enabled=true", "privacy.adaptive.count_stddev=0")


@pytest.mark.slow
def test_flower_dp_run_equals_the_simulator(tmp_path):
    """The in-process ServerApp/ClientApp path: clipping in the ClientApp, the server's step in the
    ServerApp's loop (the public denominator, adaptive C from the exact count)."""
    from fl_platform.flower import config as fc
    from fl_platform.flower.client_app import app as client_app
    from fl_platform.flower.server_app import run_server

    overrides = (*COMMON, *MLP, *FLOWER_DP, "save_model=true", "compressor=randomk", "compressor.ratio=0.5")
    cfg = fc.compose(["logger.progress=false", *overrides])
    rc = fc.flatten_config(cfg, fc.DeployConf(round_timeout=5.0, poll_interval=0.01, connect_timeout=5.0))
    grid = _flower_utils().LocalGrid(client_app, [{"partition-id": i, "num-partitions": 5, "threads": 1}
                                                  for i in range(5)], rc)
    run_server(grid, rc, run_id=3, run_dir=tmp_path / "flower")
    run_experiment(cfg, tmp_path / "sim")
    a, b = (torch.load(tmp_path / d / "model.pt", weights_only=True) for d in ("flower", "sim"))
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-6
    rows = [[json.loads(line) for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("flower", "sim")]
    for x, y in zip(*rows):
        for key in ("dp_clip", "dp_unclipped_estimate", "dp_clipped_fraction", "num_clients"):
            assert x[key] == pytest.approx(y[key], rel=1e-6), key
    assert len({row["dp_clip"] for row in rows[0]}) == 3  # C moved every round


def test_flower_server_refuses_non_private_replies_and_the_strategy_api():
    from fl_platform.flower.strategy import AlgorithmStrategy

    conf = PrivacyConf(name="central", clip=1.0, noise_multiplier=1.0, adaptive=AdaptiveClipConf(enabled=True))
    sp = _server(conf)
    with pytest.raises(ValueError, match=r"\['kept'\]"):
        sp.bound(ClientUpdate(0, {"delta": torch.ones(10)}, {"n": 1.0, "kept": 3.0}, 1))
    with pytest.raises(ValueError, match=BELOW):
        sp.bound(ClientUpdate(0, {"delta": torch.ones(10), BELOW: torch.tensor([3.0])}, {"n": 1.0}, 1))
    update = ClientUpdate(0, {"delta": torch.full((10,), 5.0)}, {"n": 1.0}, 1)
    sp.bound(update)  # a client that did not clip is clipped by the server
    assert joint_norm(update.tensors.values()) == pytest.approx(1.0)
    strategy = AlgorithmStrategy(None, seed=0, num_rounds=1, num_clients=3, clients_per_round=3, privacy=sp)
    with pytest.raises(NotImplementedError, match="run_server"):
        strategy.configure_train(1, None, None, None)


@pytest.mark.ray
def test_ray_two_workers_equal_inline_under_dp(ray_session):
    overrides = (*DP, "privacy.adaptive.enabled=true", "privacy.adaptive.count_stddev=2", "algorithm=scaffold")
    assert_same(run(*overrides), run(*overrides, "engine=ray", "engine.num_workers=2"))


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(("overrides", "match"), [
    (("algorithm=oneshot_fedavg", "rounds=1", "algorithm.cache_dir=null"), "list mode"),
    (("algorithm=fusefl", "model=cnn"), "list mode"),
    (("algorithm=fedimpro", "model.hidden=[8,8]"), "not declared"),
    (("algorithm=baow",), "aggregation=opwa"),
    (("privacy.accountant=pld", "privacy.sampling=fixed"), "privacy.accountant=pld cannot account for privacy.sampling=fixed"),
    (("privacy.noise_multiplier=0", "privacy.target_epsilon=2", "privacy.delta=1e-5"), "privacy.target_epsilon"),
    (("privacy.noise_multiplier=null",), "privacy.noise_multiplier"),
    (("privacy.delta=0.1",), "privacy.delta"),
    (("privacy.adaptive.enabled=true",), "privacy.adaptive.count_stddev"),  # 8/20 = 0.4: too small for z = 0.8
    (("algorithm=scaffold", "algorithm.weighting=uniform"), "algorithm.weighting"),
], ids=["oneshot", "fusefl", "fedimpro", "baow-opwa", "pld-fixed", "target-without-noise", "null-z-no-target",
        "delta-too-large", "count-noise-too-small", "scaffold-weighting"])
def test_uncovered_configurations_are_refused(overrides, match):
    with pytest.raises((ConfigError, ValueError), match=match):
        build(compose_config(*COMMON, *DP, *overrides))  # (the default MLP: digits-sized)


def test_privacy_keys_are_refused_without_privacy_and_adaptive_without_central():
    with pytest.raises(ConfigError, match=r"privacy\.clip=0\.5 has no effect"):
        build(compose_config(*COMMON, "privacy.clip=0.5"))
    with pytest.raises(ConfigError, match=r"privacy\.adaptive\.enabled=True has no effect"):
        build(compose_config(*COMMON, "privacy=local", "privacy.adaptive.enabled=true"))


@pytest.mark.slow
def test_baow_plain_and_pld_with_poisson_run_under_dp():
    _, rows, *_ = run(*DP, "algorithm=baow", "algorithm.aggregation=plain", "algorithm.rho0=0.2")
    assert "baow_coverage" not in rows[0] and rows[0]["dp_clipped_fraction"] == 1.0
    _, rows, *_ = run(*DP, "privacy.accountant=pld", "privacy.sampling=poisson")
    assert rows[-1]["dp_epsilon"] < _direct("rdp", dpa.SelfComposedDpEvent(
        dpa.PoissonSampledDpEvent(0.4, dpa.GaussianDpEvent(0.8)), 3), 1e-3)  # PLD: tighter than RDP
