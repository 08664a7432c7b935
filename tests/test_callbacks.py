"""Rounds with hooks: on_round_end callbacks (Python API and config ``_target_``), early stopping on a
validation split of the clients' training rows, the final model in ``api.run``'s result, and run
directories named after the plug-ins.

* a callback sees every round's row and the global model with that round's weights, and a true
  return stops the run after that round (``stop_reason`` in the summary);
* early stopping holds out a stratified share of each client's rows (from the seed; none of them in
  the partition the clients train on, none from the test set), evaluates on them with the test set,
  and stops after ``patience`` evaluations without improvement;
* ``Result.model`` is the run's model class with the final weights: its test accuracy is the summary's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fl_platform import api
from fl_platform.experiment import ConfigError, build
from fl_platform.outputs import plugin_name
from fl_platform.training.loop import evaluate

from .conftest import compose_config
from .test_cli import run_cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TESTS = Path(__file__).resolve().parent
SMALL = ["rounds=4", "num_clients=6", "clients_per_round=3", "train.epochs=1", "train.batch_size=16",
         "model=mlp", "model.hidden=[8]", "engine.threads_per_worker=1", "logger.progress=false"]


@pytest.fixture(autouse=True)
def plugin_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))


def test_a_callback_sees_each_round_and_stops_the_run():
    seen: list[tuple[int, float, float]] = []
    exp_data = {}

    def on_round_end(round, metrics, model):
        x, y = exp_data["test"]
        seen.append((round, metrics["test_accuracy"], evaluate(model, x, y)["test_accuracy"]))
        return round == 2

    from fl_platform.datasets.registry import load_source

    source = load_source("digits", seed=0)
    exp_data["test"] = (torch.from_numpy(source.test_x), torch.from_numpy(source.test_y))
    result = api.run(SMALL, callbacks=[on_round_end])
    assert [r["round"] for r in result.history] == [1, 2]
    assert [s[0] for s in seen] == [1, 2]
    assert all(abs(row_acc - model_acc) < 1e-12 for _, row_acc, model_acc in seen)  # the round's own weights
    assert "callback" in result.summary["stop_reason"] and "on_round_end" in result.summary["stop_reason"]
    final = evaluate(result.model, *exp_data["test"])
    assert final["test_accuracy"] == pytest.approx(result.summary["final_test_accuracy"], abs=1e-12)
    assert isinstance(result.model, torch.nn.Module) and not result.model.training


def test_a_configured_callback_is_made_from_its_target_and_arguments():
    result = api.run([*SMALL, "callbacks=[{_target_: 'plugin_pkg.cb:StopAt', round: 3}, 'plugin_pkg.cb:never']"])
    assert len(result.history) == 3 and "StopAt" in result.summary["stop_reason"]
    full = api.run([*SMALL, "callbacks=['plugin_pkg.cb:never']"])
    assert len(full.history) == 4 and "stop_reason" not in full.summary


@pytest.mark.parametrize(("callbacks", "message"), [
    ("[{_target_: 'plugin_pkg.cb:StopAt', round: abc}]", r"callbacks\[0\]\.round='abc': parameter round of "
                                                          r"plugin_pkg\.cb:StopAt.* is annotated int, got str 'abc'"),
    ("[{_target_: 'plugin_pkg.cb:StopAt'}]", r"plugin_pkg\.cb:StopAt\(round, note=''\) \(callbacks\[0\]\._target_="
                                             r"plugin_pkg\.cb:StopAt\) needs \+callbacks\[0\]\.round"),
    ("['plugin_pkg.cb:Nope']", r"callbacks\[0\]=plugin_pkg\.cb:Nope: module plugin_pkg\.cb .* has no attribute"),
])
def test_bad_callbacks_are_refused_at_start_up(callbacks, message):
    with pytest.raises(ConfigError, match=message):
        build(compose_config(*SMALL, f"callbacks={callbacks}"))


EARLY = [*SMALL, "rounds=6", "early_stop.patience=1"]


def test_early_stopping_holds_out_training_rows_and_stops_without_improvement():
    exp = build(compose_config(*EARLY, "early_stop.val_fraction=0.25", "early_stop.metric=val_accuracy",
                               "early_stop.min_delta=1.0"))  # nothing can improve by more than 1.0
    try:
        full = build(compose_config(*SMALL, "rounds=6"))
        full.engine.close()
        val_x, val_y = exp.simulation.round_end.validation
        held = np.setdiff1d(full.data.partition.indices, exp.data.partition.indices)
        assert len(held) == len(val_y) and len(held) == pytest.approx(0.25 * full.data.num_train, rel=0.1)
        assert torch.equal(val_x, full.data.train_x[torch.from_numpy(held)])  # training rows, not the test set
        assert torch.equal(val_y, full.data.train_y[torch.from_numpy(held)])
        for c in range(full.data.num_clients):  # each client keeps the rest of its rows
            assert set(exp.data.partition.client(c)) <= set(full.data.partition.client(c))
        summary = exp.simulation.run()
    finally:
        exp.engine.close()
    rows = exp.simulation.history
    assert len(rows) == 2 and all("val_accuracy" in r and "val_loss" in r for r in rows)
    assert "early stopping: val_accuracy has not improved" in summary["stop_reason"]
    again = build(compose_config(*EARLY, "early_stop.val_fraction=0.25"))
    again.engine.close()
    assert np.array_equal(again.data.partition.indices, exp.data.partition.indices)  # from the seed


def test_early_stopping_runs_on_while_the_metric_improves():
    exp = build(compose_config(*EARLY, "early_stop.patience=6"))
    try:
        summary = exp.simulation.run()
    finally:
        exp.engine.close()
    assert summary["rounds"] == 6 and "stop_reason" not in summary


@pytest.mark.slow
def test_run_dirs_and_summaries_name_the_plugins(tmp_path):
    proc = run_cli("rounds=1", "num_clients=4", "clients_per_round=2", "partition=iid", "algorithm=plugin",
                   "algorithm._target_=plugin_pkg.alg:SPEC", "dataset=custom", "dataset._target_=plugin_pkg.data:blobs",
                   "model=custom", "model._target_=plugin_pkg.nets:TinyNet", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    run_dir = Path(proc.stdout.strip().splitlines()[-1].split(": ", 1)[1])
    assert run_dir.name.endswith("_clipavg_blobs_s0")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["algorithm"], summary["dataset"], summary["model"]) == ("clipavg", "blobs", "TinyNet")
    assert plugin_name("model", "mlp", None) == "mlp"
    assert plugin_name("dataset", "custom", "object:_Given@7f00") == "_Given"  # (not loadable here: its text)


@pytest.mark.ray
def test_early_stopping_on_ray_equals_inline(ray_session):
    from .test_engine_determinism import run

    base = (*EARLY, "early_stop.metric=val_accuracy", "early_stop.min_delta=1.0")
    w_inline, rows_inline = run(base=base)
    w_ray, rows_ray = run("engine=ray", "engine.num_workers=2", base=base)
    assert len(rows_inline) == 2 and rows_ray == rows_inline
    assert float((w_ray - w_inline).abs().max()) <= 1e-6


def _takes_round_only(round):
    return None


@pytest.mark.parametrize(("answer", "shown"), [("no", r"a str \('no'\)"), ("False", r"a str \('False'\)"),
                                               (torch.tensor([0.0, 1.0]), r"a Tensor \(tensor"), ([], r"a list \(\[\]\)"),
                                               (1, r"a int \(1\)")])
def test_a_callback_returning_other_than_true_false_or_none_is_refused_naming_it(answer, shown):
    def says(round, metrics, model):
        return answer

    with pytest.raises(TypeError, match=rf"callback .*says returned {shown}.* after round 1; on_round_end must "
                                        r"return True \(stop\), False or None \(go on\)"):
        api.run([*SMALL, "rounds=2"], callbacks=[says])


def test_true_false_and_none_are_the_answers():
    answers = iter([None, False, np.False_, True])
    result = api.run([*SMALL, "rounds=5"], callbacks=[lambda round, metrics, model: next(answers)])
    assert len(result.history) == 4 and "stopped the run after round 4" in result.summary["stop_reason"]


def test_a_callback_with_the_wrong_signature_is_refused_at_start_up():
    calls = []

    def counting(*args):
        calls.append(args)

    with pytest.raises(ConfigError, match=r"callbacks\[1\]: .*_takes_round_only\(round\) cannot be called as "
                                          r"on_round_end\(round, metrics, model\): too many positional arguments"):
        build(compose_config(*SMALL, "callbacks=['plugin_pkg.cb:never', 'tests.test_callbacks:_takes_round_only']"))
    with pytest.raises(ConfigError, match=r"cannot be called as on_round_end"):
        api.run(SMALL, callbacks=[counting, _takes_round_only])
    assert calls == []  # refused before round 1's training, not after it
