"""GPU placement with Ray's declared GPUs on a CPU-only machine: every W/G places and runs (no hang),
the driver's evaluation share is accounted, unpackable shares are refused, and a start-up that
cannot place its actors ends after engine.start_timeout_s with an error naming what is missing.

The cases run in a subprocess (tests/gpu_placement_cases.py): each needs a Ray instance of its own
with GPUs declared, which this test process (holding the session's Ray) cannot start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def cases() -> dict[str, dict]:
    names = ["3/2", "4/2", "8/8", "3/2/eval", "unpackable", "pending", "failed_start"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(HERE / "gpu_placement_cases.py"), *names], capture_output=True,
                          text=True, timeout=900, env=env, cwd=HERE.parent)
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            out[row.pop("case")] = row
    assert set(out) == set(names), proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


@pytest.mark.ray
@pytest.mark.parametrize(("case", "share"), [("3/2", 0.5), ("4/2", 0.5), ("8/8", 1.0), ("3/2/eval", 0.5)])
def test_workers_place_on_declared_gpus_and_equal_inline(cases, case, share):
    row = cases[case]
    assert "crash" not in row, row
    assert row["share"] == share
    assert row["max_diff"] <= 1e-6
    if case.endswith("eval"):  # 3 workers + the driver's evaluation: 4 halves of 2 GPUs
        assert row["eval_gpus"] == share
        assert row["eval_device"] == "cpu"  # declared GPUs, no CUDA in this process
    else:
        assert row["eval_gpus"] == 0.0


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
