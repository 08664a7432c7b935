#!/usr/bin/env python
"""Turn run directories into accuracy plots (PNG) and a markdown table: per group, the mean over seeds
with its 95% confidence interval (Student's t over the runs of the group).

    python scripts/plot.py multirun/2026-11-30/12-00-00 --out docs/results/example
    python scripts/plot.py outputs/*/* --x bytes_up --metric test_accuracy

Each argument is a run directory (holding summary.json) or a folder searched recursively for
them (a sweep's directory, whatever launcher ran it). Runs that differ only in ``seed`` form one
group (one curve with its 95% band, clipped to [0, 1] for accuracies; one table row); the label lists the config values that differ
between groups. The table gives the final test accuracy and the mean of the last ``--last``
evaluations (steadier when accuracy swings from round to round); the best accuracy over the test
evaluations is not reported, since picking it selects on the test set.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import textwrap
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml

X_AXES = {"round": "round", "bytes_up": "cumulative upload bytes", "bytes_down": "cumulative download bytes",
          "wall_time_s": "wall time (s)", "simulated_time_s": "cumulative simulated time (s)"}
# Per-round fields summed over rounds (wall_time_s is already cumulative in metrics.jsonl).
CUMULATIVE = {"bytes_up", "bytes_down", "simulated_time_s"}


def find_runs(paths: list[str]) -> list[Path]:
    runs: list[Path] = []
    for p in map(Path, paths):
        if (p / "summary.json").exists():
            runs.append(p)
        elif p.is_dir():
            runs.extend(sorted(q.parent for q in p.rglob("summary.json")))
    return runs


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = json.dumps(v) if isinstance(v, list) else v
    return out


def load_run(path: Path) -> dict[str, Any]:
    """One run's config, summary and metric rows; ValueError naming the file whose content is not a run's
    (so the caller skips the run before anything is written)."""
    config = yaml.safe_load((path / "config.yaml").read_text()) if (path / "config.yaml").exists() else {}
    rows = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((path / "summary.json").read_text())
    if not isinstance(config or {}, dict):
        raise ValueError(f"{path / 'config.yaml'} holds a {type(config).__name__}, not a mapping")
    if not isinstance(summary, dict) or not isinstance(summary.get("rounds"), int):
        raise ValueError(f"{path / 'summary.json'} has no integer 'rounds'")
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path / 'metrics.jsonl'} has a line that is not a JSON object")
    return {"path": path, "config": _flatten(config or {}), "summary": summary, "rows": rows}


def _short(key: str) -> str:
    """``algorithm.name`` reads as ``algorithm``; other keys keep their full dotted name."""
    return key.rsplit(".", 1)[0] if key.endswith(".name") else key


def _implied_by_name(key: str, runs: list[dict[str, Any]], varying: list[str]) -> bool:
    """``algorithm.mu`` adds nothing to a label that has ``algorithm`` when it is fixed per algorithm."""
    group = key.rsplit(".", 1)[0]
    name_key = f"{group}.name"
    if key == name_key or name_key not in varying:
        return False
    per_name: dict[str, set[str]] = defaultdict(set)
    for r in runs:
        per_name[str(r["config"].get(name_key))].add(str(r["config"].get(key)))
    return all(len(values) == 1 for values in per_name.values())


def group_runs(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    ignore = {"seed", "logger.progress", "logger.wandb"}
    keys = sorted({k for r in runs for k in r["config"]} - ignore)
    varying = [k for k in keys if len({str(r["config"].get(k)) for r in runs}) > 1]
    varying = [k for k in varying if not _implied_by_name(k, runs, varying)]
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        label = ", ".join(f"{_short(k)}={r['config'].get(k)}" for k in varying) \
            or str(r["config"].get("algorithm.name", r["path"].name))
        groups[label].append(r)
    return dict(sorted(groups.items()))


def _series(run: dict[str, Any], x: str, metric: str) -> tuple[list[float], list[float]]:
    xs, ys, acc = [], [], 0.0
    for row in run["rows"]:
        acc = acc + row.get(x, 0) if x in CUMULATIVE else row.get(x)
        if row.get(metric) is not None and acc is not None:
            xs.append(float(acc))
            ys.append(float(row[metric]))
    return xs, ys


def mean_ci(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width of its ``level`` confidence interval by Student's t); half-width nan for n < 2."""
    if not values:
        return float("nan"), float("nan")
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, float("nan")
    from scipy.stats import t

    return mean, float(t.ppf(0.5 + level / 2, len(values) - 1)) * statistics.stdev(values) / len(values) ** 0.5


def last_k_mean(run: dict[str, Any], k: int, metric: str = "test_accuracy") -> float | None:
    values = [row[metric] for row in run["rows"] if row.get(metric) is not None]
    return statistics.fmean(values[-k:]) if values else None


