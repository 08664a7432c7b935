"""Build an experiment from its config and run it: data, model, algorithm, engine, outputs.

Used by the CLI (``fl_platform.run``), by tests and by benchmarks, so that all of them run
exactly the same code path. ``build``/``execute`` take the composed config and read it once at
the door (``run_config.read_config``); everything below takes the typed ``RunConfig``, and every
start-up check is in ``config_checks``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from fl_platform.algorithms.registry import get_algorithm
from fl_platform.config_checks import (  # noqa: F401 (ConfigError, RESUME_FREE_KEYS: imported from here too)
    RESUME_FREE_KEYS,
    ConfigError,
    check_cluster_keys,
    check_resumable,
    check_run,
    check_setup,
)
from fl_platform.datasets.federated import FederatedDataset, build_federated_dataset
from fl_platform.engine.scheduler import balance_warning
from fl_platform.outputs import MetricsLog, RunDir, atomic_torch_save, atomic_write_json, atomic_write_text
from fl_platform.privacy.config import sampling_of
from fl_platform.privacy.setup import resolved_privacy, server_privacy_for
from fl_platform.reporting import Reporter
from fl_platform.rounds.callbacks import RoundEnd, load_callbacks, validation_split
from fl_platform.rounds.checkpoint import Checkpoint, Checkpointer
from fl_platform.rounds.client_eval import CLIENT_METRICS, ClientEvaluation
from fl_platform.rounds.engine import Engine, workers_table
from fl_platform.rounds.sampling import sample_clients
from fl_platform.rounds.setup import ExperimentSetup, ModelFactory, resolve_device
from fl_platform.rounds.simulation import LoopConfig, Simulation
from fl_platform.run_config import RunConfig, read_config
from fl_platform.seeding import Stream, seed_torch_global
from fl_platform.system.model import build_system
from fl_platform.training.flat import FlatModel
from fl_platform.training.vectorised import parse_cohort_size

log = logging.getLogger(__name__)


def enum_value(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def round_end_for(run: RunConfig, data: FederatedDataset) -> tuple[FederatedDataset, RoundEnd | None]:
    """``data`` without the early-stopping validation rows, and what runs between rounds (None: nothing)."""
    early = run.early_stop_conf
    callbacks = load_callbacks(run.callback_items)
    data, validation = validation_split(data, early, run.seed)
    if not callbacks and validation is None:
        return data, None
    return data, RoundEnd(callbacks, early, validation)


def load_data(run: RunConfig) -> FederatedDataset:
    """The run's federated dataset (with each client's local test split under per-client evaluation)."""
    ds = run.dataset
    data = build_federated_dataset(
        ds.name, num_clients=run.num_clients, partition_name=run.partition.name, seed=run.seed,
        root=ds.root, download=ds.download, source_options=run.source_options,
        partition_options=run.partition_options, augment=run.augment,
    )
    if run.eval_clients != "none":  # each client's local test split, held out of its training rows
        data = data.with_local_test(run.eval.local_test_fraction, run.seed)
    return data


def node_path(path: str, ray: bool) -> str:
    """``engine.state_dir`` as the stores get it: absolute here inline; with Ray as given, expanded on each
    node (``~`` is each node's home; the driver's home or working directory means nothing there)."""
    return path if ray else os.path.abspath(os.path.expanduser(path))


def make_setup(run: RunConfig, data: FederatedDataset) -> ExperimentSetup:
    """What every worker needs to train clients (the simulator's, each Flower node's and the ServerApp's)."""
    from fl_platform import plugins
    from fl_platform.models.custom import CUSTOM, TARGET

    spec = run.algorithm_spec
    alg_conf = run.algorithm_conf
    outputs = spec.num_model_outputs(alg_conf, data.num_classes)
    options = run.model_options
    user_code: list[Any] = [spec.conf, spec.client, spec.server, type(alg_conf)]
    if run.model.name == CUSTOM:  # the class itself travels in the factory (and is imported once, here)
        options[TARGET] = plugins.load(options[TARGET], "model._target_")
        user_code.append(options[TARGET])
    model = ModelFactory(run.model.name, tuple(data.input_shape), outputs, options)
    if data.vocab is not None and run.model.name == "lstm":
        model = ModelFactory(model.name, model.input_shape, model.num_classes,
                             {**model.options, "vocab_size": len(data.vocab)})
    check_setup(run, model, data, run.algorithm_name if spec.staged_model else None)
    plugins.note_in_use(user_code)
    engine = run.engine
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
        train=run.train_config, seed=run.seed, device=engine.device, state_store=engine.state_store,
        state_options={"cache_mb": engine.state_cache_mb, "fsync": engine.state_fsync,
                       **({"directory": node_path(engine.state_dir, enum_value(engine.name) == "ray")}
                          if engine.state_dir else {}),
                       **({"backend": engine.state_backend} if engine.state_store == "distributed" else {})},
        nonfinite=enum_value(engine.nonfinite),
        cohort_size=parse_cohort_size(engine.cohort_size),
        threads=threads,
        deterministic=bool(engine.deterministic),
        compressor=run.compressor_options,
        system=build_system(run.get("system"), run.seed),
        privacy=resolved_privacy(run),
        server_opt=run.get("server_opt"),
        import_roots=plugins.import_roots(user_code),
        finetune_steps=int(run.eval.finetune_steps) if run.eval_clients != "none" else 0,
    )


