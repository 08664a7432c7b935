#!/usr/bin/env python
"""Many devices coming and going (issue 26 item 6): SuperNodes killed and restarted during a Flower run.

Starts a SuperLink and ``--nodes`` SuperNodes on loopback (tests/flower_utils.py's ``Federation``,
``threads=1`` on every node), runs FedAvg on digits with ``--per-round`` clients per round through
``flwr run``, and while it runs kills ``--churn`` of the nodes and restarts them: half with SIGKILL
(a device that drops off without a word: the SuperLink notices after its heartbeats lapse) after
round 1, restarted after round 3; the other half with SIGTERM (a clean sign-off) after round 3,
restarted after round 5. Then it

* checks that the run completed every round,
* prints per round the clients that took part, the rejected or missing ones with the server's
  reason, and the bytes on the wire (``bytes_down``/``bytes_up`` measured on the serialised messages),
* replays the run without churn, in process (fl_platform/flower/local.py's ``LocalGrid``, the same
  ServerApp and ClientApp code), with exactly the churn run's participants (each round's missing
  clients are made not to answer), and compares the final models: they must agree to 1e-5, the
  tolerance docs/deploy.md gives a Flower run against the simulator.

The ServerApp's identify queries at the start go ``--identify-in-flight`` (5) at a time
(``deploy.identify_in_flight``): each is a ClientApp process on its node, and 50 at once on one machine
took about 16 GB. Every process is started by this script and stopped by its PID (process group); each wait is
bounded (``--round-timeout``, ``--timeout``). Too heavy for the unit suite on 2 cores: run it by hand,
niced::

    nice -n 10 python scripts/bench/flower_churn.py                    # 50 nodes, 10 per round, 20% churn
    nice -n 10 python scripts/bench/flower_churn.py --nodes 10 --per-round 4 --rounds 6   # a smaller check
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-5  # Flower vs the simulator (docs/deploy.md)


def flower_utils() -> Any:
    spec = importlib.util.spec_from_file_location("flower_utils", REPO / "tests" / "flower_utils.py")
    module = sys.modules.setdefault("flower_utils", importlib.util.module_from_spec(spec))
    if not hasattr(module, "Federation"):
        spec.loader.exec_module(module)
    return module


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written
    return rows


def available_gb() -> float:
    """MemAvailable (Linux; inf elsewhere): the run stops itself before it starves a shared machine."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("inf")


class LowMemory(RuntimeError):
    """Less memory available than --min-free-gb: the run is stopped."""


def missing_of(row: dict) -> dict[int, str]:
    return {int(c): why for c, why in (row.get("rejected_reasons") or {}).items()}


