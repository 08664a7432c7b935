"""The user's own model, data and algorithm (tests/plugin_pkg, a package outside fl_platform) run on
every runtime, with the config as strict as for the built-ins.

* inline, on Ray with 2 workers (same result: the workers import the plug-in through the setup's
  import roots) and through the in-process Flower path (ServerApp + ClientApps, same model);
* an installed plug-in (a dist-info with an ``fl_platform.algorithms`` entry point, as pip writes it)
  is an ``algorithm=`` choice and is listed in the error for an unknown one;
* an unknown field of a plug-in's config is an error naming it; every field of the plug-in
  algorithm's conf changes the run or is refused (as tests/test_config_keys.py does for built-ins);
* split algorithms check the model for stages, and infer them for an nn.Sequential;
* code outside the checkout is shipped to Ray cluster nodes as py_modules.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from fl_platform import plugins
from fl_platform.algorithms.registry import (
    algorithm_names,
    get_algorithm,
    register_algorithm,
    unregister_algorithm,
)
from fl_platform.config import register_configs, unregister_algorithm_option
from fl_platform.engine.ray_cluster import with_plugin_modules
from fl_platform.experiment import ConfigError, build, run_experiment
from fl_platform.models import ModelInputError

from .conftest import compose_config
from .test_engine_determinism import run as run_engine

TESTS = Path(__file__).resolve().parent
SMALL = ("rounds=2", "num_clients=4", "clients_per_round=4", "train.epochs=1", "train.batch_size=16",
         "partition=iid", "engine.threads_per_worker=1", "save_model=true")
DATA = ("dataset=custom", "dataset._target_=plugin_pkg.data:blobs", "+dataset.n=240")
MODEL = ("model=custom", "model._target_=plugin_pkg.nets:TinyNet", "+model.width=8")
ALGORITHM = ("algorithm=plugin", "algorithm._target_=plugin_pkg.alg:SPEC", "+algorithm.max_norm=0.05")
PLUGINS = (*DATA, *MODEL, *ALGORITHM)
TINYNET_PARAMS = 6 * 8 + 8 + 8 * 3 + 3  # blobs: 6 features, 3 classes; width 8


@pytest.fixture(autouse=True)
def plugin_on_path(monkeypatch):
    """plugin_pkg importable in this process, as a user's package on PYTHONPATH (not in Ray's workers)."""
    monkeypatch.syspath_prepend(str(TESTS))


def run(*overrides: str) -> tuple[torch.Tensor, list[dict]]:
    return run_engine(*SMALL, *overrides)  # (global weights, metric rows without timings)


def test_plugins_run_inline_and_act():
    weights, rows = run(*PLUGINS)
    assert weights.numel() == TINYNET_PARAMS + 1  # plugin_pkg.nets.TinyNet(width=8) on blobs (+1: 16-byte alignment)
    # the plug-in server clipped: its update norm metric is logged and exceeds max_norm
    assert all(r["update_norm"] > 0.05 for r in rows)
    unclipped, _ = run(*DATA, *MODEL, "algorithm=plugin", "algorithm._target_=plugin_pkg.alg:SPEC")
    assert not torch.equal(weights, unclipped)


@pytest.mark.ray
def test_plugins_on_ray_with_2_workers_equal_inline(ray_session):
    ref_w, ref_rows = run(*PLUGINS)
    w, rows = run(*PLUGINS, "engine=ray", "engine.num_workers=2")
    assert float((w - ref_w).abs().max()) <= 1e-6
    assert [r["test_accuracy"] for r in rows] == pytest.approx([r["test_accuracy"] for r in ref_rows], abs=1e-9)
    assert [r["update_norm"] for r in rows] == pytest.approx([r["update_norm"] for r in ref_rows], rel=1e-6)


@pytest.mark.slow
def test_plugins_through_flower_in_process(tmp_path):
    from fl_platform.flower import config as fc
    from fl_platform.flower.local import run_local

    overrides = [*SMALL, *PLUGINS, "logger.progress=false"]
    rc = fc.unpack_extra(fc.flatten_config(fc.compose(overrides)))
    assert rc["model.width"] == 8 and rc["algorithm.max_norm"] == 0.05  # the user's fields travel
    summary = run_local(overrides, tmp_path / "flower")  # ServerApp + a ClientApp per client, in-process
    sim = run_experiment(compose_config(*overrides), tmp_path / "sim")
    flower_w = torch.load(tmp_path / "flower" / "model.pt", weights_only=True)
    sim_w = torch.load(tmp_path / "sim" / "model.pt", weights_only=True)
    assert flower_w.keys() == sim_w.keys() and "out.weight" in flower_w  # TinyNet's own parameter names
    assert max(float((flower_w[k] - sim_w[k]).abs().max()) for k in sim_w) < 1e-5
    assert summary["final_test_accuracy"] == pytest.approx(sim["final_test_accuracy"])
    assert summary["algorithm"] == sim["algorithm"] == "clipavg"


@pytest.mark.slow
def test_plugin_model_and_data_in_ssgd(tmp_path):
    """S-SGD (``python -m fl_platform.ssgd``: a world of one) trains the custom model on the custom data,
    the package found through PYTHONPATH; its config is as strict (an unknown model field is refused)."""
    from fl_platform.ssgd.config import compose_ssgd_config

    with pytest.raises(ConfigError, match=r"model\.widht: not a parameter"):
        compose_ssgd_config([*DATA, *MODEL, "+model.widht=3"])
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    proc = subprocess.run([sys.executable, "-m", "fl_platform.ssgd", *DATA, *MODEL, "train.steps=20",
                           "logger.progress=false", "ssgd.threads=1", f"run_dir={tmp_path}"],
                          cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert state["out.weight"].shape == (3, 8) and summary["final_test_accuracy"] > 0.5  # TinyNet learnt blobs


# ---------------------------------------------------------------- entry points


def install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> str:
    site = tmp_path / "site"
    info = site / "plugin_pkg-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[fl_platform.algorithms]\n{name} = plugin_pkg.alg:SPEC\n")
    monkeypatch.syspath_prepend(str(site))
    register_configs()
    return name


def _dist(site: Path, name: str) -> Path:
    info = site / f"{name}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{plugins.ALGORITHM_ENTRY_POINTS}]\n{name} = {name}.alg:SPEC\n")
    return info


def test_entry_points_are_read_once_and_again_when_a_distribution_comes_or_goes(tmp_path, monkeypatch):
    """plugins.entry_points caches per state of sys.path (each folder's modification time and its
    entry_points.txt files'): a second call reads no metadata, and a distribution installed into (or removed
    from) a folder already on the path, or an entry_points.txt edited in place, is seen at the next call."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    group = plugins.ALGORITHM_ENTRY_POINTS
    reads = []
    scan = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: reads.append(kw) or scan(**kw))
    assert "ep_probe_a" not in plugins.entry_points(group)
    assert "ep_probe_a" not in plugins.entry_points(group) and len(reads) == 1
    tick = 0.05  # each change lands after a tick of the filesystem's timestamp clock (<= 10 ms), as pip's do
    time.sleep(tick)
    first = _dist(site, "ep_probe_a")
    assert "ep_probe_a" in plugins.entry_points(group)
    time.sleep(tick)
    _dist(site, "ep_probe_b")
    assert {"ep_probe_a", "ep_probe_b"} <= set(plugins.entry_points(group))
    time.sleep(tick)
    shutil.rmtree(first)
    found = plugins.entry_points(group)
    assert "ep_probe_a" not in found and "ep_probe_b" in found and len(reads) == 4
    time.sleep(tick)  # an edit in place: neither the folder nor the dist-info folder changes its time
    mtimes = (site.stat().st_mtime_ns, (site / "ep_probe_b-0.1.dist-info").stat().st_mtime_ns)
    with open(site / "ep_probe_b-0.1.dist-info" / "entry_points.txt", "r+") as f:
        f.seek(0, 2)
        f.write("ep_probe_c = ep_probe_b.alg:SPEC\n")
    assert (site.stat().st_mtime_ns, (site / "ep_probe_b-0.1.dist-info").stat().st_mtime_ns) == mtimes
    assert {"ep_probe_b", "ep_probe_c"} <= set(plugins.entry_points(group)) and len(reads) == 5


