"""Every start-up check of a run's configuration, in one place, on the typed run config (run_config.py).

Hydra checks types, unknown option names and keys a schema lacks when composing. What is left is
here: values that are well-typed but make no sense, keys that nothing reads (``+key=value``), the
user's code that the config names (it loads, with the config's fields as its parameters), settings
this run would silently ignore (a field that acts only under another option), what a resume or a
runtime (Ray's cluster keys, a Flower deployment, S-SGD) cannot honour, and, once the data is
loaded, the model and step options the data cannot take. Each refusal is a ``ConfigError`` (a
``ValueError``) that names the key and the reason.

Who calls what: the simulator (``experiment.build``) runs :func:`check_run` and
:func:`check_cluster_keys`; the Flower ServerApp :func:`check_run` and :func:`check_flower_server`;
every runtime's ``make_setup`` :func:`check_setup`; a resume :func:`check_resumable`; S-SGD
(``ssgd.config.compose_ssgd_config``) :func:`check_ssgd`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import fields, is_dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from fl_platform.config import FAULT_STEPS, OPEN_OPTIONS, WANDB_MODES, EngineConf, EvalConf, LoggerConf
from fl_platform.rounds.callbacks import EarlyStopConf, load_callbacks
from fl_platform.run_config import RunConfig, plain
from fl_platform.training.loop import TrainConfig


class ConfigError(ValueError):
    """A config value that is well-typed but makes no sense (names the key)."""


def _raise_first(checks: list[tuple[bool, str, str]]) -> None:
    for ok, key, message in checks:
        if not ok:
            raise ConfigError(f"{key} {message}")


def _optimiser_checks(t: Any) -> list[tuple[bool, str, str]]:
    """The local optimiser's values, shared by the federated loop and S-SGD: a negative momentum, weight
    decay or Adam constant would train (anti-regularised, or with a sign-flipped average) without a word."""
    checks = [
        (t.batch_size >= 1, "train.batch_size", f"must be >= 1, got {t.batch_size}"),
        (t.lr > 0, "train.lr", f"must be > 0, got {t.lr}"),
        (t.optimizer in ("sgd", "adam"), "train.optimizer", f"must be one of sgd, adam; got {t.optimizer!r}"),
        (0 <= t.momentum < 1, "train.momentum", f"must be in [0, 1), got {t.momentum}"),
        (t.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {t.weight_decay}"),
        (not t.nesterov or t.optimizer != "sgd" or t.momentum > 0, "train.nesterov",
         f"needs train.momentum > 0, got momentum={t.momentum}"),
    ]
    if t.optimizer == "adam":  # under sgd these are refused as having no effect (train_inactive)
        checks += [(0 <= getattr(t, key) < 1, f"train.{key}", f"must be in [0, 1), got {getattr(t, key)}")
                   for key in ("adam_beta1", "adam_beta2")]
        checks.append((t.adam_eps > 0, "train.adam_eps", f"must be > 0, got {t.adam_eps}"))
    return checks


def _length_checks(t: Any) -> list[tuple[bool, str, str]]:
    """train.epochs / train.steps, shared by the federated loop and S-SGD: one of them, >= 1."""
    return [
        (t.steps is not None or (t.epochs is not None and t.epochs >= 1), "train.epochs",
         f"must be >= 1 (or set train.steps), got {t.epochs}"),
        (t.steps is None or t.steps >= 1, "train.steps", f"must be >= 1, got {t.steps}"),
        (t.steps is None or t.epochs is None, "train.epochs",
         f"has no effect when train.steps is set (train.steps={t.steps} fixes the number of "
         f"steps; got train.epochs={t.epochs}): set one of them"),
    ]


# ---------------------------------------------------------------- the simulator and Flower


def check_run(run: RunConfig) -> None:
    """The federated run's start-up checks (simulator and Flower): values, keys, plug-ins, inert settings."""
    from fl_platform.state.store import STORE_KINDS
    from fl_platform.training.vectorised import parse_cohort_size

    train, engine, logger = run.train, run.engine, run.logger
    checks = [
        (run.seed >= 0, "seed", f"must be >= 0, got {run.seed}"),
        (run.rounds >= 1, "rounds", f"must be >= 1, got {run.rounds}"),
        (run.num_clients >= 1, "num_clients", f"must be >= 1, got {run.num_clients}"),
        (1 <= run.clients_per_round <= run.num_clients, "clients_per_round",
         f"must be in 1..num_clients={run.num_clients}, got {run.clients_per_round}"),
        (run.eval_every >= 1, "eval_every", f"must be >= 1, got {run.eval_every}"),
        (run.eval_batch_size >= 1, "eval_batch_size", f"must be >= 1, got {run.eval_batch_size}"),
        *_optimiser_checks(train),
        *_length_checks(train),
        (run.checkpoint_every >= 0, "checkpoint_every", f"must be >= 0, got {run.checkpoint_every}"),
        (engine.state_store in STORE_KINDS, "engine.state_store",
         f"must be one of {', '.join(STORE_KINDS)}; got {engine.state_store!r}"),
        (engine.state_backend in ("memory", "disk"), "engine.state_backend",
         f"must be memory or disk; got {engine.state_backend!r}"),
        (engine.max_restarts >= 0, "engine.max_restarts", f"must be >= 0, got {engine.max_restarts}"),
        (engine.num_workers is None or engine.num_workers >= 1, "engine.num_workers",
         f"must be >= 1 (or null: 1 inline, what Ray sees with engine=ray), got {engine.num_workers}"),
        (_is_device(engine.device), "engine.device", f"must be auto, cpu, cuda[:k] or another torch device; "
                                                     f"got {engine.device!r}"),
        (engine.eval_device in ("auto", "cpu", "worker") or engine.eval_device.split(":")[0] == "cuda",
         "engine.eval_device", f"must be auto, cpu, cuda[:k] or worker; got {engine.eval_device!r}"),
        (engine.eval_device != "worker" or plain(engine.name) == "ray", "engine.eval_device",
         f"worker evaluates on a Ray worker's device and needs engine=ray; engine={plain(engine.name)} evaluates "
         f"in its own process (auto: on engine.device)"),
        (engine.start_timeout_s > 0, "engine.start_timeout_s", f"must be > 0, got {engine.start_timeout_s}"),
        (engine.round_timeout_s is None or engine.round_timeout_s > 0, "engine.round_timeout_s",
         f"must be > 0 seconds (or null: no limit), got {engine.round_timeout_s}"),
        (engine.threads_per_worker is None or engine.threads_per_worker >= 1, "engine.threads_per_worker",
         f"must be >= 1 (or null: engine.cpus_per_worker, 1 inline), got {engine.threads_per_worker}"),
        (engine.fault_injection.client is None or plain(engine.name) == "ray", "engine.fault_injection",
         "is a test-only fault for Ray workers; it needs engine=ray"),
        (engine.fault_injection.at in FAULT_STEPS, "engine.fault_injection.at",
         f"(test only) must be {', '.join(FAULT_STEPS[:-1])} or {FAULT_STEPS[-1]}, got {engine.fault_injection.at!r}"),
        (engine.fault_injection.at == "train" or engine.fault_injection.client is not None,
         "engine.fault_injection.at", "(test only) says when the worker of engine.fault_injection.client exits; "
         "set that too"),
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
        (logger.log_every >= 1, "logger.log_every", f"must be >= 1, got {logger.log_every}"),
        (logger.wandb_mode in WANDB_MODES, "logger.wandb_mode",
         f"must be one of {', '.join(WANDB_MODES)}; got {logger.wandb_mode!r}"),
    ]
    try:
        parse_cohort_size(engine.cohort_size)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if hasattr(run.partition, "alpha"):
        checks.append((run.partition.alpha > 0, "partition.alpha", f"must be > 0, got {run.partition.alpha}"))
    schedule = run.train_config.lr_schedule
    checks += [(False, f"train.lr_schedule.{key}", why) for key, why in schedule.problems(train.lr)]
    early = run.early_stop_conf
    checks += [(False, f"early_stop.{key}", why) for key, why in early.problems()]
    _raise_first(checks)
    refuse_inactive("early_stop", early, EarlyStopConf(), early.inactive_fields())
    refuse_inactive("logger", logger, LoggerConf(), logger.inactive_fields())
    refuse_inactive("engine", engine, EngineConf(), engine.inactive_fields())
    check_keys_and_plugins(run)
    check_effective(run)
    check_eval(run)


