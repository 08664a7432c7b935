"""The device check's own logic on the CPU (scripts/gpu_smoke.py, scripts/bench/gpu.py; issue 25 item 10).

The checks themselves need a GPU (``--cpu-dry-run`` runs their code on the CPU, a few minutes: left to
the script). Here, in about a second: the worker-placement assertion fails on every way a GPU run can
be wrong (a CPU worker, a worker without or with two GPU ids, an idle GPU, an uneven spread), and both
scripts refuse, with exit code 2 and a message saying why, where no CUDA is visible.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")


def load(name: str, path: Path):
    sys.path.insert(0, str(SCRIPTS / "bench"))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke():
    return load("gpu_smoke", SCRIPTS / "gpu_smoke.py")


def rows(*where: tuple[str, list[str]]) -> list[dict]:
    return [{"worker": w, "node": "n1 (host)", "device": dev, "gpu_ids": ids} for w, (dev, ids) in enumerate(where)]


def test_workers_spread_over_distinct_gpus_pass(smoke, tmp_path):
    t = smoke.Target(False, 2, tmp_path)
    assert "2 distinct GPU ids" in smoke.check_workers(rows(("cuda:0", ["0"]), ("cuda:0", ["1"])), t, 2)
    four = rows(("cuda:0", ["0"]), ("cuda:0", ["1"]), ("cuda:0", ["0"]), ("cuda:0", ["1"]))
    assert "2 distinct GPU ids" in smoke.check_workers(four, t, 4)


@pytest.mark.parametrize(("where", "words"), [
    ((("cuda:0", ["0"]), ("cpu", ["1"])), "does not train on cuda"),
    ((("cuda:0", ["0"]), ("cuda:0", [])), "not exactly one GPU id"),
    ((("cuda:0", ["0"]), ("cuda:0", ["0", "1"])), "not exactly one GPU id"),
    ((("cuda:0", ["0"]), ("cuda:0", ["0"])), "1 distinct GPUs used by 2 workers on 2 GPUs"),
    ((("cuda:0", ["0"]),), "1 workers described, 2 asked for"),
])
def test_a_wrong_placement_fails_the_check(smoke, tmp_path, where, words):
    with pytest.raises(smoke.CheckFailed, match=words):
        smoke.check_workers(rows(*where), smoke.Target(False, 2, tmp_path), 2)


def test_an_uneven_spread_fails_the_check(smoke, tmp_path):
    uneven = rows(("cuda:0", ["0"]), ("cuda:0", ["0"]), ("cuda:0", ["0"]), ("cuda:0", ["1"]))
    with pytest.raises(smoke.CheckFailed, match="not even"):
        smoke.check_workers(uneven, smoke.Target(False, 2, tmp_path), 4)


def test_dry_run_expects_cpu_workers_without_gpu_ids(smoke, tmp_path):
    t = smoke.Target(True, 2, tmp_path)
    assert smoke.check_workers(rows(("cpu", []), ("cpu", [])), t, 2) == "all 2 on cpu, no GPU ids"
    with pytest.raises(smoke.CheckFailed, match="holds GPU ids"):
        smoke.check_workers(rows(("cpu", []), ("cpu", ["0"])), t, 2)


def test_checks_after_a_broken_cuda_context_are_failed_without_running(smoke, capsys):
    """A device-side error is sticky: the checks after it are reported as not run, naming where the
    context broke, instead of each failing with the same error (the first device run read 11 failures)."""
    ran = []

    def check(name, error=None):
        def run():
            ran.append(name)
            if error:
                raise RuntimeError(error)
            return "ok"
        return name, run

    chosen = [check("a"), check("b", "wrong value"), check("c", "CUDA error: misaligned address"), check("d")]

    def context_error():  # broken from the moment check c raised
        return "AcceleratorError: CUDA error: misaligned address" if "c" in ran else None

    assert smoke.run_checks(chosen, context_error) == ["b", "c", "d"]
    assert ran == ["a", "b", "c"]  # d was not run
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("PASS a") and out[1].startswith("FAIL b") and out[2].startswith("FAIL c")
    assert out[3] == ("FAIL d (0 s): not run: the CUDA context of this process was lost in c (AcceleratorError: "
                      "CUDA error: misaligned address); run it alone with --only d")


@no_cuda
def test_the_smoke_refuses_without_cuda(smoke, capsys):
    assert smoke.main([]) == 2
    out = capsys.readouterr().out
    assert out.startswith("FAIL cuda: no CUDA device visible") and "--cpu-dry-run" in out


@no_cuda
def test_the_gpu_benchmark_refuses_without_cuda(capsys):
    bench = load("bench_gpu", SCRIPTS / "bench" / "gpu.py")
    assert bench.main(["--no-write"]) == 2
    err = capsys.readouterr().err
    assert "measures GPUs and sees none" in err and "--cpu-dry-run" in err
