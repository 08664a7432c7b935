#!/usr/bin/env python
"""Aggregation at scale: what reaches the driver per round, and what the reduction costs, against W.

Each W runs in a fresh process on a local multi-node Ray cluster (``ray.cluster_utils.Cluster``: W
nodes of 1 CPU each, each with its own raylet and object store) with W workers, one per node:
FedAvg, ResNet-18 (width 64, 11.2M parameters) on CIFAR-shaped synthetic images written in
CIFAR-10's format, W clients per round (one per worker), 1 local step of batch 32. Reported, median
over rounds 2..R:

* driver inbound: the tensor bytes the driver received in the round's messages
  (``sched_driver_in_bytes``, counted where the engine unpacks them);
* beyond the slowest worker: the round's time minus the slowest worker's busy time (messages,
  reduction, server step);
* reduction: the time from the last worker's result to the reduced aggregate (``sched_reduce_s``).

All nodes share this machine's cores, so times are indicative; bytes are exact.

    python scripts/bench/aggregation.py                       # W = 1, 2, 4, 8; writes docs/benchmarks.md
    python scripts/bench/aggregation.py --workers 1,2 --rounds 3 --no-write
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_output_args, fmt, hardware_line, run_child, write_section

WORKLOAD = ["dataset=cifar10", "model=resnet18", "model.width=64", "algorithm=fedavg", "train.steps=1",
            "train.batch_size=32", "train.lr=0.05", "eval_batch_size=500", "save_model=false", "seed=0",
            "engine=ray", "engine.threads_per_worker=1"]


def child_main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    import ray
    from common import compose, write_cifar_like
    from ray.cluster_utils import Cluster

    from fl_platform.experiment import build

    with tempfile.TemporaryDirectory(prefix="fl-agg-") as tmp:
        os.environ["RAY_TMPDIR"] = tmp  # this cluster's files stay private
        write_cifar_like(Path(tmp) / "data", train=max(500, 64 * a.workers), test=500)
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                                "object_store_memory": 600 * 2**20})
        for _ in range(a.workers - 1):
            cluster.add_node(num_cpus=1, object_store_memory=600 * 2**20)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        try:
            exp = build(compose(*WORKLOAD, f"dataset.root={Path(tmp) / 'data'}", f"num_clients={4 * a.workers}",
                                f"clients_per_round={a.workers}", f"rounds={a.rounds}", f"eval_every={a.rounds}",
                                f"engine.num_workers={a.workers}"))
            try:
                exp.simulation.run()
            finally:
                exp.engine.close()
            params = exp.simulation.server.weights.numel()
            rows = [{k: row[k] for k in ("round_time_s", "sched_makespan_s", "sched_reduce_s",
                                         "sched_driver_in_bytes") if k in row} for row in exp.simulation.history]
        finally:
            ray.shutdown()
            cluster.shutdown()
    Path(a.out).write_text(json.dumps({"params": params, "rows": rows}))


def measure(workers: int, rounds: int, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-c", "import aggregation, sys; aggregation.child_main(sys.argv[1:])",
           "--workers", str(workers), "--rounds", str(rounds)]
    res = run_child(cmd, timeout, env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    if not res.ok:
        return {"workers": workers, "ok": False, "error": res.error}
    rows = res.data["rows"][1:] or res.data["rows"]
    med = lambda key: statistics.median(r.get(key, float("nan")) for r in rows)  # noqa: E731
    return {"workers": workers, "ok": True, "params": res.data["params"], "driver_in_bytes": med("sched_driver_in_bytes"),
            "beyond_slowest_s": statistics.median(r["round_time_s"] - r["sched_makespan_s"] for r in rows),
            "reduce_s": med("sched_reduce_s"), "round_s": med("round_time_s"), "makespan_s": med("sched_makespan_s")}


def section(results: list[dict[str, Any]], rounds: int) -> str:
    ok = [r for r in results if r["ok"]]
    params = ok[0]["params"] if ok else 0
    lines = ["## Aggregation at scale", "",
             f"`python scripts/bench/aggregation.py` on {hardware_line()}, {time.strftime('%Y-%m-%d')}. W nodes of a "
             "local Ray cluster (`ray.cluster_utils.Cluster`, 1 CPU each, all on this machine's cores), W workers, one "
             f"per node; FedAvg, ResNet-18 ({params / 1e6:.1f}M parameters) on CIFAR-shaped synthetic images, W clients "
             f"per round, 1 local step of batch 32; medians over rounds 2..{rounds}. Before: what the driver received "
             "before partial aggregates were reduced among the workers (W float64 partials, 8 bytes x parameters "
             "each); now: measured (`sched_driver_in_bytes`). Times are indicative (W raylets and W workers share "
             "2 cores); bytes are exact.", "",
             "| W | driver inbound before (MB) | driver inbound now (MB) | beyond the slowest worker (s) | "
             "reduction (s) | slowest worker (s) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if not r["ok"]:
            lines.append(f"| {r['workers']} | failed: {r['error'][:80]} | | | | |")
            continue
        before = 8 * r["params"] * r["workers"]
        lines.append(f"| {r['workers']} | {before / 1e6:.0f} | {r['driver_in_bytes'] / 1e6:.0f} | "
                     f"{fmt(r['beyond_slowest_s'], 2)} | {fmt(r['reduce_s'], 2)} | {fmt(r['makespan_s'], 2)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="1,2,4,8", help="comma list of W")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--timeout", type=float, default=1200)
    add_output_args(p, "aggregation")
    a = p.parse_args(argv)
    results = []
    for w in (int(x) for x in a.workers.split(",")):
        print(f"[bench] aggregation W={w} ...", flush=True)
        results.append(measure(w, a.rounds, a.timeout))
        print(f"[bench] {json.dumps(results[-1])[:300]}", flush=True)
    body = section(results, a.rounds)
    print(body)
    if not a.no_write:
        a.results.write_text(json.dumps(results, indent=1) + "\n")
        write_section(a.doc, "aggregation", body)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
