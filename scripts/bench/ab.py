#!/usr/bin/env python
"""A/B of one engine configuration's round time: this checkout against another (an earlier commit).

Rounds of a few milliseconds move by 10-20 % from run to run on a shared VM, more than the
differences worth finding, and a noisy host slows both sides alike. So the two checkouts run in
fresh processes one after the other (in alternating order), ``--pairs`` times, and the comparison is the paired ratio
this / base of each pair's median round (rounds 2 .. R-1: round 1 warms up, the last evaluates):
its geometric mean with a 95 % t-interval over the pairs' log ratios.

The base needs the same benchmark helpers (``scripts/bench/common.py``'s ``compose`` and
``engine.py``'s ``our_overrides``), which every commit since the engine benchmark has.

    git worktree add ../base 4d37b44
    python scripts/bench/ab.py --base ../base --pairs 12            # appends a set to docs/results/bench_ab.json
    python scripts/bench/ab.py --base ../base --pairs 6 --calls     # a round's call pair alone (transport)
    python scripts/bench/ab.py --base ../base --pairs 5 --workload utilisation --rounds 5   # GPU-shaped workload
    python scripts/bench/ab.py --from-results                       # the sets recorded so far
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, run_child

sys.path.insert(0, str(REPO / "scripts"))
from results_common import interval

RESULTS = REPO / "docs" / "results" / "bench_ab.json"
#: Run inside the checkout under test (cwd and PYTHONPATH): writes one JSON line. The workload: the
#: engine benchmark's (``engine.py``'s configuration), or ``utilisation``, the GPU-shaped one of
#: ``utilisation.py`` (CIFAR-shaped synthetic images, the small ResNet, 40 clients per round, Ray with 2
#: workers), its overrides and data from the checkout under test.
CHILD = """
import json, statistics, sys, tempfile
from pathlib import Path
from common import compose
from fl_platform.experiment import build
*args, _, out = sys.argv[1:]  # ... --out FILE
workload, config, rounds, *extra = args
with tempfile.TemporaryDirectory(prefix="fl-ab-") as tmp:
    if workload == "utilisation":
        from common import write_cifar_like
        import utilisation as U
        write_cifar_like(Path(tmp), train=4000, test=500)
        overrides = U.overrides(Path(tmp), int(rounds), 2)
    else:
        import engine as E
        overrides = E.our_overrides(config, int(rounds))
    exp = build(compose(*overrides, *extra))
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
times = [r["round_time_s"] for r in exp.simulation.history[1:-1]]
open(out, "w").write(json.dumps({"median_round_s": statistics.median(times)}))
"""

#: ``--calls``: one call pair of a round (two actors that do no work, each answering with a fixed
#: 5-client result of a 9,610-parameter aggregate), through the checkout's own transport and call
#: shape: one packed ``RoundCall`` from 4c7d283 until b81aa75; before and since, four arguments with
#: the broadcast ``Packed`` (since b81aa75 the engine's call has two more small ones), or (4d37b44)
#: three with the process-wide serialiser.
CALLS = """
import importlib.util, json, statistics, sys, time
import ray, torch
from fl_platform.core import Aggregate, Broadcast, Metrics, RoundContext
PACKED = importlib.util.find_spec("fl_platform.engine.transport") is not None
if PACKED:
    from fl_platform.engine.transport import Packed
    from fl_platform.rounds.engine import WorkerResult
    try:  # one argument per call (since 4c7d283)
        from fl_platform.engine.ray_actors import RoundCall
    except ImportError:
        RoundCall = None
else:
    from fl_platform.engine.ray_engine import use_fast_tensor_transport
    from fl_platform.engine.worker import WorkerResult