def replay(overrides: list[str], missing: dict[int, set[int]], run_dir: Path) -> dict[str, Any]:
    """The run again in process, without churn, with each round's missing clients not answering."""
    import torch

    from fl_platform.flower.client_app import app as client_app
    from fl_platform.flower.config import DeployConf, compose, flatten_config
    from fl_platform.flower.local import LocalGrid, nodes_for
    from fl_platform.flower.server_app import run_server

    cfg = compose(overrides)
    run_config = flatten_config(cfg, DeployConf(round_timeout=2.0, poll_interval=0.01, connect_timeout=10.0))
    nodes = nodes_for(cfg.num_clients)

    class ReplayGrid(LocalGrid):
        def push_messages(self, messages):
            messages = list(messages)
            self.down = {nid for m in messages if m.metadata.message_type == "train"
                         for nid in [m.metadata.dst_node_id]
                         if self.contexts[nid].node_config["partition-id"] in missing.get(int(m.metadata.group_id), ())}
            return super().push_messages(messages)

    threads = torch.get_num_threads()
    try:
        run_server(ReplayGrid(client_app, nodes, run_config), run_config, run_id=1, run_dir=run_dir)
    finally:
        torch.set_num_threads(threads)
    return torch.load(run_dir / "model.pt", weights_only=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--churn", type=float, default=0.2, help="fraction of the nodes killed and restarted")
    parser.add_argument("--round-timeout", type=float, default=150.0, help="deploy.round_timeout (seconds)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole flwr run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--start-interval", type=float, default=1.0, help="seconds between SuperNode starts")
    parser.add_argument("--identify-in-flight", type=int, default=5,
                        help="deploy.identify_in_flight: identify queries (ClientApp processes) at once at the start")
    parser.add_argument("--min-free-gb", type=float, default=3.0,
                        help="stop the run (every process, by PID) when less memory than this is available")
    args = parser.parse_args(argv)
    if args.rounds < 6:
        parser.error("--rounds must be >= 6 (kills after rounds 1 and 3, restarts after rounds 3 and 5)")

    import torch

    from fl_platform.flower.config import DeployConf, compose, flatten_config, to_toml

    fu = flower_utils()
    overrides = ["dataset=digits", "model=mlp", f"num_clients={args.nodes}", f"clients_per_round={args.per_round}",
                 f"rounds={args.rounds}", "partition=iid", "train.steps=20", f"seed={args.seed}",
                 "logger.progress=false"]
    churned = random.Random(args.seed).sample(range(args.nodes), max(2, round(args.churn * args.nodes)))
    half = len(churned) // 2
    killed_hard, killed_soft = sorted(churned[:half]), sorted(churned[half:])
    # (after round, action, nodes): SIGKILL half after round 1, restart them and SIGTERM the rest after
    # round 3, restart those after round 5
    schedule = [(1, "kill", killed_hard, signal.SIGKILL), (3, "restart", killed_hard, None),
                (3, "kill", killed_soft, signal.SIGTERM), (5, "restart", killed_soft, None)]
    events: list[str] = []

    with tempfile.TemporaryDirectory(prefix="flower-churn-") as tmp:
        home = Path(tmp)
        run_dir = home / "run"
        deploy = DeployConf(round_timeout=args.round_timeout, connect_timeout=args.timeout, poll_interval=0.2,
                            run_dir=str(run_dir), device="cpu", min_replies=1,
                            identify_in_flight=args.identify_in_flight)
        config = home / "run_config.toml"
        config.write_text(to_toml(flatten_config(compose(overrides), deploy)))
        fed = fu.Federation(home / "fed")
        run_proc: subprocess.Popen | None = None
        started = time.monotonic()

        def node_config(i: int) -> str:
            return f"partition-id={i} num-partitions={args.nodes} threads=1"

        try:
            fed.start_superlink()
            names = {}
            for i in range(args.nodes):  # staggered: each new node makes the ServerApp start an identify process
                names[i] = fed.start_supernode(node_config(i), name=f"node{i}")
                time.sleep(args.start_interval)
                if available_gb() < args.min_free_gb:
                    raise LowMemory(f"{available_gb():.1f} GB available after starting {i + 1} SuperNodes")
            log = open(home / "flwr_run.log", "wb")  # noqa: SIM115 - open while the run streams
            run_proc = subprocess.Popen([str(fu.BIN / "flwr"), "run", ".", fed.connection, "--run-config",
                                         str(config), "--stream"], env=fed.env, cwd=REPO, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            restarts = 0
            # The run lives on the SuperLink: wait for its summary, not for the CLI (which may exit first)
            while not (run_dir / "summary.json").exists():
                if time.monotonic() - started > args.timeout:
                    print(f"timeout after {args.timeout:g} s", flush=True)
                    break
                if available_gb() < args.min_free_gb:
                    raise LowMemory(f"{available_gb():.1f} GB available during the run")
                done = len(read_rows(run_dir / "metrics.jsonl"))
                while schedule and done >= schedule[0][0]:
                    after, action, nodes, sig = schedule.pop(0)
                    for i in nodes:
                        if action == "kill":
                            fed.kill(names[i], sig)
                        else:
                            restarts += 1
                            names[i] = fed.start_supernode(node_config(i), name=f"node{i}-restart{restarts}")
                    events.append(f"after round {after}: {action} nodes {nodes}"
                                  + (f" ({signal.Signals(sig).name})" if sig else ""))
                    print(f"[{time.monotonic() - started:6.0f} s] {events[-1]}", flush=True)
                time.sleep(1.0)
        except LowMemory as err:
            print(f"error: stopped: {err} (--min-free-gb {args.min_free_gb:g}); each SuperNode is two "
                  "processes (SuperNode, SuperExec) and each message a third", file=sys.stderr)
            return 3
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C must not leave processes behind
            if run_proc is not None and run_proc.poll() is None:
                os.killpg(run_proc.pid, signal.SIGKILL)
                run_proc.wait(timeout=10)
            fed.stop()
            signal.signal(signal.SIGINT, signal.default_int_handler)
        rows = read_rows(run_dir / "metrics.jsonl")
        elapsed = time.monotonic() - started
        complete = (run_dir / "summary.json").exists() and len(rows) == args.rounds
        if not complete:
            print((home / "flwr_run.log").read_text(errors="replace")[-4000:])
            print(f"error: the run did not complete ({len(rows)} of {args.rounds} rounds in {elapsed:.0f} s)",
                  file=sys.stderr)
            return 1
        churn_model = torch.load(run_dir / "model.pt", weights_only=True)
        print(f"\n{args.nodes} SuperNodes (1 thread each), {args.per_round} per round, {len(churned)} killed and "
              f"restarted; {args.rounds} rounds in {elapsed:.0f} s")
        print("round  took part  bytes_down  bytes_up  round_s  missing (reason)")
        missing: dict[int, set[int]] = {}
        for row in rows:
            gone = missing_of(row)
            missing[row["round"]] = set(gone)
            reasons = "; ".join(f"{c}: {why[:60]}" for c, why in sorted(gone.items())) or "-"
            print(f"{row['round']:>5}  {row['num_clients']:>9}  {row['bytes_down']:>10}  {row['bytes_up']:>8}  "
                  f"{row['round_time_s']:7.1f}  {reasons}")
        base = replay(overrides, missing, home / "replay")
    diff = max(float((churn_model[k] - base[k]).abs().max()) for k in churn_model)
    ok = diff <= TOLERANCE
    print(f"final model vs the same participants without churn (in process): max |diff| {diff:.2e}; "
          f"tolerance {TOLERANCE:g}: {'within' if ok else 'NOT within'}")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
