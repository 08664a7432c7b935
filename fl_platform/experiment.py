"""Build an experiment from its config and run it: data, model, algorithm, engine, outputs.

Used by the CLI (``fl_platform.run``), by tests and by benchmarks, so that all of them run
exactly the same code path.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from fl_platform.algorithms.registry import PLUGIN, get_algorithm, spec_of
from fl_platform.config import EngineConf, options_of, unknown_keys
from fl_platform.datasets.federated import FederatedDataset, build_federated_dataset
from fl_platform.engine.scheduler import balance_warning
from fl_platform.models import check_model_input
from fl_platform.outputs import (
    MetricsLog,
    RunDir,
    atomic_torch_save,
    atomic_write_json,
    atomic_write_text,
    plugin_name,
)
from fl_platform.privacy.config import sampling_of
from fl_platform.privacy.setup import resolved_privacy, server_privacy_for
from fl_platform.reporting import Reporter
from fl_platform.rounds.callbacks import EarlyStopConf, RoundEnd, load_callbacks, validation_split
from fl_platform.rounds.checkpoint import Checkpoint, Checkpointer
from fl_platform.rounds.client_eval import CLIENT_METRICS, ClientEvaluation
from fl_platform.rounds.engine import Engine, workers_table
from fl_platform.rounds.sampling import sample_clients
from fl_platform.rounds.setup import ExperimentSetup, ModelFactory, resolve_device
from fl_platform.rounds.simulation import LoopConfig, Simulation
from fl_platform.seeding import Stream, seed_torch_global
from fl_platform.system.model import build_system
from fl_platform.training.flat import FlatModel
from fl_platform.training.loop import TrainConfig
from fl_platform.training.step import check_cohort_options, check_image_inputs
from fl_platform.training.vectorised import parse_cohort_size

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config value that is well-typed but makes no sense (names the key)."""


