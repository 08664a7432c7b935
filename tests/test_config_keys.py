"""No silently ignored config keys: every accepted key changes what runs, or is refused at start-up.

For every registered algorithm, every compressor option, every system option and the local
training settings, each field of the schema (enumerated from the dataclass, so a new field is
covered or this test fails) is set to another valid value on a tiny run (digits, 3 clients, 1-2
rounds). The outcome must be one of:

* the run's result differs from the unperturbed run: the server state (final model, and the client
  models or fused levels a server keeps), the bytes or the metric rows (wall-clock timings aside);
* ``build`` refuses it with an error that names the key (``config_checks.check_run`` refuses a field
  that has no effect in this configuration when it is set away from its default);
* the field is in ``ALLOW`` with the reason it legitimately cannot change a result.

A ``Perturb`` may carry a ``context`` applied to both runs (so that the field acts, e.g. the bucket
size under ``scope=bucket``) and ``also``: settings the new value requires (FuseFL's rounds).
"""

from __future__ import annotations

import copy
import csv
import json
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from fl_platform.algorithms.registry import algorithm_names, get_algorithm
from fl_platform.algorithms.server_opt import ServerOptConf
from fl_platform.compression.registry import compressor_schemas
from fl_platform.config import EvalConf
from fl_platform.experiment import build
from fl_platform.privacy.config import PrivacyConf
from fl_platform.rounds.callbacks import EarlyStopConf
from fl_platform.system.config import DistConf, SystemConf
from fl_platform.training.loop import TrainConfig
from fl_platform.training.schedule import LrSchedule

from .conftest import compose_config

pytestmark = pytest.mark.slow  # the exhaustive sweep: ~540 small runs (about 2 min on two workers)

TINY = ("dataset=digits", "num_clients=3", "clients_per_round=3", "rounds=2",
        "train.epochs=1", "train.batch_size=64", "save_model=false", "seed=1", "engine.threads_per_worker=1",
        "partition.alpha=0.5", "logger.progress=false")
MLP = ("model=mlp", "model.hidden=[8]")
SMALL_CNN = ("model=cnn", "model.channels=[2,2]", "model.hidden=4", "model.norm=batch")
ONESHOT = (*MLP, "rounds=1", "algorithm.cache_dir=null")
GENERATOR = (*SMALL_CNN, "rounds=1", "algorithm.cache_dir=null", "algorithm.epochs=2", "algorithm.g_steps=2", "algorithm.nz=4", "algorithm.ngf=2",
             "algorithm.synthesis_batch_size=8", "algorithm.kd_batch_size=4")

# A tiny run per algorithm in which as many of its fields as possible act (2 rounds where a field
# acts from the second round on: server momentum, schedules, error feedback).
ALGORITHM_BASES: dict[str, tuple[str, ...]] = {
    "fedavg": MLP, "fedprox": MLP, "scaffold": MLP, "fednova": MLP,
    "feddyn": MLP, "moon": MLP,
    "fedimpro": ("model=mlp", "model.hidden=[8,8]"),
    "vhl": (*SMALL_CNN, "algorithm.virtual_batch_size=4", "algorithm.samples_per_class=2",
            "algorithm.generator_channels=4", "algorithm.style_dim=4"),
    "baow": (*MLP, "system=uniform", "algorithm.rho0=0.1"),
    "oneshot_fedavg": ONESHOT, "oneshot_ensemble": ONESHOT,
    # no validation split, so every step counts (eval_every and patience are then refused)
    "oneshot_feddf": (*ONESHOT, "algorithm.steps=4", "algorithm.batch_size=8", "algorithm.val_fraction=0",
                      "algorithm.server_fraction=0.2", "algorithm.lr=0.05"),
    "oneshot_dense": GENERATOR, "oneshot_coboost": GENERATOR,
    "oneshot_adi": (*SMALL_CNN, "rounds=1", "algorithm.cache_dir=null", "algorithm.epochs=2", "algorithm.di_steps=2",
                    "algorithm.synthesis_batch_size=8", "algorithm.kd_batch_size=4"),
    "fusefl": (*SMALL_CNN, "rounds=3", "algorithm.blocks=2", "algorithm.sample_per_class=20"),
    # personalised: BatchNorm for FedBN; Ditto's lam shapes only the personal models per-client evaluation reads
    "fedbn": SMALL_CNN, "fedper": MLP, "fedrep": (*MLP, "algorithm.head_epochs=1"),
    "ditto": (*MLP, "eval.clients=all"),
}