def _is_device(name: str) -> bool:
    """``auto`` or a device string torch parses (whether that device is present is checked where it is used)."""
    import torch

    if name == "auto":
        return True
    try:
        torch.device(name)
    except RuntimeError:
        return False
    return True


def check_eval(run: RunConfig) -> None:
    """The eval section: sane values, and no key that acts only with per-client evaluation set without it."""
    ev = run.get("eval")
    if ev is None:
        return
    if not 0.0 < ev.local_test_fraction < 1.0:
        raise ConfigError(f"eval.local_test_fraction must be in (0, 1), got {ev.local_test_fraction}")
    if ev.finetune_steps < 0:
        raise ConfigError(f"eval.finetune_steps must be >= 0, got {ev.finetune_steps}")
    if run.eval_clients == "none":
        why = "it acts only with per-client evaluation, and eval.clients=none (set eval.clients=all or sample)"
        refuse_inactive("eval", ev, EvalConf(), {"local_test_fraction": why, "finetune_steps": why})


def unknown_keys(node: Any, prefix: str = "") -> list[str]:
    """Dotted keys of ``node`` (a typed section) that its schema dataclass does not declare.

    Hydra refuses a new key unless it is added with ``+`` (``+algorithm.mux=1``), and merging onto a
    schema keeps an added key without complaint (the door keeps it as an attribute): this finds them,
    so that such a key is refused rather than ignored. The user's own fields in an open option
    (``model=custom``, ...) are left to the plug-in checks (:func:`check_plugins`)."""
    if not is_dataclass(node) or isinstance(node, type):
        return []
    group = prefix.rstrip(".")
    open_option = group in OPEN_OPTIONS and str(getattr(node, "name", None)) in OPEN_OPTIONS[group]
    declared = {f.name for f in fields(node)}
    out = [] if open_option else [f"{prefix}{k}" for k in vars(node) if k not in declared]
    for key, value in vars(node).items():
        if open_option or key in declared:
            out += unknown_keys(value, f"{prefix}{key}.")
    return out


