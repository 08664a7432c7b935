"""``hydra/launcher=ray_cluster``: every job of a sweep is a Ray task on a (possibly remote) cluster.

    python -m fl_platform.run -m hydra/launcher=ray_cluster hydra.launcher.address=auto \\
        algorithm=fedavg,scaffold seed=0,1,2,3,4

The sweep's jobs are submitted at once and Ray runs as many side by side as the cluster's
resources allow (``num_cpus``/``num_gpus`` per job). Compared with Hydra's own Ray launcher
plugin it needs nothing beyond Ray's core install, ships the project's code to the nodes
(``runtime_env``, default: the repository, as ``engine.runtime_env`` does), and brings every job's
run directory back to the driver's sweep directory, so nodes need not share a filesystem. A job
that fails does not stop the others; the sweep then ends with an error naming the failed jobs.

A job with ``engine=ray`` runs its own Ray workers on the same cluster: give the cluster enough
CPUs for the jobs running side by side and their workers (each job task holds ``num_cpus``).
"""

# No ``from __future__ import annotations``: Hydra imports plugin modules without registering them
# in sys.modules, where dataclasses would look up string annotations.
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

log = logging.getLogger(__name__)


@dataclass
class RayClusterLauncherConf:
    _target_: str = "hydra_plugins.fl_platform_launcher.ray_cluster.RayClusterLauncher"
    address: str | None = None  # None: a local Ray (or the one already running); "auto" or host:port: a cluster
    num_cpus: float = 1.0  # reserved by each job's task
    num_gpus: float = 0.0
    # ``default``: ship the repository (code and conf/, as engine.runtime_env's default); null: nothing
    # (every node has the project installed); or a Ray runtime_env dict.
    runtime_env: Any = "default"
    copy_back: bool = True  # write each job's run-directory files into the driver's sweep directory
    init: dict[str, Any] = field(default_factory=dict)  # extra ray.init arguments (e.g. num_cpus of a local Ray)


ConfigStore.instance().store(group="hydra/launcher", name="ray_cluster", node=RayClusterLauncherConf,
                             provider="fl_platform")


def default_runtime_env() -> dict[str, Any]:
    """The engine's shipped checkout (``engine.runtime_env``'s default when joining a cluster), plus the
    driver's data root as ``$FL_DATA_ROOT`` (absolute), which the shipped copy could not find beside itself."""
    from fl_platform.datasets.paths import ENV_VAR, data_root
    from fl_platform.engine.ray_cluster import default_runtime_env as shipped_checkout

    return {**shipped_checkout(), "env_vars": {ENV_VAR: str(data_root().resolve())}}


def _write_tree(root: Path, files: dict[str, bytes]) -> int:
    """Write a job's files under ``root`` (atomically; files already there with the same bytes, as on a
    shared filesystem, are kept); returns how many were written."""
    from fl_platform.outputs import atomic_write_bytes

    written = 0
    for rel, data in files.items():
        path = root / rel
        if not (path.exists() and path.read_bytes() == data):
            atomic_write_bytes(path, data)
            written += 1
    return written


