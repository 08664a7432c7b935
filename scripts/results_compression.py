#!/usr/bin/env python
"""BAOW vs FedAvg + Top-k (uniform ratio, equal average bytes) vs FedAvg -> docs/results/compression.md.

    nice -n 10 python scripts/results_compression.py             # 3 seeds (about 10 min of 1 CPU core)
    python scripts/results_compression.py --quick                # a 2-minute check of the whole script

Fashion-MNIST (the IDX files under the data root), Dirichlet(alpha=0.1) over 100 clients, 10 per
round, an MLP (784-128-10), one local epoch, and ``system=heterogeneous`` (uplinks log-uniform over
0.2-20 Mbit/s, a 100x range; each downlink 10x its uplink; compute log-normal around 1000
samples/s; 50 ms latency per transfer). Every method sees the same clients, devices and data.

Methods (all without error feedback, the card's BAOW default, so the Top-k baselines match it):
  fedavg       uncompressed FedAvg
  topk_equal   FedAvg + layer-wise Top-k with one ratio for every client, chosen so that the mean
               upload per client equals BAOW's (computed exactly from the seeds' sampled clients and
               bandwidths before any training, and checked against the runs' logged bytes)
  baow         BAOW: BCRS ratios rho_k = min(1, rho0 b_k / b_min) and OPWA aggregation
  topk_rho0    FedAvg + Top-k at BAOW's straggler ratio rho0 (same straggler bytes, fewer in total)
  baow_plain   BAOW's ratios with plain FedAvg division instead of OPWA (ablation)
  baow_cap2    BAOW with OPWA's amplification capped at 2x (gamma_max = 2, the card's safeguard)
Run directories go to outputs/results/compression/ (not committed); tables and plots to docs/results/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

import plot  # noqa: E402
import torch  # noqa: E402
from common import compose, write_section  # noqa: E402
from fl_platform.algorithms.baow import keep_ratios  # noqa: E402

from fl_platform.compression.topk import TopK  # noqa: E402
from fl_platform.experiment import run_experiment  # noqa: E402
from fl_platform.models import build_model  # noqa: E402
from fl_platform.rounds.sampling import sample_clients  # noqa: E402
from fl_platform.system.model import build_system  # noqa: E402
from fl_platform.training.flat import FlatModel  # noqa: E402

COMMON = ["dataset=fashion_mnist", "model=mlp", "model.hidden=[128]", "partition=dirichlet", "partition.alpha=0.1",
          "num_clients=100", "clients_per_round=10", "train.epochs=1", "train.batch_size=32", "train.lr=0.05",
          "system=heterogeneous", "save_model=false"]
LABELS = {"fedavg": "FedAvg (dense)", "topk_equal": "FedAvg + Top-k, uniform ratio, BAOW's mean bytes",
          "baow": "BAOW (BCRS + OPWA)", "topk_rho0": "FedAvg + Top-k at rho0", "baow_plain": "BAOW ratios, plain averaging",
          "baow_cap2": "BAOW, OPWA capped at gamma_max = 2"}


def method_overrides(method: str, rho0: float, rho_equal: float) -> list[str]:
    topk = ["compressor=topk", "compressor.error_feedback=false", "compressor.index=auto"]
    return {"fedavg": ["algorithm=fedavg"],
            "topk_equal": ["algorithm=fedavg", *topk, f"compressor.ratio={rho_equal:.6f}"],
            "topk_rho0": ["algorithm=fedavg", *topk, f"compressor.ratio={rho0}"],
            "baow": ["algorithm=baow", f"algorithm.rho0={rho0}"],
            "baow_plain": ["algorithm=baow", f"algorithm.rho0={rho0}", "algorithm.aggregation=plain"],
            "baow_cap2": ["algorithm=baow", f"algorithm.rho0={rho0}", "algorithm.gamma_max=2"]}[method]


def topk_bytes(slots, ratio: float) -> int:
    """One client's layer-wise Top-k upload (int32 indices or bitmap, whichever is smaller)."""
    return sum(TopK(ratio).payload_nbytes(s.numel) if s.is_param else 4 * s.numel for s in slots)


def baow_mean_bytes(cfg, slots, seeds: list[int], rounds: int, rho0: float) -> float:
    """BAOW's mean upload per client over these seeds and rounds, from the sampled clients' bandwidths."""
    total = count = 0
    for seed in seeds:
        system = build_system(cfg.system, seed)
        for r in range(rounds):
            clients = sample_clients(seed, r, cfg.num_clients, cfg.clients_per_round)
            ratios = keep_ratios(rho0, {c: system.uplink_bandwidth(c, r) for c in clients})
            total += sum(topk_bytes(slots, rho) for rho in ratios.values())
            count += len(clients)
    return total / count


def equal_bytes_ratio(slots, target: float) -> float:
    """The uniform Top-k ratio whose per-client upload is closest to ``target`` bytes (bisection)."""
    lo, hi = 1e-5, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if topk_bytes(slots, mid) < target:
            lo = mid
        else:
            hi = mid
    return lo if abs(topk_bytes(slots, lo) - target) <= abs(topk_bytes(slots, hi) - target) else hi


