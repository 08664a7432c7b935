"""Vectorised cohort training benchmark: per-round time of our engine with ``engine.cohort_size``
against the plain sequential loop (the limit of training clients one by one) and our own
sequential path, on the same workload.

Workloads: FedAvg, 1 local epoch, batch 10, SGD lr 0.05, seed 0, on

* ``synthetic-mlp``: the engine benchmark's workload (scripts/bench/engine.py): FedProx
  Synthetic(0.5, 0.5) with devices of about 12 samples (power-law sizes), MLP 60-128-10;
* ``mlp`` and ``cnn``: scikit-learn digits, ``partition=iid``, MLP 64-128-10 and the small CNN
  (conv 32, conv 64, fc 128). With 1,000 clients every client holds 1 or 2 training samples, so one
  local step each (the extreme where per-client bookkeeping outweighs the training); ``100/100``
  (about 14 samples, 2 steps per client) is a second point.

Systems:

* ``plain``: the limit, written here: one process, no framework, the sampled clients trained one
  after another with plain PyTorch (torch.optim.SGD, index batches on tensors), the weighted sum of
  deltas in float64. Same cohorts, shuffles and initial model as ours, so accuracies agree.
* ``sequential``: our engine, ``engine=inline``, ``engine.cohort_size=1``.
* ``vectorised``: our engine, ``engine=inline``, ``engine.cohort_size=auto`` (the whole round's
  clients in one chunk when memory allows).

Each (configuration, model, system) runs in a fresh process (scripts/bench/common.py, shared with the
engine benchmark). Round time: median of rounds 2..R (round 1 includes warm-up: vmap tracing, the
model probe), evaluation excluded (once at the end). Torch intra-op threads: each of ``--threads``
(default ``1,2``: one thread as in the engine benchmark, and both cores of a 2-core machine) for
every system alike. Each row is ``--repeats`` runs (default 3, fresh processes, the three systems
interleaved): the median of the runs' median round times, with their range (this VM's round
times move by 10-50 % from run to run).

    python scripts/bench/vectorised.py          # 108 processes, ~8 min on 2 quiet cores; writes docs/benchmarks.md
    python scripts/bench/vectorised.py --configs 1000/100 --models mlp --threads 1 --rounds 2 --no-write  # ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    REPO,
    fmt,
    hardware_line,
    measure_interleaved,
    median,
    process_age_s,
    run_child,
    spread,
    write_section,
)
from engine import SOURCE as SYNTHETIC  # the engine benchmark's Synthetic devices

CONFIGS: dict[str, dict[str, int]] = {
    "1000/100": {"num_clients": 1000, "clients_per_round": 100},
    "100/100": {"num_clients": 100, "clients_per_round": 100},
}
# workload -> (model, its options, dataset, partition, source options); "synthetic-mlp" is the
# engine benchmark's workload.
MODELS: dict[str, tuple[str, dict[str, Any], str, str, dict[str, Any]]] = {
    "synthetic-mlp": ("mlp", {"hidden": [128]}, "synthetic", "natural", SYNTHETIC),
    "mlp": ("mlp", {"hidden": [128]}, "digits", "iid", {}),
    "cnn": ("cnn", {"channels": [32, 64], "hidden": 128}, "digits", "iid", {}),
}
SYSTEMS = ["plain", "sequential", "vectorised"]
LABELS = {"plain": "plain loop (limit)", "sequential": "ours, sequential (cohort_size=1)",
          "vectorised": "ours, vectorised (cohort_size=auto)"}
TARGETS = {"synthetic-mlp": 5.0, "mlp": 5.0, "cnn": 3.0}  # vectorised speed-up over the plain loop (issue 8), at 1000/100
LR, BATCH, SEED = 0.05, 10, 0


def our_overrides(config: str, model: str, rounds: int, device: str) -> list[str]:
    c = CONFIGS[config]
    name, options, dataset, partition, source = MODELS[model]
    opts = [f"model.{k}={json.dumps(v).replace(' ', '')}" for k, v in options.items()]
    return [f"dataset={dataset}", f"partition={partition}", *(f"dataset.{k}={v}" for k, v in source.items()),
            f"model={name}", *opts,
            f"num_clients={c['num_clients']}", f"clients_per_round={c['clients_per_round']}",
            f"rounds={rounds}", f"eval_every={rounds}", "train.epochs=1", f"train.batch_size={BATCH}",
            f"train.lr={LR}", "train.optimizer=sgd", f"seed={SEED}", "save_model=false",
            f"engine.device={device}"]


# ----------------------------------------------------------------------------- the plain loop


def child_plain(config: str, model_name: str, rounds: int, device: str) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from fl_platform.datasets.federated import build_federated_dataset
    from fl_platform.models import build_model
    from fl_platform.rounds.sampling import sample_clients
    from fl_platform.seeding import Stream, seed_torch_global, torch_generator

    c = CONFIGS[config]
    dev = torch.device(device)
    name, options, dataset, partition, source = MODELS[model_name]
    data = build_federated_dataset(dataset, num_clients=c["num_clients"], partition_name=partition, seed=SEED,
                                   source_options=dict(source)).to(dev)
    seed_torch_global(SEED, Stream.INIT)  # the same initial weights as our engine's
    model = build_model(name, tuple(data.input_shape), data.num_classes, **options).to(dev)
    params = [t for t in model.state_dict().values() if t.is_floating_point()]
    startup = process_age_s()
    times = []
    for r in range(rounds):
        t0 = time.perf_counter()
        start = [p.detach().clone() for p in params]
        acc = [torch.zeros_like(p, dtype=torch.float64) for p in params]
        total = 0
        for cid in sample_clients(SEED, r, c["num_clients"], c["clients_per_round"]):
            with torch.no_grad():
                for p, s in zip(params, start):
                    p.copy_(s)
            x, y, idx = data.client_view(cid)  # its row block, labels and rows in it
            n = idx.numel()
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            order = idx[torch.randperm(n, generator=torch_generator(SEED, Stream.SHUFFLE, r, cid)).to(dev)]
            model.train()
            for lo in range(0, n, BATCH):
                b = order[lo : lo + BATCH]
                opt.zero_grad()
                F.cross_entropy(model(x.index_select(0, b)), y.index_select(0, b)).backward()
                opt.step()
            with torch.no_grad():
                for a, p, s in zip(acc, params, start):
                    a.add_((p - s).double(), alpha=n)
            total += n
        with torch.no_grad():
            for p, s, a in zip(params, start, acc):
                p.copy_(s + (a / total).float())
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    model.eval()
    with torch.inference_mode():
        accuracy = float((model(data.test_x).argmax(1) == data.test_y).float().mean())
    return {"startup_s": startup, "round_s": times, "accuracy": accuracy}


# ----------------------------------------------------------------------------- our engine


def child_ours(system: str, config: str, model: str, rounds: int, device: str) -> dict[str, Any]:
    from common import compose

    from fl_platform.experiment import build

    cohort = {"sequential": "1", "vectorised": "auto"}[system]
    exp = build(compose(*our_overrides(config, model, rounds, device), f"engine.cohort_size={cohort}"))
    startup = process_age_s()
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    hist = exp.simulation.history
    return {"startup_s": startup, "round_s": [row["round_time_s"] for row in hist],
            "accuracy": hist[-1]["test_accuracy"]}


# ----------------------------------------------------------------------------- driver


def child_main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    for name in ("--system", "--config", "--model", "--device", "--out"):
        p.add_argument(name, required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    if a.system == "plain":
        result = child_plain(a.config, a.model, a.rounds, a.device)
    else:
        result = child_ours(a.system, a.config, a.model, a.rounds, a.device)
    Path(a.out).write_text(json.dumps(result))


def measure(system: str, config: str, model: str, rounds: int, threads: int, device: str,
            timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, "-c", "import vectorised, sys; vectorised.child_main(sys.argv[1:])",
           "--system", system, "--config", config, "--model", model, "--rounds", str(rounds),
           "--threads", str(threads), "--device", device]
    env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    load = os.getloadavg()[0]  # other work on the machine when this row was measured
    res = run_child(cmd, timeout, env=env)
    row: dict[str, Any] = {"system": system, "config": config, "model": model, "ok": res.ok,
                           "peak_rss_mb": res.peak_rss / 2**20, "threads": threads, "device": device,
                           "load": load}
    if not res.ok:
        row["error"] = res.error
        return row
    times = res.data["round_s"]
    row.update(startup_s=res.data["startup_s"], round_s=times,
               median_round_s=median(times[1:]) if len(times) > 1 else times[0], accuracy=res.data["accuracy"])
    return row


def render(rows: list[dict[str, Any]], rounds: int, threads: list[int], device: str) -> str:
    by = {(r["config"], r["model"], r["system"], r["threads"]): r for r in rows}
    lines = ["## Vectorised cohort training vs the plain sequential loop", "",
             f"Measured by `python scripts/bench/vectorised.py` on {hardware_line()}; {time.strftime('%Y-%m-%d')}; "
             f"device {device}. Other work on the machine adds noise.", "",
             "Workloads: FedAvg, 1 local epoch, batch 10, SGD lr 0.05. `synthetic-mlp` is the engine benchmark's "
             "(FedProx Synthetic(0.5, 0.5), devices of about 12 samples, MLP 60-128-10); `mlp` and `cnn` use "
             "scikit-learn digits (iid): MLP 64-128-10 and the small CNN (conv 32, conv 64, fc 128). With digits at "
             "1000/100 each client holds 1-2 samples (one local step: per-client bookkeeping outweighs the "
             "training), at 100/100 about 14 (two steps). Round time: median of rounds "
             f"2..{rounds}, evaluation excluded, median over the runs (fresh processes, systems interleaved), "
             "with the runs' range in ms. Speed-up: plain-loop round time / this system's. Load: the "
             "machine's 1-minute load average when the row's last run started (2 cores: above 2, other work "
             "competed).", "",
             "| clients | model | threads | system | runs | round (s) | range (ms) | speed-up vs plain | peak RSS (MB) "
             "| accuracy | load |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    verdicts = []
    for config in CONFIGS:
        for model in MODELS:
            for t in threads:
                limit = by.get((config, model, "plain", t))
                for system in SYSTEMS:
                    r = by.get((config, model, system, t))
                    if r is None:
                        continue
                    if not r["ok"]:
                        lines.append(f"| {config} | {model} | {t} | {LABELS[system]} | failed | | | | | | |")
                        continue
                    speedup = (limit["median_round_s"] / r["median_round_s"]
                               if limit and limit.get("ok") and r["median_round_s"] else None)
                    lines.append(f"| {config} | {model} | {t} | {LABELS[system]} | {r.get('repeats', 1)} | "
                                 f"{fmt(r['median_round_s'], 4)} | {spread(r)} | "
                                 f"{fmt(speedup, 1)} | {r['peak_rss_mb']:.0f} | {fmt(r['accuracy'], 4)} | "
                                 f"{fmt(r.get('load'), 1)} |")
                    if system == "vectorised" and config == "1000/100" and speedup is not None:
                        goal = TARGETS[model]
                        verdicts.append(f"- {config} {model}, {t} thread(s): vectorised >= {goal:g}x faster than the "
                                        f"plain loop: {'met' if speedup >= goal else 'NOT met'} ({speedup:.1f}x)")
    if verdicts:
        lines += ["", "Targets (issue 8):", "", *verdicts]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="runs of each (config, model, threads, system)")
    p.add_argument("--threads", default="1,2", help="comma list of torch intra-op thread counts (each for all systems)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per (config, model, system) process")
    p.add_argument("--results", type=Path, default=REPO / "docs" / "results" / "bench_vectorised.json",
                   help="raw results (JSON); merged with earlier runs of the same settings")
    p.add_argument("--doc", type=Path, default=REPO / "docs" / "benchmarks.md")
    p.add_argument("--no-write", action="store_true", help="print the table, do not touch the results or the doc")
    a = p.parse_args()
    choices = {"configs": CONFIGS, "models": MODELS, "systems": SYSTEMS}
    picked = {k: [x for x in getattr(a, k).split(",") if x] for k in choices}
    for key, values in picked.items():
        for v in values:
            if v not in choices[key]:
                p.error(f"--{key}: unknown {v!r}; choose from {', '.join(choices[key])}")
    if a.rounds < 2:
        p.error("--rounds must be >= 2 (round 1 is warm-up)")
    try:
        threads = [int(t) for t in a.threads.split(",") if t]
    except ValueError:
        p.error(f"--threads: a comma list of positive integers, got {a.threads!r}")
    if not threads or min(threads) < 1:
        p.error(f"--threads: a comma list of positive integers, got {a.threads!r}")
    same = {"rounds": a.rounds, "device": a.device}
    old: list[dict[str, Any]] = []
    if not a.no_write and a.results.exists():
        old = [r for r in json.loads(a.results.read_text())["rows"] if all(r.get(k) == v for k, v in same.items())]
    rows = {(r["config"], r["model"], r["system"], r["threads"]): r for r in old}
    for config in picked["configs"]:
        for model in picked["models"]:
            for t in threads:
                combined = measure_interleaved(
                    f"{config} {model} {t} thread(s)", picked["systems"], lambda _s: a.repeats,
                    lambda s, config=config, model=model, t=t: measure(s, config, model, a.rounds, t, a.device,
                                                                       a.timeout))
                for system, row in combined.items():
                    rows[(config, model, system, t)] = {**row, **same}
                if not a.no_write:
                    a.results.parent.mkdir(parents=True, exist_ok=True)
                    a.results.write_text(json.dumps({"rows": list(rows.values())}, indent=1))
    all_threads = sorted({r["threads"] for r in rows.values()})
    text = render(list(rows.values()), a.rounds, all_threads, a.device)
    print(text)
    if not a.no_write:
        write_section(a.doc, "vectorised", text)


if __name__ == "__main__":
    main()
