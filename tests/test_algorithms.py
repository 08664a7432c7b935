"""FedAvg, FedProx and SCAFFOLD through the real experiment path: they learn, and runs are reproducible."""

from __future__ import annotations

import math
import re

import pytest
import torch

from fl_platform.algorithms.base import AlgorithmSpec, ClientAlgorithm
from fl_platform.algorithms.fedavg import FedAvgConf, FedAvgServer
from fl_platform.experiment import build, run_experiment
from fl_platform.rounds.simulation import is_timing_key

TIMING = {"round_time_s", "wall_time_s", "eval_time_s", "makespan_s", "balance", "first_round_s",
          "median_round_s", "setup_time_s", "predicted_makespan_s", "busy_s"}


def _strip(rows):
    return [{k: v for k, v in r.items() if k not in TIMING and not is_timing_key(k) and not k.startswith("busy")}
            for r in rows]


@pytest.mark.slow
def test_fedavg_digits_reaches_85_percent_within_30_rounds(make_config, tmp_path):
    cfg = make_config("algorithm=fedavg", "partition=dirichlet", "partition.alpha=0.5", "num_clients=100",
                      "clients_per_round=10", "rounds=30")
    summary = run_experiment(cfg, tmp_path)
    assert summary["rounds"] == 30
    assert summary["best_test_accuracy"] >= 0.85
    assert summary["final_test_accuracy"] >= 0.85


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fedprox", "scaffold"])
def test_fedprox_and_scaffold_learn(make_config, tmp_path, algorithm):
    cfg = make_config(f"algorithm={algorithm}", "rounds=20")
    summary = run_experiment(cfg, tmp_path)
    assert summary["final_test_accuracy"] >= 0.8


def test_same_config_and_seed_give_identical_metrics(make_config, tmp_path):
    cfg = make_config("algorithm=scaffold", "rounds=4", "seed=3")
    first = build(cfg, tmp_path / "a")
    first.simulation.run()
    second = build(cfg, tmp_path / "b")
    second.simulation.run()
    assert _strip(first.simulation.history) == _strip(second.simulation.history)
    assert torch.equal(first.simulation.server.weights, second.simulation.server.weights)
    third = build(make_config("algorithm=scaffold", "rounds=4", "seed=4"))
    third.simulation.run()
    assert not torch.equal(first.simulation.server.weights, third.simulation.server.weights)


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_number_of_inline_workers_does_not_change_the_result(make_config, algorithm):
    results = []
    for workers in (1, 3):
        exp = build(make_config(f"algorithm={algorithm}", "rounds=3", f"engine.num_workers={workers}"))
        exp.simulation.run()
        results.append((exp.simulation.server.weights, _strip(exp.simulation.history)))
    (w1, h1), (w3, h3) = results
    assert float((w1 - w3).abs().max()) <= 1e-6
    for a, b in zip(h1, h3):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], float):
                assert math.isclose(a[key], b[key], rel_tol=1e-6, abs_tol=1e-9), key
            else:
                assert a[key] == b[key], key


def test_fedprox_with_mu_zero_equals_fedavg(make_config):
    weights = []
    for overrides in (["algorithm=fedavg"], ["algorithm=fedprox", "algorithm.mu=0.0"]):
        exp = build(make_config(*overrides, "rounds=2"))
        exp.simulation.run()
        weights.append(exp.simulation.server.weights)
    assert torch.equal(weights[0], weights[1])


def test_fedprox_pulls_clients_towards_the_global_model(make_config):
    drift = {}
    for mu in (0.0, 1.0):
        exp = build(make_config("algorithm=fedprox", f"algorithm.mu={mu}", "rounds=1", "train.epochs=10"))
        start = exp.simulation.server.weights.clone()
        exp.simulation.run()
        drift[mu] = float((exp.simulation.server.weights - start).norm())
    assert drift[1.0] < drift[0.0]


@pytest.mark.slow
def test_scaffold_keeps_each_clients_control_variate_across_rounds(make_config):
    exp = build(make_config("algorithm=scaffold", "rounds=3", "num_clients=10", "clients_per_round=4"))
    exp.simulation.run()
    store = exp.engine.workers[0].store
    sampled = set()
    from fl_platform.rounds.sampling import sample_clients

    for r in range(3):
        sampled.update(sample_clients(exp.cfg.seed, r, 10, 4))
    for cid in range(10):
        state = store.get(cid)
        if cid in sampled:
            assert state is not None and float(state["c"].abs().sum()) > 0
        else:
            assert state is None
    # The server control variate is the running mean of client updates, hence non-zero after training.
    assert float(exp.simulation.server.c.norm()) > 0


