#!/usr/bin/env python
"""S-SGD steps per second with N processes: uncompressed vs PowerSGD vs ACP-SGD vs Top-k.

    python scripts/bench/ssgd.py                       # ResNet-18 (11.2M params), 2 processes, CPU/gloo
    python scripts/bench/ssgd.py --steps 30 --write-docs   # and put the table into docs/benchmarks.md

Starts ``torchrun --nproc-per-node N`` once on loopback; the workers run every method in turn
through the real runtime (``SSGDTrainer``: data layer, FlatModel, DDP + compression hook or the
ACP-SGD wrapper), one metrics row per step. The first ``--warmup`` steps of each method are not
measured (DDP's bucket rebuild after iteration 1, the hooks' two dense steps, allocator warm-up);
test evaluation is off. Reported: steps/s over the measured steps (rank 0's clock; every step ends
in collectives, so ranks are in lock-step), the median step time (robust to load spikes on a
shared machine), and the bytes each worker sends per step (payload, and the ring-model wire bytes).
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

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, hardware_line, write_section

DOCS = REPO / "docs" / "benchmarks.md"
SECTION = "ssgd"  # docs/benchmarks.md keeps it between <!-- ssgd:start --> and <!-- ssgd:end -->


def methods(rank: int, ratio: float) -> dict[str, list[str]]:
    return {
        "S-SGD, DDP all-reduce (no compression)": ["compressor=none"],
        f"PowerSGD rank {rank}, EF, DDP hook (2 all-reduces)": ["compressor=powersgd", f"compressor.rank={rank}"],
        f"ACP-SGD rank {rank}, EF, optimiser wrapper (1 all-reduce)": ["compressor=acpsgd", f"compressor.rank={rank}"],
        f"Top-k {ratio:g} + EF, DDP hook (all-gather)": ["compressor=topk", f"compressor.ratio={ratio}"],
    }


def overrides(args: argparse.Namespace) -> list[str]:
    out = [f"dataset={args.dataset}", f"model={args.model}", f"train.batch_size={args.batch_size}",
           f"train.steps={args.warmup + args.steps}", "train.lr=0.01", "train.momentum=0.9", "log_every_steps=1",
           "eval_every=0", "save_model=false", "logger.progress=false", "ssgd.threads=1", f"seed={args.seed}"]
    if args.width is not None:
        out.append(f"model.width={args.width}")
    return out + list(args.extra)


# ---------------------------------------------------------------- worker side (under torchrun)


def worker(args: argparse.Namespace) -> None:
    from fl_platform.ssgd.config import compose_ssgd_config
    from fl_platform.ssgd.distributed import init_distributed, shutdown
    from fl_platform.ssgd.trainer import SSGDTrainer

    ctx = init_distributed("auto", "auto", timeout_s=1800)
    results: list[dict] = []
    ok = False
    try:
        for label, extra in methods(args.rank, args.ratio).items():
            cfg = compose_ssgd_config([*overrides(args), *extra, f"run_dir={Path(args.out) / str(len(results))}"])
            trainer = SSGDTrainer(cfg, ctx)
            summary = trainer.run()
            rows = trainer.history[args.warmup:]
            seconds = [r["train_time_s"] for r in rows]
            results.append({
                "method": label, "sync": summary["sync"], "steps": len(rows),
                "steps_per_s": len(rows) / sum(seconds), "median_step_ms": 1000 * statistics.median(seconds),
                "payload_bytes_per_step": statistics.mean(r["bytes_per_worker"] for r in rows),
                "wire_bytes_per_step": statistics.mean(r["wire_bytes_per_worker"] for r in rows),
                "dense_bytes_per_step": summary["dense_bytes_per_step"], "num_params": summary["num_params"],
                "world_size": ctx.world_size, "backend": ctx.backend, "device": str(ctx.device),
            })
            if ctx.is_main:
                print(json.dumps(results[-1]), flush=True)
        ok = True
    finally:
        shutdown(barrier=ok)
    if ctx.is_main:
        (Path(args.out) / "results.json").write_text(json.dumps(results, indent=2))


# ---------------------------------------------------------------- launcher side


def _load() -> str:
    try:
        return ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def markdown(results: list[dict], args: argparse.Namespace, command: str, seconds: float, load: str) -> str:
    r0 = results[0]
    dense = r0["dense_bytes_per_step"]
    lines = [
        "## S-SGD: steps per second (torch.distributed, scripts/bench/ssgd.py)",
        "",
        f"`{command}` ({seconds:.0f} s wall, including process start-up and data loading).",
        "",
        f"- Machine: {hardware_line()}; {r0['world_size']} processes on one host, backend {r0['backend']}, "
        f"device {r0['device']}, 1 intra-op thread per process. Load average at the start: {load} (other "
        "jobs were running: absolute numbers are noisy, compare within the table).",
        f"- Model: {args.model}{f' width {args.width}' if args.width else ''} ({r0['num_params'] / 1e6:.2f}M "
        f"parameters, {dense / 2**20:.1f} MiB of fp32 gradients) on {args.dataset}, batch {args.batch_size} per "
        f"worker (global {args.batch_size * r0['world_size']}), SGD lr 0.01 momentum 0.9.",
        f"- {args.steps} measured steps per method after {args.warmup} warm-up steps (DDP rebuilds its buckets "
        "after iteration 1; the compression hooks run dense for iterations 0-1). Evaluation off. Time is rank 0's "
        "per-step clock, which includes waiting in the step's collectives.",
        "",
        "| method | steps/s | median ms/step | payload B/worker/step | vs dense | wire B/worker/step (ring) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(f"| {r['method']} | {r['steps_per_s']:.3f} | {r['median_step_ms']:.1f} | "
                     f"{r['payload_bytes_per_step']:,.0f} | {r['payload_bytes_per_step'] / dense:.4f} | "
                     f"{r['wire_bytes_per_step']:,.0f} |")
    lines += [
        "",
        "Payload: the bytes each worker contributes per step (the compressors' exact wire sizes; PowerSGD: P and Q, "
        "ACP-SGD: P or Q, Top-k: values + indices, plus dense 1-D tensors). Wire: what a ring moves per worker "
        "(all-reduce 2(n-1)/n m, all-gather (n-1) m). On one host over loopback, communication is cheap next to "
        "a CPU forward/backward, so compression cannot buy much here and its encode/decode cost (QR, top-k "
        "selection) shows; the ranking on a real network or GPUs can differ (ACP-SGD reports 4.06x over S-SGD "
        "on 8-64 GPUs). Rerun on a quiet machine with the command above.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=2, help="processes (workers)")
    ap.add_argument("--model", default="resnet18")
    ap.add_argument("--width", type=int, default=None, help="resnet18 width (default: the model's, 64)")
    ap.add_argument("--dataset", default="fashion_mnist")
    ap.add_argument("--batch-size", type=int, default=8, help="per worker")
    ap.add_argument("--steps", type=int, default=10, help="measured steps per method")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps per method (>= 2)")
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD and ACP-SGD rank")
    ap.add_argument("--ratio", type=float, default=0.01, help="Top-k keep ratio")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-docs", action="store_true", help=f"put the table into {DOCS.relative_to(REPO)}")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("extra", nargs="*", help="further overrides of conf/ssgd.yaml, e.g. ssgd.bucket_cap_mb=50")
    args = ap.parse_args()
    if args.warmup < 2:
        ap.error("--warmup must be >= 2 (DDP rebuilds its buckets after iteration 1)")
    if args.worker:
        from fl_platform.ssgd.distributed import end_worker

        worker(args)
        end_worker(0)
    load, t0 = _load(), time.perf_counter()
    command = "python scripts/bench/ssgd.py " + " ".join(a for a in sys.argv[1:] if a != "--write-docs")
    with tempfile.TemporaryDirectory(prefix="bench_ssgd_") as out:
        from fl_platform.ssgd.launch import torchrun_command

        forwarded = [a for a in sys.argv[1:] if a != "--write-docs"]
        cmd = torchrun_command(args.nproc, ["--worker", "--out", out, *forwarded], target=(__file__,))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
        subprocess.run(cmd, check=True, env=env, cwd=REPO)
        results = json.loads((Path(out) / "results.json").read_text())
    seconds = time.perf_counter() - t0
    section = markdown(results, args, command.strip(), seconds, load)
    print(section)
    if args.write_docs:
        write_section(DOCS, SECTION, section)
        print(f"wrote {DOCS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