def check_keys_and_plugins(run: RunConfig) -> None:
    """No key that nothing reads (``+key=value`` beyond the schemas), and the user's code loads with
    the config's fields for it (also S-SGD's check)."""
    unknown = unknown_keys(run.tree)
    if unknown:
        raise ConfigError(f"{', '.join(unknown)}: not a key of the config (a + override adds a key no schema "
                          "declares, so nothing would read it)")
    check_plugins(run)


def check_plugins(run: RunConfig) -> None:
    """The user's code that the config names (a custom model or dataset, a plug-in algorithm) loads,
    and the config's fields for it are its parameters (an unknown one is refused, naming it)."""
    from fl_platform.datasets.registry import CUSTOM as CUSTOM_DATA
    from fl_platform.datasets.registry import custom_loader
    from fl_platform.models.custom import CUSTOM, builder_of, split_options

    try:
        if run.get("algorithm") is not None:
            run.algorithm_spec  # noqa: B018 (loads algorithm._target_)
        if run.model.name == CUSTOM:
            builder_of(*split_options(run.model_options))
        if run.dataset.name == CUSTOM_DATA:
            ds = run.dataset
            own = {k: v for k, v in run.source_options.items() if k != "_target_"}
            custom_loader(ds._target_, own, ds.root, ds.download)
        load_callbacks(run.callback_items)
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


