"""How many Ray workers a run gets and what each one reserves (CPUs, GPUs).

Decided once at start-up from ``engine.*`` and what the Ray cluster offers. A request the cluster
cannot satisfy is refused here, naming the numbers, instead of leaving actors pending forever.
"""

from __future__ import annotations

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

    @property
    def uses_gpu(self) -> bool:
        return self.gpus_per_worker > 0


def plan_placement(cfg: Any, device: str, resources: dict[str, float]) -> Placement:
    """Workers and per-worker resources for ``engine`` config ``cfg`` on a cluster with ``resources``."""
    cpus_per_worker = float(conf_value(cfg, "cpus_per_worker", 1.0))
    total_cpus = float(resources.get("CPU", 0.0))
    total_gpus = float(resources.get("GPU", 0.0))
    use_gpu = device != "cpu" and total_gpus > 0
    if device.startswith("cuda") and total_gpus == 0:
        raise RuntimeError(f"engine.device={device!r} but the Ray cluster has no GPUs")
    num_workers = conf_value(cfg, "num_workers")
    if num_workers is None:
        num_workers = int(total_gpus) if use_gpu else int(total_cpus // max(cpus_per_worker, 1e-9))
    num_workers = int(num_workers)
    if num_workers < 1:
        raise ValueError(f"engine.num_workers must be >= 1, got {num_workers} "
                         f"(Ray sees {total_cpus:g} CPUs and {total_gpus:g} GPUs)")
    gpus = 0.0
    if use_gpu:
        gpus = conf_value(cfg, "gpus_per_worker")
        if gpus is None:  # share the GPUs evenly: W workers on G GPUs get G/W each (at most 1)
            gpus = min(1.0, total_gpus / num_workers)
        gpus = float(gpus)
    if num_workers * cpus_per_worker > total_cpus + 1e-9 or num_workers * gpus > total_gpus + 1e-9:
        raise ValueError(
            f"engine.num_workers={num_workers} x (engine.cpus_per_worker={cpus_per_worker}, "
            f"engine.gpus_per_worker={gpus}) needs more than the Ray cluster has ({total_cpus:g} CPUs, "
            f"{total_gpus:g} GPUs); the actors would wait forever. Lower num_workers or the per-worker resources.")
    return Placement(num_workers, cpus_per_worker, gpus)
