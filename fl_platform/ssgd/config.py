"""The S-SGD runtime's config: its own top-level schema over the simulator's dataset/model/compressor groups.

``conf/ssgd.yaml`` selects ``dataset``, ``model``, ``compressor`` and ``logger`` options from the
same ``conf/`` groups as the simulator (so ``model=resnet18 compressor=powersgd`` means the same
thing in both runtimes) and adds what only data-parallel training has: the ``ssgd`` section. It is
kept apart from the simulator's ``Config`` (no rounds, clients, partition or algorithm here).

Every rank composes the same config from the same command line with Hydra's compose API (no
``@hydra.main``: that would make every rank create a time-stamped output directory), reads it at
the door into a typed ``RunConfig`` (fl_platform/run_config.py) whose tree is ``SSGDConfig``, and
checks it (``config_checks.check_ssgd``); only rank 0 writes the run directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import MISSING

from fl_platform.compression.registry import CompressorConf
from fl_platform.config import DatasetConf, LoggerConf, ModelConf
from fl_platform.training.loop import TrainConfig

if TYPE_CHECKING:
    from fl_platform.run_config import RunConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
CONFIG_NAME = "ssgd"
SCHEMA_NAME = "ssgd_base_config"


class SyncMode(StrEnum):
    ddp = "ddp"  # gradients every step: DDP (+ a compression hook), or the ACP-SGD optimiser wrapper
    local = "local"  # local SGD: average the model every ``period`` steps (post-local after ``local_start_step``)


@dataclass
class SSGDConf:
    """What only the data-parallel runtime has (the ``ssgd`` section)."""

    sync: SyncMode = SyncMode.ddp
    backend: str = "auto"  # auto: nccl when the device is CUDA, else gloo
    device: str = "auto"  # auto: cuda:<LOCAL_RANK> when CUDA is available, else cpu
    bucket_cap_mb: float = 25.0  # DDP gradient buckets; the ACP-SGD wrapper's fusion buffers (scaled)
    start_iter: int = 2  # DDP compression hooks compress from this iteration on (>= 2: DDP rebuilds buckets)
    period: int = 8  # local SGD: average the model every H steps
    local_start_step: int = 0  # post-local SGD: plain S-SGD (gradient all-reduce) for the first t0 steps
    threads: int | None = None  # torch intra-op threads per process (None: $OMP_NUM_THREADS, else cores / local procs)
    check_replicas: bool = False  # debug: after every sync compare each rank's model with rank 0's
    timeout_s: float = 300.0  # process-group timeout: a collective waiting longer fails the run


@dataclass
class SSGDConfig:
    """The whole run: one process per rank composes this from the same overrides."""

    seed: int = 0
    eval_every: int = 1  # metric rows between test evaluations, and the last row (0: never, e.g. benchmarks)
    log_every_steps: int = 0  # steps per metrics.jsonl row (0: one row per epoch)
    eval_batch_size: int = 1024
    save_model: bool = True
    # Run directory written by rank 0 (None: outputs/ssgd/<date>/<time>_<sync>_<compressor>_<dataset>_s<seed>).
    run_dir: str | None = None
    train: TrainConfig = field(default_factory=TrainConfig)  # batch_size is per worker; epochs/steps per worker
    dataset: DatasetConf = MISSING
    model: ModelConf = MISSING
    compressor: CompressorConf = MISSING
    ssgd: SSGDConf = field(default_factory=SSGDConf)
    logger: LoggerConf = field(default_factory=LoggerConf)


def register_ssgd_config() -> None:
    """Register the group schemas (shared with the simulator) and this runtime's top-level schema."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from fl_platform.config import register_configs

    register_configs()
    ConfigStore.instance().store(name=SCHEMA_NAME, node=SSGDConfig)
    # train.momentum in conf/ssgd.yaml: 0.9 under SGD only, so that train.optimizer=adam has no momentum
    # it would ignore (an explicit train.momentum beside adam is refused, config_checks.train_inactive).
    OmegaConf.register_new_resolver("fl_if_sgd", lambda optimizer, value, otherwise: value if optimizer == "sgd"
                                    else otherwise, replace=True)


def compose_ssgd_config(overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The config ``python -m fl_platform.ssgd <overrides>`` runs, read at the door (run_config.py) and
    checked (config_checks.check_ssgd)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from fl_platform.config_checks import check_ssgd
    from fl_platform.run_config import read_config

    register_ssgd_config()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=CONFIG_NAME, overrides=list(overrides))
    GlobalHydra.instance().clear()
    run = read_config(cfg)
    check_ssgd(run)
    return run