def enum_value(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def validate(cfg: DictConfig) -> None:
    checks = [
        (cfg.rounds >= 1, "rounds", f"must be >= 1, got {cfg.rounds}"),
        (cfg.num_clients >= 1, "num_clients", f"must be >= 1, got {cfg.num_clients}"),
        (1 <= cfg.clients_per_round <= cfg.num_clients, "clients_per_round",
         f"must be in 1..num_clients={cfg.num_clients}, got {cfg.clients_per_round}"),
        (cfg.eval_every >= 1, "eval_every", f"must be >= 1, got {cfg.eval_every}"),
        (cfg.train.batch_size >= 1, "train.batch_size", f"must be >= 1, got {cfg.train.batch_size}"),
        (cfg.train.lr > 0, "train.lr", f"must be > 0, got {cfg.train.lr}"),
        (cfg.train.steps is not None or (cfg.train.epochs is not None and cfg.train.epochs >= 1), "train.epochs",
         f"must be >= 1 (or set train.steps), got {cfg.train.epochs}"),
        (cfg.train.steps is None or cfg.train.steps >= 1, "train.steps", f"must be >= 1, got {cfg.train.steps}"),
        (cfg.train.steps is None or cfg.train.epochs is None, "train.epochs",
         f"has no effect when train.steps is set (train.steps={cfg.train.steps} fixes the number of local "
         f"steps; got train.epochs={cfg.train.epochs}): set one of them"),
        (cfg.train.optimizer in ("sgd", "adam"), "train.optimizer",
         f"must be one of sgd, adam; got {cfg.train.optimizer!r}"),
    ]
    engine = cfg.engine
    from fl_platform.state.store import STORE_KINDS

    checks += [
        (cfg.checkpoint_every >= 0, "checkpoint_every", f"must be >= 0, got {cfg.checkpoint_every}"),
        (engine.state_store in STORE_KINDS, "engine.state_store",
         f"must be one of {', '.join(STORE_KINDS)}; got {engine.state_store!r}"),
        (engine.state_backend in ("memory", "disk"), "engine.state_backend",
         f"must be memory or disk; got {engine.state_backend!r}"),
        (engine.max_restarts >= 0, "engine.max_restarts", f"must be >= 0, got {engine.max_restarts}"),
        (engine.eval_device in ("auto", "cpu") or engine.eval_device.split(":")[0] == "cuda", "engine.eval_device",
         f"must be auto, cpu or cuda[:k]; got {engine.eval_device!r}"),
        (engine.start_timeout_s > 0, "engine.start_timeout_s", f"must be > 0, got {engine.start_timeout_s}"),
        (engine.threads_per_worker is None or engine.threads_per_worker >= 1, "engine.threads_per_worker",
         f"must be >= 1 (or null: engine.cpus_per_worker, 1 inline), got {engine.threads_per_worker}"),
        (engine.fault_injection.client is None or enum_value(engine.name) == "ray", "engine.fault_injection",
         "is a test-only fault for Ray workers; it needs engine=ray"),
        (engine.fault_injection.slow_worker is not None or engine.fault_injection.slow_factor == 1.0,
         "engine.fault_injection.slow_factor", "slows the worker named by engine.fault_injection.slow_worker "
         "(test only); set that too, or leave slow_factor at 1.0"),
        (engine.fault_injection.slow_worker is None or engine.fault_injection.slow_factor > 1.0,
         "engine.fault_injection.slow_worker", f"(test only) needs engine.fault_injection.slow_factor > 1, got "
         f"{engine.fault_injection.slow_factor}"),
        (not engine.state_fsync or engine.state_store == "disk"
         or (engine.state_store == "distributed" and engine.state_backend == "disk"), "engine.state_fsync",
         f"needs client-state files (engine.state_store=disk, or distributed with state_backend=disk); got "
         f"state_store={engine.state_store}, state_backend={engine.state_backend}"),
    ]
    try:
        parse_cohort_size(engine.cohort_size)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if "alpha" in cfg.partition:
        checks.append((cfg.partition.alpha > 0, "partition.alpha", f"must be > 0, got {cfg.partition.alpha}"))
    train = cfg.train
    checks.append((not train.nesterov or train.optimizer != "sgd" or train.momentum > 0, "train.nesterov",
                   f"needs train.momentum > 0, got momentum={train.momentum}"))
    schedule = train_config(cfg).lr_schedule
    checks += [(False, f"train.lr_schedule.{key}", why) for key, why in schedule.problems(cfg.train.lr)]
    early = early_stop_conf(cfg)
    checks += [(False, f"early_stop.{key}", why) for key, why in early.problems()]
    for ok, key, message in checks:
        if not ok:
            raise ConfigError(f"{key} {message}")
    refuse_inactive("early_stop", early, EarlyStopConf(), early.inactive_fields())
    check_keys_and_plugins(cfg)
    check_effective(cfg)
    check_eval(cfg)


def eval_clients(cfg: DictConfig) -> str:
    """``eval.clients`` (none when the config has no eval section)."""
    return str(enum_value(cfg.eval.clients)) if cfg.get("eval") is not None else "none"


def check_eval(cfg: DictConfig) -> None:
    """The eval section: sane values, and no key that acts only with per-client evaluation set without it."""
    from fl_platform.config import EvalConf

    if cfg.get("eval") is None:
        return
    ev, base = cfg.eval, EvalConf()
    if not 0.0 < ev.local_test_fraction < 1.0:
        raise ConfigError(f"eval.local_test_fraction must be in (0, 1), got {ev.local_test_fraction}")
    if ev.finetune_steps < 0:
        raise ConfigError(f"eval.finetune_steps must be >= 0, got {ev.finetune_steps}")
    if eval_clients(cfg) == "none":
        why = "it acts only with per-client evaluation, and eval.clients=none (set eval.clients=all or sample)"
        refuse_inactive("eval", ev, base, {"local_test_fraction": why, "finetune_steps": why})


def check_keys_and_plugins(cfg: DictConfig) -> None:
    """No key that nothing reads (``+key=value`` beyond the schemas), and the user's code loads with
    the config's fields for it (also S-SGD's validation)."""
    unknown = unknown_keys(cfg)
    if unknown:
        raise ConfigError(f"{', '.join(unknown)}: not a key of the config (a + override adds a key no schema "
                          "declares, so nothing would read it)")
    check_plugins(cfg)


def check_plugins(cfg: DictConfig) -> None:
    """The user's code that the config names (a custom model or dataset, a plug-in algorithm) loads,
    and the config's fields for it are its parameters (an unknown one is refused, naming it)."""
    from fl_platform.datasets.registry import CUSTOM as CUSTOM_DATA
    from fl_platform.datasets.registry import custom_loader
    from fl_platform.models.custom import CUSTOM, builder_of, split_options

    try:
        if "algorithm" in cfg:
            spec_of(cfg.algorithm)
        if cfg.model.name == CUSTOM:
            builder_of(*split_options(options_of(cfg.model)))
        if cfg.dataset.name == CUSTOM_DATA:
            ds = cfg.dataset
            own = options_of(ds, exclude=("name", "root", "download", "augment", "_target_"))
            custom_loader(None if OmegaConf.is_missing(ds, "_target_") else ds._target_, own, ds.root, ds.download)
        load_callbacks(OmegaConf.to_container(cfg.callbacks, resolve=True) if "callbacks" in cfg else [])
    except (ValueError, TypeError) as err:  # PluginError is a ValueError
        raise ConfigError(str(err)) from None


def train_inactive(train: TrainConfig) -> dict[str, str]:
    """Local-training fields that the chosen optimizer or lr schedule does not read (field -> why)."""
    schedule = {f"lr_schedule.{k}": why for k, why in train.lr_schedule.inactive_fields().items()}
    if train.optimizer == "sgd":
        return {**dict.fromkeys(("adam_beta1", "adam_beta2", "adam_eps"), "an Adam setting, and train.optimizer=sgd"),
                **schedule}
    return {**dict.fromkeys(("momentum", "nesterov"), f"an SGD setting, and train.optimizer={train.optimizer}"),
            **schedule}


def _field(conf: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        conf = getattr(conf, part)
    return conf


def refuse_inactive(section: str, conf: Any, default: Any, inactive: dict[str, str]) -> None:
    """ConfigError for the first field in ``inactive`` (field -> why it has no effect) whose value in
    ``conf`` differs from ``default``'s: a key that would be silently ignored."""
    for key, why in inactive.items():
        value, base = _field(conf, key), _field(default, key)
        if value != base:
            raise ConfigError(f"{section}.{key}={value!r} has no effect in this run: {why} (leave it at {base!r})")


def check_effective(cfg: DictConfig) -> None:
    """Refuse, naming the key, a setting that this run would silently ignore: a field that only acts
    under another option (``train.adam_beta1`` with ``optimizer=sgd``, ``algorithm.constant_weight``
    with a gradual schedule, ``system.trace`` without ``system=trace``) set away from its default,
    or a compressor whose ``tensors`` are not among what the algorithm uploads."""
    from fl_platform.compression.registry import COMPRESSORS, conf_of
    from fl_platform.compression.uplink import check_compressor
    from fl_platform.system.config import SystemConf
    from fl_platform.system.model import system_conf

    train = train_config(cfg)
    refuse_inactive("train", train, TrainConfig(), train_inactive(train))
    spec = spec_of(cfg.algorithm)
    alg = algorithm_conf(cfg)
    refuse_inactive("algorithm", alg, spec.conf(), alg.inactive_fields(cfg))
    if cfg.get("compressor") is not None:
        try:
            comp = conf_of(cfg.compressor)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        refuse_inactive("compressor", comp, COMPRESSORS[comp.name][0](), comp.inactive_fields(cfg.rounds))
        try:
            check_compressor(comp, spec.client.uploads(alg), algorithm_name(cfg),
                             getattr(spec.client, "compresses_uplink", False))
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if cfg.get("system") is not None:
        system = system_conf(cfg.system)
        refuse_inactive("system", system, SystemConf(), system.inactive_fields())
    if cfg.get("privacy") is not None:
        check_privacy_keys(cfg, spec, alg)
    if cfg.get("server_opt") is not None:
        from fl_platform.algorithms.server_opt import ServerOptConf, check_server_opt

        opt = server_opt_conf(cfg)
        refuse_inactive("server_opt", opt, ServerOptConf(), opt.inactive_fields())
        try:
            check_server_opt(opt, spec.server, algorithm_name(cfg))
        except ValueError as err:
            raise ConfigError(str(err)) from None


def server_opt_conf(cfg: DictConfig) -> Any:
    """The ``server_opt`` section as its dataclass (None when the config has none)."""
    from fl_platform.algorithms.server_opt import ServerOptConf

    node = cfg.get("server_opt")
    return None if node is None else OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ServerOptConf), node))