@dataclass(frozen=True)
class Perturb:
    value: Any
    context: dict[str, Any] = field(default_factory=dict)  # set in both runs (relative to the section)
    also: dict[str, Any] = field(default_factory=dict)  # set with the new value (absolute keys)


# Values for fields whose default has no generic perturbation (strings, None, lists) or whose
# generic one (flip a bool, x2 an int, x0.5 a float, 0 -> 1 or 0.5) cannot act in the tiny run.
# Keys: "<option>.<field>" first, then "<field>".
PERTURB: dict[str, Any] = {
    # algorithms
    "scaffold.weighting": "uniform", "oneshot_fedavg.weighting": "uniform", "oneshot_ensemble.weighting": "samples",
    "split_after": "fc2", "weight_schedule": "constant", "fedimpro.aggregation": "label_size",
    "stats_update": "last_batch", "sample_from": "local",
    "num_virtual_classes": 3, "align_local_epochs": 0, "virtual_seed": 7,
    "ratio_rule": "budget", "baow.scope": "global", "baow.index": "int32", "baow.aggregation": "plain",
    "gamma_max": 1.5, "bcrs_reweight": "ratio",
    "oneshot_feddf.student_init": "fresh", "student_init": "fedavg", "generator_clip": 0.001, "kd_clip": 0.001,
    "oneshot_fedavg.calibrate": Perturb(True, also={"rounds": 2}),
    "oneshot_ensemble.calibrate": Perturb(True, also={"rounds": 2}),
    "distill_set": "digits", "distill_size": Perturb(50, {"distill_set": "digits"}),  # out of domain: digits' own train set
    # the mask matters only where student and ensemble disagree: a fresh student disagrees everywhere
    "adv_mask": Perturb(MISSING, {"student_init": "fedavg"}),
    "pool_batches": 1, "input_low": Perturb(-2.0, {"input_low": -1.0, "input_high": 2.0}),
    "input_high": Perturb(3.0, {"input_low": -1.0, "input_high": 2.0}),
    "blocks": Perturb(3, also={"rounds": 4}), "cuts": ["conv2"], "adaptor": "avg", "local_epochs": 2,
    "calibrate": Perturb(False, also={"rounds": 2, "algorithm.sample_per_class": 5000}), "calibration": "reference",
    "calibration_batch_size": 256,
    # compressors (base: fedavg, 2 rounds, every client in both)
    "tensors": [], "scope": "global", "topk.index": "bitmap", "qsgd.bucket": 256, "min_compression_rate": 8.0,
    "bucket_size": Perturb(32, {"scope": "bucket", "bucket_size": 16}),
    "none.bucket_size": 16, "identity.bucket_size": 16, "sign.bucket_size": 16, "powersgd.bucket_size": 16,
}

# Fields that cannot change a result, and why (not run).
ALLOW: dict[str, str] = {
    # A cache of trained client models keyed by everything that determines them: a hit returns
    # bit-identical models, so where it lives changes time and disk use, never a result.
    "cache_dir": "client-model cache location",
    # Where the server-side method runs: the same computation (cpu here; a GPU changes only float
    # rounding), like engine.device.
    "server_device": "device placement",
    # Changes test_accuracy_predshift only when some test prediction is exactly virtual class 0
    # (logit C), which a tiny run need not produce; tests/test_vhl.py checks it on set predictions.
    "vhl.predshift_strict": "acts on evaluation only for predictions equal to C",
}

TIMING = ("round_time_s", "eval_time_s", "wall_time_s", "server_time_s", "setup_time_s", "beyond_slowest_s")


def _result_key(row_key: str) -> bool:
    """Metric-row fields that are results (wall-clock, busy-time and scheduler timings are not; simulated time is)."""
    return row_key not in TIMING and not row_key.startswith(("sched_", "worker_"))


_BASES: dict[tuple[str, ...], Any] = {}
_RESULTS: dict[str, Any] = {}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny runs: threads only add contention
    yield
    torch.set_num_threads(threads)


def _base(overrides: tuple[str, ...]):
    if overrides not in _BASES:
        _BASES[overrides] = compose_config(*overrides)
    return copy.deepcopy(_BASES[overrides])


