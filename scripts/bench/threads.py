#!/usr/bin/env python
"""The thread cliff: the same inline run with torch's default intra-op threads and with one, on the
machine as it is and beside busy processes (docs/engine.md, "Threads"; docs/benchmarks.md).

Each configuration runs ``python -m fl_platform.run`` (digits, 10 rounds, inline, no evaluation but
the last round's) in a fresh process; the figure is the sum of the rounds' ``round_time_s``
(training and aggregation, no start-up). Configurations are interleaved rep by rep so that other load
on a shared machine falls on all of them alike; the 1-minute load average before each run is shown.
The busy processes are this script's own (``while True: pass``), stopped by their PIDs at the end.

    python scripts/bench/threads.py                       # 3 reps; threads: torch's default (cores), 1, auto
    python scripts/bench/threads.py --busy 2 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
RUN = ("rounds=10", "eval_every=100", "save_model=false", "logger.progress=false", "engine=inline")


def one_run(threads: str, extra: list[str], timeout: float) -> float | None:
    """Seconds of the rounds (sum of round_time_s); None when it ran past ``timeout``."""
    with tempfile.TemporaryDirectory() as d:
        setting = [] if threads == "auto" else [f"engine.threads_per_worker={threads}"]
        cmd = [sys.executable, "-m", "fl_platform.run", *RUN, *setting, *extra, f"hydra.run.dir={d}/run"]
        try:
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        rows = [json.loads(line) for line in (Path(d) / "run" / "metrics.jsonl").read_text().splitlines()]
        return sum(r["round_time_s"] for r in rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--busy", type=int, default=2, help="busy processes beside the run in the loaded case")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per run before it counts as > timeout")
    p.add_argument("--threads", nargs="+", default=[str(torch.get_num_threads()), "1", "auto"],
                   help="engine.threads_per_worker values ('auto': the platform's default)")
    p.add_argument("extra", nargs="*", help="more overrides for every run")
    a = p.parse_args()
    results: dict[tuple[str, str], list[float | None]] = {}
    loads: dict[str, list[float]] = {"as is": [], f"+{a.busy} busy": []}
    for rep in range(a.reps):
        for load in loads:
            busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)] \
                if load != "as is" else []
            try:
                time.sleep(1.0 if busy else 0.0)
                for threads in a.threads:
                    loads[load].append(os.getloadavg()[0])
                    seconds = one_run(threads, a.extra, a.timeout)
                    results.setdefault((load, threads), []).append(seconds)
                    print(f"rep {rep} {load:>8} threads={threads:>4}: "
                          f"{'> timeout' if seconds is None else f'{seconds:.2f} s'}", flush=True)
            finally:
                for proc in busy:  # ours only, by PID
                    proc.kill()
                    proc.wait()
    print(f"\ncores: {os.cpu_count()}, torch default threads: {torch.get_num_threads()}, torch {torch.__version__}")
    print("| machine | threads_per_worker | rounds' time, median [min, max] (s) | 1-min load before runs |")
    print("|---|---|---|---|")
    for (load, threads), values in results.items():
        done = [v for v in values if v is not None]
        text = (f"{statistics.median(done):.2f} [{min(done):.2f}, {max(done):.2f}]" if len(done) == len(values)
                else f"{len(values) - len(done)} of {len(values)} runs > {a.timeout:.0f}")
        print(f"| {load} | {threads} | {text} | {statistics.median(loads[load]):.1f} |")


if __name__ == "__main__":
    main()