GENERATOR = ("model=cnn", "model.channels=[2,2]", "model.hidden=4", "rounds=1", "algorithm.cache_dir=null",
             "algorithm.epochs=1", "algorithm.g_steps=1", "algorithm.nz=4", "algorithm.ngf=2")


@pytest.mark.parametrize(("overrides", "message"), [
    (["algorithm=fedavg", "algorithm.server_lr=0"], "algorithm.server_lr must be > 0, got 0.0"),
    (["algorithm=scaffold", "algorithm.server_lr=-1"], "algorithm.server_lr must be > 0, got -1.0"),
    (["algorithm=fedrep", "algorithm.server_lr=-1"], "algorithm.server_lr must be > 0"),  # past FedRep's own check
    (["algorithm=fedavg", "algorithm.server_momentum=1.0"], "algorithm.server_momentum must be in [0, 1), got 1.0"),
    (["algorithm=fedprox", "algorithm.mu=-0.01"], "algorithm.mu must be >= 0, got -0.01"),
    (["algorithm=ditto", "algorithm.lam=-0.1"], "algorithm.lam must be >= 0, got -0.1"),
    (["algorithm=vhl", "model=cnn", "algorithm.style_std=-0.3"], "algorithm.style_std must be >= 0, got -0.3"),
    (["algorithm=oneshot_dense", *GENERATOR, "algorithm.lambda_adv=-1"], "algorithm.lambda_adv must be >= 0, got -1.0"),
    (["algorithm=oneshot_dense", *GENERATOR, "algorithm.lambda_oh=-1"], "algorithm.lambda_oh must be >= 0, got -1.0"),
    (["algorithm=oneshot_coboost", *GENERATOR, "algorithm.epochs=2", "algorithm.reweight_delta=1.5"],
     "algorithm.reweight_delta must be in (0, 1], got 1.5"),
    (["algorithm=oneshot_coboost", *GENERATOR, "algorithm.kd_clip=0"], "algorithm.kd_clip must be null or > 0, got 0.0"),
    (["algorithm=oneshot_adi", *GENERATOR[:5], "algorithm.di_steps=1", "algorithm.lambda_adi=-0.2"],
     "algorithm.lambda_adi must be >= 0, got -0.2"),
    (["algorithm=oneshot_feddf", "model=cnn", "model.channels=[2,2]", "model.hidden=4", "rounds=1",
      "algorithm.cache_dir=null", "algorithm.temperature=0"], "algorithm.temperature must be > 0, got 0.0"),
    (["algorithm=moon", "algorithm.mu=-1"], "algorithm.mu must be >= 0, got -1.0"),
    (["algorithm=moon", "algorithm.temperature=0"], "algorithm.temperature must be > 0, got 0.0"),
    (["algorithm=feddyn", "algorithm.alpha=0"], "algorithm.alpha must be > 0 (FedDyn divides by it), got 0.0"),
])
def test_a_weight_or_rate_outside_its_range_is_refused_at_start_up(make_config, overrides, message):
    """A negative proximal weight, loss weight or server rate would run as a silent sign flip (a repulsive
    FedProx term, an ascending server step); it is refused before any round, naming the key."""
    with pytest.raises(ValueError) as err:
        build(make_config(*overrides))
    assert message in str(err.value)


@pytest.mark.parametrize(("overrides", "message"), [
    (["train.momentum=-0.5"], "train.momentum must be in [0, 1), got -0.5"),
    (["train.momentum=1.0"], "train.momentum must be in [0, 1), got 1.0"),
    (["train.weight_decay=-1"], "train.weight_decay must be >= 0, got -1.0"),
    (["train.optimizer=adam", "train.adam_beta1=-0.5"], "train.adam_beta1 must be in [0, 1), got -0.5"),
    (["train.optimizer=adam", "train.adam_beta2=1.5"], "train.adam_beta2 must be in [0, 1), got 1.5"),
    (["train.optimizer=adam", "train.adam_eps=0"], "train.adam_eps must be > 0, got 0.0"),
    (["eval_batch_size=-1"], "eval_batch_size must be >= 1, got -1"),  # evaluated nothing: accuracy 0.0000
])
def test_a_training_or_evaluation_setting_outside_its_range_is_refused_at_start_up(make_config, overrides, message):
    with pytest.raises(ValueError) as err:
        build(make_config(*overrides))
    assert message in str(err.value)


