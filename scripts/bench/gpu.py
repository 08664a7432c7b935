"""ResNet-18 on CIFAR-shaped data on GPUs: rounds per minute and worker busy fraction (issue 25, item 10).

CIFAR-shaped synthetic images (3x32x32, 10 classes; ``common.write_cifar_like``, written as CIFAR-10
batches and read by the real loader), the platform's ResNet-18 (``model=resnet18``, width 64), 100
IID clients, 40 per round, 1 local epoch at batch 32, ``engine=ray``; one cell per (workers per GPU
in {1, 2}) x (``train.precision`` in {fp32, bf16}), each a run of its own (the engine starts and stops
its Ray). Per cell, over the rounds after the first (warm-up: cuDNN's autotuner, CUDA contexts) and
before the last (it evaluates on the 10,000 test images): the median round time, rounds per minute
(60 / that), the median ``worker_busy_frac`` and ``sched_balance``; and the first round's time and
the evaluation's. Writes ``docs/results/bench_gpu.json`` and the "GPU benchmark" section of
``docs/benchmarks.md``.

    python scripts/bench/gpu.py                        # needs CUDA; the table into docs/benchmarks.md
    python scripts/bench/gpu.py --no-write --rounds 4
    python scripts/bench/gpu.py --cpu-dry-run          # a tiny version on this CPU: proves the script, no numbers

Without CUDA it refuses (exit code 2), except ``--cpu-dry-run``: ResNet-18 at width 8, 8 clients, 4
per round, 1 round, the Ray workers on the CPU (``engine.device=cpu``, as many as the cells would put
on one GPU); it prints the table and writes nothing.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_output_args, compose, hardware_line, write_cifar_like, write_section

PRECISIONS = ("fp32", "bf16")
PER_GPU = (1, 2)


def overrides(root: Path, a: argparse.Namespace, per_gpu: int, gpus: int, precision: str) -> list[str]:
    out = ["dataset=cifar10", f"dataset.root={root}", "model=resnet18", f"model.width={a.width}", "partition=iid",
           f"num_clients={a.clients}", f"clients_per_round={a.clients_per_round}", f"rounds={a.rounds}",
           f"eval_every={a.rounds}", "train.epochs=1", f"train.batch_size={a.batch_size}",
           f"train.precision={precision}", "engine=ray", f"engine.num_workers={per_gpu * gpus}",
           # A GPU worker's CPU only launches kernels (docs/engine.md, Threads): half a CPU each leaves
           # room for 2 workers per GPU on a machine with as many cores as GPUs x 2.
           "engine.cpus_per_worker=0.5", "engine.threads_per_worker=1", "save_model=false", "seed=0"]
    if a.cpu_dry_run:
        out.append("engine.device=cpu")
    return out


def measure(root: Path, a: argparse.Namespace, per_gpu: int, gpus: int, precision: str) -> dict:
    from fl_platform.experiment import build

    exp = build(compose(*overrides(root, a, per_gpu, gpus, precision)))
    t0 = time.perf_counter()
    try:
        rows_of_workers = exp.engine.describe_workers()
        exp.simulation.run()
    finally:
        exp.engine.close()
    wall = time.perf_counter() - t0
    history = exp.simulation.history
    rows = history[1:-1] or history  # not the warm-up, not the evaluating round (all of them for short runs)
    round_s = statistics.median(r["round_time_s"] for r in rows)
    return {"per_gpu": per_gpu, "workers": per_gpu * gpus, "gpus": gpus, "precision": precision,
            "rounds": len(history), "rows_used": len(rows), "round_s": round_s, "rounds_per_min": 60.0 / round_s,
            "busy_frac": statistics.median(r["worker_busy_frac"] for r in rows),
            "sched_balance": statistics.median(r["sched_balance"] for r in rows),
            "first_round_s": history[0]["round_time_s"], "eval_s": history[-1].get("eval_time_s"),
            "accuracy": history[-1].get("test_accuracy"), "wall_s": wall,
            "devices": sorted({w["device"] for w in rows_of_workers}),
            "gpu_ids": sorted({",".join(w["gpu_ids"]) for w in rows_of_workers})}


def table(cells: list[dict], a: argparse.Namespace, command: str) -> str:
    lines = [
        "## GPU benchmark (scripts/bench/gpu.py)", "",
        f"`{command}`: CIFAR-shaped synthetic images (3x32x32, 10 classes, {a.train_images} training and "
        f"{a.test_images} test images), ResNet-18 at width {a.width}, {a.clients} IID clients, "
        f"{a.clients_per_round} per round, 1 local epoch at batch {a.batch_size}, `engine=ray` with 1 and 2 workers "
        f"per GPU, `train.precision` fp32 and bf16; medians over the rounds after the first (warm-up) and before "
        f"the last (it evaluates). {hardware_line()}. {a.note}".rstrip(), "",
        "| workers per GPU | workers | precision | round (s) | rounds / min | `worker_busy_frac` | `sched_balance` "
        "| first round (s) | evaluation (s) |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cells:
        if "error" in c:
            lines.append(f"| {c['per_gpu']} | {c['workers']} | {c['precision']} | failed: {c['error'][:120]} "
                         f"| | | | | |")
            continue
        ev = f"{c['eval_s']:.2f}" if c["eval_s"] is not None else "n/a"
        lines.append(f"| {c['per_gpu']} | {c['workers']} | {c['precision']} | {c['round_s']:.3f} "
                     f"| {c['rounds_per_min']:.1f} | {c['busy_frac']:.3f} | {c['sched_balance']:.3f} "
                     f"| {c['first_round_s']:.2f} | {ev} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--clients-per-round", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--train-images", type=int, default=50000)
    p.add_argument("--test-images", type=int, default=10000)
    p.add_argument("--per-gpu", default=",".join(map(str, PER_GPU)), help="workers per GPU, comma list")
    p.add_argument("--precisions", default=",".join(PRECISIONS), help="comma list of fp32, bf16")
    p.add_argument("--note", default="", help="a sentence for the doc (e.g. that the machine was shared)")
    p.add_argument("--cpu-dry-run", action="store_true",
                   help="a tiny version on the CPU (width 8, 8 clients, 1 round): proves the script, writes nothing")
    add_output_args(p, "gpu")
    a = p.parse_args(argv)
    import torch

    if a.cpu_dry_run:
        a.width, a.clients, a.clients_per_round, a.rounds = 8, 8, 4, 1
        a.train_images, a.test_images, a.no_write = 400, 100, True
        gpus = 1  # the cells' worker counts for one GPU, on the CPU
    elif not torch.cuda.is_available():
        print(f"error: scripts/bench/gpu.py measures GPUs and sees none (torch {torch.__version__}, "
              f"torch.version.cuda={torch.version.cuda}, torch.cuda.is_available() is False). Run it on a machine "
              f"with a GPU and a CUDA build of torch; --cpu-dry-run checks the script on the CPU.", file=sys.stderr)
        return 2
    else:
        gpus = torch.cuda.device_count()
    precisions = [s for s in a.precisions.split(",") if s]
    bad = sorted(set(precisions) - set(PRECISIONS))
    if bad:
        p.error(f"--precisions: unknown {bad}; choose from {', '.join(PRECISIONS)}")
    per_gpu = [int(s) for s in a.per_gpu.split(",") if s]
    cells: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="fl-bench-gpu-") as tmp:
        write_cifar_like(Path(tmp), train=a.train_images, test=a.test_images)
        for k in per_gpu:
            for precision in precisions:
                print(f"[bench] {k} worker(s) per GPU x {gpus} GPU(s), {precision} ...", flush=True)
                try:
                    cell = measure(Path(tmp), a, k, gpus, precision)
                except Exception as err:  # one failed cell is a row saying so; the exit code says it too
                    cell = {"per_gpu": k, "workers": k * gpus, "gpus": gpus, "precision": precision,
                            "error": f"{type(err).__name__}: {err}"}
                print(f"[bench] {json.dumps(cell)}", flush=True)
                cells.append(cell)
    command = "python scripts/bench/gpu.py" + (" --cpu-dry-run" if a.cpu_dry_run else "")
    if not a.cpu_dry_run and a.rounds != 6:
        command += f" --rounds {a.rounds}"
    text = table(cells, a, command)
    print(text)
    if not a.no_write:
        a.results.parent.mkdir(parents=True, exist_ok=True)
        a.results.write_text(json.dumps({"hardware": hardware_line(), "cells": cells}, indent=1) + "\n")
        write_section(a.doc, "gpu", text)
    return 1 if any("error" in c for c in cells) else 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
