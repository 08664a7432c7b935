#!/usr/bin/env python
"""bf16 against fp32: FedAvg on digits (the default run: 100 non-IID clients, 10 per round, 30 rounds,
MLP), both precisions on the same seeds, through the platform's Python API (the CLI's code path).

Prints each seed's final test accuracy at fp32 and bf16 and the paired difference (bf16 - fp32) with
its 95% t-interval; the acceptance of issue 25 is a mean difference within 1 point. Writes the table
to docs/benchmarks.md (section "precision") and the raw rows to docs/results/bench_precision.json.

    python scripts/bench/precision.py                       # 5 seeds, ~15 min on 2 busy cores
    python scripts/bench/precision.py --seeds 0,1 --no-write
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import add_output_args, hardware_line, write_section

PRECISIONS = ("fp32", "bf16")


def final_accuracy(seed: int, precision: str, extra: list[str]) -> tuple[float, float, float]:
    """(final test accuracy, final test loss, wall seconds) of the default digits FedAvg run at ``precision``."""
    from fl_platform import api

    t0 = time.perf_counter()
    result = api.run([f"seed={seed}", f"train.precision={precision}", "save_model=false", *extra])
    last = [row for row in result.history if "test_loss" in row][-1]
    return float(result.summary["final_test_accuracy"]), float(last["test_loss"]), time.perf_counter() - t0


def interval(diffs: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t-interval of the paired differences."""
    from scipy.stats import t

    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, float("nan"), float("nan")
    half = t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / len(diffs) ** 0.5
    return mean, mean - half, mean + half


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma list of seeds (pairs)")
    p.add_argument("overrides", nargs="*", help="extra overrides for both runs (e.g. rounds=10)")
    add_output_args(p, "precision")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # both precisions on the same single-thread kernels, steadier on shared cores
    seeds = [int(s) for s in args.seeds.split(",") if s]
    rows = []
    for seed in seeds:
        row: dict = {"seed": seed}
        for precision in PRECISIONS:  # interleaved: load changes hit both sides of a pair alike
            row[precision], row[f"{precision}_loss"], row[f"{precision}_s"] = final_accuracy(seed, precision,
                                                                                             args.overrides)
        rows.append(row)
        print(f"seed {seed}: fp32 {row['fp32']:.4f}  bf16 {row['bf16']:.4f}  diff {row['bf16'] - row['fp32']:+.4f}  "
              f"test loss {row['fp32_loss']:.5f} / {row['bf16_loss']:.5f}  "
              f"({row['fp32_s']:.0f} s, {row['bf16_s']:.0f} s)", flush=True)
    mean, lo, hi = interval([100 * (r["bf16"] - r["fp32"]) for r in rows])
    summary = f"bf16 - fp32: {mean:+.2f} points, 95% CI [{lo:+.2f}, {hi:+.2f}] over {len(rows)} seeds"
    print(summary)
    if args.no_write:
        return 0
    cmd = "python scripts/bench/precision.py" + "".join(f" {o}" for o in args.overrides)
    lines = [f"`{cmd}` (FedAvg, digits, MLP, the default 100 clients / 10 per round / 30 rounds; "
             f"1 torch thread; {hardware_line()})", "",
             "| seed | fp32 accuracy | bf16 accuracy | bf16 - fp32 (points) | fp32 test loss | bf16 test loss "
             "| fp32 s | bf16 s |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['seed']} | {r['fp32']:.4f} | {r['bf16']:.4f} | {100 * (r['bf16'] - r['fp32']):+.2f} | "
              f"{r['fp32_loss']:.5f} | {r['bf16_loss']:.5f} | {r['fp32_s']:.0f} | {r['bf16_s']:.0f} |" for r in rows]
    lines += ["", f"Mean paired difference {mean:+.2f} points, 95% t-interval [{lo:+.2f}, {hi:+.2f}]."]
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({"command": cmd, "rows": rows}, indent=1) + "\n")
    write_section(args.doc, "precision", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
