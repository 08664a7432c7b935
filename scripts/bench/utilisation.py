"""How busy the workers are on a GPU-shaped workload, measured on this CPU (issue 25, item 6).

CIFAR-shaped synthetic images (3x32x32, written as CIFAR-10 batches and read by the real loader),
the small ResNet (ResNet-18 at width 8), 40 clients per round, the Ray engine with 2 workers of
1 thread each. Reports, over the rounds after the first (warm-up) and before the last (it
evaluates), the median ``worker_busy_frac`` (training time / (workers x round wall time); target
>= 0.85) and the round's time beyond its slowest worker as a fraction of the round (target <= 10%),
with each worker's split of its round (training, state I/O, transport, waiting).

    python scripts/bench/utilisation.py                 # table into docs/benchmarks.md
    python scripts/bench/utilisation.py --no-write --rounds 4
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

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import add_output_args, compose, hardware_line, write_cifar_like, write_section

TARGET_BUSY, TARGET_BEYOND = 0.85, 0.10


def overrides(root: Path, rounds: int, workers: int) -> list[str]:
    return ["dataset=cifar10", f"dataset.root={root}", "model=resnet18", "model.width=8", "partition=iid",
            "num_clients=100", "clients_per_round=40", f"rounds={rounds}", f"eval_every={rounds}",
            "train.epochs=1", "train.batch_size=32", "engine=ray", f"engine.num_workers={workers}",
            "engine.threads_per_worker=1", "save_model=false", "seed=0"]


def measure(rounds: int, workers: int, train_images: int) -> dict:
    from fl_platform.experiment import build

    with tempfile.TemporaryDirectory(prefix="fl-util-") as tmp:
        write_cifar_like(Path(tmp), train=train_images, test=500)
        exp = build(compose(*overrides(Path(tmp), rounds, workers)))
        t0 = time.perf_counter()
        try:
            exp.simulation.run()
        finally:
            exp.engine.close()
        wall = time.perf_counter() - t0
    rows = exp.simulation.history[1:-1] or exp.simulation.history  # not the warm-up, not the evaluating round

    def med(key: str, w: int | None = None) -> float:
        return statistics.median(row[key] if w is None else row[key][w] for row in rows)

    return {"workers": workers, "rounds": rounds, "rows_used": len(rows), "wall_s": wall,
            "round_s": med("round_time_s"), "busy_frac": med("worker_busy_frac"),
            "beyond_frac": statistics.median(row["beyond_slowest_s"] / row["round_time_s"] for row in rows),
            "per_worker": [{k: med(f"worker_{k}_s", w) for k in ("train", "state_io", "transport", "wait")}
                           for w in range(workers)],
            "sched_balance": med("sched_balance")}


def table(result: dict, command: str, note: str) -> str:
    ok = lambda good: "meets" if good else "misses"  # noqa: E731
    lines = [
        "## Worker utilisation (GPU-shaped workload on CPU)", "",
        f"`{command}`: CIFAR-shaped synthetic images (3x32x32), ResNet-18 at width 8, 100 IID clients, 40 per "
        f"round, 1 local epoch at batch 32, `engine=ray` with {result['workers']} workers of 1 thread; medians over "
        f"{result['rows_used']} rounds (not the first, not the last, which evaluates). {hardware_line()}. {note}", "",
        "| figure | value | target |", "|---|---|---|",
        f"| `worker_busy_frac` | {result['busy_frac']:.3f} | >= {TARGET_BUSY} ({ok(result['busy_frac'] >= TARGET_BUSY)}) |",
        f"| round beyond its slowest worker | {result['beyond_frac']:.1%} | <= {TARGET_BEYOND:.0%} "
        f"({ok(result['beyond_frac'] <= TARGET_BEYOND)}) |",
        f"| round time | {result['round_s']:.2f} s | |",
        f"| `sched_balance` (slowest / mean worker) | {result['sched_balance']:.3f} | |", "",
        "| worker | training s | state I/O s | transport s | waiting s |", "|---|---|---|---|---|",
    ]
    for w, p in enumerate(result["per_worker"]):
        lines.append(f"| {w} | {p['train']:.3f} | {p['state_io']:.4f} | {p['transport']:.4f} | {p['wait']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--train-images", type=int, default=4000)
    p.add_argument("--note", default="", help="a sentence for the doc (e.g. that the machine was shared)")
    add_output_args(p, "utilisation")
    a = p.parse_args()
    result = measure(a.rounds, a.workers, a.train_images)
    command = "python scripts/bench/utilisation.py" + (f" --rounds {a.rounds}" if a.rounds != 8 else "")
    text = table(result, command, a.note)
    print(text)
    print(json.dumps(result))
    if not a.no_write:
        a.results.parent.mkdir(parents=True, exist_ok=True)
        a.results.write_text(json.dumps(result, indent=1) + "\n")
        write_section(a.doc, "utilisation", text)


if __name__ == "__main__":
    main()