def make_engine(run: RunConfig, setup: ExperimentSetup) -> Engine:
    """The engine ``engine.name`` names, built for ``setup`` (Ray: from the typed ``engine`` section)."""
    engine = run.engine
    name = enum_value(engine.name)
    if name == "inline":
        from fl_platform.engine.inline import InlineEngine

        fault = engine.fault_injection
        return InlineEngine(setup, num_workers=engine.num_workers or 1,
                            scheduler_smoothing=engine.scheduler_smoothing,
                            scheduler=enum_value(engine.scheduler), slow_worker=fault.slow_worker,
                            slow_factor=fault.slow_factor)
    if name == "ray":
        from fl_platform.engine.ray_cluster import keep_local_ray_on_loopback

        keep_local_ray_on_loopback(engine.address)  # (before Ray is imported)
        from fl_platform.engine.ray_engine import RayEngine

        return RayEngine(setup, engine)
    raise ConfigError(f"engine.name must be inline or ray, got {name!r}")


@dataclass
class Experiment:
    cfg: RunConfig  # the run's typed configuration (run_config.py)
    data: FederatedDataset
    setup: ExperimentSetup
    simulation: Simulation
    engine: Engine
    run_dir: RunDir | None


def build(cfg: DictConfig | RunConfig, run_dir: Path | str | None = None, reporter: Reporter | None = None
          ) -> Experiment:
    """Everything needed to run ``cfg``; writes config.yaml and partition.npz when ``run_dir`` is given."""
    run = read_config(cfg)
    check_run(run)
    check_cluster_keys(run)
    rd = RunDir(run_dir) if run_dir is not None else None
    checkpointer, ckpt = open_checkpoint(run, rd) if rd is not None else (None, None)
    data, round_end = round_end_for(run, load_data(run))
    setup = make_setup(run, data)
    engine_conf = run.engine
    inline = enum_value(engine_conf.name) == "inline"
    # The run dir is the driver's: the Ray engine keeps states in node-local folders unless one is shared.
    if (rd is not None and setup.state_store != "memory" and "directory" not in setup.state_options
            and (inline or engine_conf.state_dir_shared)):
        setup.state_options["directory"] = str(rd.path / "client_state")
    if rd is not None:
        if ckpt is None or ckpt.round < run.rounds:  # rounds to train: an earlier run's results are not this one's
            for stale in (rd.summary, rd.model):
                stale.unlink(missing_ok=True)
        atomic_write_text(rd.config, run.to_yaml())
        data.partition.save(rd.partition)
    eval_device = engine_conf.eval_device
    device = resolve_device(engine_conf.device if eval_device == "auto" else eval_device) if inline \
        else torch.device("cpu")
    seed_torch_global(run.seed, Stream.INIT)
    eval_model = FlatModel(setup.model(), device)
    spec = get_algorithm(setup.algorithm)
    alg_setup = setup.algorithm_setup(eval_model.num_params, eval_model.num_buffers)
    server = spec.server(setup.algorithm_conf, alg_setup, eval_model.vector.detach().cpu().clone())
    server.attach_data(data)
    privacy = server_privacy_for(setup.privacy, spec, setup.algorithm_conf, alg_setup, eval_model,
                                 num_clients=run.num_clients, clients_per_round=run.clients_per_round,
                                 rounds=run.rounds, seed=run.seed)
    engine = make_engine(run, setup)
    try:  # from here an error releases the engine's workers and GPUs (a notebook's api.run goes on)
        report_workers(engine, rd)
        warn_unbalanced(run, setup, engine.num_workers, sampling_of(setup.privacy))
        if engine.eval_device is not None and engine.eval_device != eval_model.device:
            # The Ray engine decided where the driver evaluates (a GPU share it holds): the same model there.
            # Its weights come from the server at every evaluation; its construction draws no run RNG.
            with torch.random.fork_rng(devices=[]):
                eval_model = FlatModel(setup.model(), engine.eval_device)
        loop = LoopConfig(seed=run.seed, rounds=run.rounds, clients_per_round=run.clients_per_round,
                          eval_every=run.eval_every, eval_batch_size=run.eval_batch_size,
                          sampling=sampling_of(setup.privacy), nonfinite=setup.nonfinite)
        sim = Simulation(loop, data, server, engine, eval_model,
                         metrics=MetricsLog(rd.metrics) if rd is not None else None, reporter=reporter,
                         checkpointer=checkpointer if run.checkpoint_every > 0 else None)
        sim.system = setup.system
        sim.privacy = privacy
        sim.round_end = round_end
        if round_end is not None and round_end.validation is not None:
            sim.evaluator.add("validation", *round_end.validation)
        if run.eval_clients != "none":
            sim.client_eval = ClientEvaluation(run.eval_clients, data.num_clients,
                                               rd.path / CLIENT_METRICS if rd is not None else None)
        sim.restore(ckpt)
    except BaseException:
        engine.close()
        raise
    return Experiment(run, data, setup, sim, engine, rd)


