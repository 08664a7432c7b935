"""GPU placement with Ray's declared GPUs on a CPU-only machine.

Placement: the engine's GPU bundles hold a probe per worker that reports the GPU ids Ray assigned it
(``ray.get_gpu_ids()``): for W/G = 3/2, 8/8 (+ the driver's evaluation), 10/8, 12/8 and 16/8 over
two nodes of 4 GPUs, every GPU hosts floor(W/G) or ceil(W/G) workers. Fail loud: the default
``engine.device=auto`` with a worker that Ray gave a GPU and this CPU-only torch stops the run,
naming the node and the torch build; ``engine.device=cpu`` trains. Impossible requests are refused
at once with the numbers (``plan_placement``, no Ray); a start-up that cannot place its bundles
ends after engine.start_timeout_s naming what is missing.

The Ray cases run in a subprocess (tests/gpu_placement_cases.py): each needs a Ray instance of its
own with GPUs declared, which this test process (holding the session's Ray) cannot start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from fl_platform.engine.ray_placement import plan_placement

HERE = Path(__file__).resolve().parent
GROUPS = ["one_node", "two_nodes", "pending", "failed_start"]
CASES = ["3/2", "fail_loud", "cpu", "unpackable", "8/8", "8/8/eval", "10/8", "12/8", "16/8", "pending", "failed_start"]


@pytest.fixture(scope="module")
def cases() -> dict[str, dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "gpu_placement_cases.py"), *GROUPS], capture_output=True,
                          text=True, timeout=900, env=env, cwd=HERE.parent)
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            out[row.pop("case")] = row
    assert set(out) == set(CASES), proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def check_every_gpu_used(row: dict, workers: int, gpus: int) -> Counter:
    """Each worker got exactly one GPU; the GPUs in use are min(W, G), loads differ by at most one."""
    assert "crash" not in row, row
    assert all(len(g.split(":")[1].split(",")) == 1 for g in row["gpus"]), row["gpus"]
    load = Counter(row["gpus"])
    assert len(load) == min(workers, gpus), load
    assert max(load.values()) - min(load.values()) <= 1, load
    return load


@pytest.mark.ray
@pytest.mark.parametrize(("case", "gpus", "nodes"), [("3/2", 2, 1), ("8/8", 8, 2), ("10/8", 8, 2), ("12/8", 8, 2),
                                                      ("16/8", 8, 2)])
def test_every_gpu_hosts_floor_or_ceil_of_its_workers(cases, case, gpus, nodes):
    workers = int(case.split("/")[0])
    row = cases[case]
    load = check_every_gpu_used(row, workers, gpus)
    assert len({g.split(":")[0] for g in load}) == nodes
    for w, g in enumerate(row["gpus"]):  # a worker's share is its GPU's even split
        assert row["shares"][w] == pytest.approx(1 / load[g])


@pytest.mark.ray
def test_the_drivers_evaluation_does_not_halve_the_workers_shares(cases):
    row = cases["8/8/eval"]
    check_every_gpu_used(row, 8, 8)
    assert row["eval"].split(":")[0] == row["driver"]  # on a GPU of the driver's node
    assert row["eval"] in row["gpus"]
    host = row["gpus"].index(row["eval"])  # the worker on that GPU leaves EVAL_SHARE to the evaluation
    assert row["shares"][host] == pytest.approx(0.9)
    assert [s for w, s in enumerate(row["shares"]) if w != host] == [1.0] * 7


@pytest.mark.ray
def test_a_worker_given_a_gpu_without_cuda_stops_the_run(cases):
    error = cases["fail_loud"]["error"]
    assert error is not None, "the run trained on the CPU of a worker that Ray gave a GPU"
    for part in ("Ray gave this worker GPU(s)", "on node", "torch.version.cuda=None", "CPU-only build",
                 "engine.device=cpu"):
        assert part in error, error
    row = cases["cpu"]  # explicitly on the CPU: trains, no GPU assigned, the table says so
    assert row["rounds"] == 1
    assert [(w["device"], w["gpu_ids"], w["gpu_share"]) for w in row["workers"]] == [("cpu", [], 0.0)] * 2
    assert {"worker", "node", "torch", "cuda"} <= set(row["workers"][0])


@pytest.mark.ray
def test_an_unpackable_gpu_share_is_refused(cases):
    error = cases["unpackable"]["error"]
    assert error and "cannot be placed" in error and "0.67" in error and "1/ceil(W/G)" in error


@pytest.mark.ray
def test_start_up_that_cannot_place_its_workers_ends_with_the_numbers(cases):
    row = cases["pending"]
    assert row.get("error"), row
    assert "did not start within 8 s" in row["error"] and "engine.start_timeout_s" in row["error"]
    assert "1 CPUs and 1 GPUs on one node" in row["error"]
    assert row["seconds"] < 60


@pytest.mark.ray
def test_a_failed_start_up_leaves_no_ray_behind(cases):
    row = cases["failed_start"]
    assert row.get("error"), row
    assert row["ray_left_running"] is False


@pytest.mark.parametrize(("cfg", "node_gpus", "words"), [
    ({"num_workers": 3, "gpus_per_worker": 1}, [1, 1], ["3 workers at engine.gpus_per_worker=1", "2 whole GPUs",
                                                        "per node: [1, 1]"]),
    # a worker trains on its first GPU: more than one would leave the rest reserved and idle
    ({"num_workers": 1, "gpus_per_worker": 2}, [4, 4], ["engine.gpus_per_worker=2: a worker trains on one GPU",
                                                        "1 of the 2"]),
    ({"num_workers": 20, "gpus_per_worker": 0.4, "cpus_per_worker": 0.5}, [4, 4], ["20 workers at 0.4 GPU",
                                                                                    "3 share one GPU"]),
    ({"num_workers": 9, "cpus_per_worker": 2}, [4, 4], ["engine.num_workers=9 x engine.cpus_per_worker=2", "16 CPUs"]),
])
def test_an_impossible_request_is_refused_at_once_with_the_numbers(cfg, node_gpus, words):
    with pytest.raises(ValueError) as err:
        plan_placement(cfg, "auto", {"CPU": 16.0, "GPU": float(sum(node_gpus))}, node_gpus=node_gpus)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(("workers", "gpus", "per_gpu"), [(8, 8, [1] * 8), (10, 8, [2, 2] + [1] * 6),
                                                          (12, 8, [2] * 4 + [1] * 4), (3, 2, [2, 1]), (3, 8, [1] * 3),
                                                          (16, 8, [2] * 8)])
def test_the_plan_deals_workers_over_one_bundle_per_gpu(workers, gpus, per_gpu):
    p = plan_placement({"num_workers": workers, "cpus_per_worker": 0.5}, "auto", {"CPU": 16.0, "GPU": float(gpus)})
    assert [p.occupants(b) for b in range(p.bundles)] == per_gpu
    assert sorted(Counter(p.bundle_of(w) for w in range(workers)).values(), reverse=True) == per_gpu
    assert [s["GPU"] for s in p.bundle_specs()] == [1.0] * len(per_gpu)


def test_evaluation_on_a_gpu_without_one_on_the_drivers_node_is_refused_at_once():
    cfg = {"num_workers": 4, "cpus_per_worker": 1}
    with pytest.raises(ValueError, match=r"the driver's node has no GPU .*engine\.eval_device=cpu"):
        plan_placement(cfg, "auto", {"CPU": 8.0, "GPU": 4.0}, eval_on_gpu=True, node_gpus=[0, 4], driver_gpus=0)
    with pytest.raises(ValueError, match="the driver's node has no GPU"):  # CPU workers too
        plan_placement(cfg, "cpu", {"CPU": 8.0, "GPU": 4.0}, eval_on_gpu=True, node_gpus=[0, 4], driver_gpus=0)
    assert plan_placement(cfg, "auto", {"CPU": 8.0, "GPU": 4.0}, eval_on_gpu=True, node_gpus=[4],
                          driver_gpus=4).eval_gpus == pytest.approx(0.1)


def test_evaluation_goes_to_a_gpu_of_the_drivers_node_by_default_when_the_workers_have_gpus():
    from fl_platform.engine.ray_placement import evaluates_on_gpu

    assert evaluates_on_gpu("auto", gpu_workers=True, driver_gpus=8)
    assert not evaluates_on_gpu("auto", gpu_workers=True, driver_gpus=0)  # (warned: the driver's CPU)
    assert not evaluates_on_gpu("auto", gpu_workers=False, driver_gpus=8)  # CPU workers: the driver's CPU
    assert not evaluates_on_gpu("cpu", gpu_workers=True, driver_gpus=8)
    assert evaluates_on_gpu("cuda", gpu_workers=False, driver_gpus=8)


def test_a_worker_ray_gave_no_gpu_trains_on_the_cpu_even_where_cuda_is_visible(monkeypatch):
    """engine.device=auto is decided by the GPU ids Ray assigned the worker, not by the CUDA devices its
    process sees (Ray's override that hides them from actors without GPUs is being retired): a RayWorker
    built where CUDA looks available but Ray gave no GPU holds its data and model on the CPU.
    ``engine.device=cuda`` without GPU ids is refused, naming the setting."""
    import ray
    import torch

    from fl_platform.engine.ray_actors import RayWorker, worker_device
    from fl_platform.experiment import load_data, make_setup
    from fl_platform.run_config import read_config

    from .conftest import compose_config

    run = read_config(compose_config("dataset=digits", "num_clients=4", "clients_per_round=2", "model=mlp",
                                     "engine.threads_per_worker=1"))
    setup = make_setup(run, load_data(run))
    assert setup.device == "auto"
    blocks = list(setup.dataset.train_blocks)
    shipped = replace(setup, dataset=setup.dataset.without_training_features())
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a node's GPUs visible to the process
    worker = RayWorker(0, shipped, None, *blocks)
    assert worker.device == torch.device("cpu")
    assert worker.fm.vector.device.type == "cpu" and worker.data.device.type == "cpu"
    assert worker_device("auto", ["3"]) == "auto" and worker_device("cpu", ["3"]) == "cpu"
    with pytest.raises(RuntimeError, match=r"engine\.device=cuda but Ray assigned this worker no GPU"):
        worker_device("cuda", [])
