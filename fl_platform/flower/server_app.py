"""The ServerApp: the simulator's round loop with Flower as the transport.

It composes the experiment from the run config (``config.py``), builds the global model exactly
as the simulator does (torch seeded from (seed, INIT), then the model factory), waits for the
SuperNodes, and runs ``engine.simulation.Simulation`` with a ``FlowerEngine``: same sampling,
same server step (and, under client-level DP, the same noise on the sum and the same accounting),
same evaluation and the same run directory (config.yaml, partition.npz,
metrics.jsonl, summary.json, model.pt), plus run_config.toml (what Flower was given) and
server.log (the ServerApp's log, warnings included).

With ``checkpoint_every`` > 0 the run dir also holds the simulator's ``checkpoint/`` (server half,
privacy state, RNG, metrics rows; fl_platform/rounds/checkpoint.py), and ``flwr run`` with the same run
config (``resume=auto``) continues after the last one: a new run's SuperNodes start with empty
``context.state``, so a resume is refused for algorithms or compressors with per-client state.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fl_platform.algorithms.registry import get_algorithm
from fl_platform.compression.uplink import contribution_sizes, declared_sizes, make_uplink, uploads_of
from fl_platform.flower.config import DeployConf, from_run_config, to_toml
from fl_platform.flower.payloads import PayloadCodec
from fl_platform.flower.strategy import AlgorithmStrategy, FlowerEngine
from fl_platform.outputs import MetricsLog, RunDir, atomic_torch_save, atomic_write_json, atomic_write_text
from fl_platform.privacy.config import sampling_of
from fl_platform.privacy.setup import deployed, make_server_privacy, secret_sampling_seed
from fl_platform.reporting import Reporter
from fl_platform.rounds.checkpoint import Checkpoint
from fl_platform.rounds.setup import resolve_device
from fl_platform.rounds.simulation import PRIVACY_STATE, LoopConfig, Simulation
from fl_platform.run_config import RunConfig, read_config
from fl_platform.seeding import Stream, seed_torch_global
from fl_platform.training.flat import FlatModel

log = logging.getLogger("fl_platform")


def default_run_dir(cfg: RunConfig, run_id: int, run_config: Mapping[str, Any] | None = None) -> Path:
    """Time-stamped; with checkpoints on, one derived from the run config (what changes results), so the
    same ``flwr run`` finds its checkpoint; ``resume=<dir>``: that dir (the simulator's rule, run_dir_for)."""
    from fl_platform.config import run_dir_for
    from fl_platform.config_checks import RESUME_FREE_KEYS

    now = datetime.now()
    name = f"{cfg.algorithm.name}_{cfg.dataset.name}_s{cfg.seed}"
    results = {k: v for k, v in sorted((run_config or {}).items())
               if not k.startswith((*RESUME_FREE_KEYS, "deploy."))}
    digest = hashlib.sha256(repr(results).encode()).hexdigest()[:10]
    base = Path.cwd() / "outputs" / "flower"
    return Path(run_dir_for(cfg.resume, cfg.checkpoint_every, str(base / f"{now:%Y-%m-%d}" / f"{now:%H-%M-%S}_{name}_run{run_id}"),
                            str(base / f"{name}_{digest}")))


def refuse_lost_node_state(ckpt: Checkpoint, specs: Mapping[str, Any], algorithm: str) -> None:
    """A new ``flwr run`` starts every SuperNode's ``context.state`` empty (Flower keeps it per run): an
    algorithm or compressor that keeps per-client state across rounds cannot continue from a checkpoint
    without it, and must not be given zeros instead."""
    if ckpt.round > 0 and specs:
        raise ValueError(
            f"resume: cannot continue the Flower run in {ckpt.path.parent.parent} after round {ckpt.round}: "
            f"{algorithm} keeps per-client state on the SuperNodes ({', '.join(sorted(specs))}), which Flower "
            f"keeps per run, so a new `flwr run` would start every client from empty state. Rerun with "
            f"resume=never to start over (this deletes the checkpoint), or use an algorithm and compressor "
            f"without client state")


def _log_to(path: Path) -> logging.Handler:
    """Send fl_platform's log (INFO and up) to ``path`` and to stderr (which ``flwr run --stream`` shows)."""
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler = logging.FileHandler(path)
    handler.setFormatter(fmt)
    logger = logging.getLogger("fl_platform")
    logger.addHandler(handler)
    if not any(isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
               for h in logger.handlers):
        stream = logging.StreamHandler()
        stream.setFormatter(fmt)
        logger.addHandler(stream)
    logger.setLevel(logging.INFO)
    return handler


def run_server(grid: Grid, run_config: Mapping[str, Any], run_id: int = 0,
               run_dir: Path | str | None = None) -> dict[str, Any]:
    """Run the experiment described by ``run_config`` over ``grid``; returns the summary."""
    from fl_platform.config_checks import check_flower_server, check_run
    from fl_platform.experiment import load_data, make_setup, open_checkpoint

    t0 = time.perf_counter()
    composed, deploy = from_run_config(run_config)
    cfg = read_config(composed)  # the door: everything below reads the typed run config
    check_run(cfg)
    check_flower_server(cfg)
    rd = RunDir(run_dir or deploy.run_dir or default_run_dir(cfg, run_id, run_config))
    checkpointer, ckpt = open_checkpoint(cfg, rd)  # (before config.yaml is rewritten: it is compared)
    handler = _log_to(rd.path / "server.log")
    lg = cfg.logger
    reporter = Reporter(cfg.rounds, start_round=ckpt.round if ckpt is not None else 0, progress=False,
                        wandb=lg.wandb, wandb_project=lg.wandb_project, wandb_mode=lg.wandb_mode,
                        run_dir=str(rd.path), config=cfg.to_container(), log_every=lg.log_every)
    summary: dict[str, Any] = {}
    try:
        log.info("Flower run %d: %s on %s, %d clients, results in %s", run_id, cfg.algorithm.name,
                 cfg.dataset.name, cfg.num_clients, rd.path)
        data = load_data(cfg)
        setup = make_setup(cfg, data)
        atomic_write_text(rd.config, cfg.to_yaml())
        atomic_write_text(rd.path / "run_config.toml", to_toml(dict(run_config)))
        data.partition.save(rd.partition)
        device = resolve_device(deploy.device)
        seed_torch_global(cfg.seed, Stream.INIT)  # the simulator's initial weights
        eval_model = FlatModel(setup.model(), device)
        spec = get_algorithm(setup.algorithm)
        alg_setup = setup.algorithm_setup(eval_model.num_params, eval_model.num_buffers)
        server = spec.server(setup.algorithm_conf, alg_setup, eval_model.vector.detach().cpu().clone())
        server.attach_data(data)  # one-shot servers distil on a held-out split of it
        client_half = spec.client(setup.algorithm_conf, alg_setup)  # what its replies look like
        uplink = make_uplink(setup.compressor, eval_model, client_half)
        sizes = contribution_sizes(client_half, eval_model)
        if ckpt is not None:
            refuse_lost_node_state(ckpt, {**client_half.state_spec(), **(uplink.state_spec() if uplink else {})},
                                   cfg.algorithm_name)
        # Under DP the noise comes from this server's OS CSPRNG and the cohorts from a secret of its own: every
        # client is sent the seed, from which both could otherwise be computed.
        # A restart reads the secret back from the checkpoint (the cohorts and local DP's counts go on).
        sampling_seed = secret_sampling_seed(setup.privacy,
                                             ckpt.server.get(PRIVACY_STATE) if ckpt is not None else None)
        privacy = make_server_privacy(deployed(setup.privacy), spec, setup.algorithm_conf, sizes,
                                      num_clients=cfg.num_clients, clients_per_round=cfg.clients_per_round,
                                      rounds=cfg.rounds, seed=cfg.seed if sampling_seed is None else sampling_seed,
                                      secret_seed=sampling_seed is not None)
        strategy = AlgorithmStrategy(server, seed=cfg.seed, num_rounds=cfg.rounds, num_clients=cfg.num_clients,
                                     clients_per_round=cfg.clients_per_round, deploy=deploy,
                                     expected_sizes=declared_sizes(client_half, eval_model),
                                     uploads=uploads_of(client_half),
                                     codec=PayloadCodec(uplink) if uplink is not None else None, privacy=privacy)
        strategy.summary()
        strategy.connect(grid)
        loop = LoopConfig(seed=cfg.seed, rounds=cfg.rounds, clients_per_round=cfg.clients_per_round,
                          eval_every=cfg.eval_every, eval_batch_size=cfg.eval_batch_size,
                          sampling=sampling_of(setup.privacy), sampling_seed=sampling_seed, nonfinite=setup.nonfinite)
        sim = Simulation(loop, data, server, FlowerEngine(strategy, grid), eval_model,
                         metrics=MetricsLog(rd.metrics), reporter=reporter,
                         checkpointer=checkpointer if cfg.checkpoint_every > 0 else None)
        sim.privacy = privacy  # the noise on the sum, epsilon and the target-epsilon stop: the simulator's loop
        if ckpt is not None:  # server half, privacy state, RNG and metrics rows; the rounds after it follow
            sim.restore(ckpt)
        setup_s = time.perf_counter() - t0
        summary = sim.run()
        summary.update({
            "setup_time_s": setup_s,
            "algorithm": cfg.algorithm_name, "dataset": cfg.dataset.name, "model": cfg.model.name,
            "partition": cfg.partition.name, "seed": cfg.seed, "num_clients": cfg.num_clients,
            "clients_per_round": cfg.clients_per_round, "engine": "flower", "flower_run_id": run_id,
            "nodes": {str(c): n for c, n in sorted(strategy.node_of.items())},
        })
        if cfg.save_model:
            atomic_torch_save(eval_model.state_dict(server.weights), rd.model)
        atomic_write_json(rd.summary, summary)
        log.info("Flower run %d finished: final test accuracy %s; run_dir: %s", run_id,
                 summary.get("final_test_accuracy"), rd.path)
    except Exception:
        log.exception("Flower run %d failed", run_id)
        raise
    finally:
        reporter.close(summary)
        logging.getLogger("fl_platform").removeHandler(handler)
        handler.close()
    return summary


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    run_server(grid, context.run_config, run_id=context.run_id)


__all__ = ["DeployConf", "app", "default_run_dir", "run_server"]
