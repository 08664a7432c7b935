#!/usr/bin/env python
"""Scheduler benchmark: learned-speed LPT against round-robin with one worker slowed.

Two workers, worker 1 slowed ``--slow-factor`` times (the test-only
``engine.fault_injection.slow_worker``: it sleeps (factor - 1) x each client's measured training
time, so its clients really take that much longer). Each (system, policy) runs in a fresh process:

* ``ray2``: ``engine=ray engine.num_workers=2`` (the workers train in parallel: the round lasts
  as long as the slowest worker, the makespan);
* ``inline2``: ``engine=inline engine.num_workers=2`` (the workers run one after the other: the
  round lasts the sum of their busy times, so a plan that gives the slow worker less work still
  shortens it, but the makespan is not the round).

Reported per row, over rounds 2..R (round 1 calibrates the runtime model: before it both workers
count as equally fast): the mean round time, the mean predicted makespan of the plan
(``sched_predicted_s``, from the runtime model before the round) against the measured one
(``sched_makespan_s``, the slowest worker's busy time), the balance (max / mean busy time), the
slow worker's share of the samples, and the final accuracy (equal between the policies: the
schedule changes only timing).

    python scripts/bench/scheduler.py                  # writes its section of docs/benchmarks.md
    python scripts/bench/scheduler.py --systems inline2 --rounds 4 --no-write
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_output_args, fmt, hardware_line, parse_systems, run_child, write_section

SYSTEMS = {"ray2": ["engine=ray", "engine.num_workers=2"], "inline2": ["engine=inline", "engine.num_workers=2"]}
POLICIES = ["lpt", "round_robin"]
# FedAvg on Synthetic(0.5, 0.5), devices of 20-400 samples (lognormal sizes, capped), MLP, 2 epochs:
# rounds of about a second, long against the timing noise of a shared machine.
WORKLOAD = ["dataset=synthetic", "partition=natural", "model=mlp", "dataset.size_mean=4", "dataset.size_sigma=1",
            "dataset.min_size=20", "dataset.max_size=400", "num_clients=1000", "clients_per_round=100",
            "train.epochs=2", "train.batch_size=10", "train.lr=0.05", "seed=0", "save_model=false",
            "engine.threads_per_worker=1"]


def overrides(system: str, policy: str, rounds: int, slow_factor: float) -> list[str]:
    slow = ["engine.fault_injection.slow_worker=1", f"engine.fault_injection.slow_factor={slow_factor}"] \
        if slow_factor != 1.0 else []
    return [*WORKLOAD, f"rounds={rounds}", f"eval_every={rounds}", *SYSTEMS[system], f"engine.scheduler={policy}",
            *slow]


def child_main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--overrides", required=True, help="JSON list of config overrides")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    from common import compose

    from fl_platform.experiment import build

    exp = build(compose(*json.loads(a.overrides)))
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    keep = ("round_time_s", "sched_predicted_s", "sched_makespan_s", "sched_balance", "sched_busy_s", "sched_work",
            "test_accuracy")
    rows = [{k: row[k] for k in keep if k in row} for row in exp.simulation.history]
    Path(a.out).write_text(json.dumps({"rows": rows}))


def measure(system: str, policy: str, rounds: int, slow_factor: float, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-c", "import scheduler, sys; scheduler.child_main(sys.argv[1:])",
           "--overrides", json.dumps(overrides(system, policy, rounds, slow_factor))]
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0",
           "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
    res = run_child(cmd, timeout, env=env)
    row: dict[str, Any] = {"system": system, "policy": policy, "ok": res.ok}
    if not res.ok:
        row["error"] = res.error
        return row
    hist = res.data["rows"]
    later = hist[1:]  # round 1 calibrates the runtime model

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in later)

    row.update(round_s=mean("round_time_s"), predicted_s=mean("sched_predicted_s"),
               makespan_s=mean("sched_makespan_s"), balance=mean("sched_balance"),
               slow_share=statistics.fmean(r["sched_work"][1] / sum(r["sched_work"]) for r in later),
               accuracy=hist[-1].get("test_accuracy"), rounds=hist)
    return row


def render(rows: list[dict[str, Any]], rounds: int, slow_factor: float) -> str:
    lines = ["## Scheduler: learned-speed LPT vs round-robin, one worker slowed", "",
             f"Measured by `python scripts/bench/scheduler.py` on {hardware_line()}; {time.strftime('%Y-%m-%d')}. "
             "Other work on the machine adds noise.", "",
             "Workload: FedAvg on Synthetic(0.5, 0.5), 1,000 devices of 20-400 samples (`size_mean=4 size_sigma=1 "
             "min_size=20 max_size=400`), 100 per round, MLP 60-128-10, 2 local epochs, batch 10; 2 workers, worker 1 "
             f"slowed {slow_factor:g}x (`engine.fault_injection.slow_worker=1 "
             f"engine.fault_injection.slow_factor={slow_factor:g}`, test only: a sleep of (factor - 1) x each of its "
             f"clients' measured time). {rounds} rounds; means over rounds 2..{rounds} (round 1 calibrates the runtime "
             "model). Predicted: the plan's makespan from the runtime model before the round; measured: the slowest "
             "worker's busy time. Ray's workers train in parallel (the round is the makespan plus the driver's "
             "work); inline's run one after the other (the round is the sum of busy times).", "",
             "| system | scheduler | round (s) | predicted makespan (s) | measured makespan (s) | predicted / measured "
             "| balance (max/mean) | slow worker's samples | accuracy |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['system']} | {r['policy']} | failed: {r['error'].splitlines()[-1][:80]} "
                         "| | | | | | |")
            continue
        lines.append(f"| {r['system']} | {r['policy']} | {fmt(r['round_s'], 3)} | {fmt(r['predicted_s'], 3)} | "
                     f"{fmt(r['makespan_s'], 3)} | {fmt(r['predicted_s'] / r['makespan_s'], 2)} | "
                     f"{fmt(r['balance'], 2)} | {100 * r['slow_share']:.0f} % | {fmt(r['accuracy'], 4)} |")
    by = {(r["system"], r["policy"]): r for r in rows if r["ok"]}
    lines.append("")
    for system in SYSTEMS:
        lpt, rr = by.get((system, "lpt")), by.get((system, "round_robin"))
        if lpt and rr:
            lines.append(f"- {system}: LPT's round {lpt['round_s'] / rr['round_s']:.2f}x round-robin's, makespan "
                         f"{lpt['makespan_s'] / rr['makespan_s']:.2f}x; accuracy equal: "
                         f"{'yes' if lpt['accuracy'] == rr['accuracy'] else 'NO'}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per (system, policy) process")
    add_output_args(p, "scheduler")
    a = p.parse_args()
    systems = parse_systems(p, a.systems, SYSTEMS)
    if a.rounds < 2:
        p.error("--rounds must be >= 2 (round 1 calibrates)")
    if a.slow_factor <= 1.0:
        p.error("--slow-factor must be > 1")
    rows = []
    for system in systems:
        for policy in POLICIES:
            print(f"[bench] {system} {policy} ...", flush=True)
            row = measure(system, policy, a.rounds, a.slow_factor, a.timeout)
            print(f"[bench] {system} {policy}: " + (f"round {fmt(row['round_s'])} s, predicted "
                  f"{fmt(row['predicted_s'])} s, makespan {fmt(row['makespan_s'])} s" if row["ok"] else row["error"]),
                  flush=True)
            rows.append(row)
    text = render(rows, a.rounds, a.slow_factor)
    print(text)
    if not a.no_write:
        a.results.parent.mkdir(parents=True, exist_ok=True)
        a.results.write_text(json.dumps({"rows": rows, "slow_factor": a.slow_factor}, indent=1))
        write_section(a.doc, "scheduler", text)


if __name__ == "__main__":
    main()