def check_effective(run: RunConfig) -> None:
    """Refuse, naming the key, a setting that this run would silently ignore: a field that only acts
    under another option (``train.adam_beta1`` with ``optimizer=sgd``, ``algorithm.constant_weight``
    with a gradual schedule, ``system.trace`` without ``system=trace``) set away from its default,
    or a compressor whose ``tensors`` are not among what the algorithm uploads."""
    from fl_platform.compression.registry import COMPRESSORS
    from fl_platform.compression.uplink import check_compressor
    from fl_platform.system.config import SystemConf

    train = run.train_config
    refuse_inactive("train", train, TrainConfig(), train_inactive(train))
    spec = run.algorithm_spec
    alg = run.algorithm_conf
    refuse_inactive("algorithm", alg, spec.conf(), alg.inactive_fields(run))
    refuse_dataset_inactive(run)
    if run.get("compressor") is not None:
        comp = _compressor_conf(run.compressor)
        refuse_inactive("compressor", comp, COMPRESSORS[comp.name][0](), comp.inactive_fields(run.rounds))
        try:
            check_compressor(comp, spec.client.uploads(alg), run.algorithm_name,
                             getattr(spec.client, "compresses_uplink", False))
        except ValueError as err:
            raise ConfigError(str(err)) from None
    if run.get("system") is not None:
        refuse_inactive("system", run.system, SystemConf(), run.system.inactive_fields())
    if run.get("privacy") is not None:
        check_privacy_keys(run, spec, alg)
    if run.get("server_opt") is not None:
        from fl_platform.algorithms.server_opt import ServerOptConf, check_server_opt

        opt = run.server_opt
        refuse_inactive("server_opt", opt, ServerOptConf(), opt.inactive_fields())
        try:
            check_server_opt(opt, spec.server, run.algorithm_name)
        except ValueError as err:
            raise ConfigError(str(err)) from None


def _compressor_conf(node: Any) -> Any:
    """The compressor section as its option's schema instance (ConfigError naming an unknown option or key)."""
    from fl_platform.compression.registry import conf_of

    try:
        return conf_of(node)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def refuse_dataset_inactive(run: RunConfig) -> None:
    """A dataset field that the other dataset settings make inert (``dataset.alpha`` with
    ``dataset=synthetic dataset.iid=true``), set away from its default: both runtimes."""
    ds = run.dataset
    inactive = getattr(ds, "inactive_fields", None)
    if inactive is not None:
        refuse_inactive("dataset", ds, type(ds)(), inactive())


def check_privacy_keys(run: RunConfig, spec: Any, alg: Any) -> None:
    """The privacy group: no inert key, sane values, an algorithm and sampling the mechanism and the
    accountant cover (fl_platform/privacy/setup.py), else ConfigError naming the key."""
    from fl_platform.privacy.config import PrivacyConf
    from fl_platform.privacy.setup import check_privacy

    conf = run.privacy
    refuse_inactive("privacy", conf, PrivacyConf(), conf.inactive_fields(run.num_clients, run.clients_per_round))
    try:
        check_privacy(run, spec, alg)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_cluster_keys(run: RunConfig) -> None:
    """Refuse the Ray engine's cluster keys where they would do nothing (engine=inline, not a disk store)."""
    from fl_platform.engine.ray_cluster import runtime_env_for

    engine = run.engine
    ray = plain(engine.name) == "ray"
    base = EngineConf()
    _raise_first([
        (ray or engine.address is None, "engine.address", "joins a Ray cluster; it needs engine=ray"),
        (ray or engine.start_timeout_s == base.start_timeout_s, "engine.start_timeout_s",
         "bounds how long Ray workers may take to start; it needs engine=ray"),
        (ray or engine.max_restarts == base.max_restarts, "engine.max_restarts",
         "restarts dead Ray workers; it needs engine=ray"),
        (ray or engine.round_timeout_s is None, "engine.round_timeout_s",
         "replaces hung Ray workers; it needs engine=ray (inline workers run in this process)"),
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
         f"got engine={plain(engine.name)}, state_store={engine.state_store}"),
    ])
    try:
        runtime_env_for(plain(engine.runtime_env), joining=True)
    except ValueError as err:
        raise ConfigError(str(err)) from None


