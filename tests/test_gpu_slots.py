"""One GPU per parallel job slot (fl_platform/gpu_slots.py): the results scripts' ``--jobs N`` hand each
running job its own GPU id; the joblib launcher's worker processes are tested in tests/test_sweeps.py."""

from __future__ import annotations

import sys
import threading

import pytest

from fl_platform.gpu_slots import slot_gpu, visible_gpus

from .conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
import results_common as rc


def test_visible_gpus_reads_cuda_visible_devices_and_deals_slots_round_robin():
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}) == ["2", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == [] == visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"})
    assert [slot_gpu(s, ["2", "5"]) for s in range(5)] == ["2", "5", "2", "5", "2"]


@pytest.mark.parametrize(("visible", "jobs", "expect"), [("0,1,2", 3, {"0", "1", "2"}), ("0,1", 4, {"0", "1"}),
                                                         (None, 2, {None})])
def test_each_running_job_has_its_own_gpu(monkeypatch, tmp_path, visible, jobs, expect):
    """8 jobs, ``jobs`` at a time: no two running jobs share a slot; with as many GPUs as slots no two
    share a GPU; every GPU is used; without GPUs the environment is left alone (None)."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        monkeypatch.setattr(rc, "visible_gpus", lambda: [])
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    lock, running, used, overlaps = threading.Lock(), [], [], []
    started = threading.Barrier(jobs, timeout=60)

    def fake_run_job(job, runs, artefacts, code, threads, gpu=None):
        with lock:
            overlaps.append(list(running))
            running.append(gpu)
            used.append(gpu)
        if job.seed < jobs:
            started.wait()  # the first `jobs` jobs all run at once
        with lock:
            running.remove(gpu)
        return {"cpu_s": 0.0}

    monkeypatch.setattr(rc, "run_job", fake_run_job)
    rc.run_jobs([rc.Job(f"cell{i}", i, []) for i in range(8)], tmp_path, tmp_path / "artefacts", (tmp_path, "x"), jobs)
    assert set(used) == expect
    if visible is not None and len(visible.split(",")) >= jobs:
        assert all(gpu not in before for gpu, before in zip(used, overlaps))


def test_a_job_is_started_seeing_only_its_gpu(monkeypatch, tmp_path):
    seen = {}

    class Started(Exception):
        pass

    def fake_popen(cmd, cwd, env, stdout, stderr):
        seen.update(env)
        raise Started

    monkeypatch.setattr(rc.subprocess, "Popen", fake_popen)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    with pytest.raises(Started):
        rc.run_job(rc.Job("cell", 0, []), tmp_path / "runs", tmp_path / "artefacts", (tmp_path, "x"), 1, gpu="3")
    assert seen["CUDA_VISIBLE_DEVICES"] == "3"