def check_privacy_keys(cfg: DictConfig, spec: Any, alg: Any) -> None:
    """The privacy group: no inert key, sane values, an algorithm and sampling the mechanism and the
    accountant cover (fl_platform/privacy/setup.py), else ConfigError naming the key."""
    from fl_platform.privacy.config import PrivacyConf, privacy_conf
    from fl_platform.privacy.setup import check_privacy

    conf = privacy_conf(cfg.privacy)
    refuse_inactive("privacy", conf, PrivacyConf(), conf.inactive_fields(cfg.num_clients, cfg.clients_per_round))
    try:
        check_privacy(cfg, spec, alg)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def early_stop_conf(cfg: DictConfig) -> EarlyStopConf:
    """The ``early_stop`` section (off when the config has none)."""
    node = cfg.get("early_stop")
    return EarlyStopConf() if node is None else EarlyStopConf(**OmegaConf.to_container(node, resolve=True))


def round_end_for(cfg: DictConfig, data: FederatedDataset) -> tuple[FederatedDataset, RoundEnd | None]:
    """``data`` without the early-stopping validation rows, and what runs between rounds (None: nothing)."""
    early = early_stop_conf(cfg)
    callbacks = load_callbacks(OmegaConf.to_container(cfg.callbacks, resolve=True) if "callbacks" in cfg else [])
    data, validation = validation_split(data, early, cfg.seed)
    if not callbacks and validation is None:
        return data, None
    return data, RoundEnd(callbacks, early, validation)