def run_all(methods: list[str], seeds: list[int], rounds: int, rho0: float, rho_equal: float, runs: Path,
            force: bool) -> dict[str, list[Path]]:
    out: dict[str, list[Path]] = {m: [] for m in methods}
    for seed in seeds:
        for m in methods:
            path = runs / f"{m}_s{seed}"
            out[m].append(path)
            if (path / "summary.json").exists() and not force:
                continue
            t0 = time.perf_counter()
            cfg = compose(*COMMON, f"rounds={rounds}", f"seed={seed}", *method_overrides(m, rho0, rho_equal))
            s = run_experiment(cfg, path)
            print(f"{m:11s} seed {seed}: final acc {s['final_test_accuracy']:.4f}  ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    return out


def run_minutes(runs: dict[str, list[Path]]) -> float:
    total = 0.0
    for paths in runs.values():
        for p in paths:
            s = json.loads((p / "summary.json").read_text())
            total += s.get("wall_time_s", 0.0) + s.get("setup_time_s", 0.0)
    return total / 60


def series(path: Path, x: str) -> tuple[list[float], list[float]]:
    return plot._series(plot.load_run(path), x, "test_accuracy")


def time_to_target(path: Path, x: str, target: float) -> float | None:
    xs, ys = series(path, x)
    return next((xv for xv, yv in zip(xs, ys) if yv >= target), None)


def _ms(values: list[float], fmt: str = "{:.1f}") -> str:
    if not values:
        return "n/a"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{fmt.format(statistics.fmean(values))} ± {fmt.format(sd)}"


def summarise(runs: dict[str, list[Path]], targets: list[float]) -> tuple[str, dict[str, Any]]:
    lines = ["| method | final acc (%) | mean acc, last 50 rounds (%) | round-to-round std, last 50 (points) | "
             "simulated time, all rounds (s) | slowest upload, summed over rounds (s) | upload / client / round (KiB) | "
             "upload spread max/min (median) |",
             "|---|---|---|---|---|---|---|---|"]
    stats: dict[str, Any] = {}
    for m, paths in runs.items():
        rows = [plot.load_run(p)["rows"] for p in paths]
        final = [100 * r[-1]["test_accuracy"] for r in rows]
        last = [100 * statistics.fmean(x["test_accuracy"] for x in r[-50:]) for r in rows]
        swing = [100 * statistics.stdev(x["test_accuracy"] for x in r[-50:]) for r in rows]
        sim = [sum(x["simulated_time_s"] for x in r) for r in rows]
        up = [sum(x["sim_upload_max_s"] for x in r) for r in rows]
        per_client = [sum(x["bytes_up"] for x in r) / sum(x["num_clients"] for x in r) / 1024 for r in rows]
        spread = [statistics.median(x["sim_upload_max_s"] / x["sim_upload_min_s"] for x in r) for r in rows]
        stats[m] = {"per_client_bytes": statistics.fmean(per_client) * 1024, "sim_total": sim}
        lines.append(f"| {LABELS[m]} | {_ms(final)} | {_ms(last)} | {_ms(swing)} | {_ms(sim, '{:.0f}')} | {_ms(up, '{:.0f}')} | "
                     f"{_ms(per_client)} | {_ms(spread, '{:.1f}')} |")
    table = "\n".join(lines)
    for target in targets:
        table += (f"\n\nTime and upload to reach {100 * target:.0f}% test accuracy (first evaluation at or above it; "
                  "mean ± std over the seeds that reach it):\n\n"
                  "| method | seeds reaching it | simulated time (s) | cumulative upload (MiB) | rounds |\n"
                  "|---|---|---|---|---|")
        for m, paths in runs.items():
            t = [v for p in paths if (v := time_to_target(p, "simulated_time_s", target)) is not None]
            b = [v / 2**20 for p in paths if (v := time_to_target(p, "bytes_up", target)) is not None]
            rd = [v for p in paths if (v := time_to_target(p, "round", target)) is not None]
            stats[m][f"t{target}"] = t
            table += f"\n| {LABELS[m]} | {len(t)}/{len(paths)} | {_ms(t)} | {_ms(b, '{:.2f}')} | {_ms(rd, '{:.0f}')} |"
    return table, stats


def figures(runs: dict[str, list[Path]], out: Path, smooth: int = 5) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    paths = []
    for x, label, scale in (("simulated_time_s", "cumulative simulated time (s)", 1.0),
                            ("bytes_up", "cumulative upload, all clients (MiB)", 1 / 2**20),
                            ("round", "round", 1.0)):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m, ps in runs.items():
            ss = [series(p, x) for p in ps]
            n = min(len(s[0]) for s in ss)
            xs = np.mean([s[0][:n] for s in ss], axis=0) * scale
            ys = 100 * np.array([s[1][:n] for s in ss])
            if smooth > 1:  # trailing mean over the last ``smooth`` evaluations (the first ones average fewer)
                c = np.cumsum(ys, axis=1)
                c[:, smooth:] = c[:, smooth:] - c[:, :-smooth]
                ys = c / np.minimum(np.arange(1, n + 1), smooth)
            ax.plot(xs, ys.mean(axis=0), label=f"{LABELS[m]} (n={len(ss)})")
            ax.fill_between(xs, ys.mean(axis=0) - ys.std(axis=0), ys.mean(axis=0) + ys.std(axis=0), alpha=0.15)
        if x != "round":
            ax.set_xscale("log")
        ax.set_xlabel(label + (" (log scale)" if x != "round" else ""))
        ax.set_ylabel(f"test accuracy (%), trailing mean of {smooth} rounds" if smooth > 1 else "test accuracy (%)")
        ax.set_title("Fashion-MNIST, Dirichlet(0.1), 100 clients / 10 per round, heterogeneous uplinks")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"accuracy_vs_{x}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--rho0", type=float, default=0.01)
    ap.add_argument("--targets", type=float, nargs="+", default=[0.65, 0.70, 0.75, 0.78])
    ap.add_argument("--methods", nargs="+",
                    default=["fedavg", "topk_equal", "baow", "topk_rho0", "baow_plain", "baow_cap2"],
                    choices=sorted(LABELS))
    ap.add_argument("--quick", action="store_true", help="1 seed, 8 rounds, into outputs/.../quick and /tmp")
    ap.add_argument("--force", action="store_true", help="rerun runs whose summary.json exists")
    ap.add_argument("--runs", type=Path, default=REPO / "outputs" / "results" / "compression")
    ap.add_argument("--doc", type=Path, default=REPO / "docs" / "results" / "compression.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.seeds, args.rounds, args.targets = [0], 8, [0.5]
        args.runs, args.doc = args.runs / "quick", Path("/tmp/results_compression_quick.md")
    torch.set_num_threads(1)  # one core per run: two threads on a shared 2-core machine only spin
    t0 = time.perf_counter()
    cfg = compose(*COMMON, f"rounds={args.rounds}")
    torch.manual_seed(0)
    fm = FlatModel(build_model("mlp", (1, 28, 28), 10, hidden=[128]))
    target_bytes = baow_mean_bytes(cfg, fm.slots, args.seeds, args.rounds, args.rho0)
    rho_equal = equal_bytes_ratio(fm.slots, target_bytes)
    print(f"BAOW mean upload per client {target_bytes / 1024:.1f} KiB -> uniform Top-k ratio {rho_equal:.4f} "
          f"({topk_bytes(fm.slots, rho_equal) / 1024:.1f} KiB); dense {4 * len(fm) / 1024:.1f} KiB", flush=True)
    runs = run_all(args.methods, args.seeds, args.rounds, args.rho0, rho_equal, args.runs, args.force)
    table, stats = summarise(runs, args.targets)
    if "baow" in stats:
        measured = stats["baow"]["per_client_bytes"]
        assert abs(measured - target_bytes) <= 1e-6 * target_bytes, (measured, target_bytes)
    figs = figures(runs, args.doc.parent / "compression")
    cmd = "nice -n 10 python scripts/results_compression.py" + ("" if args.seeds == [0, 1, 2] else
                                                                f" --seeds {' '.join(map(str, args.seeds))}")
    body = "\n".join([
        f"Reproduce: `{cmd}`" + (f" `--rounds {args.rounds}`" if args.rounds != 150 else "") +
        f" (seeds {', '.join(map(str, args.seeds))}; the {sum(map(len, runs.values()))} runs took "
        f"{run_minutes(runs):.0f} min of wall time in total on this shared 2-core machine, one torch thread each; "
        "run dirs in `outputs/results/compression/`, reused when present).",
        "",
        f"Setup: `{' '.join(COMMON)} rounds={args.rounds}`; rho0 = {args.rho0}. BAOW's mean upload is "
        f"{target_bytes / 1024:.2f} KiB per client per round (dense: {4 * len(fm) / 1024:.1f} KiB), so the "
        f"equal-bytes uniform Top-k ratio is {rho_equal:.4f}.",
        "",
        table,
        "",
        "Figures: mean over seeds (band: ± one std over seeds) of the test accuracy, a trailing mean over 5 "
        "rounds; x axes are cumulative (log scale for time and bytes).",
        "",
        *[f"![{p.stem}](compression/{p.name})" for p in figs],
    ])
    if not args.doc.exists():
        args.doc.parent.mkdir(parents=True, exist_ok=True)
        args.doc.write_text("# Compression: BAOW vs uniform Top-k vs FedAvg\n")
    write_section(args.doc, "results", body, title="# Compression: BAOW vs uniform Top-k vs FedAvg")
    (args.runs / "stats.json").write_text(json.dumps(stats, indent=1, default=str))
    print(table)
    print(f"wrote {args.doc} and {len(figs)} figures in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