@pytest.mark.parametrize("overrides", [["algorithm=fedprox", "algorithm.mu=0"], ["algorithm=ditto", "algorithm.lam=0", "eval.clients=all"],
                                       ["algorithm=fedavg", "algorithm.server_momentum=0.9", "rounds=2"],
                                       ["train.momentum=0", "train.weight_decay=0"],
                                       ["train.optimizer=adam", "train.adam_beta1=0", "train.adam_beta2=0.5"]])
def test_the_edge_of_each_range_still_builds(make_config, overrides):
    build(make_config(*overrides)).engine.close()


# ---------------------------------------------------------------- a plug-in's halves, checked where they hand over

class _Tampering(ClientAlgorithm):
    """FedAvg's client half whose update is then broken as ``MODE`` says (set per test)."""

    MODE = ""

    def train(self, ctx, client_id, broadcast, state, data, trainer):
        update = super().train(ctx, client_id, broadcast, state, data, trainer)
        delta = update.tensors["delta"]
        if self.MODE == "missing":
            update.tensors = {"dleta": delta}
        elif self.MODE == "int":
            update.tensors["delta"] = delta.to(torch.int64)
        elif self.MODE == "short":
            update.tensors["delta"] = delta[:-3]
        elif self.MODE == "nan weight":
            update.weights["n"] = math.nan
        elif self.MODE == "none":
            return None
        return update


class _Silent(FedAvgServer):
    def aggregate(self, ctx, result):
        super().aggregate(ctx, result)  # a forgotten ``return``


@pytest.mark.parametrize(("mode", "message"), [
    ("missing", "client 0's update in round 1 carries none of its uploads ['delta'] (it sends ['dleta'])"),
    ("int", "wrong tensors 'delta': shape"),
    ("short", "wrong tensors 'delta': shape"),
    ("nan weight", "weights {'n': nan} must be finite numbers >= 0"),
    ("none", "the client half's train returned NoneType, not a ClientUpdate"),
])
def test_a_plug_in_update_that_is_not_a_contribution_stops_the_run_naming_it(monkeypatch, mode, message):
    """A client half that misnames or drops its delta made every round a silent no-op (the model never moved),
    an integer delta was cut to whole numbers, a short one failed in the server step without a name, a NaN
    weight passed the finiteness check: the worker now checks each update against the declared uploads'
    sizes (ClientUpdate.problem, as a Flower server checks a reply)."""
    from fl_platform import api

    monkeypatch.setattr(_Tampering, "MODE", mode)
    spec = AlgorithmSpec("tampering", FedAvgConf, _Tampering, FedAvgServer, "FedAvg, broken on purpose")
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        api.run(["dataset=digits", "num_clients=3", "clients_per_round=3", "rounds=1", "train.epochs=1",
                 "logger.progress=false"], algorithm=spec)


def test_a_server_half_must_return_its_metrics_as_a_dict_of_numbers():
    """A forgotten ``return {}`` gave "'NoneType' object is not a mapping" with no class named."""
    from fl_platform import api
    from fl_platform.rounds.simulation import server_metrics

    spec = AlgorithmSpec("silent", FedAvgConf, ClientAlgorithm, _Silent, "FedAvg without its return")
    with pytest.raises(TypeError, match=re.escape("_Silent.aggregate must return a dict of metric names to numbers")):
        api.run(["dataset=digits", "num_clients=3", "clients_per_round=3", "rounds=1", "train.epochs=1",
                 "logger.progress=false"], algorithm=spec)
    server = object.__new__(_Silent)
    assert server_metrics(server, {"a": 1, "b": torch.tensor(2.5)}) == {"a": 1, "b": 2.5}
    for bad in ({"a": "x"}, {"a": {"b": 1.0}}, {"a": torch.ones(2)}, {1: 1.0}, [("a", 1.0)]):
        with pytest.raises(TypeError, match=r"_Silent\.aggregate"):
            server_metrics(server, bad)
