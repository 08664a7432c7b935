"""scripts/bench/ab.py's summary: the paired ratio this / base and its interval over log ratios."""

from __future__ import annotations

import importlib.util
import math
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
