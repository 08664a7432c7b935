"""Sweeps with parallel launchers: ``hydra/launcher=joblib`` (local processes) and
``hydra/launcher=ray_cluster`` (each job a Ray task on a cluster started outside the sweep, jobs on
several nodes); every job's run directory is complete, and ``scripts/plot.py`` turns the sweep into
per-group means with 95% confidence intervals."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from .conftest import REPO, short_tmp
from .test_cli import cli_call, run_cli

pytestmark = pytest.mark.slow  # each sweep runs its jobs in processes (joblib, a Ray cluster)

SWEEP = ("-m", "algorithm=fedavg,fedprox", "seed=0,1", "rounds=2", "num_clients=20", "clients_per_round=4",
         "train.epochs=1")
RUN_FILES = ("config.yaml", "metrics.jsonl", "partition.npz", "model.pt", "summary.json")


def assert_complete_sweep(sweep) -> None:
    summaries = sorted(sweep.rglob("summary.json"))
    assert len(summaries) == 4, summaries
    for summary in summaries:
        run = summary.parent
        assert all((run / name).stat().st_size > 0 for name in RUN_FILES), sorted(p.name for p in run.iterdir())
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [row["round"] for row in rows] == [1, 2]
        assert json.loads(summary.read_text())["rounds"] == 2
    names = sorted(s.parent.name for s in summaries)
    assert names == ["0_fedavg_digits_s0", "1_fedavg_digits_s1", "2_fedprox_digits_s0", "3_fedprox_digits_s1"]


def test_joblib_launcher_runs_a_sweep_in_parallel_processes(tmp_path, monkeypatch):
    """... with one GPU per worker process: given GPUs 0 and 1 (declared: this torch has no CUDA, which
    makes the ids harmless), each of the 2 worker processes claims its own, and every job of a process
    sees only that one (fl_platform/gpu_slots.py)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    sweep = tmp_path / "sweep"
    proc = run_cli(*SWEEP, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr
    assert "Joblib.Parallel(n_jobs=2" in proc.stdout + proc.stderr
    assert_complete_sweep(sweep)
    seen = {}  # worker pid -> the GPU its jobs saw
    jobs = [re.findall(r"joblib worker (\d+): GPU slot \d+ of 2, CUDA_VISIBLE_DEVICES=(\S+)", log.read_text())
            for log in sweep.rglob("*.log")]
    assert len(jobs) == 4 and all(len(lines) == 1 for lines in jobs), jobs  # every job, once
    for (pid, gpu), in jobs:
        assert seen.setdefault(pid, gpu) == gpu
    assert len(seen) == 2 and sorted(seen.values()) == ["0", "1"], seen


@pytest.mark.ray
def test_ray_cluster_launcher_runs_jobs_on_the_nodes_of_a_cluster(tmp_path, monkeypatch):
    """A 2-node cluster (1 CPU each) started outside the sweep; 4 jobs of 1 CPU each spread over both
    nodes; run directories complete on the driver; the plot script gives means with 95% intervals."""
    from ray.cluster_utils import Cluster

    # The cluster's files (and its address file, which a later plain ray.init() would join) stay private.
    with short_tmp("fl-sweep-") as ray_tmp:
        monkeypatch.setenv("RAY_TMPDIR", ray_tmp)
        monkeypatch.setenv("RAY_DEDUP_LOGS", "0")  # Ray folds alike log lines of several nodes into one
        cluster = Cluster(initialize_head=True, connect=False,
                          head_node_args={"num_cpus": 1, "include_dashboard": False})
        try:
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            sweep = tmp_path / "sweep"
            proc = run_cli(*SWEEP, "hydra/launcher=ray_cluster", f"hydra.launcher.address={cluster.address}",
                           f"hydra.sweep.dir={sweep}", timeout=400)
        finally:
            cluster.shutdown()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert_complete_sweep(sweep)
    nodes = set(re.findall(r"job \d+ ran on node ([0-9a-f]+)", out))
    assert len(nodes) == 2, out[-3000:]  # the cluster's nodes both ran jobs

    plot = subprocess.run([sys.executable, str(REPO / "scripts" / "plot.py"), str(sweep), "--out",
                           str(tmp_path / "plots")], capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr
    rows = [line for line in plot.stdout.splitlines() if line.startswith("| algorithm=")]
    assert len(rows) == 2 and all(re.search(r"\| 2 \| \d+\.\d\d ± \d+\.\d\d \|", row) for row in rows), plot.stdout


def test_a_failed_job_fails_the_ray_sweep_and_names_it(tmp_path):
    """One job with an impossible setting: the others finish, the sweep exits non-zero naming it. The
    local Ray the launcher starts listens on 127.0.0.1 only, though this environment does not ask for it
    (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER unset; Ray's default on Linux is every interface)."""
    sweep = tmp_path / "sweep"
    argv, env = cli_call(("-m", "algorithm=fedavg", "rounds=1", "num_clients=20", "clients_per_round=4",
                          "train.lr=0.1,1e30", "hydra/launcher=ray_cluster", "+hydra.launcher.init.num_cpus=2",
                          f"hydra.sweep.dir={sweep}"))
    env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
    with short_tmp("flw") as ray_tmp:
        proc = subprocess.run([sys.executable, "-m", "fl_platform.run", *argv], cwd=REPO, capture_output=True,
                              text=True, timeout=400, env={**env, "RAY_TMPDIR": ray_tmp})
    found = re.search(r"on the Ray at (\S+):\d+, sweep dir", proc.stdout + proc.stderr)
    assert found and found[1] == "127.0.0.1", (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode != 0
    assert "error: 1 of 2 jobs failed: #1" in proc.stderr and "train.lr=1e+30" in proc.stderr, proc.stderr[-3000:]
    assert "non-finite" in proc.stderr  # the job's own reason, from its log
    assert "Traceback" not in proc.stderr
    assert len(list(sweep.rglob("summary.json"))) == 1