def train_config(cfg: DictConfig) -> TrainConfig:
    """The train section; a cosine schedule's horizon (``lr_schedule.rounds``) defaults to the run's rounds."""
    train = TrainConfig(**OmegaConf.to_container(cfg.train, resolve=True))
    if train.lr_schedule.name == "cosine" and train.lr_schedule.rounds is None:
        train.lr_schedule.rounds = int(cfg.rounds)
    return train


def algorithm_name(cfg: DictConfig) -> str:
    """The algorithm's name for logs and summaries: ``algorithm.name``, or the spec's for ``algorithm=plugin``."""
    return spec_of(cfg.algorithm).name if cfg.algorithm.name == PLUGIN else cfg.algorithm.name


def algorithm_conf(cfg: DictConfig):
    """The algorithm section as its spec's conf dataclass. ``algorithm=plugin``: its fields but
    ``_target_`` onto the SPEC's conf, so a field the conf lacks is an error naming it."""
    from omegaconf.errors import OmegaConfBaseException

    spec = spec_of(cfg.algorithm)
    if cfg.algorithm.name != PLUGIN:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(spec.conf), cfg.algorithm))
    own = options_of(cfg.algorithm, exclude=("name", "_target_"))
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(spec.conf), own))
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        names = [f.name for f in dataclasses.fields(spec.conf) if f.name != "name"]
        raise ConfigError(f"algorithm.{key}: {str(err).splitlines()[0]} (algorithm._target_="
                          f"{cfg.algorithm._target_}: {spec.conf.__name__} has fields {', '.join(names) or 'none'})"
                          ) from None


def load_data(cfg: DictConfig) -> FederatedDataset:
    ds = cfg.dataset
    data = build_federated_dataset(
        ds.name, num_clients=cfg.num_clients, partition_name=cfg.partition.name, seed=cfg.seed,
        root=ds.root, download=ds.download,
        source_options=options_of(ds, exclude=("name", "root", "download", "augment")),
        partition_options=options_of(cfg.partition), augment=options_of(ds.augment, exclude=()),
    )
    if eval_clients(cfg) != "none":  # each client's local test split, held out of its training rows
        data = data.with_local_test(cfg.eval.local_test_fraction, cfg.seed)
    return data


