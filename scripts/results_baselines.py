#!/usr/bin/env python
"""FedAvg vs FedProx vs SCAFFOLD on digits (100 clients, 10 per round), 3 seeds -> docs/results/baselines.md.

    python scripts/results_baselines.py            # about 1 minute on 2 CPU cores

Two partitions: Dirichlet(0.5) label skew and the strongly non-IID 2-classes-per-client shards.
Run directories go to outputs/results/baselines/ (not committed); the table and plots to docs/results/.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import plot  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from fl_platform.config import register_configs  # noqa: E402
from fl_platform.experiment import run_experiment  # noqa: E402

PARTITIONS = {"dirichlet(0.5)": ["partition=dirichlet", "partition.alpha=0.5"],
              "shards(2 classes/client)": ["partition=shards", "partition.classes_per_client=2"]}
ALGORITHMS = ["fedavg", "fedprox", "scaffold"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default=str(REPO / "docs" / "results"))
    ap.add_argument("--runs", default=str(REPO / "outputs" / "results" / "baselines"))
    args = ap.parse_args()
    register_configs()
    out, runs = Path(args.out), Path(args.runs)
    common = ["dataset=digits", "model=mlp", "num_clients=100", "clients_per_round=10", f"rounds={args.rounds}",
              "train.epochs=5", "train.batch_size=10", "train.lr=0.05", "logger.progress=false"]
    sections = []
    t0 = time.time()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        for label, part in PARTITIONS.items():
            slug = part[0].split("=")[1]
            dirs = []
            for alg in ALGORITHMS:
                for seed in range(args.seeds):
                    cfg = compose(config_name="config", overrides=[*common, *part, f"algorithm={alg}", f"seed={seed}"])
                    run_dir = runs / slug / f"{alg}_s{seed}"
                    summary = run_experiment(cfg, run_dir)
                    print(f"{label:26s} {alg:9s} seed {seed}: final {summary['final_test_accuracy']:.4f}", flush=True)
                    dirs.append(run_dir)
            groups = plot.group_runs([plot.load_run(d) for d in dirs])
            png = plot.plot(groups, out / f"baselines_{slug}.png", "round", "test_accuracy", f"digits, {label}")
            sections.append(f"### {label}\n\n{plot.table(groups)}\n![accuracy vs round]({png.name})\n")
    cmd = "python scripts/results_baselines.py" + (f" --seeds {args.seeds}" if args.seeds != 3 else "") + (
        f" --rounds {args.rounds}" if args.rounds != 30 else "")
    text = (
        "# Baselines: FedAvg, FedProx, SCAFFOLD on digits\n\n"
        f"Produced by `{cmd}` ({time.time() - t0:.0f} s on 2 CPU cores).\n\n"
        "Setting: scikit-learn digits (1,438 train / 359 test images), MLP 64-128-10, 100 clients, 10 sampled per "
        f"round, {args.rounds} rounds, 5 local epochs, batch 10, SGD lr 0.05; FedProx mu = 0.01; SCAFFOLD option II "
        f"with sample-weighted model deltas. Mean ± std over {args.seeds} seeds (seed changes the partition, the "
        "initial model, client sampling and shuffling). Accuracies in %.\n\n" + "\n".join(sections)
    )
    (out / "baselines.md").write_text(text)
    print(f"wrote {out / 'baselines.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