def _fmt(mean: float, half: float) -> str:
    if mean != mean:
        return "-"
    return f"{100 * mean:.2f} ± {100 * half:.2f}" if half == half else f"{100 * mean:.2f}"


def table(groups: dict[str, list[dict[str, Any]]], last: int = 5) -> str:
    lines = ["Mean over seeds ± half-width of its 95% confidence interval (Student's t); accuracies in %.", "",
             f"| runs | seeds | final test accuracy | mean of the last {last} evaluations | rounds |",
             "|---|---|---|---|---|"]
    for label, runs in groups.items():
        final = [r["summary"]["final_test_accuracy"] for r in runs if r["summary"].get("final_test_accuracy") is not None]
        lastk = [v for v in (last_k_mean(r, last) for r in runs) if v is not None]
        rounds = sorted({r["summary"]["rounds"] for r in runs})
        lines.append(f"| {label} | {len(runs)} | {_fmt(*mean_ci(final))} | {_fmt(*mean_ci(lastk))} | "
                     f"{','.join(map(str, rounds))} |")
    return "\n".join(lines) + "\n"


def curves(groups: dict[str, list[dict[str, Any]]], x: str, metric: str) -> dict[str, dict[str, Any]]:
    """Per group: ``xs``, the ``mean`` over seeds, ``n`` and, for n > 1, the 95% band ``lo``/``hi`` of the
    mean. An accuracy's band is clipped to [0, 1]: Student's t is symmetric, accuracy is not."""
    import numpy as np

    out: dict[str, dict[str, Any]] = {}
    for label, runs in groups.items():
        series = [_series(r, x, metric) for r in runs]
        series = [s for s in series if s[0]]
        if not series:
            continue
        n = min(len(s[0]) for s in series)
        ys = np.array([s[1][:n] for s in series])
        curve: dict[str, Any] = {"xs": np.mean([s[0][:n] for s in series], axis=0), "mean": ys.mean(axis=0),
                                 "n": len(series)}
        if len(series) > 1:
            half = np.array([mean_ci(list(col))[1] for col in ys.T])
            lo, hi = curve["mean"] - half, curve["mean"] + half
            if "accuracy" in metric:
                lo, hi = np.clip(lo, 0.0, 1.0), np.clip(hi, 0.0, 1.0)
            curve.update(lo=lo, hi=hi)
        out[label] = curve
    return out


def figure(groups: dict[str, list[dict[str, Any]]], x: str, metric: str, title: str | None) -> Any:
    """The plot as a matplotlib figure: one curve per group with its 95% band; whole-round ticks on a round axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, c in curves(groups, x, metric).items():
        ax.plot(c["xs"], c["mean"], label=f"{label} (n={c['n']})")
        if "lo" in c:  # the 95% confidence band of the mean over seeds
            ax.fill_between(c["xs"], c["lo"], c["hi"], alpha=0.2)
    if x == "round":
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no round 1.5
    ax.set_xlabel(X_AXES.get(x, x))
    ax.set_ylabel(metric.replace("_", " "))
    if title:
        ax.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=10)  # long titles wrap, never cut
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot(groups: dict[str, list[dict[str, Any]]], out: Path, x: str, metric: str, title: str | None) -> Path:
    import matplotlib.pyplot as plt

    fig = figure(groups, x, metric, title)
    path = out.with_suffix(".png") if out.suffix else out / f"{metric}_vs_{x}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="run directories or folders containing them")
    ap.add_argument("--out", default="plots", help="output folder (or a .png path)")
    ap.add_argument("--metric", default="test_accuracy")
    ap.add_argument("--x", default="round", choices=sorted(X_AXES), help="x axis")
    ap.add_argument("--title", default=None)
    ap.add_argument("--last", type=int, default=5, help="evaluations averaged for the table's last-k column")
    args = ap.parse_args(argv)
    paths = find_runs(args.paths)
    if not paths:
        print(f"error: no run directories (with summary.json) under {args.paths}", file=sys.stderr)
        return 1
    runs = []
    for p in paths:  # a run dir another tool tore or emptied is named and left out, never read half
        try:
            runs.append(load_run(p))
        except (OSError, ValueError, yaml.YAMLError) as err:
            print(f"warning: skipped {p}: unreadable ({type(err).__name__}: {err})", file=sys.stderr)
    if not runs:
        print(f"error: none of the {len(paths)} run directories under {args.paths} could be read", file=sys.stderr)
        return 1
    groups = group_runs(runs)
    out = Path(args.out)
    png = plot(groups, out, args.x, args.metric, args.title)
    md = table(groups, args.last)
    table_path = (out.parent if out.suffix else out) / "table.md"
    table_path.write_text(md)
    print(md)
    print(f"plot: {png}\ntable: {table_path}" + (f"\n{len(paths) - len(runs)} unreadable run(s) left out (warnings "
                                                   "above)" if len(runs) < len(paths) else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
