"""scripts/bench/ab.py's summary: the paired ratio this / base and its interval over log ratios."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench"


@pytest.fixture(scope="module")
def ab():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_ab", BENCH / "ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ratio_is_the_geometric_mean_of_this_over_base(ab):
    # Ratios 1.1 and 1.21 (this slower): geometric mean 1.1 * sqrt(1.1) = 1.1537.
    text = ab.summary([(0.010, 0.011), (0.004, 0.00484)])
    assert "ratio this / base 1.154" in text
    assert "median rounds 7.00 ms (base) and 7.92 ms (this)" in text


def test_interval_from_the_log_ratios(ab):
    pairs = [(1.0, r) for r in (1.0, 1.1, 1.2, 1.3)]
    logs = [math.log(r) for _, r in pairs]
    mean = sum(logs) / 4
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / 3)
    lo, hi = math.exp(mean - 3.182446 * sd / 2), math.exp(mean + 3.182446 * sd / 2)  # t(0.975, 3)
    assert f"[{lo:.3f}, {hi:.3f}]" in ab.summary(pairs)
    assert "too few" in ab.summary([(1.0, 1.1)])


def test_sets_of_the_same_code_are_pooled(ab):
    # b1 and b2 are one code (a docs-only commit between them), c is another.
    code = {"a": "A", "b1": "B", "b2": "B", "c": "C"}.get
    one = {"config": "100/10", "overrides": ["engine=ray"], "base_commit": "a"}
    sets = [{**one, "this_commit": "b1", "pairs": [[1.0, 1.1], [1.0, 1.2]]},
            {**one, "this_commit": "b2", "pairs": [[1.0, 1.3]]},
            {**one, "this_commit": "c", "pairs": [[1.0, 0.9]]},
            {**one, "config": "1000/100", "this_commit": "b2", "pairs": [[1.0, 1.0]]}]
    (label, pairs), = ab.pools(sets, code)
    assert label == "100/10 engine=ray, a -> b1 = b2"
    assert pairs == [(1.0, 1.1), (1.0, 1.2), (1.0, 1.3)]


def test_code_identity_is_the_code_folders_trees(ab, tmp_path):
    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    git("config", "user.email", "t@example.org")
    git("config", "user.name", "t")
    commits = []
    for path, text in (("fl_platform/x.py", "a = 1\n"), ("docs/n.md", "note\n"), ("fl_platform/x.py", "a = 2\n")):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
        git("add", "-A")
        git("commit", "-q", "-m", path)
        commits.append(git("rev-parse", "--short", "HEAD"))
    first, docs, changed = (ab.code_of(c, tmp_path) for c in commits)
    assert first == docs != changed
    assert ab.code_of("0000000", tmp_path) == "0000000"  # not in the repository: the commit itself
