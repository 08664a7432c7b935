"""The suite passes on a clone with no ``../shared`` beside it.

Every test not marked ``shared_data`` already runs against an empty data root (tests/conftest.py), so
one that reads the shared files without the mark fails in every run. This test runs the marked ones
against an empty root in a child pytest: each must skip, naming the file it missed, or pass on data
it writes itself; none may fail."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def marked_modules() -> list[Path]:
    return sorted(p for p in TESTS.glob("test_*.py") if p.name != Path(__file__).name
                  and "shared_data" in p.read_text())


@pytest.mark.slow
def test_shared_data_tests_skip_or_pass_without_the_shared_data(tmp_path):
    modules = marked_modules()
    assert modules, "no test is marked shared_data: the bare-clone check would check nothing"
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {**os.environ, "FL_DATA_ROOT": str(empty), "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-m", "shared_data", "-p", "no:cacheprovider",
         "-p", "no:xdist", *map(str, modules)],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    summary = out.strip().splitlines()[-1]
    assert "failed" not in summary and "error" not in summary, summary
    skips = re.findall(r"^SKIPPED \[\d+\] .*$", out, flags=re.M)
    assert skips, out[-3000:]  # the real files are absent: something must have skipped
    for line in skips:  # each names the missing file under the empty root
        assert str(empty) in line and "not present" in line, line
