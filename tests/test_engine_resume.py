"""Checkpoint/resume: a run killed with SIGKILL and rerun with the same command ends with the metrics
of an uninterrupted run (timing fields aside), for FedAvg and SCAFFOLD with the disk store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fl_platform.config_checks import ConfigError
from fl_platform.experiment import build, run_experiment
from fl_platform.rounds.simulation import is_timing_key

from .conftest import REPO, compose_config
from .interrupt import StopAfter

ROUNDS = 8


def cli(*overrides: str) -> list[str]:
    return [sys.executable, "-m", "fl_platform.run", f"rounds={ROUNDS}", "checkpoint_every=2", "clients_per_round=40",
            "train.epochs=3", "engine.state_store=disk", "engine.threads_per_worker=1", "logger.progress=false",
            *overrides]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def run_dir_of(cwd: Path) -> Path:
    (found,) = list((cwd / "outputs" / "resumable").iterdir())
    return found


def metric_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not is_timing_key(k)} for r in rows]


def rows_written(cwd: Path) -> int:
    runs = cwd / "outputs" / "resumable"
    files = list(runs.glob("*/metrics.jsonl")) if runs.exists() else []
    return len(files[0].read_text().splitlines()) if files else 0


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_killed_run_resumes_to_the_uninterrupted_metrics(tmp_path, algorithm):
    cmd = cli(f"algorithm={algorithm}")
    ref_cwd, cwd = tmp_path / "ref", tmp_path / "killed"
    ref_cwd.mkdir()
    cwd.mkdir()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while rows_written(cwd) < 3 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)  # after round 3: the last checkpoint is round 2
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = rows_written(cwd)
    assert 3 <= killed_at < ROUNDS
    run_dir = run_dir_of(cwd)
    assert (run_dir / "checkpoint" / "LATEST").exists()

    resumed = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"run_dir: {run_dir}" in resumed.stdout  # the same command found the same run dir
    reference = subprocess.run(cmd, cwd=ref_cwd, env=env(), capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-2000:]

    got, want = metric_rows(run_dir), metric_rows(run_dir_of(ref_cwd))
    assert [r["round"] for r in got] == list(range(1, ROUNDS + 1))
    assert got == want
    model = torch.load(run_dir / "model.pt", weights_only=True)
    ref_model = torch.load(run_dir_of(ref_cwd) / "model.pt", weights_only=True)
    assert all(torch.equal(model[k], ref_model[k]) for k in ref_model)

    if algorithm == "scaffold":  # rerunning a finished command changes nothing and trains no more rounds
        again = subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=300)
        assert again.returncode == 0 and metric_rows(run_dir) == want


def test_resume_refuses_a_changed_config(tmp_path):
    common = ("rounds=2", "checkpoint_every=1", "train.epochs=1")
    run_experiment(compose_config(*common), tmp_path)
    with pytest.raises(ValueError, match=r"train\.lr: 0\.05 -> 0\.1"):
        build(compose_config(*common, "train.lr=0.1"), tmp_path)
    exp = build(compose_config(*common, "resume=never"), tmp_path)  # starts over
    assert exp.simulation.start_round == 0 and not (tmp_path / "checkpoint").exists()
    exp.engine.close()
    run_experiment(compose_config(*common), tmp_path)
    whole = (tmp_path / "config.yaml").read_text()
    (tmp_path / "config.yaml").write_text(whole[: whole.index("\n", len(whole) // 2)] + "\n  - [torn")
    with pytest.raises(ConfigError, match=rf"resume: {tmp_path / 'config.yaml'} is not readable YAML .*resume=never"):
        build(compose_config(*common), tmp_path)


def test_resume_of_a_named_directory_needs_an_earlier_run_with_the_same_config(tmp_path):
    """resume=<dir> names an earlier run: a directory without one (a typo, or resume=true read as a path
    'True') is refused instead of starting a fresh run there; one made with another config is refused even
    without a checkpoint, instead of being overwritten; the same config reruns in place."""
    with pytest.raises(ValueError, match=r"holds no earlier run \(no config.yaml\) \(resume is not a switch"):
        build(compose_config("rounds=1", "resume=true"), tmp_path / "True")
    with pytest.raises(ValueError, match=r"resume=.*fresh: .* holds no earlier run"):
        build(compose_config("rounds=1", f"resume={tmp_path / 'fresh'}"), tmp_path / "fresh")
    earlier = tmp_path / "earlier"
    run_experiment(compose_config("rounds=1", "seed=3"), earlier)  # no checkpoint_every: no checkpoint
    with pytest.raises(ValueError, match=r"the run in .*earlier was made with a different config \(seed: 3 -> 4\)"):
        build(compose_config("rounds=1", "seed=4", f"resume={earlier}"), earlier)
    assert json.loads((earlier / "summary.json").read_text())["rounds"] == 1
    exp = build(compose_config("rounds=1", "seed=3", f"resume={earlier}"), earlier)
    exp.engine.close()


@pytest.mark.ray
def test_ray_distributed_state_resumes_in_process(ray_session, tmp_path):
    """A checkpointed Ray run abandoned mid-way (no clean shutdown of its stores) resumes exactly."""
    base = ("algorithm=scaffold", "rounds=4", "checkpoint_every=2", "train.epochs=1", "clients_per_round=12",
            "engine.num_workers=2", "engine.state_store=distributed", "engine.threads_per_worker=1")
    common = (*base, "engine=ray")
    reference = run_experiment(compose_config(*base, "engine=inline"), tmp_path / "ref")
    exp = build(compose_config(*common), tmp_path / "run")
    for r in range(3):  # round 3 is lost: the checkpoint is after round 2
        exp.simulation.history.append({**exp.simulation.run_round(r), "wall_time_s": 0.0})
        exp.simulation.metrics.append(exp.simulation.history[-1])
        exp.simulation.after_round(r)
    for actor in exp.engine.pool:  # die without flushing anything
        ray_session.kill(actor, no_restart=True)
    summary = run_experiment(compose_config(*common), tmp_path / "run")
    assert summary["final_test_accuracy"] == reference["final_test_accuracy"]
    assert metric_rows(tmp_path / "run") == metric_rows(tmp_path / "ref")


@pytest.mark.ray
def test_interrupted_ray_run_resumes_exactly(ray_session, tmp_path):
    """A Ray run interrupted after logging round 3 (checkpointed after round 2): the resumed run drops
    that row, reruns from the checkpoint of round 2 and ends equal to an uninterrupted run."""
    base = ("algorithm=fedavg", "algorithm.server_momentum=0.9", "rounds=5", "checkpoint_every=2",
            "train.epochs=1", "clients_per_round=12", "engine.threads_per_worker=1")
    reference = run_experiment(compose_config(*base, "engine=inline"), tmp_path / "ref")
    common = (*base, "engine=ray", "engine.num_workers=1")
    exp = build(compose_config(*common), tmp_path / "run", reporter=StopAfter(3))
    try:
        with pytest.raises(KeyboardInterrupt):
            exp.simulation.run()
    finally:
        exp.engine.close()
    assert len(metric_rows(tmp_path / "run")) == 3
    summary = run_experiment(compose_config(*common), tmp_path / "run")
    assert summary["final_test_accuracy"] == reference["final_test_accuracy"]
    assert metric_rows(tmp_path / "run") == metric_rows(tmp_path / "ref")
