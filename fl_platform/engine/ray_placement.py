"""How many Ray workers a run gets, what each one reserves (CPUs, GPUs), and on which GPU it lands.

Decided once at start-up from ``engine.*`` and what the Ray cluster offers. GPU workers are placed
through a placement group with one bundle per GPU (``GpuGroup``): W workers on G GPUs are dealt
round-robin over min(W, G) bundles, so every GPU hosts floor(W/G) or ceil(W/G) workers and none
hosts two while another has none, on one node or many. (Fractional shares without bundles do not
give this: Ray's allocator fills one GPU before it opens the next, so 10 workers at 1/2 used 5 of 8
GPUs.) A request the cluster cannot satisfy is refused here, naming the numbers, instead of leaving
actors pending forever.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

#: The GPU share the driver's evaluation (engine.eval_device=cuda) holds in the bundle of a GPU on its
#: node; that GPU's workers share the rest. Evaluation runs between rounds, when the workers wait, so
#: it needs memory, not a worker's share of the GPU's time.
EVAL_SHARE = 0.1


def conf_value(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg.key`` from an OmegaConf node, a dataclass or a dict; ``default`` when absent or None."""
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


@dataclass(frozen=True)
class Placement:
    """The plan: W workers of ``cpus_per_worker`` CPUs; on GPUs, ``bundles`` bundles of one whole GPU
    each, worker w in bundle ``w % bundles``."""

    num_workers: int
    cpus_per_worker: float
    gpus_per_worker: float  # 0: the workers train on CPU; else the explicit share, or 0 for "even" (1/occupants)
    eval_gpus: float = 0.0  # the GPU share held for the driver's evaluation (engine.eval_device=cuda)
    bundles: int = 0  # GPU bundles (0: CPU workers, placed by Ray's SPREAD)
    uses_gpu: bool = False

    def bundle_of(self, worker_id: int) -> int:
        return worker_id % self.bundles

    def occupants(self, bundle: int) -> int:
        """Workers in ``bundle``."""
        return self.num_workers // self.bundles + (1 if bundle < self.num_workers % self.bundles else 0)

    def share(self, worker_id: int, eval_bundle: int | None = None) -> float:
        """Worker ``worker_id``'s GPU share (0 on CPU): the explicit share, else an even split of its
        bundle's GPUs (less the evaluation's share when the driver evaluates on that GPU)."""
        if not self.uses_gpu:
            return 0.0
        if self.gpus_per_worker:
            return self.gpus_per_worker
        b = self.bundle_of(worker_id)
        free = 1.0 - (self.eval_gpus if b == eval_bundle else 0.0)
        return free / self.occupants(b)

    def bundle_specs(self) -> list[dict[str, float]]:
        return [{"GPU": 1.0, "CPU": self.cpus_per_worker * self.occupants(b)}
                for b in range(self.bundles)]


def whole_gpus(nodes: list[dict[str, Any]]) -> list[int]:
    """Whole GPUs per alive node (a bundle holds whole GPUs of one node)."""
    return [math.floor(n["Resources"].get("GPU", 0.0) + 1e-9) for n in nodes if n.get("Alive")]


def evaluates_on_gpu(eval_device: str, gpu_workers: bool, driver_gpus: int) -> bool:
    """Whether the driver evaluates on a GPU (holding ``EVAL_SHARE`` of one): ``cuda``; or ``auto`` when
    the workers train on GPUs and the driver's node has one. Evaluation goes where the GPUs are:
    ResNet-18 on 10,000 test images is minutes of CPU per round, more than the GPUs' whole round."""
    return eval_device == "cuda" or (eval_device == "auto" and gpu_workers and driver_gpus > 0)


def evaluates_on_worker(eval_device: str, gpu_workers: bool, driver_gpus: int) -> bool:
    """Whether worker 0 evaluates the global model (on its device, between rounds): ``worker``; or ``auto``
    when the workers train on GPUs and the driver's node has none, rather than the driver's CPU."""
    return eval_device == "worker" or (eval_device == "auto" and gpu_workers and driver_gpus == 0)