# engine.* keys that change results; the others place and pace the simulator's workers, which a deployment's
# nodes do instead.
_ENGINE_RESULT_KEYS = ("nonfinite", "deterministic", "cohort_size")


def check_flower_server(run: RunConfig | Mapping[str, Any]) -> None:
    """What a Flower deployment does not implement. The ServerApp refuses it before waiting for nodes (``run``:
    the typed config), and the run config's export (``flower.config.flatten_config``: the plain resolved values,
    maybe a run's config.yaml) before writing it: the run config carries no ``engine.*`` or ``eval.*`` key, so
    a setting of theirs that changes results would otherwise be dropped."""
    data = run.to_container() if isinstance(run, RunConfig) else run
    if (data.get("early_stop") or {}).get("patience") or data.get("callbacks"):  # (rounds/callbacks.py)
        raise ValueError("early_stop.patience and callbacks are not implemented for Flower deployments: the "
                         "validation split would have to be cut on every node; use them with engine=inline|ray "
                         "or fl_platform.api.run")
    system = (data.get("system") or {}).get("name", "none")
    if system != "none":
        raise ValueError(f"a system model (system.name={system}) is not implemented for Flower deployments: it "
                         "simulates the clients' speeds, bandwidths and availability (the sim_* times, BAOW's "
                         "bandwidths), and a deployment's devices are real; use system=none, or the simulator "
                         "(engine=inline|ray)")
    eval_default, engine_default = plain(EvalConf()), plain(EngineConf())
    changed = [f"eval.{k}={v}" for k, v in (data.get("eval") or {}).items() if v != eval_default.get(k, v)]
    engine = data.get("engine") or {}
    changed += [f"engine.{k}={engine[k]}" for k in _ENGINE_RESULT_KEYS if k in engine and engine[k] != engine_default[k]]
    if changed:
        raise ValueError(f"{', '.join(changed)}: not carried to a Flower deployment (per-client evaluation runs on "
                         "the simulator's engines; a SuperNode trains its one client with engine's defaults, and a "
                         "client whose update is not finite fails its reply: deploy.min_replies); leave them at "
                         "their defaults, or use the simulator")


