"""The Python API (fl_platform/api.py): the example runs and equals the CLI; objects as inputs.

* examples/python_api.py, run as a user runs it, gives the summary and metric rows that
  ``python -m fl_platform.run <the same overrides>`` writes;
* a model class defined in a function, tensors, a partition by hand and an AlgorithmSpec object
  run inline and on Ray with 2 workers (the objects travel by value) with the same result, and the
  clients hold exactly the samples given;
* torch Datasets are read into the source form; bad inputs are refused with the reason;
* the objects a config names by ``object:`` reference live as long as that config (or the Result
  holding it), and no longer.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fl_platform import api, plugins
from fl_platform.algorithms.registry import algorithm_names, unregister_algorithm
from fl_platform.experiment import build
from fl_platform.rounds.simulation import is_timing_key

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "python_api.py"


def _example():
    spec = importlib.util.spec_from_file_location("python_api_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _results(summary: dict) -> dict:
    return {k: v for k, v in summary.items() if not is_timing_key(k) and k not in ("setup_time_s", "engine")}


@pytest.mark.slow
def test_the_example_gives_the_summary_of_the_same_cli_command(tmp_path):
    overrides = _example().OVERRIDES
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    ex = subprocess.run([sys.executable, str(EXAMPLE), "--run-dir", str(tmp_path / "api")], cwd=REPO, env=env,
                        capture_output=True, text=True, timeout=300)
    assert ex.returncode == 0, ex.stderr[-3000:]
    cli = subprocess.run([sys.executable, "-m", "fl_platform.run", *overrides, f"hydra.run.dir={tmp_path / 'cli'}"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-3000:]
    api_summary = json.loads((tmp_path / "api" / "summary.json").read_text())
    cli_summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert api_summary["rounds"] == cli_summary["rounds"] == 5
    assert _results(api_summary) == _results(cli_summary)  # same accuracy, loss, bytes, rounds, config
    rows = [[{k: v for k, v in json.loads(line).items() if not is_timing_key(k)}
             for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in ("api", "cli")]
    assert rows[0] == rows[1]
    printed = json.loads(ex.stdout.strip().splitlines()[-1])
    assert printed["overrides"]["final_test_accuracy"] == cli_summary["final_test_accuracy"]
    assert (printed["objects"]["algorithm"], printed["objects"]["num_clients"]) == ("fedadam", 8)


def _toy(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 3, (n,), generator=g)
        return torch.nn.functional.one_hot(y, 5).float() * 2 + torch.randn(n, 5, generator=g), y

    return (*draw(300), *draw(90))


CLIENTS = [np.arange(k, 300, 6)[: 20 + 5 * k] for k in range(6)]  # 6 clients of different sizes
SMALL = ["rounds=3", "clients_per_round=6", "train.epochs=1", "train.batch_size=8", "logger.progress=false",
         "engine.threads_per_worker=1"]


@pytest.fixture
def plugin_spec(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    from plugin_pkg.alg import SPEC

    yield SPEC
    unregister_algorithm(SPEC.name)


def _objects_config(spec, *extra: str):
    class Local(nn.Module):  # defined here: no import path reaches it (an object: reference)
        def __init__(self, num_classes: int) -> None:
            super().__init__()
            self.fc = nn.Linear(5, num_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    cfg = api.compose([*SMALL, "algorithm.max_norm=0.5", *extra], model=Local, data=_toy(), partition=CLIENTS,
                      algorithm=spec)
    return cfg, Local


def _run(cfg) -> tuple[torch.Tensor, list[dict], object]:
    exp = build(cfg)
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    return exp.simulation.server.weights.clone(), exp.simulation.history, exp


@pytest.mark.ray
def test_objects_run_inline_and_on_ray_with_the_clients_given(plugin_spec, ray_session):
    cfg, local = _objects_config(plugin_spec)
    assert cfg.model._target_.startswith(plugins.OBJECT_PREFIX) and cfg.algorithm.name == "clipavg"
    assert (cfg.num_clients, cfg.partition.name) == (6, "natural")
    weights, rows, exp = _run(cfg)
    assert isinstance(exp.simulation.eval_model.model, local) and exp.simulation.eval_model.param_count == 5 * 3 + 3
    assert weights.numel() == 20  # weight 15 (+1 alignment padding), bias 3 (+1)
    train_x = _toy()[0]
    for c, given in enumerate(CLIENTS):  # client c holds exactly the samples given, in that order
        x, _ = exp.data.client_data(c)
        assert torch.equal(x, train_x[torch.from_numpy(given)])
    ray_cfg, _ = _objects_config(plugin_spec, "engine=ray", "engine.num_workers=2")
    ray_weights, ray_rows, _ = _run(ray_cfg)
    assert float((ray_weights - weights).abs().max()) <= 1e-6
    assert [r["test_accuracy"] for r in ray_rows] == pytest.approx([r["test_accuracy"] for r in rows], abs=1e-9)


def test_run_returns_the_history_it_writes(plugin_spec, tmp_path):
    result = api.run([*SMALL, "algorithm.max_norm=0.5"], model=plugins.load("plugin_pkg.nets:TinyNet", "m"),
                     data=_toy(), partition="iid", algorithm=plugin_spec, run_dir=tmp_path)
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert result.history == written and len(written) == 3
    assert result.summary == json.loads((tmp_path / "summary.json").read_text())
    assert result.config.model._target_ == "plugin_pkg.nets:TinyNet"  # an importable object keeps its path
    assert result.metric("test_accuracy") == [(r["round"], r["test_accuracy"]) for r in written]
    assert "clipavg" in algorithm_names()


def test_torch_datasets_are_read_into_the_source_form():
    train_x, train_y, test_x, test_y = _toy()
    source = api.source_from((torch.utils.data.TensorDataset(train_x, train_y),
                              torch.utils.data.TensorDataset(test_x, test_y)))
    assert source.train_x.dtype == np.float32 and source.train_y.dtype == np.int64
    assert source.input_shape == (5,) and source.num_classes == 3 and source.num_test == 90
    np.testing.assert_array_equal(source.train_x, train_x.numpy())


def test_bad_inputs_are_refused_with_the_reason(monkeypatch):
    data = _toy()
    with pytest.raises(TypeError, match="not an instance"):
        api.overrides_for(model=nn.Linear(5, 3))
    with pytest.raises(ValueError, match="in two clients"):
        api.overrides_for(data=data, partition=[[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="needs data="):
        api.overrides_for(partition=[[0, 1]])
    with pytest.raises(TypeError, match="integer class ids"):
        api.source_from((data[0], data[1].float(), data[2], data[3]))
    test_y = data[3].clone()
    test_y[4] = 7  # training labels are 0..2: no client can learn class 7
    with pytest.raises(ValueError, match=r"test_y holds class id\(s\) 7 outside the training labels' range 0\.\.2"):
        api.source_from((data[0], data[1], data[2], test_y))
    train_x = data[0].clone()
    train_x[3, 1] = float("inf")
    with pytest.raises(ValueError, match=r"python: train_x has non-finite values \(NaN or inf\) in 1 row\(s\), "
                                         r"first row 3"):
        api.source_from((train_x, data[1], data[2], data[3]))
    monkeypatch.syspath_prepend(str(REPO / "tests"))
    from plugin_pkg.bad import NO_AGGREGATE

    with pytest.raises(plugins.PluginError, match=r"register_algorithm\('lazy'\): .*server half plugin_pkg\.bad:Lazy "
                                                  r"does not define aggregate"):
        api.overrides_for(algorithm=NO_AGGREGATE)
    with pytest.raises(plugins.PluginError, match=r"names a Python object given to fl_platform\.api in the process"):
        plugins.load("object:Local@7f00", "model._target_")


class _Pairs(torch.utils.data.Dataset):
    def __init__(self, xs, ys) -> None:
        self.xs, self.ys = xs, ys

    def __len__(self) -> int:
        return len(self.xs)

    def __getitem__(self, i):
        return self.xs[i], self.ys[i]


_FN = _toy  # any importable function: an override conflict is refused before anything is loaded


@pytest.mark.parametrize(("overrides", "objects", "message"), [
    (["model=cnn"], {"model": nn.Linear}, r"override 'model=cnn' conflicts with the model= argument, which sets "
                                          r"'model=custom'"),
    (["model=custom", "model._target_=plugin_pkg.nets:TinyNet"], {"model": nn.Linear},
     r"override 'model\._target_=plugin_pkg\.nets:TinyNet' conflicts with the model= argument"),
    (["model=cnn"], {"model": "mlp"}, r"override 'model=cnn' conflicts with the model= argument, which sets 'model=mlp'"),
    (["dataset=digits"], {"data": _toy()}, r"override 'dataset=digits' conflicts with the data= argument"),
    (["dataset=synthetic"], {"data": "digits"}, r"'dataset=synthetic' conflicts with the data= argument, which sets "
                                                r"'dataset=digits'"),
    (["partition=iid"], {"data": _toy(), "partition": CLIENTS}, r"'partition=iid' conflicts with the partition= "
                                                                r"argument, which sets 'partition=natural'"),
    (["num_clients=5"], {"data": _toy(), "partition": CLIENTS}, r"'num_clients=5' conflicts with the partition= "
                                                                r"argument, which sets 'num_clients=6'"),
    (["partition=iid"], {"partition": "dirichlet"}, r"'partition=iid' conflicts with the partition= argument"),
    (["algorithm=fedprox"], {"algorithm": "fedavg"}, r"'algorithm=fedprox' conflicts with the algorithm= argument, "
                                                     r"which sets 'algorithm=fedavg'"),
    (["callbacks=[tests.test_api:_FN]"], {"callbacks": [_FN]}, r"'callbacks=\[tests\.test_api:_FN\]' conflicts "
                                                               r"with the callbacks= argument"),
    (["+callbacks=[x:y]"], {"callbacks": [_FN]}, r"conflicts with the callbacks= argument"),
])
def test_an_override_of_a_key_the_objects_set_is_refused_naming_both(overrides, objects, message):
    with pytest.raises(ValueError, match=message):
        api.compose(["rounds=1", *overrides], **objects)


def test_an_override_the_objects_do_not_set_or_repeat_is_kept():
    cfg = api.compose(["rounds=1", "algorithm=fedprox", "algorithm.mu=0.5"], algorithm="fedprox")
    assert (cfg.algorithm.name, cfg.algorithm.mu) == ("fedprox", 0.5)


def test_wrongly_typed_arguments_are_refused_naming_them():
    with pytest.raises(TypeError, match=r"overrides must be a list of strings such as \['rounds=20'\], got a str "
                                        r"\('rounds=1': pass \['rounds=1'\]\)"):
        api.compose("rounds=1")
    with pytest.raises(TypeError, match=r"overrides\[1\] must be a string such as 'rounds=20', got a int \(3\)"):
        api.compose(["rounds=1", 3])
    with pytest.raises(TypeError, match=r"callbacks must be a list of callbacks .* got a function \(pass \[fn\]\)"):
        api.compose([], callbacks=_FN)
    with pytest.raises(TypeError, match=r"callbacks must be a list .* got a str"):
        api.compose([], callbacks="mypkg:cb")
    with pytest.raises(TypeError, match=r"run_dir must be a path \(a str or os\.PathLike\) or None, got a int \(5\)"):
        api.run(["rounds=1"], run_dir=5)
    with pytest.raises(TypeError, match=r"partition must be a partitioner's name or a list .* got a int"):
        api.overrides_for(data=_toy(), partition=3)


def test_data_is_refused_rather_than_converted():
    train_x, train_y, test_x, test_y = (t.numpy() for t in _toy())
    with pytest.raises(TypeError, match=r"data: train_x is int64 and test_x float32: both must be float features or "
                                        r"both integer token ids"):
        api.source_from((np.abs(train_x * 3).astype(np.int64), train_y, test_x, test_y))
    with pytest.raises(TypeError, match=r"data: train_x holds <U\d+ values; features must be numbers"):
        api.source_from((train_x.astype(str), train_y, test_x, test_y))
    ragged = [list(row[: 5 - i % 2]) for i, row in enumerate(train_x)]
    with pytest.raises(TypeError, match=r"data: train_x is not an array or tensor \(list: .*inhomogeneous"):
        api.source_from((ragged, train_y, test_x, test_y))
    test = _Pairs(test_x, test_y)
    with pytest.raises(ValueError, match=r"data: train dataset item 1 has x of shape \(4,\), item 0 of shape \(5,\)"):
        api.source_from((_Pairs([np.asarray(r) for r in ragged], train_y), test))
    for labels, dtype in ((train_y + 0.7, "float64"), (train_y.astype(str), "<U1")):
        with pytest.raises(TypeError, match=rf"data: the train dataset's y must be a 1-d array of integer class ids, "
                                            rf"got dtype {dtype}"):
            api.source_from((_Pairs(train_x, labels), test))
    with pytest.raises(TypeError, match=r"train dataset item 0 is not an \(x, y\) pair: a tuple of 3"):
        api.source_from(([(train_x[0], 0, 0)], test))
    source = api.source_from((_Pairs(train_x, torch.from_numpy(train_y)), test))  # tensor labels: as given
    np.testing.assert_array_equal(source.train_y, train_y)


def test_partition_indices_must_be_integers_not_masks():
    data = _toy()
    with pytest.raises(ValueError, match=r"partition\[0\] must hold integer sample indices; 2 of 2 are not "
                                         r"\(e\.g\. 0\.9\)"):
        api.overrides_for(data=data, partition=[np.array([0.9, 1.9]), np.array([2])])
    mask = np.arange(300) < 150
    with pytest.raises(TypeError, match=r"partition\[0\] is a boolean mask; partition takes index lists, not masks "
                                        r"\(pass np\.flatnonzero\(mask\)"):
        api.overrides_for(data=data, partition=[mask, ~mask])
    with pytest.raises(TypeError, match=r"partition\[1\] must hold integer sample indices, got dtype <U1"):
        api.overrides_for(data=data, partition=[[0], ["1"]])
    assert api.overrides_for(data=data, partition=[np.array([0.0, 1.0]), [2]])[1] == "num_clients=2"  # whole floats


def test_a_run_leaves_the_callers_random_streams_where_they_were():
    """The run seeds torch's global RNG from its own seed (the model's initialisation): a notebook's own
    draws after api.run went on from the run's seed, not from where the caller had left them."""
    import random

    def draws() -> tuple:
        return torch.rand(3).tolist(), np.random.rand(2).tolist(), random.random()

    torch.manual_seed(123), np.random.seed(4), random.seed(5)
    expected = draws()
    torch.manual_seed(123), np.random.seed(4), random.seed(5)
    api.run(["dataset=digits", "num_clients=3", "clients_per_round=3", "rounds=1", "train.epochs=1",
             "logger.progress=false"])
    assert draws() == expected