@pytest.fixture
def installed_plugin(tmp_path, monkeypatch):
    """plugin_pkg 'installed': a dist-info with an entry point in the fl_platform.algorithms group, as
    ``pip install`` of a package declaring ``[project.entry-points."fl_platform.algorithms"]`` writes it."""
    yield install(tmp_path, monkeypatch, "clip_ep")
    monkeypatch.undo()
    unregister_algorithm_option("clip_ep")


def test_an_installed_or_built_in_spec_given_to_the_api_is_itself(tmp_path, monkeypatch):
    """api.run(algorithm=SPEC) with SPEC the installed entry point of its own name (or a built-in's
    SPEC) uses that option; another spec under a taken name is still refused."""
    from plugin_pkg.alg import SPEC

    from fl_platform.algorithms import fedprox
    from fl_platform.api import overrides_for

    name = install(tmp_path, monkeypatch, SPEC.name)  # "clipavg = plugin_pkg.alg:SPEC"
    try:
        assert overrides_for(algorithm=SPEC) == [f"algorithm={name}"]
        assert compose_config(*SMALL, f"algorithm={name}", "algorithm.max_norm=0.05").algorithm.max_norm == 0.05
        assert overrides_for(algorithm=fedprox.SPEC) == ["algorithm=fedprox"]
        with pytest.raises(ValueError, match="'fedprox' is taken"):
            register_algorithm(SPEC, "fedprox")
    finally:
        monkeypatch.undo()
        unregister_algorithm_option(name)


