"""GPU placement cases with GPUs declared to Ray on a CPU-only machine (run by
tests/test_engine_gpu_placement.py in a subprocess; prints one JSON line per case).

    python tests/gpu_placement_cases.py <group> [<group> ...]

Groups, each one Ray instance: ``one_node`` (2 GPUs: 3 workers placed; a worker given a GPU by Ray
on this CPU-only torch stops the run; engine.device=cpu trains; an unpackable share is refused),
``two_nodes`` (a ray.cluster_utils.Cluster of 2 nodes x 4 GPUs: 8, 8 + the driver's evaluation,
10, 12 and 16 workers placed), ``pending`` (GPUs on a node without CPUs to spare: the bounded
start-up wait names what is missing), ``failed_start`` (a start-up that fails shuts down the Ray
the engine started). Placement cases start the engine's GPU bundles and, in them, a probe actor per
worker with the engine's own actor options, which reports the GPU ids Ray assigned
(``ray.get_gpu_ids()``) and its node: placement without training.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

COMMON = ("rounds=1", "num_clients=16", "clients_per_round=8", "train.epochs=1", "engine.threads_per_worker=1",
          "save_model=false")
TIMEOUT_S = 120


def run(*overrides: str, run_dir: str | None = None):
    from conftest import compose_config

    from fl_platform.experiment import build

    exp = build(compose_config(*COMMON, *overrides), run_dir)
    try:
        exp.simulation.run()
        return exp
    finally:
        exp.engine.close()


class Probe:
    """Stands in for a worker: where Ray put it."""

    def where(self) -> dict:
        import ray

        return {"gpu_ids": [str(g) for g in ray.get_gpu_ids()], "node": ray.get_runtime_context().get_node_id()}


def placed(workers: int, eval_gpu: bool = False, cpus_per_worker: float = 0.1) -> dict:
    """The engine's GPU bundles for ``workers``, a probe in each worker's place: (node, GPU id) per worker."""
    import ray

    from fl_platform.engine.ray_actors import hold_eval_gpu
    from fl_platform.engine.ray_placement import GpuGroup, plan_placement, whole_gpus

    cfg = {"num_workers": workers, "cpus_per_worker": cpus_per_worker}
    placement = plan_placement(cfg, "auto", ray.cluster_resources(), eval_on_gpu=eval_gpu,
                               node_gpus=whole_gpus(ray.nodes()))
    driver = ray.get_runtime_context().get_node_id()
    group = GpuGroup(placement, TIMEOUT_S, driver)
    slot = None
    try:
        probes = [ray.remote(Probe).options(**group.actor_options(w)).remote() for w in range(workers)]
        where = ray.get([p.where.remote() for p in probes], timeout=TIMEOUT_S)
        out = {"gpus": [w["node"][:8] + ":" + ",".join(w["gpu_ids"]) for w in where],
               "shares": [group.share(w) for w in range(workers)]}
        if eval_gpu:
            slot, gpu = hold_eval_gpu(placement.eval_gpus, TIMEOUT_S, group)
            out["eval"] = f"{group.nodes[group.eval_bundle][:8]}:{gpu}"
            out["driver"] = driver[:8]
        for p in probes:
            ray.kill(p)
        return out
    finally:
        if slot is not None:
            ray.kill(slot)
        group.close()


def one_node() -> dict:
    import ray

    ray.init(num_cpus=3, num_gpus=2, include_dashboard=False, log_to_driver=False)
    out: dict = {}
    try:
        out["3/2"] = placed(3)
        try:  # the default engine.device=auto on this CPU-only torch, Ray giving each worker a GPU
            run("engine=ray", "engine.num_workers=2", f"engine.start_timeout_s={TIMEOUT_S}")
            out["fail_loud"] = {"error": None}
        except Exception as err:
            out["fail_loud"] = {"error": f"{type(err).__name__}: {err}"}
        with tempfile.TemporaryDirectory() as tmp:  # engine.device=cpu stays available explicitly
            exp = run("engine=ray", "engine.num_workers=2", "engine.device=cpu", f"engine.start_timeout_s={TIMEOUT_S}",
                      run_dir=tmp)
            out["cpu"] = {"rounds": len(exp.simulation.history),
                          "workers": json.loads((Path(tmp) / "run.json").read_text())["workers"]}
        try:
            run("engine=ray", "engine.num_workers=3", "engine.gpus_per_worker=0.67")
            out["unpackable"] = {"error": None}
        except ValueError as err:
            out["unpackable"] = {"error": str(err)}
    finally:
        ray.shutdown()
    return out


def two_nodes() -> dict:
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 4, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=2, num_gpus=4)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        return {"8/8": placed(8), "8/8/eval": placed(8, eval_gpu=True), "10/8": placed(10), "12/8": placed(12),
                "16/8": placed(16)}
    finally:
        ray.shutdown()
        cluster.shutdown()


def pending() -> dict:
    """GPUs on a node with 1 CPU, CPUs on a node without GPUs: the totals allow 2 workers of 1 CPU and
    1 GPU, no node does; the wait ends after engine.start_timeout_s with the numbers."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 2, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=2, num_gpus=0)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        t0 = time.perf_counter()
        try:
            run("engine=ray", "engine.num_workers=2", "engine.start_timeout_s=8")
            return {"pending": {"error": None}}
        except RuntimeError as err:
            return {"pending": {"error": str(err), "seconds": time.perf_counter() - t0}}
    finally:
        ray.shutdown()
        cluster.shutdown()


def failed_start() -> dict:
    """The engine starts Ray itself (none running) and its start-up fails: it leaves no Ray behind."""
    import ray

    try:
        run("engine=ray", "engine.num_workers=2", "engine.gpus_per_worker=1", "engine.start_timeout_s=5")
        return {"failed_start": {"error": None}}
    except Exception as err:
        return {"failed_start": {"error": f"{type(err).__name__}: {err}", "ray_left_running": ray.is_initialized()}}


GROUPS = {"one_node": one_node, "two_nodes": two_nodes, "pending": pending, "failed_start": failed_start}


def main(groups: list[str]) -> None:
    for group in groups:
        try:
            for case, out in GROUPS[group]().items():
                print(json.dumps({"case": case, **out}), flush=True)
        except Exception as err:
            traceback.print_exc()
            print(json.dumps({"case": group, "crash": f"{type(err).__name__}: {err}"}), flush=True)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="fl-gpu-") as tmp:
        os.environ["RAY_TMPDIR"] = tmp  # this script's Ray instances stay private
        main(sys.argv[1:])
