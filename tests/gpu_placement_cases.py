"""GPU placement cases, each in its own Ray instance with GPUs declared on a CPU-only machine (run by
tests/test_engine_gpu_placement.py in a subprocess; prints one JSON line per case).

    python tests/gpu_placement_cases.py <case> [<case> ...]

Cases: ``W/G`` (W workers on G declared GPUs: placed, one round equal to inline), ``W/G/eval`` (the
same with engine.eval_device=cuda: one more share held for the driver), ``unpackable`` (an explicit
share that cannot be packed is refused), ``pending`` (a 2-node cluster whose GPUs sit on a node
without CPUs to spare: the bounded start-up wait names what is missing), ``failed_start`` (a start-up
that fails shuts down the Ray the engine started).
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


def run(*overrides: str):
    from conftest import compose_config

    from fl_platform.experiment import build

    exp = build(compose_config(*COMMON, *overrides))
    try:
        exp.simulation.run()
        return exp
    finally:
        exp.engine.close()


def placed(workers: int, gpus: int, eval_gpu: bool) -> dict:
    import ray

    ray.init(num_cpus=workers, num_gpus=gpus, include_dashboard=False, log_to_driver=False)
    try:
        extra = ("engine.eval_device=cuda",) if eval_gpu else ()
        t0 = time.perf_counter()
        exp = run("engine=ray", f"engine.num_workers={workers}", "engine.start_timeout_s=120", *extra)
        seconds = time.perf_counter() - t0
        ray_weights = exp.simulation.server.weights.clone()
        placement = exp.engine.placement
    finally:
        ray.shutdown()
    ref = run("engine=inline").simulation.server.weights
    return {"share": placement.gpus_per_worker, "eval_gpus": placement.eval_gpus, "seconds": seconds,
            "max_diff": float((ray_weights - ref).abs().max()), "eval_device": str(exp.simulation.eval_model.device)}


def unpackable() -> dict:
    import ray

    ray.init(num_cpus=3, num_gpus=2, include_dashboard=False, log_to_driver=False)
    try:
        run("engine=ray", "engine.num_workers=3", "engine.gpus_per_worker=0.67")
        return {"error": None}
    except ValueError as err:
        return {"error": str(err)}
    finally:
        ray.shutdown()


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
            return {"error": None}
        except RuntimeError as err:
            return {"error": str(err), "seconds": time.perf_counter() - t0}
    finally:
        ray.shutdown()
        cluster.shutdown()


def failed_start() -> dict:
    """The engine starts Ray itself (none running) and its start-up fails: it leaves no Ray behind."""
    import ray

    try:
        run("engine=ray", "engine.num_workers=2", "engine.gpus_per_worker=1", "engine.start_timeout_s=5")
        return {"error": None}
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}", "ray_left_running": ray.is_initialized()}


def main(cases: list[str]) -> None:
    for case in cases:
        try:
            if case == "unpackable":
                out = unpackable()
            elif case == "pending":
                out = pending()
            elif case == "failed_start":
                out = failed_start()
            else:
                w, g, *rest = case.split("/")
                out = placed(int(w), int(g), rest == ["eval"])
            print(json.dumps({"case": case, **out}), flush=True)
        except Exception as err:
            traceback.print_exc()
            print(json.dumps({"case": case, "crash": f"{type(err).__name__}: {err}"}), flush=True)


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="fl-gpu-") as tmp:
        os.environ["RAY_TMPDIR"] = tmp  # this script's Ray instances stay private
        main(sys.argv[1:])