@pytest.mark.slow  # composes every option of every group (export_config's defaults)
def test_an_installed_plugin_leaves_the_exported_defaults_alone(installed_plugin):
    """default_run_config (pyproject's [tool.flwr.app.config]) lists the built-ins' keys only, whatever is
    installed: it never composes algorithm=<plug-in> (its fields travel in ``extra``)."""
    from fl_platform.flower import config as fc

    fc._group_keys.cache_clear()
    try:
        assert installed_plugin not in fc.group_options("algorithm")
        exported = fc.default_run_config()
    finally:
        fc._group_keys.cache_clear()
    assert "algorithm.max_norm" not in exported and "algorithm.warmup_rounds" not in exported
    assert exported == fc.pyproject_defaults()  # the committed defaults, unchanged by the installed plug-in


@pytest.mark.slow
def test_an_entry_point_plugins_own_fields_travel_through_flower_in_extra(installed_plugin, tmp_path):
    """algorithm=<installed plug-in> with its own field (and a custom model's and loader's) through the
    ServerApp + ClientApps in-process: the fields pyproject does not list go in the JSON key ``extra``, which
    the SuperLink accepts (check_keys), and the run equals the simulator's."""
    from fl_platform.flower import config as fc
    from fl_platform.flower.local import run_local

    overrides = [*SMALL, *DATA, *MODEL, f"algorithm={installed_plugin}", "algorithm.max_norm=0.05",
                 "logger.progress=false"]
    rc = fc.flatten_config(fc.compose(overrides))
    fc.check_keys(rc, fc.pyproject_defaults())  # no key the SuperLink would refuse
    assert json.loads(rc["extra"]) == {"algorithm.max_norm": 0.05, "dataset.n": 240}  # (model.width: listed)
    assert fc.from_run_config(rc)[0].algorithm.max_norm == 0.05
    summary = run_local(overrides, tmp_path / "flower")
    sim = run_experiment(compose_config(*overrides), tmp_path / "sim")
    flower_w = torch.load(tmp_path / "flower" / "model.pt", weights_only=True)
    sim_w = torch.load(tmp_path / "sim" / "model.pt", weights_only=True)
    assert max(float((flower_w[k] - sim_w[k]).abs().max()) for k in sim_w) < 1e-5
    assert summary["final_test_accuracy"] == pytest.approx(sim["final_test_accuracy"])
    # a key of the defaults given in extra, or extra that is not a JSON object, is refused naming it
    with pytest.raises(ValueError, match=r"'rounds' in extra is a key of \[tool\.flwr\.app\.config\]"):
        fc.from_run_config({**rc, "extra": json.dumps({"rounds": 3})})
    with pytest.raises(ValueError, match="extra must be a JSON object"):
        fc.from_run_config({**rc, "extra": "max_norm=1"})
    with pytest.raises(ValueError, match=r"'engine\.num_workers' in extra: engine, eval\.\* are simulation"):
        fc.from_run_config({**rc, "extra": json.dumps({"engine.num_workers": 2})})
    with pytest.raises(ValueError, match=r"algorithm\.maxnorm"):
        fc.from_run_config({**rc, "extra": json.dumps({"algorithm.maxnorm": 1.0})})