def node_path(path: str, ray: bool) -> str:
    """``engine.state_dir`` as the stores get it: absolute here inline; with Ray as given, expanded on each
    node (``~`` is each node's home; the driver's home or working directory means nothing there)."""
    return path if ray else os.path.abspath(os.path.expanduser(path))


def make_setup(cfg: DictConfig, data: FederatedDataset) -> ExperimentSetup:
    from fl_platform import plugins
    from fl_platform.models.custom import CUSTOM, TARGET

    spec = spec_of(cfg.algorithm)
    alg_conf = algorithm_conf(cfg)
    outputs = spec.num_model_outputs(alg_conf, data.num_classes)
    options = options_of(cfg.model)
    user_code: list[Any] = [spec.conf, spec.client, spec.server, type(alg_conf)]
    if cfg.model.name == CUSTOM:  # the class itself travels in the factory (and is imported once, here)
        options[TARGET] = plugins.load(options[TARGET], "model._target_")
        user_code.append(options[TARGET])
    model = ModelFactory(cfg.model.name, tuple(data.input_shape), outputs, options)
    if data.vocab is not None and cfg.model.name == "lstm":
        model = ModelFactory(model.name, model.input_shape, model.num_classes,
                             {**model.options, "vocab_size": len(data.vocab)})
    check_model_input(model.name, model.input_shape, model.num_classes, data.train_dtype,
                      dataset=cfg.dataset.name, stages_for=algorithm_name(cfg) if spec.staged_model else None,
                      **model.options)
    train = train_config(cfg)
    try:  # the step's options this data and engine cannot apply (the device's: LocalTrainer)
        check_image_inputs(train, model.input_shape, data.train_dtype.is_floating_point)
        check_cohort_options(train, parse_cohort_size(cfg.engine.cohort_size))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    plugins.note_in_use(user_code)
    engine = cfg.engine
    # One torch thread per CPU a worker owns (inline: 1) unless set: more threads than free cores make
    # every OpenMP barrier wait for a descheduled thread, and a run on a shared machine slows 10-100x
    # (docs/engine.md "Threads", scripts/bench/threads.py).
    threads = engine.threads_per_worker or max(1, int(engine.cpus_per_worker))
    log.info("torch threads per worker: %d (%s; the machine has %d cores; docs/engine.md, Threads)", threads,
             "engine.threads_per_worker" if engine.threads_per_worker else
             "default: engine.cpus_per_worker, 1 inline, which does not collapse on a shared machine; set "
             "engine.threads_per_worker=N for a large CPU model on idle cores", os.cpu_count() or 1)
    return ExperimentSetup(
        dataset=data, model=model, algorithm=spec, algorithm_conf=alg_conf,
        train=train_config(cfg), seed=cfg.seed, device=engine.device, state_store=engine.state_store,
        state_options={"cache_mb": engine.state_cache_mb, "fsync": engine.state_fsync,
                       **({"directory": node_path(engine.state_dir, enum_value(engine.name) == "ray")}
                          if engine.state_dir else {}),
                       **({"backend": engine.state_backend} if engine.state_store == "distributed" else {})},
        nonfinite=enum_value(engine.nonfinite),
        cohort_size=parse_cohort_size(engine.cohort_size),
        threads=threads,
        deterministic=bool(engine.deterministic),
        compressor=OmegaConf.to_container(cfg.compressor, resolve=True) if cfg.get("compressor") else None,
        system=build_system(cfg.get("system"), cfg.seed),
        privacy=resolved_privacy(cfg),
        server_opt=server_opt_conf(cfg),
        import_roots=plugins.import_roots(user_code),
        finetune_steps=int(cfg.eval.finetune_steps) if eval_clients(cfg) != "none" else 0,
    )


