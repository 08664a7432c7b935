"""How many Ray workers a run gets and what each one reserves (CPUs, GPUs).

Decided once at start-up from ``engine.*`` and what the Ray cluster offers. A request the cluster
cannot satisfy is refused here, naming the numbers, instead of leaving actors pending forever.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def conf_value(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg.key`` from an OmegaConf node, a dataclass or a dict; ``default`` when absent or None."""
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


@dataclass(frozen=True)
class Placement:
    num_workers: int
    cpus_per_worker: float
    gpus_per_worker: float  # 0: the workers train on CPU
    eval_gpus: float = 0.0  # a GPU share held for the driver's evaluation (engine.eval_device=cuda)

    @property
    def uses_gpu(self) -> bool:
        return self.gpus_per_worker > 0


def gpu_share(slots: int, gpus: float) -> float:
    """The GPU fraction per slot when ``slots`` share ``gpus`` whole GPUs: 1 / ceil(slots / gpus), at most 1.

    A fractional share must fit on one GPU, so G / W (what an even split would give) leaves
    actors pending forever whenever W is not a multiple of G: 3 workers on 2 GPUs at 2/3 each fit
    one per GPU, and the third waits. 1 / ceil(W / G) packs ceil(W / G) workers per GPU instead.
    """
    return min(1.0, 1.0 / math.ceil(slots / gpus)) if gpus >= 1 else 0.0


def fits(num_workers: int, share: float, gpus: float) -> bool:
    """Whether ``num_workers`` shares of ``share`` GPU each can be placed on ``gpus`` whole GPUs."""
    if share <= 0:
        return True
    if share > 1:  # whole GPUs per worker
        return share == int(share) and num_workers * share <= gpus + 1e-9
    return num_workers <= math.floor(1.0 / share + 1e-9) * math.floor(gpus + 1e-9)


def plan_placement(cfg: Any, device: str, resources: dict[str, float], eval_on_gpu: bool = False) -> Placement:
    """Workers and per-worker resources for ``engine`` config ``cfg`` on a cluster with ``resources``;
    ``eval_on_gpu``: the driver evaluates on a GPU, so one more share is held for it."""
    cpus_per_worker = float(conf_value(cfg, "cpus_per_worker", 1.0))
    total_cpus = float(resources.get("CPU", 0.0))
    total_gpus = float(resources.get("GPU", 0.0))
    use_gpu = device != "cpu" and total_gpus > 0
    if device.startswith("cuda") and total_gpus == 0:
        raise RuntimeError(f"engine.device={device!r} but the Ray cluster has no GPUs")
    if eval_on_gpu and total_gpus == 0:
        raise RuntimeError("engine.eval_device asks for a GPU but the Ray cluster has no GPUs")
    num_workers = conf_value(cfg, "num_workers")
    if num_workers is None:
        num_workers = int(total_gpus) if use_gpu else int(total_cpus // max(cpus_per_worker, 1e-9))
    num_workers = int(num_workers)
    if num_workers < 1:
        raise ValueError(f"engine.num_workers must be >= 1, got {num_workers} "
                         f"(Ray sees {total_cpus:g} CPUs and {total_gpus:g} GPUs)")
    slots = num_workers + (1 if eval_on_gpu else 0)
    gpus = 0.0
    if not use_gpu and conf_value(cfg, "gpus_per_worker") is not None:
        raise ValueError(f"engine.gpus_per_worker={conf_value(cfg, 'gpus_per_worker')} has no effect: the workers "
                         f"train on CPU ({'engine.device=cpu' if device == 'cpu' else 'the Ray cluster has no GPUs'})")
    if use_gpu:
        gpus = conf_value(cfg, "gpus_per_worker")
        gpus = gpu_share(slots, total_gpus) if gpus is None else float(gpus)
    # The driver's evaluation holds a worker's share, or a whole GPU when the workers train on CPUs.
    eval_gpus = (gpus if use_gpu else min(1.0, total_gpus)) if eval_on_gpu else 0.0
    if num_workers * cpus_per_worker > total_cpus + 1e-9:
        raise ValueError(
            f"engine.num_workers={num_workers} x engine.cpus_per_worker={cpus_per_worker:g} needs more than the "
            f"{total_cpus:g} CPUs of the Ray cluster; the actors would wait forever. Lower num_workers or "
            f"cpus_per_worker.")
    placeable = fits(slots, gpus, total_gpus) if use_gpu else fits(1, eval_gpus, total_gpus)
    if not placeable:
        held = " and one for the driver's evaluation (engine.eval_device)" if eval_on_gpu else ""
        raise ValueError(
            f"{num_workers} workers{held} at {gpus:g} GPU each cannot be placed on the cluster's {total_gpus:g} "
            f"GPUs (a fractional share must fit on one GPU); leave engine.gpus_per_worker unset for 1/ceil(W/G), "
            f"or lower engine.num_workers.")
    return Placement(num_workers, cpus_per_worker, gpus, eval_gpus)