def test_an_installed_plugin_is_an_algorithm_choice(installed_plugin):
    from plugin_pkg.alg import SPEC

    assert installed_plugin in algorithm_names() and get_algorithm(installed_plugin) is SPEC
    cfg = compose_config(*SMALL, *DATA, *MODEL, f"algorithm={installed_plugin}", "algorithm.max_norm=0.05")
    assert OmegaConf.get_type(cfg.algorithm).__name__ == "ClipConf"  # Hydra validates it as a built-in's
    weights, _ = run(*DATA, *MODEL, f"algorithm={installed_plugin}", "algorithm.max_norm=0.05")
    assert torch.equal(weights, run(*PLUGINS)[0])  # the same algorithm as by import path
    with pytest.raises(Exception, match=r"Could not override 'algorithm\.maxnorm'"):
        compose_config(f"algorithm={installed_plugin}", "algorithm.maxnorm=1")
    with pytest.raises(ConfigError, match=r"algorithm\.maxnorm: not a key of the config"):
        build(compose_config(*SMALL, f"algorithm={installed_plugin}", "+algorithm.maxnorm=1"))
    with pytest.raises(Exception, match=r"Could not find 'algorithm/nope'") as err:
        compose_config("algorithm=nope")
    assert f"\t{installed_plugin}\n" in str(err.value) and "\tfedavg\n" in str(err.value)
    with pytest.raises(ValueError, match=rf"valid choices: .*{installed_plugin}"):
        get_algorithm("nope")


def test_without_the_entry_point_the_name_is_unknown(tmp_path):
    with pytest.raises(Exception, match=r"Could not find 'algorithm/clip_ep'"):
        compose_config("algorithm=clip_ep")


def test_a_registered_spec_is_a_choice_and_can_be_dropped():
    from plugin_pkg.alg import SPEC

    name = register_algorithm(SPEC, "clip_registered")
    try:
        assert compose_config(f"algorithm={name}").algorithm.name == name
        with pytest.raises(ValueError, match="taken"):
            register_algorithm(SPEC, "fedavg")
    finally:
        unregister_algorithm(name)
    assert name not in algorithm_names()
    with pytest.raises(Exception, match=rf"Could not find 'algorithm/{name}'"):
        compose_config(f"algorithm={name}")


def test_another_spec_under_a_registered_name_is_a_warning_naming_both(caplog):
    """It changes which code algorithm=<name> runs: a WARNING names the name and both specs. The same
    spec again says nothing; an equal one (same classes and settings) only at DEBUG."""
    from dataclasses import dataclass, replace

    from plugin_pkg.alg import SPEC, ClipConf

    @dataclass
    class Tighter(ClipConf):
        max_norm: float = 0.5

    other = replace(SPEC, conf=Tighter)
    name = register_algorithm(SPEC, "clip_twice")
    try:
        with caplog.at_level("DEBUG", logger="fl_platform.algorithms.registry"):
            register_algorithm(SPEC, name)
            assert caplog.records == []
            register_algorithm(other, name)
            assert get_algorithm(name) is other
            [warning] = [r for r in caplog.records if r.levelno >= logging.INFO]
            caplog.clear()
            register_algorithm(replace(other), name)
            assert [r.levelname for r in caplog.records] == ["DEBUG"]
    finally:
        unregister_algorithm(name)
    assert warning.levelname == "WARNING"
    new, old = warning.getMessage().split(" instead of ")
    assert new.startswith("algorithm 'clip_twice' re-registered: algorithm=clip_twice now runs AlgorithmSpec "
                          f"'{SPEC.name}' (conf {Tighter.__module__}:{Tighter.__qualname__}, client ")
    assert old == (f"plugin_pkg.alg:SPEC (conf plugin_pkg.alg:ClipConf, client {SPEC.client.__module__}:"
                   f"{SPEC.client.__qualname__}, server plugin_pkg.alg:{SPEC.server.__qualname__})")


def test_the_tests_compose_cache_composes_afresh_once_the_config_store_changes():
    """conftest's compose_config composes each override list once per state of the ConfigStore and hands
    out copies: a caller's edit never reaches the next caller, and an option registered again with other
    defaults is read again (never the config cached under the same overrides)."""
    from dataclasses import dataclass, replace

    from plugin_pkg.alg import SPEC, ClipConf

    @dataclass
    class Tighter(ClipConf):
        max_norm: float = 0.5

    compose_config("rounds=2")  # (a process's first compose loads Hydra's plug-ins, which add store entries)
    mine = compose_config("rounds=2")
    mine.rounds = 9
    assert compose_config("rounds=2").rounds == 2
    name = register_algorithm(SPEC, "clip_cached")
    try:
        assert compose_config(f"algorithm={name}").algorithm.max_norm == 0.0
    finally:
        unregister_algorithm(name)
    register_algorithm(replace(SPEC, conf=Tighter), name)
    try:
        assert compose_config(f"algorithm={name}").algorithm.max_norm == 0.5
    finally:
        unregister_algorithm(name)


