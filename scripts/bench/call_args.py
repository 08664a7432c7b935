#!/usr/bin/env python
"""What a Ray call's arguments cost: a round's call pair with its parts as separate arguments against
the same parts packed into one.

Two actors that do no work (1 CPU each) receive a round's call, in one process and one Ray session,
the shapes interleaved block by block so that the host's noise falls on all of them alike:

* ``4 args``: the round context, the packed broadcast (9,610 parameters), the clients and the
  manifest's rounds as four arguments (the engine's call until 56a524c, and again since issue 25 item 9
  with two more small ones: the number of homes and the split flag);
* ``2 args``: the packed broadcast and the rest packed apart;
* ``1 packed``: everything packed as one argument (the engine's call from 4c7d283, a packed
  ``RoundCall``, until issue 25 item 9 went back to plain arguments: docs/benchmarks.md).

Prints, per shape, the median time of a call pair (submit and wait) over the blocks with their range,
and the median time to submit a pair alone.

    python scripts/bench/call_args.py                 # 25 blocks of 200 call pairs per shape
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only

import ray
import torch

from fl_platform.core import Broadcast, RoundContext
from fl_platform.engine.transport import Packed


@ray.remote(num_cpus=1)
class Idle:
    def call(self, *args: object) -> int:
        return 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=25)
    p.add_argument("--pairs", type=int, default=200, help="call pairs per block")
    a = p.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actors = [Idle.remote(), Idle.remote()]
        ray.get([w.call.remote() for w in actors])
        ctx = RoundContext(round=3, seed=0, clients=tuple(range(10)), num_rounds=300, num_clients=100)
        bc = Broadcast({"weights": torch.randn(9610)}, {"lr": 0.1})
        ids = [1, 2, 3, 4, 5]

        def four() -> list:
            packed = Packed(bc)
            return [w.call.remote(ctx, packed, ids, None) for w in actors]

        def two() -> list:
            packed = Packed(bc)
            return [w.call.remote(packed, Packed((ctx, ids, None))) for w in actors]

        def one() -> list:
            return [w.call.remote(Packed((ctx, ids, bc))) for w in actors]

        shapes = {"4 args": four, "2 args": two, "1 packed": one}
        pair_ms: dict[str, list[float]] = {name: [] for name in shapes}
        submit_us: dict[str, list[float]] = {name: [] for name in shapes}
        for submit in shapes.values():  # warm-up, not counted
            for _ in range(a.pairs):
                ray.get(submit())
        for _ in range(a.blocks):
            for name, submit in shapes.items():
                t0 = time.perf_counter()
                for _ in range(a.pairs):
                    t = time.perf_counter()
                    refs = submit()
                    submit_us[name].append((time.perf_counter() - t) * 1e6)
                    ray.get(refs)
                pair_ms[name].append((time.perf_counter() - t0) / a.pairs * 1e3)
        for name in shapes:
            ms = pair_ms[name]
            print(f"{name:>8}: call pair {statistics.median(ms):.3f} ms ({min(ms):.3f}-{max(ms):.3f} over "
                  f"{a.blocks} blocks), submitting {statistics.median(submit_us[name]):.0f} us")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