def _flat_state(state: Any) -> dict[str, Any]:
    """A server state_dict as {dotted path: leaf} (dicts and lists of tensors opened up)."""
    if isinstance(state, dict | list | tuple):
        items = state.items() if isinstance(state, dict) else enumerate(state)
        return {f"{k}.{path}": leaf for k, sub in items for path, leaf in _flat_state(sub).items()}
    return {"": state}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            torch.equal(a, b)
    return repr(a) == repr(b)  # (NaN == NaN here)


def _run(cfg) -> dict[str, Any]:
    """Build (errors propagate as they are: refusals) and run; the run's result."""
    exp = build(cfg)
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    rows = [{k: v for k, v in row.items() if _result_key(k)} for row in exp.simulation.history]
    return {"rows": json.dumps(rows, sort_keys=True, default=repr),
            "state": _flat_state(exp.simulation.server.state_dict())}


def _differs(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["rows"] != b["rows"] or set(a["state"]) != set(b["state"]):
        return True
    return any(not _same(a["state"][k], b["state"][k]) for k in a["state"])


def _apply(cfg, section: str, values: dict[str, Any]) -> None:
    for key, value in values.items():
        OmegaConf.update(cfg, f"{section}.{key}" if section else key, value, merge=False)


def _reference(overrides: tuple[str, ...], section: str, context: dict[str, Any]) -> dict[str, Any]:
    key = json.dumps([overrides, section, context], sort_keys=True, default=repr)
    if key not in _RESULTS:
        cfg = _base(overrides)
        _apply(cfg, section, context)
        _RESULTS[key] = _run(cfg)
    return _RESULTS[key]


def _generic(default: Any) -> Any:
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default * 2 if default else 1
    if isinstance(default, float):
        return default * 0.5 if default else 0.5
    return MISSING


def perturbation(option: str, name: str, default: Any) -> Any:
    """The value to try for field ``name`` of ``option`` (``ALLOW``-ed: None)."""
    if name in ALLOW or f"{option}.{name}" in ALLOW:
        return None
    spec = PERTURB.get(f"{option}.{name}", PERTURB.get(name, MISSING))
    if spec is MISSING:
        spec = _generic(default)
    elif isinstance(spec, Perturb) and spec.value is MISSING:  # a context, with the generic value
        spec = Perturb(_generic(default), spec.context, spec.also)
    assert spec is not MISSING, (f"no perturbation for field {name} of {option} (default {default!r}): add one "
                                 "to PERTURB, or a reason to ALLOW")
    return spec


def check_key(overrides: tuple[str, ...], section: str, name: str, option: str, spec: Any) -> str:
    """Set ``section.name`` to ``spec`` on the run ``overrides``; returns how the key proved effective."""
    if spec is None:
        return "allowed"
    p = spec if isinstance(spec, Perturb) else Perturb(spec)
    dotted = f"{section}.{name}"
    reference = _reference(overrides, section, p.context)
    cfg = _base(overrides)
    _apply(cfg, section, p.context)
    _apply(cfg, "", p.also)
    OmegaConf.update(cfg, dotted, p.value, merge=False)
    try:
        result = _run(cfg)
    except (ValueError, NotImplementedError) as err:  # start-up refusals (ConfigError is a ValueError)
        assert dotted in str(err), f"{dotted}={p.value!r} ({option}) was refused, but the error does not name it: {err}"
        return "refused"
    assert _differs(result, reference), (f"{dotted}={p.value!r} ({option}) was accepted but changed nothing: "
                                         "make it act, refuse it in config_checks.check_run, or ALLOW it with the reason")
    return "changed"


def _fields(schema: type) -> list[tuple[str, Any]]:
    out = []
    for f in fields(schema):
        if f.name == "name":
            continue
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        out.append((f.name, default))
    return out


# ---------------------------------------------------------------- algorithms


def _algorithm_cases() -> list[Any]:
    return [pytest.param(alg, name, default, id=f"{alg}-{name}")
            for alg in algorithm_names() for name, default in _fields(get_algorithm(alg).conf)]


def test_every_registered_algorithm_has_a_tiny_base_run():
    assert set(ALGORITHM_BASES) == set(algorithm_names())


@pytest.mark.parametrize(("algorithm", "name", "default"), _algorithm_cases())
def test_every_algorithm_field_changes_the_run_or_is_refused(algorithm, name, default):
    overrides = (*TINY, f"algorithm={algorithm}", *ALGORITHM_BASES[algorithm])
    current = OmegaConf.select(_base(overrides), f"algorithm.{name}")  # the base run's value
    check_key(overrides, "algorithm", name, algorithm, perturbation(algorithm, name, current))


@pytest.mark.parametrize("algorithm", algorithm_names())
def test_every_algorithm_runs_with_a_compressor_or_refuses_it(algorithm):
    """A compressor on an algorithm whose uplink has no tensor it names is refused, not inert."""
    overrides = (*TINY, f"algorithm={algorithm}", *ALGORITHM_BASES[algorithm])
    reference = _reference(overrides, "", {})
    try:
        result = _run(_base((*overrides, "compressor=topk", "compressor.ratio=0.5")))
    except (ValueError, NotImplementedError) as err:
        assert "compressor" in str(err)
        return
    assert _differs(result, reference)


def test_oneshot_fedavg_compresses_the_uploaded_weights_when_told_to():
    """The issue's case: topk on oneshot_fedavg was silently dense; now it names compressor.tensors, and
    compressor.tensors=[weights] compresses the client models (a quarter of the bytes at ratio 0.1, bitmap)."""
    overrides = (*TINY, "algorithm=oneshot_fedavg", *ONESHOT, "compressor=topk", "compressor.ratio=0.1")
    with pytest.raises(ValueError, match=r"compressor\.tensors names \['delta'\], but oneshot_fedavg uploads "
                                         r"only \['weights'\]"):
        build(_base(overrides))
    dense = _reference((*TINY, "algorithm=oneshot_fedavg", *ONESHOT), "", {})
    sparse = _run(_base((*overrides, "compressor.tensors=[weights]")))
    bytes_of = [json.loads(r["rows"])[0]["bytes_up"] for r in (dense, sparse)]
    assert bytes_of[1] < 0.3 * bytes_of[0]


@pytest.mark.parametrize("algorithm", ["oneshot_fedavg", "oneshot_feddf", "fusefl", "feddyn"])
def test_server_lr_is_not_a_key_of_algorithms_that_never_read_it(algorithm):
    with pytest.raises(Exception, match="server_lr"):
        compose_config(f"algorithm={algorithm}", "algorithm.server_lr=0.5")


# ---------------------------------------------------------------- compressors


def _compressor_cases() -> list[Any]:
    return [pytest.param(option, name, default, id=f"{option}-{name}")
            for option, schema in compressor_schemas().items() if option != "acpsgd"
            for name, default in _fields(schema)]


@pytest.mark.parametrize(("option", "name", "default"), _compressor_cases())
def test_every_compressor_field_changes_the_run_or_is_refused(option, name, default):
    overrides = (*TINY, *MLP, f"compressor={option}")
    current = OmegaConf.select(_base(overrides), f"compressor.{name}")
    check_key(overrides, "compressor", name, option, perturbation(option, name, current))


def test_acpsgd_and_so_each_of_its_fields_is_refused_for_fl_uplinks():
    with pytest.raises(NotImplementedError, match="acpsgd is not implemented for FL uplinks"):
        build(_base((*TINY, *MLP, "compressor=acpsgd")))


# ---------------------------------------------------------------- system model


def _leaves(schema: Any, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for f in fields(schema):
        value = getattr(schema, f.name)
        if is_dataclass(value):
            out += _leaves(value, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", value))
    return out


SYSTEM_BASES = ("none", "uniform", "lognormal", "heterogeneous", "trace")
SYSTEM_PERTURB: dict[str, Any] = {"downlink_per_uplink": 5.0, "trace_assign": "random", "name": "sampled"}


def _trace(directory: Path, name: str, scale: float) -> str:
    path = directory / name
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["compute_sps", "uplink_mbps", "downlink_mbps"])
        w.writerows([[500 * scale, 2 * scale, 20 * scale], [2000 * scale, 8 * scale, 80 * scale]])
    return str(path)


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("traces")
    return _trace(d, "a.csv", 1.0), _trace(d, "b.csv", 3.0)


def _system_cases() -> list[Any]:
    return [pytest.param(base, name, default, id=f"{base}-{name}")
            for base in SYSTEM_BASES for name, default in _leaves(SystemConf())]


@pytest.mark.parametrize(("base", "name", "default"), _system_cases())
def test_every_system_field_changes_the_run_or_is_refused(base, name, default, traces):
    overrides = (*TINY, *MLP, "rounds=1", f"system={base}", *([f"system.trace={traces[0]}"] if base == "trace" else []))
    cfg_value = OmegaConf.select(_base(overrides), f"system.{name}")
    if name == "name":
        if base != "none":
            # Switching the kind of a configured system leaves its distributions (or trace) unused,
            # which is refused under their own keys; the switch itself is exercised from system=none.
            return
        value: Any = "sampled"
    elif name == "trace":
        value = traces[1]
    elif name.endswith(".dist") and (base in ("none", "trace") or cfg_value == "constant"):
        value = "uniform"
    elif name.endswith(".dist"):
        # To constant: the old distribution's parameters go back to their defaults (else refused).
        quantity = getattr(SystemConf(), name.split(".")[0])
        old = DistConf(dist=cfg_value).inactive_fields()
        value = Perturb("constant", also={f"system.{name[:-4]}{p}": getattr(quantity, p)
                                          for p in ("low", "high", "median", "sigma") if p not in old})
    else:
        value = SYSTEM_PERTURB.get(name, _generic(cfg_value))
    check_key(overrides, "system", name, f"system={base}", value)


def test_trace_assign_is_refused_when_every_trace_row_names_its_client(tmp_path):
    path = tmp_path / "ids.csv"
    path.write_text("client_id,compute_sps,uplink_mbps,downlink_mbps\n0,500,2,20\n1,900,4,40\n2,700,3,30\n")
    overrides = (*TINY, *MLP, "rounds=1", "system=trace", f"system.trace={path}")
    build(_base(overrides)).engine.close()
    with pytest.raises(ValueError, match=r"system\.trace_assign='random' has no effect"):
        build(_base((*overrides, "system.trace_assign=random")))


# ---------------------------------------------------------------- local training


TRAIN_BASES = {"sgd": (), "adam": ("train.optimizer=adam", "train.lr=0.01")}
TRAIN_PERTURB: dict[str, Any] = {"steps": 3, "clip_norm": 0.01, "sgd.optimizer": "adam", "adam.optimizer": "sgd",
                                 "sgd.nesterov": Perturb(True, {"momentum": 0.5}), "precision": "bf16"}
# The same computation, compiled: equal to the eager run within float rounding, so a changed result would
# prove nothing (and compiling takes minutes here). tests/test_training.py checks that the forward is
# compiled, before the first round, and trains as eager does.
TRAIN_ALLOW = {"compile": "torch.compile of the same forward"}


@pytest.mark.parametrize(("base", "name", "default"),
                         [pytest.param(b, n, d, id=f"{b}-{n}") for b in TRAIN_BASES for n, d in _fields(TrainConfig)
                          if n != "lr_schedule"])  # (its fields: the next test)
def test_every_train_field_changes_the_run_or_is_refused(base, name, default):
    overrides = (*TINY, *MLP, "rounds=1", *TRAIN_BASES[base])
    current = OmegaConf.select(_base(overrides), f"train.{name}")
    spec = TRAIN_PERTURB.get(f"{base}.{name}", TRAIN_PERTURB.get(name, _generic(current)))
    check_key(overrides, "train", name, f"train({base})", None if name in TRAIN_ALLOW else spec)


# train.lr_schedule on 3 rounds, from each schedule (the context sets it in both runs); name is switched
# from constant (from step or cosine, the switch leaves their own fields set, refused under their keys).
SCHEDULE_BASES: dict[str, dict[str, Any]] = {"constant": {}, "step": {"lr_schedule.name": "step",
                                                                      "lr_schedule.step_every": 1},
                                             "cosine": {"lr_schedule.name": "cosine"}}
SCHEDULE_PERTURB: dict[str, Any] = {"name": "cosine", "step_every": 2, "gamma": 0.05, "min_lr": 0.01, "rounds": 5}


@pytest.mark.parametrize(("base", "name"), [pytest.param(b, n, id=f"{b}-{n}") for b in SCHEDULE_BASES
                                            for n, _ in _fields(LrSchedule) if b == "constant" or n != "name"])
def test_every_lr_schedule_field_changes_the_run_or_is_refused(base, name):
    overrides = (*TINY, *MLP, "rounds=3")
    current = OmegaConf.select(_base(overrides), f"train.lr_schedule.{name}")
    value = SCHEDULE_PERTURB.get(name, _generic(current))
    check_key(overrides, "train", f"lr_schedule.{name}", f"lr_schedule({base})", Perturb(value, SCHEDULE_BASES[base]))


# early_stop on 4 rounds: off (patience 0), every other field is refused; on (patience 1), each field
# changes the split, the row fields or the round the run stops after.
EARLY_BASES: dict[str, dict[str, Any]] = {"off": {}, "on": {"patience": 1}}
EARLY_PERTURB: dict[str, Any] = {"patience": 1, "val_fraction": 0.3, "metric": "val_accuracy", "min_delta": 1.0}


@pytest.mark.parametrize(("base", "name"), [pytest.param(b, n, id=f"{b}-{n}") for b in EARLY_BASES
                                            for n, _ in _fields(EarlyStopConf) if not (b == "on" and n == "patience")])
def test_every_early_stop_field_changes_the_run_or_is_refused(base, name):
    overrides = (*TINY, *MLP, "rounds=4")
    # metric: with a min_delta of 0.02 val_loss improves every round of this run (by 0.045 to 0.07), val_accuracy
    # not in round 2 (+0.007): the runs stop at different rounds (without it both run all 4 rounds alike)
    context = {**EARLY_BASES[base], **({"min_delta": 0.02} if name == "metric" and base == "on" else {})}
    check_key(overrides, "early_stop", name, f"early_stop({base})", Perturb(EARLY_PERTURB[name], context))


# ---------------------------------------------------------------- per-client evaluation


EVAL_BASES = {"none": (), "all": ("eval.clients=all",)}
# From none: per-client evaluation on (new row fields); from all: off again (the local test rows train too).
EVAL_PERTURB: dict[str, Any] = {"none.clients": "all", "all.clients": "none"}


@pytest.mark.parametrize(("base", "name", "default"),
                         [pytest.param(b, n, d, id=f"{b}-{n}") for b in EVAL_BASES for n, d in _fields(EvalConf)])
def test_every_eval_field_changes_the_run_or_is_refused(base, name, default):
    """eval.clients=none refuses the fields that only per-client evaluation reads; with it they act."""
    overrides = (*TINY, *MLP, *EVAL_BASES[base])
    current = OmegaConf.select(_base(overrides), f"eval.{name}")
    spec = EVAL_PERTURB.get(f"{base}.{name}", _generic(current))
    check_key(overrides, "eval", name, f"eval({base})", spec)


# ---------------------------------------------------------------- server optimisers


SERVER_OPT_BASES = ("none", "adam", "yogi", "adagrad")


@pytest.mark.parametrize(("base", "name", "default"),
                         [pytest.param(b, n, d, id=f"{b}-{n}") for b in SERVER_OPT_BASES
                          for n, d in _fields(ServerOptConf)])
def test_every_server_opt_field_changes_the_run_or_is_refused(base, name, default):
    """server_opt=none refuses every field; adam's and yogi's act; adagrad refuses beta2 (no decay)."""
    overrides = (*TINY, *MLP, f"server_opt={base}")
    current = OmegaConf.select(_base(overrides), f"server_opt.{name}")
    check_key(overrides, "server_opt", name, f"server_opt={base}", _generic(current))


@pytest.mark.parametrize("algorithm", algorithm_names())
def test_every_algorithm_runs_with_a_server_optimiser_or_refuses_it(algorithm):
    """server_opt=yogi acts on every algorithm whose server step takes a pseudo-gradient, and is refused,
    naming it, by the others (one-shot, FuseFL, FedDyn)."""
    overrides = (*TINY, f"algorithm={algorithm}", *ALGORITHM_BASES[algorithm])
    reference = _reference(overrides, "", {})
    try:
        result = _run(_base((*overrides, "server_opt=yogi")))
    except (ValueError, NotImplementedError) as err:
        assert "server_opt=yogi" in str(err)
        return
    assert _differs(result, reference)


# ---------------------------------------------------------------- privacy


PRIVACY_BASES = ("none", "central", "local")
ADAPTIVE = {"adaptive.enabled": True, "adaptive.count_stddev": 2.0}  # sigma_b must exceed z/2 = 0.5
# target_epsilon: between epsilon after 1 and 2 rounds, so the run stops after round 1 (z = 1, every client
# every round: central, Poisson with q = 1, add/remove: about 4.7 and 7.1; local, replace-one: 10.7 and 16.5).
PRIVACY_PERTURB: dict[str, Any] = {"target_epsilon": 12.0, "central.target_epsilon": 6.0,
                                   "accountant": "pld", "sampling": "fixed",
                                   "adaptive.count_stddev": 2.0,
                                   "adaptive.enabled": Perturb(True, also={"privacy.adaptive.count_stddev": 2.0})}


@pytest.mark.parametrize(("base", "name", "default"),
                         [pytest.param(b, n, d, id=f"{b}-{n}") for b in PRIVACY_BASES
                          for n, d in _leaves(PrivacyConf()) if n != "name"])
def test_every_privacy_field_changes_the_run_or_is_refused(base, name, default):
    """privacy=none refuses every field; central's and local's act (epsilon in the rows, the noise,
    the clip, the stop), or are refused where they cannot (adaptive clipping under local DP)."""
    overrides = (*TINY, *MLP, f"privacy={base}")
    current = OmegaConf.select(_base(overrides), f"privacy.{name}")
    spec = PRIVACY_PERTURB.get(f"{base}.{name}", PRIVACY_PERTURB.get(name, _generic(current)))
    if base == "central" and name.startswith("adaptive.") and name != "adaptive.enabled":
        spec = Perturb(_generic(ADAPTIVE[name]) if name in ADAPTIVE else _generic(current), ADAPTIVE)
    assert spec is not MISSING, f"no perturbation for privacy.{name}"
    check_key(overrides, "privacy", name, f"privacy={base}", spec)


@pytest.mark.parametrize("algorithm", algorithm_names())
def test_every_algorithm_runs_under_dp_or_refuses_it(algorithm):
    """privacy=central on every algorithm: it acts (clipped, noised, epsilon rows), or start-up refuses it
    naming privacy (list-mode one-shot methods, FuseFL, FedImpro's statistics, BAOW's OPWA)."""
    overrides = (*TINY, f"algorithm={algorithm}", *ALGORITHM_BASES[algorithm])
    reference = _reference(overrides, "", {})
    try:
        result = _run(_base((*overrides, "privacy=central")))
    except (ValueError, NotImplementedError) as err:
        assert "privacy=central" in str(err)
        return
    assert _differs(result, reference)


# ---------------------------------------------------------------- engine.deterministic


@pytest.fixture
def deterministic_off(monkeypatch):
    """engine.deterministic=true switches this (inline) process to deterministic algorithms: undone after."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic = False


def test_engine_deterministic_acts_in_the_worker_and_names_itself_when_an_op_has_no_deterministic_kernel(
        deterministic_off):
    """On the CPU the result is bit-identical either way (so the key cannot show in a result here); what it
    changes: the worker runs under torch's deterministic algorithms, and an operation that has no
    deterministic kernel (on CUDA it raises through this same alert) stops the round naming the key."""
    import os

    from torch._prims_common import alert_not_deterministic

    from fl_platform.core import RoundContext
    from fl_platform.engine.worker import Worker

    overrides = (*TINY, *MLP, "algorithm=scaffold")
    plain = _run(_base(overrides))
    assert not torch.are_deterministic_algorithms_enabled()
    exp = build(_base((*overrides, "engine.deterministic=true")))
    exp.engine.close()
    worker = Worker(0, exp.setup)
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    train = worker.client.train

    def train_with_a_nondeterministic_op(*args, **kwargs):
        alert_not_deterministic("an_op_without_a_deterministic_kernel")  # torch's alert, as such a CUDA op raises it
        return train(*args, **kwargs)

    worker.client.train = train_with_a_nondeterministic_op
    ctx = RoundContext(round=0, seed=1, clients=(0, 1), num_rounds=1, num_clients=3)
    with pytest.raises(RuntimeError, match=r"engine\.deterministic=true refuses .*an_op_without_a_deterministic_kernel"
                                           r"(.|\n)*set engine\.deterministic=false"):
        worker.run_round(ctx, exp.simulation.server.broadcast(ctx), [0, 1])
    worker.close()
    assert not _differs(_run(_base((*overrides, "engine.deterministic=true"))), plain)  # bit-identical on CPU