def open_checkpoint(run: RunConfig, rd: RunDir) -> tuple[Checkpointer, Checkpoint | None]:
    """The run dir's checkpointer and the checkpoint to continue from (``resume``; the simulator and the
    Flower ServerApp): resume=never clears it; else the latest usable one, after refusing a config that
    changes results. ``resume=<dir>`` must name an earlier run (its config.yaml), and one with another
    config is refused even without a checkpoint (it would be overwritten). Call before config.yaml is
    rewritten."""
    named = run.resume not in ("auto", "never")  # resume=<the directory of an earlier run>
    if named and not rd.config.exists():
        switch = " (resume is not a switch: auto, the default, already continues a checkpoint)" if str(
            run.resume).lower() in ("true", "false") else ""
        raise ConfigError(f"resume={run.resume}: {rd.path} holds no earlier run (no config.yaml){switch}; resume "
                          "takes auto (continue the run dir's checkpoint, if any), never (start over) or the "
                          "directory of an earlier run")
    checkpointer = Checkpointer(rd.checkpoint, run.checkpoint_every)
    if run.resume == "never":
        checkpointer.clear()
        return checkpointer, None
    if checkpointer.latest_file.exists() or named:  # a named run without a checkpoint is rerun, never replaced
        check_resumable(run, rd.config)
    return checkpointer, checkpointer.load()  # an unusable latest checkpoint: the one before, or CheckpointError


def warn_unbalanced(run: RunConfig, setup: ExperimentSetup, num_workers: int, sampling: str) -> None:
    """Warn at start-up when the rounds' clients are too few per worker to keep the workers busy."""
    rounds = range(min(run.rounds, 10))
    sets = [sample_clients(run.seed, r, run.num_clients, run.clients_per_round, sampling) for r in rounds]
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


@dataclass
class Outcome:
    """A finished run: its summary (summary.json) and one metrics row per round (metrics.jsonl)."""

    summary: dict[str, Any]
    history: list[dict[str, Any]]
    model: torch.nn.Module | None = None  # the final global model (the run's model class, on the CPU)


def run_experiment(cfg: DictConfig | RunConfig, run_dir: Path | str | None = None) -> dict[str, Any]:
    """Build, run, and write summary.json (and model.pt); returns the summary."""
    return execute(cfg, run_dir).summary


def execute(cfg: DictConfig | RunConfig, run_dir: Path | str | None = None) -> Outcome:
    """Build, run, and write summary.json (and model.pt); returns the summary and the metric rows."""
    t0 = time.perf_counter()
    run = read_config(cfg)
    rd = RunDir(run_dir) if run_dir is not None else None
    exp = build(run, rd.path if rd else None)
    setup_s = time.perf_counter() - t0
    lg = run.logger
    try:  # the reporter starts where the resumed run does (a wandb run continues: reporting.py)
        reporter = Reporter(run.rounds, start_round=exp.simulation.start_round, progress=lg.progress,
                            wandb=lg.wandb, wandb_project=lg.wandb_project,
                            wandb_mode=lg.wandb_mode, run_dir=str(rd.path) if rd else None,
                            config=run.to_container(), log_every=lg.log_every)
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
            "algorithm": run.algorithm_name, "dataset": run.name_of("dataset"), "model": run.name_of("model"),
            "partition": run.partition.name, "seed": run.seed, "num_clients": run.num_clients,
            "clients_per_round": run.clients_per_round,
            "engine": enum_value(run.engine.name),
        })
        if rd is not None:
            if run.save_model:
                atomic_torch_save(exp.simulation.eval_model.state_dict(exp.simulation.server.weights), rd.model)
            atomic_write_json(rd.summary, summary)
        failed = False
    finally:
        reporter.close(summary, failed=failed)
    return Outcome(summary, [dict(row) for row in exp.simulation.history], final_model(exp))


def final_model(exp: Experiment) -> torch.nn.Module:
    """A fresh instance of the run's model holding the server's final weights (CPU, eval mode)."""
    sim = exp.simulation
    with torch.random.fork_rng(devices=[]):  # (its initialisation draws nothing from the run's streams)
        model = exp.setup.model()
    model.load_state_dict(sim.eval_model.state_dict(sim.server.weights))
    return model.eval()