def check_cluster_keys(cfg: DictConfig) -> None:
    """Refuse the Ray engine's cluster keys where they would do nothing (engine=inline, not a disk store)."""
    from fl_platform.engine.ray_cluster import runtime_env_for

    engine = cfg.engine
    ray = enum_value(engine.name) == "ray"
    base = EngineConf()
    checks = [
        (ray or engine.address is None, "engine.address", "joins a Ray cluster; it needs engine=ray"),
        (ray or engine.start_timeout_s == base.start_timeout_s, "engine.start_timeout_s",
         "bounds how long Ray workers may take to start; it needs engine=ray"),
        (ray or engine.max_restarts == base.max_restarts, "engine.max_restarts",
         "restarts dead Ray workers; it needs engine=ray"),
        (ray or engine.cpus_per_worker == base.cpus_per_worker, "engine.cpus_per_worker",
         "is each Ray worker's CPU reservation; it needs engine=ray (inline: engine.threads_per_worker)"),
        (ray or engine.gpus_per_worker == base.gpus_per_worker, "engine.gpus_per_worker",
         "is each Ray worker's GPU share; it needs engine=ray"),
        (ray or engine.runtime_env == "auto", "engine.runtime_env", "ships code to Ray nodes; it needs engine=ray"),
        (not (ray and engine.state_dir) or os.path.isabs(engine.state_dir) or engine.state_dir.startswith("~"),
         "engine.state_dir", f"is relative ({engine.state_dir}): with engine=ray it is interpreted on every node, "
         f"whose working directory is Ray's; give an absolute path (or one under ~, expanded on each node)"),
        (not engine.state_dir_shared or (ray and engine.state_store == "disk"), "engine.state_dir_shared",
         f"declares a disk store's folder shared by Ray workers; it needs engine=ray and engine.state_store=disk, "
         f"got engine={enum_value(engine.name)}, state_store={engine.state_store}"),
    ]
    for ok, key, message in checks:
        if not ok:
            raise ConfigError(f"{key} {message}")
    try:
        runtime_env_for(OmegaConf.to_container(engine, resolve=True).get("runtime_env"), joining=True)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def make_engine(cfg: DictConfig, setup: ExperimentSetup) -> Engine:
    name = enum_value(cfg.engine.name)
    if name == "inline":
        from fl_platform.engine.inline import InlineEngine

        fault = cfg.engine.fault_injection
        return InlineEngine(setup, num_workers=cfg.engine.num_workers or 1,
                            scheduler_smoothing=cfg.engine.scheduler_smoothing,
                            scheduler=enum_value(cfg.engine.scheduler), slow_worker=fault.slow_worker,
                            slow_factor=fault.slow_factor)
    if name == "ray":
        from fl_platform.engine.ray_engine import RayEngine

        return RayEngine(setup, cfg.engine)
    raise ConfigError(f"engine.name must be inline or ray, got {name!r}")


@dataclass
class Experiment:
    cfg: DictConfig
    data: FederatedDataset
    setup: ExperimentSetup
    simulation: Simulation
    engine: Engine
    run_dir: RunDir | None


