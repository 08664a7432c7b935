#!/usr/bin/env python
"""Partitioning many clients: our vectorised partitioners against flwr-datasets' through
``partition=flwr`` (datasets/flwr_interop.py), on the same labels.

For each pair (IID; Dirichlet label skew, alpha 0.5, no minimum size) and each client count, the
time to turn ``--samples`` labels of 10 classes into the CSR partition a run uses:

* ``ours``: ``make_partition`` (numpy over the whole label array);
* ``flwr-datasets``: ``flwr_partition``, i.e. their partitioner through its public API, one
  ``load_partition(c)`` per client (what a user of flwr-datasets does), split into the first call
  (their partitioner's own assignment, where it computes all clients at once) and the rest (one
  ``Dataset.select``/``shard`` view per client read back as indices).

    python scripts/bench/partition.py                      # writes its section of docs/benchmarks.md
    python scripts/bench/partition.py --clients 1000 --no-write
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, hardware_line, write_section

PAIRS = {  # name -> (ours: name, options), (flwr-datasets: class, options)
    "iid": (("iid", {}), ("IidPartitioner", {})),
    "dirichlet(0.5)": (("dirichlet", {"alpha": 0.5, "min_size": 0}),
                       ("DirichletPartitioner", {"alpha": 0.5, "min_partition_size": 0})),
}


def time_ours(labels, clients: int, name: str, options: dict[str, Any]) -> tuple[float, Any]:
    from fl_platform.datasets.partition import make_partition

    t0 = time.perf_counter()
    part = make_partition(name, labels, clients, seed=0, **options)
    return time.perf_counter() - t0, part


def time_flwr(labels, clients: int, cls: str, options: dict[str, Any]) -> tuple[float, float, Any]:
    """(total seconds, seconds of the first load_partition, partition): flwr_partition, timed inside."""
    from fl_platform.datasets import flwr_interop

    first: list[float] = []
    rows = flwr_interop._rows

    def timed_rows(part):  # the first client's call includes the partitioner's own assignment
        if not first:
            first.append(time.perf_counter())
        return rows(part)

    flwr_interop._rows = timed_rows
    try:
        t0 = time.perf_counter()
        part = flwr_interop.flwr_partition(labels, clients, 0, cls, options)
        total = time.perf_counter() - t0
    finally:
        flwr_interop._rows = rows
    return total, first[0] - t0, part


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1_000, 100_000])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = parser.parse_args(argv)

    import flwr_datasets  # noqa: F401  (imported before timing: its import takes seconds)
    import numpy as np

    labels = np.random.default_rng(0).integers(0, 10, args.samples)
    rows = []
    for pair in args.pairs:
        (ours, ours_opts), (theirs, theirs_opts) = PAIRS[pair]
        for clients in args.clients:
            t_ours, p_ours = time_ours(labels, clients, ours, ours_opts)
            t_flwr, t_first, p_flwr = time_flwr(labels, clients, theirs, theirs_opts)
            assert p_ours.num_clients == p_flwr.num_clients == clients
            row = (f"| {pair} | {clients:,} | {t_ours:.3f} | {t_flwr:.1f} | {t_first:.1f} | {t_flwr / t_ours:,.0f}x |")
            print(row, flush=True)
            rows.append(row)
    import flwr_datasets as fd

    import datasets

    body = "\n".join([
        "## Partitioning: ours against flwr-datasets (scripts/bench/partition.py)",
        "",
        f"`python scripts/bench/partition.py --clients {' '.join(map(str, args.clients))} --samples {args.samples}` on "
        f"{hardware_line()}; flwr-datasets {fd.__version__}, datasets {datasets.__version__}. {args.samples:,} labels "
        "of 10 classes; seconds to build the run's CSR partition. flwr-datasets runs through `partition=flwr` "
        "(their public API: one `load_partition` per client); 'first call' is the part spent before the first "
        "client's rows came back (their own assignment of all clients, where the partitioner computes it at once).",
        "",
        "| partition | clients | ours (s) | flwr-datasets (s) | of which first call (s) | ours faster |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        *rows,
    ])
    print()
    print(body)
    if not args.no_write:
        write_section(REPO / "docs" / "benchmarks.md", "partition", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