def result():
    agg = Aggregate()
    agg.add({"delta": torch.randn(9610)}, {"n": 5.0}, 5)
    m = Metrics()
    for k in ("loss", "accuracy", "steps", "train_s", "n"):
        m.add(k, 1.0, 2.0)
    return WorkerResult(0, agg, [], m, {c: 0.01 for c in range(5)}, 0.05, 1000, 1000,
                        client_stats={c: {"bytes_up": 1.0, "samples": 12.0} for c in range(5)})

calls, out = int(sys.argv[1]), sys.argv[3]  # CALLS --out FILE
ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

@ray.remote(num_cpus=1)
class Worker:
    def __init__(self):
        if not PACKED:
            use_fast_tensor_transport()
        self.result = result()

    def call(self, *args):
        return Packed(self.result) if PACKED else self.result

if not PACKED:
    use_fast_tensor_transport()
workers = [Worker.remote(), Worker.remote()]
ray.get([w.call.remote(0, 0, 0) for w in workers])
ctx = RoundContext(round=3, num_rounds=300, clients=list(range(10)), seed=0, num_clients=100)
bc = Broadcast({"weights": torch.randn(9610)}, {"lr": 0.1})
runs = []
for _ in range(5):
    t = time.perf_counter()
    for _ in range(calls):
        if PACKED and RoundCall is not None:
            refs = [w.call.remote(Packed(RoundCall(ctx, [1, 2, 3, 4, 5], bc))) for w in workers]
        elif PACKED:
            packed = Packed(bc)
            refs = [w.call.remote(ctx, packed, [1, 2, 3, 4, 5], None) for w in workers]
        else:
            refs = [w.call.remote(ctx, bc, [1, 2, 3, 4, 5]) for w in workers]
        [ray.get(r) for r in refs]
    runs.append((time.perf_counter() - t) / calls)
