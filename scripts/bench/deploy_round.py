#!/usr/bin/env python
"""One device's round in a Flower deployment, phase by phase (issue 26 item 4; docs/benchmarks.md).

Starts a SuperLink and ``--nodes`` SuperNodes on loopback (tests/flower_utils.py's ``Federation``:
free ports, ``FLWR_HOME`` in a temporary folder, every process stopped by PID), runs FedAvg on
Fashion-MNIST with ``--per-round`` of the nodes in each round (default: every node) through ``flwr run``,
and reads back each ClientApp's
``timing`` line (fl_platform/flower/client_app.py) from the SuperNodes' logs and the server's
``metrics.jsonl``. Per round it prints the median over the devices of each phase:

  flower_start  process start -> our module: the SuperNode's spawn, Python, Flower's imports, the
                message pull and the FAB install (Flower's)
  torch         importing torch
  ours          our module and imports, the set-up (config + data, or the node cache's entry) and the
                message codec; ``set_up`` says which (miss: built and stored, hit: read from the cache)
  train         the algorithm's client half (local training)
  rest          the server's round time minus the slowest device's process time: Flower's polling,
                transfer, the server's aggregation and evaluation

and checks the target: after a node's first round (its node cache holds the set-up: ``set_up`` hit), our
share beyond training is at most 0.3 s per device (median over those device-rounds).

    FL_DATA_ROOT=/path/to/data python scripts/bench/deploy_round.py            # 10 nodes, 4 rounds
    python scripts/bench/deploy_round.py --nodes 3 --rounds 3 --no-cache      # cache-entries=0 on the nodes
    python scripts/bench/deploy_round.py --nodes 10 --per-round 1 --rounds 25 # one device at a time

Ten SuperNodes on a 2-core machine start ten Python processes at once per round, so each device's wall
time is several times what it would be on a device of its own: ``--per-round 1`` runs one ClientApp at a
time (a device's round undisturbed). Run it niced, and read wall times on a shared machine as upper bounds
(CPU seconds are printed beside them).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TARGET_S = 0.3  # our share of a device's round beyond training, after round 1 (issue 26 item 4)
PHASES = ("flower_start", "torch_import", "ours", "ours_cpu", "module_import", "our_imports", "prepare", "codec",
          "train", "train_cpu")


def federation_class():
    spec = importlib.util.spec_from_file_location("flower_utils", REPO / "tests" / "flower_utils.py")
    module = sys.modules.setdefault("flower_utils", importlib.util.module_from_spec(spec))
    if not hasattr(module, "Federation"):
        spec.loader.exec_module(module)
    return module.Federation, module.BIN


def timing_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        _, sep, payload = line.partition("timing {")
        if sep:
            try:
                out.append(json.loads("{" + payload))
            except json.JSONDecodeError:
                continue
    return out


def summarise(timings: list[dict], rows: list[dict]) -> list[dict]:
    """Per round: the devices' median of each phase, the slowest device's, and the server's round time."""
    table = []
    for row in rows:
        r = row["round"]
        devs = [{**t, "codec": t["codec_in"] + t["codec_out"]} for t in timings if t["round"] == r]
        if not devs:
            continue
        entry = {"round": r, "devices": len(devs), "round_time_s": row.get("round_time_s"),
                 "bytes_down": row.get("bytes_down"), "bytes_up": row.get("bytes_up"),
                 "set_up": dict(sorted({o: sum(t["set_up"] == o for t in devs) for o in {t["set_up"] for t in devs}}
                                       .items()))}
        for phase in PHASES:
            entry[phase] = statistics.median(t[phase] for t in devs)
        process = [t["flower_start"] + t["module_import"] + t["torch_import"] + t["our_imports"] + t["prepare"]
                   + t["codec_in"] + t["train"] + t["codec_out"] for t in devs]
        entry["process_max"] = max(process)
        entry["ours_max"] = max(t["ours"] for t in devs)
        entry["ours_cpu_max"] = max(t["ours_cpu"] for t in devs)
        entry["prepare_hit"] = statistics.median([t["prepare"] for t in devs if t["set_up"] == "hit"] or [0.0])
        if entry["round_time_s"] is not None:
            entry["rest"] = max(0.0, entry["round_time_s"] - entry["process_max"])
        table.append(entry)
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--per-round", type=int, default=None, help="clients per round (default: every node)")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--steps", type=int, default=50, help="local steps per round (train.steps)")
    parser.add_argument("--no-cache", action="store_true", help="start the nodes with cache-entries=0")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole flwr run")
    parser.add_argument("--json", type=Path, help="write the per-round table here")
    args = parser.parse_args(argv)

    from fl_platform.datasets.paths import data_root
    from fl_platform.flower.config import DeployConf, compose, flatten_config, to_toml

    root = data_root()
    if not any((root / f).is_dir() for f in ("fashion-mnist", "FashionMNIST")):
        print(f"skipped: Fashion-MNIST not found under the data root {root} (set FL_DATA_ROOT)")
        return 0
    per_round = args.per_round or args.nodes
    if not 1 <= per_round <= args.nodes:
        parser.error(f"--per-round must be in [1, --nodes={args.nodes}], got {per_round}")
    Federation, _ = federation_class()
    overrides = ["dataset=fashion_mnist", f"model={args.model}", f"num_clients={args.nodes}",
                 f"clients_per_round={per_round}", f"rounds={args.rounds}", "partition=iid",
                 f"train.steps={args.steps}", "train.batch_size=32", "logger.progress=false"]
    with tempfile.TemporaryDirectory(prefix="deploy-round-") as tmp:
        home = Path(tmp)
        run_dir = home / "run"
        deploy = DeployConf(round_timeout=900.0, connect_timeout=900.0, poll_interval=0.1, run_dir=str(run_dir),
                            device="cpu")
        config = home / "run_config.toml"
        config.write_text(to_toml(flatten_config(compose(overrides), deploy)))
        fed = Federation(home / "fed")
        started = time.monotonic()
        try:
            fed.start_superlink()
            cache = " cache-entries=0" if args.no_cache else ""
            for i in range(args.nodes):
                fed.start_supernode(f'partition-id={i} num-partitions={args.nodes} data-root="{root}" threads=1'
                                    f"{cache}", name=f"node{i}")
            proc = fed.flwr("run", ".", fed.connection, "--run-config", str(config), "--stream",
                            timeout=args.timeout, check=False)
            if not (run_dir / "summary.json").exists():
                print(proc.stdout[-3000:], proc.stderr[-3000:], fed.log("node0")[-3000:], sep="\n")
                print("error: the flwr run did not finish", file=sys.stderr)
                return 1
            timings = [t for i in range(args.nodes) for t in timing_lines(fed.log(f"node{i}"))]
        finally:
            fed.stop()
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    table = summarise(timings, rows)
    print(f"{args.nodes} SuperNodes on loopback, {per_round} per round, Fashion-MNIST, model={args.model}, "
          f"{args.steps} local steps, cache {'off' if args.no_cache else 'on'}; {time.monotonic() - started:.0f} s in all")
    print("round  round_s  flower_start  torch  ours (cpu)  = module + imports + set-up + codec  train (cpu)  rest  "
          "ours max (cpu)  set-up")
    for e in table:
        print(f"{e['round']:>5}  {e['round_time_s']:7.2f}  {e['flower_start']:12.2f}  {e['torch_import']:5.2f}  "
              f"{e['ours']:4.2f} ({e['ours_cpu']:4.2f})    {e['module_import']:5.3f}  {e['our_imports']:7.3f}  "
              f"{e['prepare']:6.3f}  {e['codec']:5.3f}  {e['train']:5.2f} ({e['train_cpu']:4.2f})  "
              f"{e.get('rest', float('nan')):5.2f}  {e['ours_max']:5.2f} ({e['ours_cpu_max']:4.2f})  {e['set_up']}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rounds": table,
                                         "devices": timings},
                                        indent=1))
    hits = [t for t in timings if t["set_up"] == "hit"]  # a node's later rounds: its cache holds the set-up
    if not hits:
        print("no device-round found its set-up in the node cache: nothing to check the target on")
        return 0 if args.no_cache else 2
    ours = statistics.median(t["ours"] for t in hits)
    ours_cpu = statistics.median(t["ours_cpu"] for t in hits)
    ok = ours <= TARGET_S
    print(f"our share beyond training after a node's first round ({len(hits)} device-rounds with a cache hit): "
          f"median {ours:.3f} s wall ({ours_cpu:.3f} s CPU), slowest {max(t['ours'] for t in hits):.3f} s wall "
          f"({max(t['ours_cpu'] for t in hits):.3f} s CPU); target <= {TARGET_S} s: {'met' if ok else 'NOT met'}")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