# ---------------------------------------------------------------- strict config


@pytest.mark.parametrize(("extra", "message"), [
    (("+model.widht=3",), r"model\.widht: not a parameter of plugin_pkg\.nets:TinyNet\(input_shape, num_classes, "
                          r"width=16\) .*its parameters: width"),
    (("+dataset.count=3",), r"dataset\.count: not a parameter of plugin_pkg\.data:blobs.*its parameters: classes, "
                            r"features, n, spread"),
    (("+algorithm.maxnorm=1",), r"algorithm\.maxnorm: Key 'maxnorm' not in 'ClipConf'.*has fields server_lr, "
                                r"max_norm, warmup_rounds"),
    (("algorithm.max_norm=big",), r"algorithm\.max_norm: Value 'big'.*could not be converted to Float"),
    (("dataset.root=/data",), r"dataset\.root='/data' has no effect: plugin_pkg\.data:blobs.*takes no root"),
    (("model._target_=plugin_pkg.nets:Nope",), r"model\._target_=plugin_pkg\.nets:Nope: module plugin_pkg\.nets "
                                               r".* has no attribute 'Nope'"),
    (("algorithm._target_=plugin_pkg.nets:TinyNet",), r"is a type, not an AlgorithmSpec"),
    (("model._target_=plugin_pkg.nets:sequential", "+model.depth=2"), r"model\.depth: not a parameter"),
], ids=["model", "dataset", "algorithm", "algorithm-type", "inactive-root", "missing-attr", "not-a-spec",
        "function-target"])
def test_an_unknown_or_inactive_plugin_field_is_an_error_naming_it(extra, message):
    cfg = compose_config(*SMALL, *PLUGINS, *extra)
    with pytest.raises(ConfigError, match=message):
        build(cfg)


@pytest.mark.parametrize("extra", [("algorithm=fedprox", "+algorithm.mux=0.1"), ("+dataset.augment.rotate=1",),
                                   ("+rounds_total=3",), ("model=custom", "model._target_=plugin_pkg.nets:TinyNet",
                                                          "+model.width=4", "+model.name2=x")])
def test_a_key_added_with_plus_that_no_schema_declares_is_refused(extra):
    """Hydra lets ``+key=value`` add any key; one that nothing reads is refused (a user's own field is
    checked against the plug-in's signature instead)."""
    key = extra[-1].lstrip("+").partition("=")[0]
    with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')}: not (a key of the config|a parameter)"):
        build(compose_config(*SMALL, *extra))


def test_hydra_dotted_targets_load_like_colon_ones():
    from plugin_pkg.alg import SPEC
    from plugin_pkg.nets import TinyNet

    assert plugins.load("plugin_pkg.nets.TinyNet", "model._target_") is TinyNet
    assert plugins.load("plugin_pkg.alg:SPEC", "algorithm._target_") is SPEC
    cfg = compose_config(*SMALL, *DATA, "model=custom", "model._target_=plugin_pkg.nets.TinyNet",
                         "algorithm=plugin", "algorithm._target_=plugin_pkg.alg.SPEC")
    exp = build(cfg)
    exp.engine.close()
    assert isinstance(exp.simulation.eval_model.model, TinyNet) and exp.setup.algorithm is SPEC


def test_a_missing_target_says_how_to_set_it():
    with pytest.raises(ConfigError, match=r"model=custom needs model\._target_="):
        build(compose_config(*SMALL, "model=custom"))
    with pytest.raises(ConfigError, match=r"algorithm=plugin needs algorithm\._target_="):
        build(compose_config(*SMALL, "algorithm=plugin"))


def test_split_algorithms_need_stages_and_get_them_from_a_sequential():
    with pytest.raises(ModelInputError, match=r"algorithm=fedimpro cuts the model into stages, but model\._target_="
                                          r"plugin_pkg\.nets:TinyNet builds a TinyNet"):
        build(compose_config(*SMALL, *DATA, *MODEL, "algorithm=fedimpro"))
    exp = build(compose_config(*SMALL, *DATA, "model=custom", "model._target_=plugin_pkg.nets:sequential",
                               "algorithm=fedimpro", "algorithm.split_after=stage2"))
    try:
        assert exp.simulation.eval_model.model.stage_names == ["stage0", "stage1", "stage2", "stage3", "stage4",
                                                               "head"]
        exp.simulation.run()
    finally:
        exp.engine.close()


