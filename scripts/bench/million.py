#!/usr/bin/env python
"""A million registered clients: start-up time by phase and peak memory against the data's own bytes.

FedAvg on FedProx Synthetic(0.5, 0.5) with 1,000,000 devices of a few samples each
(``size_mean=1 size_sigma=1 min_size=10``, the small devices of docs/engine.md's Scale section:
about 14 samples, 12 for training), 1,000 clients per round, the MLP, 1 local epoch. Systems,
each in a fresh process:

* ``inline``: ``engine=inline`` (one in-process worker);
* ``ray2``: ``engine=ray engine.num_workers=2`` on a 2-node local cluster
  (``ray.cluster_utils.Cluster``, 1 CPU per node, so one worker per node; each node's object
  store receives the dataset once, the training features one row block at a time, and its worker
  reads it there without a copy). The nodes run
  with ``RAY_object_manager_max_bytes_in_flight`` = 256 MiB: Ray's default (2 GiB) buffers up to
  2 GiB per node while the 3.4 GB set-up moves to the second node (measured: 14.3 GB peak PSS
  instead of 11.9 GB, and a slower start).

Memory: the whole process tree (driver, and for Ray the raylets, GCS and workers) sampled every
``--interval`` s: the peak of the summed RSS (memory shared by several processes, such as the
object store mapped by a worker, counted in each) and of the summed PSS (shared pages divided
among the processes sharing them: the physical memory), also per node. The data's own bytes:
training and test features and labels plus the partition's two arrays. Start-up phases (timed by
wrapping the functions the run calls): process start and imports, generating the data,
partitioning, wrapping it as tensors, starting the engine (Ray: the actors and shipping the data;
the cluster itself is started before and timed apart), the rest of the set-up; then the rounds.

    python scripts/bench/million.py                                   # writes its section of docs/benchmarks.md
    python scripts/bench/million.py --clients 100000 --systems inline --no-write
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    PeakRSS,
    add_output_args,
    fmt,
    hardware_line,
    parse_systems,
    process_age_s,
    run_child,
    write_section,
)

SYSTEMS = ["inline", "ray2"]
SOURCE = {"size_mean": 1, "size_sigma": 1, "min_size": 10}
MB = 2**20
IN_FLIGHT = 256 * MB  # Ray's object_manager_max_bytes_in_flight for the cluster's nodes (see above)


def overrides(system: str, clients: int, per_round: int, rounds: int) -> list[str]:
    engine = ["engine=inline"] if system == "inline" else ["engine=ray", "engine.num_workers=2"]
    return ["dataset=synthetic", "partition=natural", "model=mlp", *(f"dataset.{k}={v}" for k, v in SOURCE.items()),
            f"num_clients={clients}", f"clients_per_round={per_round}", f"rounds={rounds}", f"eval_every={rounds}",
            "train.epochs=1", "train.batch_size=10", "train.lr=0.05", "seed=0", "save_model=false",
            "engine.threads_per_worker=1", *engine]


PUT = "of which ray.put"  # inside "start the engine": the data (row blocks, then the set-up) into the head's store
MARKS: list[tuple[str, float]] = []  # (phase, time.time() at its end), to line up with the memory timeline


def _timed(phases: dict[str, float], name: str, fn: Any) -> Any:
    """``fn``, adding its run time to ``phases[name]``."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
            MARKS.append((name, time.time()))
    return wrapper


class NodeMemory(PeakRSS):
    """Peak RSS of the tree (as ``PeakRSS``) and peak PSS per group of processes, and of their sum:
    ``driver`` (the measured process), ``node<i>`` (the subtree of the i-th raylet the driver
    started, workers included, in order of creation; node0 also holds the head's other services,
    GCS and monitors)."""

    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(pid, interval)
        self.peak_pss: dict[str, int] = {}
        self.timeline: list[tuple[float, dict[str, int]]] = []  # (time.time(), MB per group)

    def sample(self) -> None:
        import psutil

        super().sample()
        try:
            root = psutil.Process(self.pid)
            children = root.children()
            raylets = sorted((c for c in children if c.name() == "raylet"), key=lambda c: c.create_time())
        except psutil.Error:
            return
        node_of = {c.pid: f"node{raylets.index(c)}" if c in raylets else "node0" for c in children}
        totals: dict[str, int] = {}
        for top in [root, *children]:
            with contextlib.suppress(psutil.Error):
                group = "driver" if top.pid == self.pid else node_of[top.pid]
                procs = [top] if top.pid == self.pid else [top, *top.children(recursive=True)]
                for proc in procs:
                    with contextlib.suppress(psutil.Error):
                        totals[group] = totals.get(group, 0) + proc.memory_full_info().pss
        totals["total"] = sum(totals.values())
        for group, value in totals.items():
            self.peak_pss[group] = max(self.peak_pss.get(group, 0), value)
        self.timeline.append((time.time(), {k: round(v / MB) for k, v in totals.items()}))


