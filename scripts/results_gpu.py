#!/usr/bin/env python
"""Every results document in the papers' main settings, for a machine with a GPU and the datasets.

    python scripts/results_gpu.py --plan                  # what would run, and which datasets are missing
    nohup python scripts/results_gpu.py --jobs 1 --threads 8 > gpu.log &   # run everything, write the documents

Runs each document's ``--preset gpu`` (the presets in conf/experiment/, one per paper's main
setting: ResNet-18 on CIFAR-10 with Dirichlet(0.1) over 10 clients, 5 per round, the papers'
rounds and local epochs, ...; the one-shot papers' 5 clients with Dirichlet(0.5) and 200 local
epochs, FuseFL's width-20 ResNet-18 with 100 epochs per block, BAOW's CIFAR-10 with 100 clients and
heterogeneous uplinks) and writes docs/results/<document>_gpu.md with the same sections as
the CPU documents, its artefacts under docs/results/data/<document>_gpu/. Stops with a clear
message, before running anything, when a dataset is missing under the data root
($FL_DATA_ROOT, else ../shared/data): CIFAR-10 must be in cifar-10-batches-py/ there, FEMNIST
must be the full LEAF set. Interrupted runs start over; finished ones are kept.

With several GPUs, ``--jobs N`` runs N jobs at once, each seeing one GPU (``CUDA_VISIBLE_DEVICES``,
slots dealt round-robin over the GPUs this process sees: ``--jobs 8`` on 8 GPUs is one run per GPU;
set ``CUDA_VISIBLE_DEVICES`` to choose the GPUs).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Documents with a GPU preset (their script's rc.cli(..., presets=("cpu", "gpu"))).
GPU_DOCUMENTS = ["heterogeneity", "oneshot", "compression"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", action="store_true", help="list the runs and check the data; run nothing")
    ap.add_argument("--documents", nargs="+", default=GPU_DOCUMENTS, choices=GPU_DOCUMENTS)
    ap.add_argument("--jobs", type=int, default=1, help="runs in parallel, each on one GPU (round-robin over the visible GPUs)")
    ap.add_argument("--threads", type=int, default=8, help="CPU threads per run")
    ap.add_argument("--commit", default="HEAD", help="code to run: a git revision (snapshot) or 'worktree'")
    args = ap.parse_args(argv)
    worst = 0
    for doc in args.documents:
        module = importlib.import_module(f"results_{doc}")
        print(f"== {doc} (preset gpu)", flush=True)
        extra = ["--plan"] if args.plan else ["--jobs", str(args.jobs), "--threads", str(args.threads)]
        rc = module.main(["--preset", "gpu", "--commit", args.commit, *extra])
        worst = max(worst, rc)
        if rc and not args.plan:
            return rc
    return worst


if __name__ == "__main__":
    sys.exit(main())