def build(cfg: DictConfig, run_dir: Path | str | None = None, reporter: Reporter | None = None) -> Experiment:
    """Everything needed to run ``cfg``; writes config.yaml and partition.npz when ``run_dir`` is given."""
    validate(cfg)
    check_cluster_keys(cfg)
    rd = RunDir(run_dir) if run_dir is not None else None
    checkpointer, ckpt = open_checkpoint(cfg, rd) if rd is not None else (None, None)
    data, round_end = round_end_for(cfg, load_data(cfg))
    setup = make_setup(cfg, data)
    # The run dir is the driver's: the Ray engine keeps states in node-local folders unless one is shared.
    if (rd is not None and setup.state_store != "memory" and "directory" not in setup.state_options
            and (enum_value(cfg.engine.name) == "inline" or cfg.engine.state_dir_shared)):
        setup.state_options["directory"] = str(rd.path / "client_state")
    if rd is not None:
        atomic_write_text(rd.config, OmegaConf.to_yaml(cfg, resolve=True))
        data.partition.save(rd.partition)
    inline = enum_value(cfg.engine.name) == "inline"
    eval_device = cfg.engine.eval_device
    device = resolve_device(cfg.engine.device if eval_device == "auto" else eval_device) if inline else torch.device("cpu")
    seed_torch_global(cfg.seed, Stream.INIT)
    eval_model = FlatModel(setup.model(), device)
    spec = get_algorithm(setup.algorithm)
    alg_setup = setup.algorithm_setup(eval_model.num_params, eval_model.num_buffers)
    server = spec.server(setup.algorithm_conf, alg_setup, eval_model.vector.detach().cpu().clone())
    server.attach_data(data)
    privacy = server_privacy_for(setup.privacy, spec, setup.algorithm_conf, alg_setup, eval_model,
                                 num_clients=cfg.num_clients, clients_per_round=cfg.clients_per_round,
                                 rounds=cfg.rounds, seed=cfg.seed)
    engine = make_engine(cfg, setup)
    report_workers(engine, rd)
    warn_unbalanced(cfg, setup, engine.num_workers, sampling_of(setup.privacy))
    if engine.eval_device is not None and engine.eval_device != eval_model.device:
        # The Ray engine decided where the driver evaluates (a GPU share it holds): the same model there.
        # Its weights come from the server at every evaluation; its construction draws no run RNG.
        with torch.random.fork_rng(devices=[]):
            eval_model = FlatModel(setup.model(), engine.eval_device)
    loop = LoopConfig(seed=cfg.seed, rounds=cfg.rounds, clients_per_round=cfg.clients_per_round,
                      eval_every=cfg.eval_every, eval_batch_size=cfg.eval_batch_size,
                      sampling=sampling_of(setup.privacy), nonfinite=setup.nonfinite)
    sim = Simulation(loop, data, server, engine, eval_model,
                     metrics=MetricsLog(rd.metrics) if rd is not None else None, reporter=reporter,
                     checkpointer=checkpointer if cfg.checkpoint_every > 0 else None)
    sim.system = setup.system
    sim.privacy = privacy
    sim.round_end = round_end
    if eval_clients(cfg) != "none":
        sim.client_eval = ClientEvaluation(eval_clients(cfg), data.num_clients,
                                           rd.path / CLIENT_METRICS if rd is not None else None)
    try:
        sim.restore(ckpt)
    except BaseException:
        engine.close()
        raise
    return Experiment(cfg, data, setup, sim, engine, rd)


def open_checkpoint(cfg: DictConfig, rd: RunDir) -> tuple[Checkpointer, Checkpoint | None]:
    """The run dir's checkpointer and the checkpoint to continue from (``resume``; the simulator and the
    Flower ServerApp): resume=never clears it; else the latest usable one, after refusing a config that
    changes results. Call before config.yaml is rewritten."""
    checkpointer = Checkpointer(rd.checkpoint, cfg.checkpoint_every)
    if cfg.resume == "never":
        checkpointer.clear()
        return checkpointer, None
    if checkpointer.latest_file.exists():
        check_resumable(cfg, rd.config)
    return checkpointer, checkpointer.load()  # an unusable latest checkpoint: the one before, or CheckpointError


def warn_unbalanced(cfg: DictConfig, setup: ExperimentSetup, num_workers: int, sampling: str) -> None:
    """Warn at start-up when the rounds' clients are too few per worker to keep the workers busy."""
    rounds = range(min(cfg.rounds, 10))
    sets = [sample_clients(cfg.seed, r, cfg.num_clients, cfg.clients_per_round, sampling) for r in rounds]
    message = balance_warning(sets, setup.dataset.client_sizes(), setup.train, num_workers)
    if message is not None:
        log.warning("%s", message)


def report_workers(engine: Engine, rd: RunDir | None) -> None:
    """Say where everything runs: one table (worker, node, device, Ray's GPU ids, share, torch, CUDA) in the
    log at start-up, the same rows in ``run.json``'s ``workers``."""
    rows = engine.describe_workers()
    log.info("workers:\n%s", workers_table(rows))
    if rd is not None:
        run_json = rd.path / "run.json"
        try:
            info = json.loads(run_json.read_text()) if run_json.exists() else {}
        except ValueError:  # a torn file from another tool: rewritten whole
            info = {}
        atomic_write_json(run_json, {**info, "workers": rows})


