"""scripts/plot.py: accuracy bands stay in [0, 1] and a round axis has whole-round ticks only."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import plot


def fake_run(seed: int, accuracies: list[float]) -> dict:
    rows = [{"round": r + 1, "test_accuracy": a, "test_loss": 3.0 - a} for r, a in enumerate(accuracies)]
    return {"path": Path(f"s{seed}"), "config": {"algorithm.name": "fedavg", "seed": seed}, "rows": rows,
            "summary": {"final_test_accuracy": accuracies[-1], "rounds": len(accuracies)}}


# three seeds near 1 and near 0 with a wide spread: the unclipped t-band (t_0.975,2 = 4.30) leaves [0, 1]
RUNS = [fake_run(0, [0.02, 0.90, 0.99]), fake_run(1, [0.30, 0.99, 0.70]), fake_run(2, [0.01, 0.60, 1.00])]


def test_accuracy_bands_are_clipped_to_0_1_and_other_metrics_are_not():
    curve = plot.curves({"fedavg": RUNS}, "round", "test_accuracy")["fedavg"]
    ys = np.array([[r["test_accuracy"] for r in run["rows"]] for run in RUNS])
    half = np.array([plot.mean_ci(list(col))[1] for col in ys.T])
    raw_lo, raw_hi = ys.mean(axis=0) - half, ys.mean(axis=0) + half
    assert raw_lo.min() < 0 and raw_hi.max() > 1  # the case the clipping is for
    np.testing.assert_allclose(curve["lo"], np.clip(raw_lo, 0, 1), rtol=0, atol=1e-12)
    np.testing.assert_allclose(curve["hi"], np.clip(raw_hi, 0, 1), rtol=0, atol=1e-12)
    assert curve["lo"].min() == 0.0 and curve["hi"].max() == 1.0
    loss = plot.curves({"fedavg": RUNS}, "round", "test_loss")["fedavg"]  # not a fraction: left as it is
    np.testing.assert_allclose(loss["hi"], 3.0 - raw_lo, rtol=0, atol=1e-12)
    np.testing.assert_allclose(loss["lo"], 3.0 - raw_hi, rtol=0, atol=1e-12)


def test_a_round_axis_has_whole_round_ticks():
    fig = plot.figure({"fedavg": RUNS}, "round", "test_accuracy", None)
    ax = fig.axes[0]
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks  # 3 rounds: no 1.5, 2.5
    fig.clf()


def _write_run(path: Path, seed: int, accuracies: list[float]) -> None:
    import json

    path.mkdir(parents=True)
    (path / "config.yaml").write_text(f"algorithm:\n  name: fedavg\nseed: {seed}\n")
    (path / "metrics.jsonl").write_text("".join(json.dumps({"round": r + 1, "test_accuracy": a}) + "\n"
                                                for r, a in enumerate(accuracies)))
    (path / "summary.json").write_text(json.dumps({"final_test_accuracy": accuracies[-1], "rounds": len(accuracies)}))


def test_an_unreadable_run_is_named_and_left_out_and_none_readable_is_an_error(tmp_path, capsys):
    _write_run(tmp_path / "sweep" / "0", 0, [0.5, 0.6])
    _write_run(tmp_path / "sweep" / "1", 1, [0.4, 0.7])
    (tmp_path / "sweep" / "1" / "summary.json").write_text('{"final_test')  # torn by another tool
    assert plot.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "plots")]) == 0
    out, err = capsys.readouterr()
    assert f"warning: skipped {tmp_path / 'sweep' / '1'}: unreadable (JSONDecodeError" in err
    assert "| fedavg | 1 | 60.00 |" in out and "1 unreadable run(s) left out" in out
    (tmp_path / "sweep" / "0" / "metrics.jsonl").unlink()
    assert plot.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "plots")]) == 1
    assert "none of the 2 run directories" in capsys.readouterr().err


def test_a_summary_without_rounds_is_named_and_skipped_before_anything_is_written(tmp_path, capsys):
    _write_run(tmp_path / "sweep" / "0", 0, [0.5, 0.6])
    _write_run(tmp_path / "sweep" / "1", 1, [0.4, 0.7])
    (tmp_path / "sweep" / "1" / "summary.json").write_text('{"final_test_accuracy": 0.7}')  # no 'rounds'
    assert plot.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "plots")]) == 0
    out, err = capsys.readouterr()
    assert f"warning: skipped {tmp_path / 'sweep' / '1'}: unreadable (ValueError: " \
        f"{tmp_path / 'sweep' / '1' / 'summary.json'} has no integer 'rounds')" in err
    assert "| fedavg | 1 | 60.00 |" in out and (tmp_path / "plots" / "table.md").is_file()