def check_setup(run: RunConfig, model: Any, data: Any, staged_for: str | None) -> None:
    """Once the data is loaded: the model can take its samples (``check_model_input``; ``staged_for``: the
    algorithm that needs a staged model, or None), and the step's options (train.precision, channels_last,
    engine.cohort_size) suit this data and engine."""
    from fl_platform.models import check_model_input
    from fl_platform.training.step import check_cohort_options, check_image_inputs
    from fl_platform.training.vectorised import parse_cohort_size

    single = check_model_input(model.name, model.input_shape, model.num_classes, data.train_dtype,
                               dataset=run.dataset.name, stages_for=staged_for, **model.options)
    if single is not None:
        check_one_sample_batches(run.train_config, data.client_sizes(), single)
        steps = run.eval.finetune_steps if run.eval_clients != "none" else 0
        if steps > 0:  # the fine-tuning before a client's evaluation batches its training rows the same way
            check_one_sample_batches(replace(run.train_config, steps=steps, epochs=None),
                                     data.client_sizes(), single, f"fine-tuning (eval.finetune_steps={steps})")
    try:  # the step's options this data and engine cannot apply (the device's: LocalTrainer)
        check_image_inputs(run.train_config, model.input_shape, data.train_dtype.is_floating_point)
        check_cohort_options(run.train_config, parse_cohort_size(run.engine.cohort_size))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_one_sample_batches(train: Any, sizes: Any, why: str, what: str = "local training") -> None:
    """The model cannot train on a batch of one sample (``why``): refuse a run in which a client's local
    training (``what``: or its fine-tuning before evaluation) would make one (its last batch of an epoch,
    n mod train.batch_size = 1, reached within its steps), naming the clients, rather than let it fail
    mid-run in that client's first round."""
    if train.drop_last:
        return
    bs = train.batch_size
    ones = [c for c, n in enumerate(int(n) for n in sizes)
            if n > 0 and n % bs == 1 % bs and train.num_steps(n) >= -(-n // bs)]
    if ones:
        example = ", ".join(f"{c} ({int(sizes[c])} samples)" for c in ones[:5])
        raise ConfigError(f"the model cannot train on a batch of one sample ({why}), and {len(ones)} clients' "
                          f"{what} would make one with train.batch_size={bs}, e.g. clients {example}: set "
                          f"train.drop_last=true (those clients skip their last sample of each epoch) or another "
                          f"train.batch_size")


# ---------------------------------------------------------------- resuming


# Keys that may differ between a checkpointed run and its resumption: they do not change results.
RESUME_FREE_KEYS = ("resume", "checkpoint_every", "logger.", "eval_batch_size", "engine.name", "engine.num_workers",
                    "engine.device", "engine.cpus_per_worker", "engine.gpus_per_worker", "engine.threads_per_worker",
                    "engine.max_restarts", "engine.scheduler_smoothing", "engine.address", "engine.fault_injection",
                    "engine.state_cache_mb", "engine.state_fsync", "engine.cohort_size", "engine.eval_device",
                    "engine.start_timeout_s", "engine.round_timeout_s",
                    "engine.runtime_env", "engine.state_dir_shared", "engine.scheduler")


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def check_resumable(run: RunConfig, saved_config: Path) -> None:
    """Refuse to resume a run dir whose checkpoint was made with a config that changes results (the
    composed YAML form of both: config.yaml holds it)."""
    if not saved_config.exists():
        return
    try:
        old = _flatten(OmegaConf.to_container(OmegaConf.load(saved_config), resolve=True))
    except yaml.YAMLError as err:
        raise ConfigError(f"resume: {saved_config} is not readable YAML (torn by an interrupted write?): "
                          f"{type(err).__name__}: {' '.join(str(err).split())}; restore it, or resume=never to start "
                          "over") from err
    new = _flatten(run.to_container())
    diffs = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
             if not k.startswith(RESUME_FREE_KEYS) and old.get(k) != new.get(k)]
    if diffs:
        raise ConfigError(f"resume: the run in {saved_config.parent} was made with a different config "
                          f"({'; '.join(diffs[:5])}); rerun with the same overrides, or resume=never to start over")


# ---------------------------------------------------------------- S-SGD


def check_ssgd(run: RunConfig) -> None:
    """The S-SGD runtime's checks (fl_platform/ssgd): values, the federated-only train options it does
    not take, a field the chosen optimiser, compressor, sync mode or dataset option does not read (as
    the simulator's check_effective), and, as the simulator's, keys and plug-ins."""
    from fl_platform.ssgd.config import SSGDConf, SSGDConfig
    from fl_platform.training.schedule import LrSchedule

    s, t = run.ssgd, run.train
    compressor = run.compressor.name
    _raise_first([
        *_optimiser_checks(t),
        *_length_checks(t),
        (t.shuffle_offset == 0, "train.shuffle_offset",
         f"is the federated loop's noise-floor control; S-SGD shards every epoch from (seed, SHUFFLE, epoch) "
         f"and does not take it (leave it at 0), got {t.shuffle_offset}"),
        (t.lr_schedule == LrSchedule(), "train.lr_schedule",
         f"schedules the rate across federated rounds; S-SGD has no rounds (leave it at its defaults), got "
         f"{plain(t.lr_schedule)}"),
        *((getattr(t, key) == off, f"train.{key}", f"is a step option of the federated loop "
           f"(docs/engine.md, \"The step\"); the S-SGD step does not implement it (leave it at {off}), "
           f"got {getattr(t, key)}") for key, off in (("precision", "fp32"), ("channels_last", False), ("compile", False))),
        (run.eval_every >= 0, "eval_every", f"must be >= 0, got {run.eval_every}"),
        (run.eval_batch_size >= 1, "eval_batch_size", f"must be >= 1, got {run.eval_batch_size}"),
        (run.eval_every > 0 or run.eval_batch_size == SSGDConfig.eval_batch_size, "eval_batch_size",
         f"has no effect with eval_every=0 (nothing is evaluated; leave it at {SSGDConfig.eval_batch_size}), "
         f"got {run.eval_batch_size}"),
        (run.log_every_steps >= 0, "log_every_steps", f"must be >= 0, got {run.log_every_steps}"),
        (s.backend in ("auto", "gloo", "nccl"), "ssgd.backend", f"must be auto, gloo or nccl; got {s.backend!r}"),
        (s.bucket_cap_mb > 0, "ssgd.bucket_cap_mb", f"must be > 0, got {s.bucket_cap_mb}"),
        (s.start_iter >= 2, "ssgd.start_iter",
         f"must be >= 2 (DDP rebuilds its buckets after iteration 1, so per-bucket state would be lost), "
         f"got {s.start_iter}"),
        (s.period >= 1, "ssgd.period", f"must be >= 1, got {s.period}"),
        (s.local_start_step >= 0, "ssgd.local_start_step", f"must be >= 0, got {s.local_start_step}"),
        (s.threads is None or s.threads >= 1, "ssgd.threads", f"must be >= 1 or null, got {s.threads}"),
        (s.timeout_s > 0, "ssgd.timeout_s", f"must be > 0, got {s.timeout_s}"),
        (plain(s.sync) == "ddp" or compressor == "none", "ssgd.sync",
         f"local SGD averages whole models and takes no gradient compressor; got compressor={compressor} "
         "(use ssgd.sync=ddp, or compressor=none)"),
    ])
    refuse_inactive("train", t, TrainConfig(), train_inactive(t))
    comp = _compressor_conf(run.compressor)
    refuse_inactive("compressor", comp, type(comp)(), {**comp.inactive_fields(), **_ssgd_compressor_inactive(comp)})
    refuse_inactive("ssgd", s, SSGDConf(), _ssgd_inactive(plain(s.sync), comp.name))
    refuse_dataset_inactive(run)
    check_keys_and_plugins(run)  # model=custom / dataset=custom load, with their fields checked


def _ssgd_compressor_inactive(comp: Any) -> dict[str, str]:
    """Compressor fields that S-SGD (fl_platform/ssgd) never reads, beyond the option's own inactive_fields."""
    out = {"tensors": "it picks which tensors of a federated client's upload are compressed; S-SGD "
                      "compresses the gradient and never reads it"}
    if comp.name == "acpsgd":
        why = ("the ACP-SGD optimiser wrapper compresses each parameter's gradient into its fusion buffers "
               "(sized by ssgd.bucket_cap_mb) and does not read the compressor's layout")
        out |= {"scope": why, "bucket_size": why}
    return out


def _ssgd_inactive(sync: str, compressor: str) -> dict[str, str]:
    """ssgd.* fields that the chosen sync mode and compressor do not read (fl_platform/ssgd/sync.py make_sync)."""
    if sync == "local":
        return dict.fromkeys(("bucket_cap_mb", "start_iter"), "it sets up DDP (its buckets, its compression hook), "
                             "and ssgd.sync=local averages with its own all-reduces, without DDP")
    out = dict.fromkeys(("period", "local_start_step"), "a local SGD setting, and ssgd.sync=ddp (use ssgd.sync=local)")
    if compressor == "none":
        out["start_iter"] = "it is when the DDP compression hook starts compressing, and compressor=none installs no hook"
    elif compressor == "acpsgd":
        out["start_iter"] = ("it is when the DDP compression hook starts compressing, and compressor=acpsgd runs "
                             "as an optimiser wrapper, not a DDP hook (it compresses from the first step)")
    return out