def test_every_plugin_algorithm_field_changes_the_run_or_is_refused():
    """tests/test_config_keys.py's check on the plug-in algorithm's own conf (registered in-process)."""
    from plugin_pkg.alg import SPEC

    from .test_config_keys import MLP, TINY, _fields, check_key

    values = {"server_lr": 0.5, "max_norm": 0.01, "warmup_rounds": 1}  # every field of ClipConf, enumerated below
    name = register_algorithm(SPEC, "clipavg")
    try:
        base = (*TINY, *MLP, f"algorithm={name}")
        outcomes = {field: check_key(base, "algorithm", field, name, values[field]) for field, _ in _fields(SPEC.conf)}
        # warmup_rounds is refused while max_norm=0 turns clipping off (ClipConf.inactive_fields)
        assert outcomes == {"server_lr": "changed", "max_norm": "changed", "warmup_rounds": "refused"}
        assert check_key((*base, "algorithm.max_norm=0.01"), "algorithm", "warmup_rounds", name, 1) == "changed"
    finally:
        unregister_algorithm(name)


# ---------------------------------------------------------------- reaching Ray workers and cluster nodes


def test_setup_carries_the_plugin_import_roots(tmp_path):
    exp = build(compose_config(*SMALL, *PLUGINS))
    exp.engine.close()
    assert exp.setup.import_roots == ("repo:tests",)  # relative: it resolves on a node with the checkout
    assert exp.setup.model.options["_target_"].__name__ == "TinyNet"  # the class itself travels


def test_packages_outside_the_checkout_are_shipped_to_cluster_nodes(tmp_path, monkeypatch):
    outside = tmp_path / "user_code"
    shutil.copytree(TESTS / "plugin_pkg", outside / "plugin_pkg_copy")
    (outside / "single_mod.py").write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(outside))
    from plugin_pkg.alg import ClipServer

    copied = plugins.load("plugin_pkg_copy.nets:TinyNet", "model._target_")
    assert plugins.import_roots([copied, ClipServer]) == (str(outside.resolve()), "repo:tests")
    assert plugins.cluster_py_modules([copied, ClipServer]) == [str((outside / "plugin_pkg_copy").resolve())]
    monkeypatch.setattr(plugins, "_IN_USE", [])
    plugins.note_in_use([copied])
    env = with_plugin_modules({"working_dir": "/repo"})
    assert env == {"working_dir": "/repo", "py_modules": [str((outside / "plugin_pkg_copy").resolve())]}
    single = plugins.load("single_mod:f", "model._target_")
    with pytest.raises(plugins.PluginError, match="single file outside this checkout"):
        plugins.cluster_py_modules([single])


def test_import_roots_travel_first_in_a_pickled_setup(tmp_path):
    """Unpickling a setup in a process without plugin_pkg on its path imports the plug-in's classes."""
    import subprocess

    exp = build(compose_config(*SMALL, *PLUGINS))
    exp.engine.close()
    blob = tmp_path / "setup.pkl"
    import cloudpickle

    blob.write_bytes(cloudpickle.dumps(exp.setup))
    code = ("import pickle, sys; s = pickle.loads(open(sys.argv[1], 'rb').read()); "
            "print(type(s.algorithm_conf).__module__, s.model.options['_target_'].__name__, s.model()"
            ".out.out_features)")
    out = subprocess.run([sys.executable, "-c", code, str(blob)], capture_output=True, text=True, cwd="/",
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["plugin_pkg.alg", "TinyNet", "3"]
    assert json.dumps(list(exp.setup.import_roots)) == '["repo:tests"]'


def test_the_plugins_in_use_are_remembered_while_they_live(monkeypatch):
    """What a connecting Ray engine ships (in_use) is every live plug-in object of this process's runs; a
    notebook's local class is not kept alive by it once its run is gone."""
    import gc
    import weakref

    from plugin_pkg.nets import TinyNet

    monkeypatch.setattr(plugins, "_IN_USE", [])

    class Local(torch.nn.Module):
        pass

    plugins.note_in_use([TinyNet, Local, TinyNet, len])  # len: not weakly referable, held as is
    assert plugins.in_use() == [TinyNet, Local, len]
    gone = weakref.ref(Local)
    del Local
    gc.collect()
    assert gone() is None
    assert plugins.in_use() == [TinyNet, len]  # an importable class lives in its module