def start_cluster(object_store_mb: int) -> Any:
    """A head and a second node, 1 CPU each, started here (and stopped by ``cluster.shutdown``)."""
    import ray
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 1, "object_store_memory": object_store_mb * MB}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    return cluster


def child_main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--system", required=True)
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--per-round", type=int, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    from common import compose

    import fl_platform.experiment as experiment
    from fl_platform.datasets import federated, registry

    phases: dict[str, float] = {"process start and imports": process_age_s()}
    registry.load_source = _timed(phases, "generate the data", registry.load_source)
    federated.make_partition = _timed(phases, "partition", federated.make_partition)
    federated.FederatedDataset.from_source = _timed(phases, "wrap as tensors", federated.FederatedDataset.from_source)
    experiment.make_engine = _timed(phases, "start the engine", experiment.make_engine)
    if a.system == "ray2":
        import ray

        ray.put = _timed(phases, PUT, ray.put)
    cluster = None
    t0 = time.perf_counter()
    if a.system == "ray2":
        cluster = start_cluster(object_store_mb=5000)
        phases["start the 2-node cluster"] = time.perf_counter() - t0
    try:
        t1 = time.perf_counter()
        exp = experiment.build(compose(*overrides(a.system, a.clients, a.per_round, a.rounds)))
        named = sum(v for k, v in phases.items() if k not in ("process start and imports", "start the 2-node cluster", PUT))
        phases["rest of the set-up"] = time.perf_counter() - t1 - named
        startup = process_age_s()
        data, part = exp.data, exp.data.partition
        nbytes = {"train features": sum(b.nbytes for b in data.train_blocks), "train labels": data.train_y.nbytes,
                  "test features": data.test_x.nbytes, "test labels": data.test_y.nbytes,
                  "partition": part.indices.nbytes + part.offsets.nbytes}
        try:
            exp.simulation.run()
            MARKS.append(("the rounds", time.time()))
        finally:
            exp.engine.close()
    finally:
        if cluster is not None:
            import ray

            ray.shutdown()
            cluster.shutdown()
    hist = exp.simulation.history
    result = {"startup_s": startup, "phases": phases, "data_bytes": nbytes, "num_train": data.num_train,
              "num_test": int(data.test_x.shape[0]), "round_s": [r["round_time_s"] for r in hist],
              "eval_s": hist[-1].get("eval_time_s"), "accuracy": hist[-1].get("test_accuracy"), "marks": MARKS}
    Path(a.out).write_text(json.dumps(result))


def measure(system: str, clients: int, per_round: int, rounds: int, interval: float, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-c", "import million, sys; million.child_main(sys.argv[1:])", "--system", system,
           "--clients", str(clients), "--per-round", str(per_round), "--rounds", str(rounds)]
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0",
           "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "RAY_object_manager_max_bytes_in_flight": str(IN_FLIGHT)}
    res = run_child(cmd, timeout, env=env, monitor=lambda pid: NodeMemory(pid, interval))
    pss = {k: v / MB for k, v in res.monitor.peak_pss.items()}
    timeline = res.monitor.timeline
    row: dict[str, Any] = {"system": system, "clients": clients, "per_round": per_round, "ok": res.ok,
                           "peak_rss_mb": res.peak_rss / MB, "peak_pss_mb": pss.get("total", 0.0), "pss_mb": pss,
                           "wall_s": res.wall_s}
    if not res.ok:
        row["error"] = res.error
        return row
    row.update(res.data)
    row["data_mb"] = sum(res.data["data_bytes"].values()) / MB
    row["timeline"] = [(round(t - timeline[0][0], 1), v) for t, v in timeline] if timeline else []
    row["marks"] = [(name, round(t - timeline[0][0], 1)) for name, t in res.data["marks"]] if timeline else []
    # What the run holds while it trains: the largest sample per part from the engine's start to the rounds' end.
    ends = dict(res.data["marks"])
    start, end = ends.get("start the engine"), ends.get("the rounds")
    during = [v for t, v in timeline if start is not None and end is not None and start <= t <= end]
    row["rounds_pss_mb"] = {k: max(v.get(k, 0) for v in during) for k in {k for v in during for k in v}}
    # The head machine: driver and node0 summed per sample, up to the rounds' end (at shutdown the driver
    # alone maps the store's pages for a moment, which moves PSS between parts, not memory).
    row["head_pss_mb"] = max((v.get("driver", 0) + v.get("node0", 0) for t, v in timeline
                              if end is None or t <= end), default=0.0)
    times = res.data["round_s"]
    row["median_round_s"] = statistics.median(times[1:] if len(times) > 1 else times)
    return row