# Keys that may differ between a checkpointed run and its resumption: they do not change results.
RESUME_FREE_KEYS = ("resume", "checkpoint_every", "logger.", "eval_batch_size", "engine.name", "engine.num_workers",
                    "engine.device", "engine.cpus_per_worker", "engine.gpus_per_worker", "engine.threads_per_worker",
                    "engine.max_restarts", "engine.scheduler_smoothing", "engine.address", "engine.fault_injection",
                    "engine.state_cache_mb", "engine.state_fsync", "engine.cohort_size", "engine.eval_device",
                    "engine.start_timeout_s",
                    "engine.runtime_env", "engine.state_dir_shared", "engine.scheduler")


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def check_resumable(cfg: DictConfig, saved_config: Path) -> None:
    """Refuse to resume a run dir whose checkpoint was made with a config that changes results."""
    if not saved_config.exists():
        return
    old = _flatten(OmegaConf.to_container(OmegaConf.load(saved_config), resolve=True))
    new = _flatten(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    diffs = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
             if not k.startswith(RESUME_FREE_KEYS) and old.get(k) != new.get(k)]
    if diffs:
        raise ConfigError(f"resume: the checkpoint in {saved_config.parent} was made with a different config "
                          f"({'; '.join(diffs[:5])}); rerun with the same overrides, or resume=never to start over")


@dataclass
class Outcome:
    """A finished run: its summary (summary.json) and one metrics row per round (metrics.jsonl)."""

    summary: dict[str, Any]
    history: list[dict[str, Any]]
    model: torch.nn.Module | None = None  # the final global model (the run's model class, on the CPU)


def run_experiment(cfg: DictConfig, run_dir: Path | str | None = None) -> dict[str, Any]:
    """Build, run, and write summary.json (and model.pt); returns the summary."""
    return execute(cfg, run_dir).summary


def execute(cfg: DictConfig, run_dir: Path | str | None = None) -> Outcome:
    """Build, run, and write summary.json (and model.pt); returns the summary and the metric rows."""
    t0 = time.perf_counter()
    rd = RunDir(run_dir) if run_dir is not None else None
    exp = build(cfg, rd.path if rd else None)
    setup_s = time.perf_counter() - t0
    try:  # the reporter starts where the resumed run does (a wandb run continues: reporting.py)
        reporter = Reporter(cfg.rounds, start_round=exp.simulation.start_round, progress=cfg.logger.progress,
                            wandb=cfg.logger.wandb, wandb_project=cfg.logger.wandb_project,
                            wandb_mode=cfg.logger.wandb_mode, run_dir=str(rd.path) if rd else None,
                            config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
                            log_every=cfg.logger.log_every)
    except BaseException:
        exp.engine.close()
        raise
    exp.simulation.reporter = reporter
    summary: dict[str, Any] = {}
    failed = True
    try:
        try:
            summary = exp.simulation.run()
        finally:
            exp.engine.close()
        summary.update({
            "setup_time_s": setup_s,
            "algorithm": algorithm_name(cfg), "dataset": _name_of("dataset", cfg), "model": _name_of("model", cfg),
            "partition": cfg.partition.name, "seed": cfg.seed, "num_clients": cfg.num_clients,
            "clients_per_round": cfg.clients_per_round,
            "engine": enum_value(cfg.engine.name),
        })
        if rd is not None:
            if cfg.save_model:
                atomic_torch_save(exp.simulation.eval_model.state_dict(exp.simulation.server.weights), rd.model)
            atomic_write_json(rd.summary, summary)
        failed = False
    finally:
        reporter.close(summary, failed=failed)
    return Outcome(summary, [dict(row) for row in exp.simulation.history], final_model(exp))


def _name_of(group: str, cfg: DictConfig) -> str:
    """The summary's name for ``group``: the option's, or the user's plug-in's (outputs.plugin_name)."""
    node = cfg[group]
    return plugin_name(group, node.name, None if OmegaConf.is_missing(node, "_target_") else node.get("_target_"))


def final_model(exp: Experiment) -> torch.nn.Module:
    """A fresh instance of the run's model holding the server's final weights (CPU, eval mode)."""
    sim = exp.simulation
    with torch.random.fork_rng(devices=[]):  # (its initialisation draws nothing from the run's streams)
        model = exp.setup.model()
    model.load_state_dict(sim.eval_model.state_dict(sim.server.weights))
    return model.eval()