ray.shutdown()
open(out, "w").write(json.dumps({"median_round_s": statistics.median(runs)}))
"""


def git_commit(path: Path) -> str:
    out = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


#: The folders whose code runs in a benchmark: commits equal in these are the same code.
CODE = ("fl_platform", "algorithms", "datasets", "conf")


@functools.cache
def code_of(commit: str, repo: Path = REPO) -> str:
    """The identity of ``commit``'s code: its trees of the ``CODE`` folders it has; the commit itself
    where git cannot tell (not in this repository). Cached: ``pools`` asks for each set's two commits,
    a handful of commits across dozens of sets."""
    out = subprocess.run(["git", "-C", str(repo), "ls-tree", commit, "--", *CODE], capture_output=True, text=True)
    return " ".join(out.stdout.split()) if out.returncode == 0 and out.stdout.strip() else commit


def pools(sets: list[dict[str, Any]],
          code: Callable[[str], str] = code_of) -> list[tuple[str, list[tuple[float, float]]]]:
    """(label, pairs) of each comparison recorded in more than one set: the sets with the same code on
    each side (``code``: a commit's code identity), configuration and overrides, pooled."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for s in sets:
        key = (code(s["base_commit"]), code(s["this_commit"]), s["config"], " ".join(s["overrides"]))
        groups.setdefault(key, []).append(s)
    out = []
    for (_, _, config, overrides), group in groups.items():
        if len(group) > 1:
            base, this = (" = ".join(dict.fromkeys(s[side] for s in group)) for side in ("base_commit", "this_commit"))
            out.append((f"{config} {overrides}, {base} -> {this}", [tuple(x) for s in group for x in s["pairs"]]))
    return out


def run_once(checkout: Path, config: str, rounds: int, extra: list[str], timeout: float, calls: bool,
             workload: str = "engine") -> float:
    """One fresh process in ``checkout`` (run_child: its process tree, Ray's included, stopped after)."""
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    args = [CALLS, str(rounds)] if calls else [CHILD, workload, config, str(rounds), *extra]
    res = run_child([sys.executable, "-c", *args], timeout, env=env, checkout=checkout)
    if not res.ok:
        raise RuntimeError(f"run in {checkout} failed: {res.error}")
    return float(res.data["median_round_s"])


def summary(pairs: list[tuple[float, float]]) -> str:
    """``n pairs: base median, this median, ratio [lo, hi]`` (geometric mean of this / base)."""
    iv = interval([math.log(this / base) for base, this in pairs])
    base_ms = statistics.median(b for b, _ in pairs) * 1e3
    this_ms = statistics.median(t for _, t in pairs) * 1e3
    if iv.n < 2:
        return f"{iv.n} pair(s): too few for an interval"
    return (f"{iv.n} pairs: median rounds {base_ms:.2f} ms (base) and {this_ms:.2f} ms (this); ratio this / base "
            f"{math.exp(iv.mean):.3f} [{math.exp(iv.mean - iv.half):.3f}, {math.exp(iv.mean + iv.half):.3f}]")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, help="the other checkout (e.g. a git worktree of an earlier commit)")
    p.add_argument("--pairs", type=int, default=12)
    p.add_argument("--config", default="100/10", help="an engine benchmark configuration (clients/per round)")
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--calls", action="store_true",
                   help="time a round's call pair alone (actors that do no work; --rounds calls per run, 5 runs)")
    p.add_argument("--workload", choices=("engine", "utilisation"), default="engine",
                   help="engine: the engine benchmark's workload (--config); utilisation: the GPU-shaped "
                        "workload of scripts/bench/utilisation.py (Ray, 2 workers; --rounds 5 or more)")
    p.add_argument("--from-results", action="store_true", help="summarise the recorded sets; run nothing")
    p.add_argument("overrides", nargs="*",
                   help="config overrides of both sides (default for the engine workload: Ray, 2 workers, "
                        "1 thread each; the utilisation workload sets its own)")
    a = p.parse_args()
    if not a.overrides and a.workload == "engine":
        a.overrides = ["engine=ray", "engine.num_workers=2", "engine.threads_per_worker=1"]
    sets = json.loads(a.results.read_text())["sets"] if a.results.exists() else []
    if a.from_results:
        for s in sets:
            print(f"{s['date']} {s['config']} {' '.join(s['overrides'])}, {s['base_commit']} -> {s['this_commit']}: "
                  f"{summary([tuple(x) for x in s['pairs']])}")
        for label, pairs in pools(sets):
            print(f"pooled {label}: {summary(pairs)}")
        return
    if a.base is None or not (a.base / "fl_platform").is_dir():
        p.error("--base must be another checkout of the platform (a folder holding fl_platform/)")
    if a.pairs < 2 or a.rounds < 3:
        p.error("--pairs must be >= 2 and --rounds >= 3")
    pairs: list[tuple[float, float]] = []
    for i in range(a.pairs):
        run = functools.partial(run_once, config=a.config, rounds=a.rounds, extra=a.overrides, timeout=a.timeout,
                                calls=a.calls, workload=a.workload)
        if i % 2:  # the order alternates, so that neither side always runs first
            this, base = run(REPO), run(a.base.resolve())
        else:
            base, this = run(a.base.resolve()), run(REPO)
        pairs.append((base, this))
        print(f"[ab] pair {i + 1}/{a.pairs}: base {base * 1e3:.3f} ms, this {this * 1e3:.3f} ms "
              f"(load {os.getloadavg()[0]:.2f})", flush=True)
    print(summary(pairs))
    config, overrides = (("calls", ["two idle actors"]) if a.calls else
                         ("utilisation", a.overrides) if a.workload == "utilisation" else (a.config, a.overrides))
    sets.append({"date": time.strftime("%Y-%m-%d"), "config": config, "rounds": a.rounds, "overrides": overrides,
                 "base_commit": git_commit(a.base), "this_commit": git_commit(REPO), "pairs": pairs})
    a.results.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.results.with_suffix(".tmp")
    tmp.write_text(json.dumps({"sets": sets}, indent=1))
    tmp.replace(a.results)


if __name__ == "__main__":
    main()