def plan_placement(cfg: Any, device: str, resources: dict[str, float], eval_on_gpu: bool = False,
                   node_gpus: list[int] | None = None, driver_gpus: int | None = None) -> Placement:
    """Workers and per-worker resources for ``engine`` config ``cfg`` on a cluster with ``resources``
    (``node_gpus``: whole GPUs per node; default: all of ``resources['GPU']`` on one node);
    ``eval_on_gpu``: the driver evaluates on a GPU, so a share is held for it (refused at once when
    ``driver_gpus``, the whole GPUs of the driver's node, is 0)."""
    cpus_per_worker = float(conf_value(cfg, "cpus_per_worker", 1.0))
    total_cpus = float(resources.get("CPU", 0.0))
    total_gpus = float(resources.get("GPU", 0.0))
    node_gpus = node_gpus if node_gpus is not None else [math.floor(total_gpus + 1e-9)]
    gpus = sum(node_gpus)  # whole GPUs
    use_gpu = device != "cpu" and total_gpus > 0
    if device.startswith("cuda") and total_gpus == 0:
        raise RuntimeError(f"engine.device={device!r} but the Ray cluster has no GPUs")
    if eval_on_gpu and total_gpus == 0:
        raise RuntimeError("engine.eval_device asks for a GPU but the Ray cluster has no GPUs")
    if eval_on_gpu and driver_gpus == 0:
        raise ValueError(f"engine.eval_device=cuda: the driver's node has no GPU (the cluster's {total_gpus:g} are on "
                         f"other nodes), and the driver evaluates in its own process; use engine.eval_device=cpu, "
                         f"or run the driver on a GPU node")
    if use_gpu and gpus == 0:
        raise ValueError(f"the Ray cluster declares {total_gpus:g} GPUs but no node has a whole one; workers are "
                         f"placed one GPU bundle per GPU. Declare whole GPUs, or engine.device=cpu")
    num_workers = conf_value(cfg, "num_workers")
    if num_workers is None:
        num_workers = gpus if use_gpu else int(total_cpus // max(cpus_per_worker, 1e-9))
    num_workers = int(num_workers)
    if num_workers < 1:
        raise ValueError(f"engine.num_workers must be >= 1, got {num_workers} "
                         f"(Ray sees {total_cpus:g} CPUs and {total_gpus:g} GPUs)")
    explicit = conf_value(cfg, "gpus_per_worker")
    if not use_gpu and explicit is not None:
        raise ValueError(f"engine.gpus_per_worker={explicit} has no effect: the workers "
                         f"train on CPU ({'engine.device=cpu' if device == 'cpu' else 'the Ray cluster has no GPUs'})")
    if num_workers * cpus_per_worker > total_cpus + 1e-9:
        raise ValueError(
            f"engine.num_workers={num_workers} x engine.cpus_per_worker={cpus_per_worker:g} needs more than the "
            f"{total_cpus:g} CPUs of the Ray cluster; the actors would wait forever. Lower num_workers or "
            f"cpus_per_worker.")
    if not use_gpu:  # the driver's evaluation (if on a GPU) holds a whole one, outside any worker's
        return Placement(num_workers, cpus_per_worker, 0.0, min(1.0, total_gpus) if eval_on_gpu else 0.0)
    share = 0.0 if explicit is None else float(explicit)
    eval_gpus = EVAL_SHARE if eval_on_gpu else 0.0
    if share > 1:  # a worker's device is its first GPU (rounds/setup.py): the others would sit idle, reserved
        raise ValueError(f"engine.gpus_per_worker={share:g}: a worker trains on one GPU, so {share - 1:g} of the "
                         f"{share:g} it would hold sit idle; use engine.gpus_per_worker=1 (or leave it unset) and "
                         f"more workers (engine.num_workers)")
    if share == 1:  # a whole GPU per worker: one bundle each
        if eval_on_gpu:
            raise ValueError(f"engine.eval_device=cuda with engine.gpus_per_worker={share:g}: every GPU is a worker's "
                             f"whole; leave engine.gpus_per_worker unset (the evaluation then takes {EVAL_SHARE:g} of "
                             f"a GPU on the driver's node), or use engine.eval_device=cpu")
        if sum(node_gpus) < num_workers:
            raise ValueError(
                f"{num_workers} workers at engine.gpus_per_worker={share:g} GPUs each cannot be placed on the "
                f"cluster's {gpus} whole GPUs (per node: {node_gpus}); leave engine.gpus_per_worker unset for an "
                f"even split, or lower engine.num_workers.")
        return Placement(num_workers, cpus_per_worker, share, bundles=num_workers, uses_gpu=True)
    bundles = min(num_workers, gpus)
    crowd = math.ceil(num_workers / bundles)
    if share > 0 and crowd * share + (eval_gpus if eval_on_gpu else 0.0) > 1 + 1e-9:
        held = f" and {eval_gpus:g} for the driver's evaluation (engine.eval_device)" if eval_on_gpu else ""
        raise ValueError(
            f"{num_workers} workers at {share:g} GPU each cannot be placed on the cluster's {gpus} GPUs: spread "
            f"evenly, {crowd} share one GPU{held}, more than one GPU (a fractional share must fit on one GPU); "
            f"leave engine.gpus_per_worker unset for an even split (1/ceil(W/G)), or lower engine.num_workers.")
    return Placement(num_workers, cpus_per_worker, share, eval_gpus, bundles=bundles, uses_gpu=True)


class GpuGroup:
    """The placement group of a GPU placement: one bundle per GPU (or per worker with whole GPUs),
    spread over the nodes; ``actor_options`` pins each worker (and the driver's evaluation slot) to
    its bundle. Created and waited for at once, so a cluster without room fails at start-up."""

    def __init__(self, placement: Placement, timeout: float, driver_node: str | None = None) -> None:
        import ray
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

        self._ray = ray
        self.placement = placement
        specs = placement.bundle_specs()
        self.pg = placement_group(specs, strategy="SPREAD")
        try:
            ray.get(self.pg.ready(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            nodes = [f"{n['NodeID'][:12]}: {n['Resources'].get('CPU', 0):g} CPUs, {n['Resources'].get('GPU', 0):g} GPUs"
                     for n in ray.nodes() if n.get("Alive")]
            asks = sorted({(s["CPU"], s["GPU"]) for s in specs})
            raise RuntimeError(
                f"the {len(specs)} GPU bundles of {placement.num_workers} Ray workers did not start within "
                f"{timeout:g} s (engine.start_timeout_s): each asks for "
                f"{' or '.join(f'{c:g} CPUs and {g:g} GPUs on one node' for c, g in asks)}; nodes: "
                f"{'; '.join(nodes)}. Lower engine.num_workers or engine.cpus_per_worker, or add nodes") from None
        self.nodes: dict[int, str] = {int(b): n for b, n in placement_group_table(self.pg)["bundles_to_node_id"].items()}
        self.eval_bundle: int | None = None
        if placement.eval_gpus:
            mine = [b for b, n in self.nodes.items() if n == driver_node]
            if not mine:
                self.close()
                raise RuntimeError(f"engine.eval_device=cuda: the driver's node {str(driver_node)[:12]} hosts none of "
                                   f"the workers' GPUs, so the driver has no GPU to evaluate on; use "
                                   f"engine.eval_device=cpu, or run the driver on a GPU node")
            self.eval_bundle = min(mine, key=lambda b: (placement.occupants(b), b))

    def share(self, worker_id: int) -> float:
        return self.placement.share(worker_id, self.eval_bundle)

    def actor_options(self, worker_id: int) -> dict[str, Any]:
        """Ray options that put worker ``worker_id`` into its GPU's bundle with its share."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": self.placement.cpus_per_worker, "num_gpus": self.share(worker_id),
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    self.pg, placement_group_bundle_index=self.placement.bundle_of(worker_id))}

    def eval_options(self) -> dict[str, Any]:
        """Ray options of the driver's evaluation slot: its share in a bundle on the driver's node."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": 0, "num_gpus": self.placement.eval_gpus, "scheduling_strategy":
                PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=self.eval_bundle)}

    def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        with contextlib.suppress(Exception):  # the cluster may be gone already: nothing is left to free then
            remove_placement_group(self.pg)