TINY = ["rounds=1", "num_clients=2", "clients_per_round=2", "partition=iid", "train.epochs=1", "train.batch_size=16",
        "logger.progress=false", "engine.threads_per_worker=1"]


def _arrays() -> tuple[np.ndarray, ...]:
    return tuple(t.numpy()[:n] for t, n in zip(_toy(), (60, 60, 20, 20)))


def _collect() -> None:
    for _ in range(3):  # a local class is in reference cycles: one pass frees the config, the next what it held
        gc.collect()


def test_a_composed_config_keeps_its_objects_loadable_until_it_is_built():
    """compose-then-build (docs/python-api.md): the data wrapper and a lambda callback are referenced by
    nothing but the config, and still load after a collection."""
    calls = []
    cfg = api.compose(TINY, data=_arrays(), callbacks=[lambda r, m, model: calls.append(r)])
    _collect()
    exp = build(cfg)
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    assert calls == [1] and exp.data.num_clients == 2


def test_objects_given_to_a_run_live_as_long_as_its_result():
    """A notebook's api.run(data=...) does not keep the data, its local classes and callbacks for the life
    of the process: dropping the Result frees them; while it is kept, its config runs again."""

    class Net(nn.Module):  # defined here: an object: reference
        def __init__(self, num_classes: int) -> None:
            super().__init__()
            self.fc = nn.Linear(5, num_classes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    class Count:
        def __init__(self) -> None:
            self.rounds = 0

        def on_round_end(self, round, metrics, model):
            self.rounds += 1

    result = api.run(TINY, model=Net, data=_arrays(), callbacks=[Count()])
    refs = {"data": result.config.dataset._target_, "model": result.config.model._target_,
            "callback": result.config.callbacks[0]}
    assert all(r.startswith(plugins.OBJECT_PREFIX) for r in refs.values())
    alive = {k: weakref.ref(plugins.load(r, k)) for k, r in refs.items()}
    del Net, Count
    _collect()
    again = api.run_config(result.config)  # the Result keeps its config runnable
    assert again.summary["final_test_accuracy"] == result.summary["final_test_accuracy"]
    assert alive["callback"]().rounds == 2
    del result, again
    _collect()
    assert {k: r() for k, r in alive.items()} == dict.fromkeys(alive)  # the data, the class, the callback: freed
    with pytest.raises(plugins.PluginError, match=r"names a Python object given to fl_platform\.api .* no longer kept"):
        plugins.load(refs["data"], "dataset._target_")