def render(rows: list[dict[str, Any]], rounds: int, baseline_mb: float | None) -> str:
    lines = ["## A million clients: start-up and memory", "",
             f"Measured by `python scripts/bench/million.py` on {hardware_line()}; {time.strftime('%Y-%m-%d')}. "
             "Other work on the machine adds noise.", "",
             "FedAvg on Synthetic(0.5, 0.5), devices of a few samples (`size_mean=1 size_sigma=1 min_size=10`: "
             f"about 14, 12 for training), MLP 60-128-10, 1 local epoch, batch 10, {rounds} rounds (evaluated after the "
             "last). Data: the training and test features and labels plus the partition's two arrays, as one process "
             "holds them. Peak memory of the whole process tree, sampled: RSS summed over the processes (pages shared "
             "by several, such as the object store mapped by a worker, counted in each) and PSS (shared pages divided "
             "among their processes: the physical memory). Start-up: process creation to the start of round 1. Ray: "
             "2 nodes of a local cluster (`ray.cluster_utils.Cluster`, 1 CPU each, one worker per node, nodes run "
             f"with `RAY_object_manager_max_bytes_in_flight={IN_FLIGHT}`); the driver generates the data, the training "
             "features in row blocks of about 64 MiB, and puts them into the head's object store one block at a "
             "time, reading each from the store's copy as soon as it is there (its own freed), then the rest of the "
             "set-up without the test set (the driver's alone); each node's object store holds the data once, read "
             "by its worker without a copy (docs/engine.md, Scale); the cluster's own start is timed apart.", ""]
    clients = rows[0]["clients"] if rows else 1_000_000
    per_round = rows[0]["per_round"] if rows else 1000
    command = " ".join(o for o in overrides("inline", clients, per_round, rounds) if not o.startswith("engine."))
    lines += ["The same run from the command line (inline; add `engine=ray engine.address=<head>` for a cluster):",
              "", "```bash", f"python -m fl_platform.run {command}", "```", ""]
    if baseline_mb:
        lines += [f"An idle process with the platform imported (torch, numpy, Hydra) holds {baseline_mb:.0f} MB "
                  "before any data.", ""]
    lines += ["| system | registered / per round | train + test samples | data (MB) | peak RSS (MB) | x data | "
              "peak PSS (MB) | x data | start-up (s) | of which generating (s) | round (s) |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['system']} | {r['clients']:,} / {r['per_round']:,} | failed: "
                         f"{r['error'].splitlines()[-1][:80]} | | | | | | | | |")
            continue
        d = r["data_mb"]
        lines.append(f"| {r['system']} | {r['clients']:,} / {r['per_round']:,} | {r['num_train']:,} + "
                     f"{r['num_test']:,} | {d:.0f} | {r['peak_rss_mb']:.0f} | {r['peak_rss_mb'] / d:.2f} | "
                     f"{r['peak_pss_mb']:.0f} | {r['peak_pss_mb'] / d:.2f} | {fmt(r['startup_s'], 1)} | "
                     f"{fmt(r['phases'].get('generate the data'), 1)} | {fmt(r['median_round_s'], 3)} |")
    lines += [""]
    for r in rows:
        if not r["ok"]:
            continue
        startup = sum(v for k, v in r["phases"].items() if k != "start the 2-node cluster" and k != PUT)
        parts = ", ".join(f"{k} {v:.1f} s" for k, v in r["phases"].items())
        sizes = ", ".join(f"{k} {v / MB:.0f} MB" for k, v in r["data_bytes"].items())
        share = r["phases"].get("generate the data", 0.0) / startup if startup else 0.0
        lines.append(f"- {r['system']}: start-up {r['startup_s']:.1f} s: {parts}; generating is {100 * share:.0f} % "
                     f"of the run's own start-up. Data: {sizes}.")
        nodes = {k: v for k, v in r["pss_mb"].items() if k.startswith("node")}
        if nodes:
            lines.append(f"- {r['system']}, peak PSS per part (each its own peak): driver {r['pss_mb']['driver']:.0f} MB "
                         f"({r['pss_mb']['driver'] / r['data_mb']:.2f}x data), "
                         + ", ".join(f"{k} {v:.0f} MB ({v / r['data_mb']:.2f}x)" for k, v in nodes.items())
                         + f"; the head machine (driver and node0, summed per sample) {r['head_pss_mb']:.0f} MB "
                         f"({r['head_pss_mb'] / r['data_mb']:.2f}x). The driver's peak counts the data once (the "
                         "blocks not yet shipped, and the object-store pages of those shipped until the head's worker "
                         "maps them too) and the block being copied; node0: the head's raylet (with its object store), "
                         "GCS, monitors and worker; node1: raylet (object store) and worker.")
        during = r.get("rounds_pss_mb") or {}
        if nodes and during:
            d = r["data_mb"]
            held = ", ".join(f"{k} {during[k]:.0f} MB ({during[k] / d:.2f}x)" for k in ("driver", *nodes) if k in during)
            head = during.get("driver", 0) + during.get("node0", 0)
            lines.append(f"- {r['system']}, PSS held while training (the largest sample per part from the engine's start "
                         f"to the last round's end): {held}; the head machine (driver and node0) {head:.0f} MB "
                         f"({head / d:.2f}x), the whole cluster {during.get('total', 0):.0f} MB "
                         f"({during.get('total', 0) / d:.2f}x). The driver reads the head's object-store copy of each "
                         "block once it has put it and its own is freed, so each node holds the data once "
                         "(the store's pages count in the driver's PSS as it wrote them all; its node's worker maps "
                         "only the rows it reads); the test set is the driver's alone.")
    return "\n".join(lines)