def _run_job(hydra_context: HydraContext, task_function: TaskFunction, sweep_config: DictConfig,
             singleton_state: dict[Any, Any], driver_node: str | None,
             ) -> tuple[JobReturn, str, str, dict[str, bytes] | None]:
    """One job on a Ray worker: Hydra's ``run_job``; returns its JobReturn, its run directory's
    subfolder of the sweep, the node it ran on and, when this is not the driver's node, that folder's
    files. (The driver logs the node: a worker's own log lines may not reach it before the sweep ends.)"""
    import ray

    setup_globals()
    Singleton.set_state(singleton_state)
    HydraConfig.instance().set_config(sweep_config)
    # (a failed run raises fl_platform.run.JobFailed in a sweep: run_job records the job as failed)
    ret = run_job(hydra_context=hydra_context, task_function=task_function, config=sweep_config,
                  job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")
    subdir = str(sweep_config.hydra.sweep.subdir)
    files = None
    node = ray.get_runtime_context().get_node_id()
    if driver_node is not None and node != driver_node:
        root = Path(str(sweep_config.hydra.sweep.dir)) / subdir
        # (checkpoints stay on the node: they can be as large as the model times its client states)
        files = {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
                 if p.is_file() and p.relative_to(root).parts[0] != "checkpoint"}
    return ret, subdir, node, files


class RayClusterLauncher(Launcher):
    def __init__(self, **conf: Any) -> None:
        self.conf = OmegaConf.structured(RayClusterLauncherConf(**{k: v for k, v in conf.items() if k != "_target_"}))
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.task_function, self.hydra_context = config, task_function, hydra_context

    def _runtime_env(self) -> dict[str, Any] | None:
        env = self.conf.runtime_env
        if env == "default":
            return default_runtime_env()
        if env is None:
            return None
        if not isinstance(env, dict | DictConfig):
            raise ValueError(f"hydra.launcher.runtime_env must be default, null or a dict, got {env!r}")
        return OmegaConf.to_container(env, resolve=True) if isinstance(env, DictConfig) else dict(env)

    def launch(self, job_overrides: Any, initial_job_idx: int) -> list[JobReturn]:
        from fl_platform.engine.ray_cluster import (
            keep_local_ray_on_loopback,
            warn_if_listening_beyond_loopback,
        )

        keep_local_ray_on_loopback(self.conf.address)  # (before Ray is imported) a local Ray: on 127.0.0.1 only
        import ray

        setup_globals()
        assert self.config is not None and self.task_function is not None and self.hydra_context is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        owns = not ray.is_initialized()
        if owns:
            init = {"include_dashboard": False, "log_to_driver": True, **OmegaConf.to_container(self.conf.init)}
            ray.init(address=self.conf.address, runtime_env=self._runtime_env(), **init)
            if self.conf.address is None:
                warn_if_listening_beyond_loopback(ray)
        driver_node = ray.get_runtime_context().get_node_id() if self.conf.copy_back else None
        remote = ray.remote(_run_job).options(num_cpus=self.conf.num_cpus, num_gpus=self.conf.num_gpus,
                                              max_retries=0)
        log.info("Ray cluster launcher: %d jobs (%g CPUs, %g GPUs each) on the Ray at %s, sweep dir %s",
                 len(job_overrides), self.conf.num_cpus, self.conf.num_gpus, ray.get_runtime_context().gcs_address,
                 sweep_dir)
        refs = []
        for i, overrides in enumerate(job_overrides):
            idx = initial_job_idx + i
            log.info("\t#%d : %s", idx, " ".join(filter_overrides(overrides)))
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = f"{sweep_config.hydra.job.name}_{idx}"
                sweep_config.hydra.job.num = idx
                sweep_config.hydra.sweep.dir = str(sweep_dir)  # absolute: the same path on every node
            refs.append(remote.remote(self.hydra_context, self.task_function, sweep_config,
                                      Singleton.get_state(), driver_node))
        try:
            results, crashed = [], []
            for i, (ref, overrides) in enumerate(zip(refs, job_overrides)):
                try:
                    ret, subdir, node, files = ray.get(ref)
                except Exception as err:  # its process died (out of memory, node lost): the other jobs go on
                    reason = (str(err).strip().splitlines() or [type(err).__name__])[-1]
                    crashed.append(f"#{initial_job_idx + i} ({' '.join(overrides)}): {reason}")
                    log.error("job #%d crashed: %s", initial_job_idx + i, reason)
                    continue
                log.info("job %d ran on node %s", initial_job_idx + i, node)
                if files is not None:
                    written = _write_tree(sweep_dir / subdir, files)
                    log.info("job %s ran on another node: %d of its %d files copied into %s", subdir,
                             written, len(files), sweep_dir / subdir)
                results.append(ret)
        finally:
            if owns:
                ray.shutdown()
        failed = [f"#{r.hydra_cfg.hydra.job.num} ({' '.join(r.overrides)}): "
                  f"{getattr(r._return_value, 'reason', '') or r._return_value}"
                  for r in results if r.status == JobStatus.FAILED] + crashed
        if failed:  # each job printed its own reason above; the sweep's exit status says it failed
            sys.exit(f"error: {len(failed)} of {len(refs)} jobs failed: " + "; ".join(failed))
        return results
