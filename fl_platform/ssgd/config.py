"""The S-SGD runtime's config: its own top-level schema over the simulator's dataset/model/compressor groups.

``conf/ssgd.yaml`` selects ``dataset``, ``model``, ``compressor`` and ``logger`` options from the
same ``conf/`` groups as the simulator (so ``model=resnet18 compressor=powersgd`` means the same
thing in both runtimes) and adds what only data-parallel training has: the ``ssgd`` section. It is
kept apart from the simulator's ``Config`` (no rounds, clients, partition or algorithm here).

Every rank composes the same config from the same command line with Hydra's compose API (no
``@hydra.main``: that would make every rank create a time-stamped output directory), and only
rank 0 writes the run directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from fl_platform.compression.registry import CompressorConf
from fl_platform.config import DatasetConf, LoggerConf, ModelConf
from fl_platform.training.loop import TrainConfig
from fl_platform.training.schedule import LrSchedule

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

    from fl_platform.config import register_configs

    register_configs()
    ConfigStore.instance().store(name=SCHEMA_NAME, node=SSGDConfig)


def compose_ssgd_config(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The config ``python -m fl_platform.ssgd <overrides>`` runs (validated against the schemas)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_ssgd_config()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=CONFIG_NAME, overrides=list(overrides))
    GlobalHydra.instance().clear()
    validate(cfg)
    return cfg


def validate(cfg: DictConfig) -> None:
    """Reject values that are well-typed but make no sense, naming the key."""
    s, t = cfg.ssgd, cfg.train
    compressor = cfg.compressor.name
    checks: list[tuple[bool, str, str]] = [
        (t.batch_size >= 1, "train.batch_size", f"must be >= 1, got {t.batch_size}"),
        (t.lr > 0, "train.lr", f"must be > 0, got {t.lr}"),
        (t.epochs >= 1 or bool(t.steps), "train.epochs", f"must be >= 1 (or set train.steps), got {t.epochs}"),
        (t.steps is None or t.steps >= 1, "train.steps", f"must be >= 1 or null, got {t.steps}"),
        (t.optimizer in ("sgd", "adam"), "train.optimizer", f"must be one of sgd, adam; got {t.optimizer!r}"),
        (t.shuffle_offset == 0, "train.shuffle_offset",
         f"is the federated loop's noise-floor control; S-SGD shards every epoch from (seed, SHUFFLE, epoch) "
         f"and does not take it (leave it at 0), got {t.shuffle_offset}"),
        (t.get("lr_schedule") is None or dict(t.lr_schedule) == vars(LrSchedule()), "train.lr_schedule",
         f"schedules the rate across federated rounds; S-SGD has no rounds (leave it at its defaults), got "
         f"{t.get('lr_schedule')}"),
        *((t.get(key, off) == off, f"train.{key}", f"is a step option of the federated loop "
           f"(docs/engine.md, \"The step\"); the S-SGD step does not implement it (leave it at {off}), "
           f"got {t.get(key)}") for key, off in (("precision", "fp32"), ("channels_last", False), ("compile", False))),
        (cfg.eval_every >= 0, "eval_every", f"must be >= 0, got {cfg.eval_every}"),
        (cfg.log_every_steps >= 0, "log_every_steps", f"must be >= 0, got {cfg.log_every_steps}"),
        (s.backend in ("auto", "gloo", "nccl"), "ssgd.backend", f"must be auto, gloo or nccl; got {s.backend!r}"),
        (s.bucket_cap_mb > 0, "ssgd.bucket_cap_mb", f"must be > 0, got {s.bucket_cap_mb}"),
        (s.start_iter >= 2, "ssgd.start_iter",
         f"must be >= 2 (DDP rebuilds its buckets after iteration 1, so per-bucket state would be lost), "
         f"got {s.start_iter}"),
        (s.period >= 1, "ssgd.period", f"must be >= 1, got {s.period}"),
        (s.local_start_step >= 0, "ssgd.local_start_step", f"must be >= 0, got {s.local_start_step}"),
        (s.threads is None or s.threads >= 1, "ssgd.threads", f"must be >= 1 or null, got {s.threads}"),
        (s.timeout_s > 0, "ssgd.timeout_s", f"must be > 0, got {s.timeout_s}"),
        (str(s.sync) == "ddp" or compressor == "none", "ssgd.sync",
         f"local SGD averages whole models and takes no gradient compressor; got compressor={compressor} "
         "(use ssgd.sync=ddp, or compressor=none)"),
    ]
    for ok, key, message in checks:
        if not ok:
            raise ValueError(f"{key} {message}")
    from fl_platform.experiment import check_keys_and_plugins

    check_keys_and_plugins(cfg)  # model=custom / dataset=custom load, with their fields checked


def as_plain(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]