def idle_baseline_mb() -> float:
    """RSS of a fresh process that imported what a run imports, before any data."""
    code = ("import json, sys, psutil, fl_platform.experiment, fl_platform.datasets.federated; "
            "json.dump(psutil.Process().memory_info().rss, open(sys.argv[sys.argv.index('--out') + 1], 'w'))")
    res = run_child([sys.executable, "-c", code], 120)
    return float(res.data) / MB if res.ok else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--clients", type=int, default=1_000_000)
    p.add_argument("--per-round", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--interval", type=float, default=0.1, help="seconds between memory samples")
    p.add_argument("--timeout", type=float, default=1800.0)
    add_output_args(p, "million")
    p.add_argument("--dump", type=Path, help="also write the raw rows (memory timelines included) here")
    a = p.parse_args()
    systems = parse_systems(p, a.systems, SYSTEMS)
    if a.rounds < 2:
        p.error("--rounds must be >= 2 (round 1 is warm-up)")
    baseline = idle_baseline_mb()
    rows = []
    for system in systems:
        print(f"[bench] {system} {a.clients}/{a.per_round} ...", flush=True)
        row = measure(system, a.clients, a.per_round, a.rounds, a.interval, a.timeout)
        print(f"[bench] {system}: " + (f"data {row['data_mb']:.0f} MB, peak RSS {row['peak_rss_mb']:.0f} MB, "
                                       f"PSS {row['peak_pss_mb']:.0f} MB "
                                       f"({', '.join(f'{k} {v:.0f}' for k, v in row['pss_mb'].items())}), "
                                       f"start-up {row['startup_s']:.1f} s "
                                       f"{row['phases']}" if row["ok"] else row["error"]), flush=True)
        rows.append(row)
    text = render(rows, a.rounds, baseline)
    print(text)
    if a.dump:
        a.dump.write_text(json.dumps({"rows": rows, "idle_mb": baseline}, indent=1))
    if not a.no_write:
        a.results.parent.mkdir(parents=True, exist_ok=True)
        kept = [{k: v for k, v in r.items() if k != "timeline"} for r in rows]  # timelines: --dump
        a.results.write_text(json.dumps({"rows": kept, "idle_mb": baseline}, indent=1))
        write_section(a.doc, "million", text)


if __name__ == "__main__":
    main()
