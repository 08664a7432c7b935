"""Multi-node cases for tests/test_engine_cluster.py, run in a process of their own.

A driver process joins one Ray instance for its lifetime and the test session already runs a local
one, so each mode runs here, in a subprocess, and prints one JSON line per case:
``{"case": ..., "ok": bool, "detail": ...}``.

``python tests/cluster_cases.py cluster <tmp>``: ``ray.cluster_utils.Cluster`` with a head (no CPUs)
and three nodes (2 CPUs each, their own node-local folder through ``FL_NODE_STATE_DIR``, and an
audit hook that logs every file access under the nodes' folders, with the accessing process's own
folder); 3 Ray workers, one per node. ``python tests/cluster_cases.py join <tmp>``: a head started by ``ray start --head`` and two worker
nodes started by ``python tests/cluster_cases.py node <address>`` subprocesses (what ``ray start
--address`` does, minus its refusal to add nodes when ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps
every process on loopback), on free loopback ports; the driver joins with ``engine.address`` and
the job ships this checkout (``engine.runtime_env=auto``).

Everything started here is stopped here, by PID (``Cluster.shutdown`` or SIGTERM to the blocking
``ray start`` processes); Ray's temporary files go to ``<tmp>`` (``RAY_TMPDIR``), so no other Ray
on the machine finds these clusters.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import compose_config  # the tests' config composition, as the CLI does it

from fl_platform.experiment import build
from fl_platform.rounds.engine import StateLost
from fl_platform.rounds.simulation import is_timing_key

COMMON = ("rounds=5", "train.epochs=1", "clients_per_round=12", "engine.threads_per_worker=1")
RAY3 = ("engine=ray", "engine.num_workers=3")

# Installed on every node (PYTHONPATH): logs file accesses under FL_AUDIT_ROOT with the process's own folder.
SITECUSTOMIZE = '''
import os, sys
_root, _log = os.environ.get("FL_AUDIT_ROOT"), os.environ.get("FL_AUDIT_LOG")
if _root and _log:
    _own, _busy = os.environ.get("FL_NODE_STATE_DIR", ""), []
    def _hook(event, args):
        if _busy or event not in ("open", "os.mkdir", "os.rename", "os.remove", "os.rmdir", "os.listdir",
                                  "os.scandir", "shutil.rmtree"):
            return
        paths = [a for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))]
        hits = [os.fsdecode(p) for p in paths if os.path.abspath(os.fsdecode(p)).startswith(_root)]
        if hits:
            _busy.append(1)
            try:
                with open(os.path.join(_log, f"{os.getpid()}.log"), "a") as fh:
                    for p in hits:
                        fh.write(f"{_own}\\t{event}\\t{os.path.abspath(p)}\\n")
            finally:
                _busy.pop()
    sys.addaudithook(_hook)
'''


def report(case: str, ok: bool, detail: object = "") -> None:
    print(json.dumps({"case": case, "ok": bool(ok), "detail": detail}), flush=True)


def run(*overrides: str, run_dir: Path | None = None, on_round: Callable | None = None,
        prepare: Callable | None = None):
    """Build and run; returns (experiment, final weights, result rows) or raises the run's error.
    ``prepare(exp)`` is called between the two."""
    exp = build(compose_config(*COMMON, *overrides), run_dir)
    if prepare is not None:
        prepare(exp)
    if on_round is not None:
        exp.simulation.reporter = _Hook(exp, on_round)
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    rows = [{k: v for k, v in row.items() if not is_timing_key(k)} for row in exp.simulation.history]
    return exp, exp.simulation.server.weights.clone(), rows


class _Hook:
    """A reporter that calls ``fn(exp, round)`` after each logged round (the first time only)."""

    def __init__(self, exp, fn: Callable) -> None:
        self.exp, self.fn, self.seen = exp, fn, set()

    def round_done(self, row: dict) -> None:
        if row["round"] not in self.seen:
            self.seen.add(row["round"])
            self.fn(self.exp, row["round"])

    def close(self, summary: dict | None = None) -> None:
        pass


def same(a, b) -> tuple[bool, str]:
    """The determinism bar of test_engine_determinism: weights within 1e-6, identical result rows."""
    (_, wa, ra), (_, wb, rb) = a, b
    diff = float((wa - wb).abs().max())
    rows_ok = len(ra) == len(rb) and all(
        x.keys() == y.keys() and all(
            (abs(x[k] - y[k]) <= 1e-6 * abs(y[k]) + 1e-9) if isinstance(x[k], float) else x[k] == y[k] for k in x)
        for x, y in zip(ra, rb))
    return diff <= 1e-6 and rows_ok, f"max abs weight diff {diff:.3g}, rows equal: {rows_ok}"


def case(name: str, fn: Callable[[], tuple[bool, object]]) -> None:
    t0 = time.perf_counter()
    try:
        ok, detail = fn()
    except Exception:  # reported, not raised: the other cases still run
        ok, detail = False, traceback.format_exc()[-3000:]
    report(name, ok, {"detail": detail, "seconds": round(time.perf_counter() - t0, 1)})


# ---------------------------------------------------------------------------------------------- cluster


def cluster_mode(tmp: Path) -> None:
    import ray
    from ray.cluster_utils import Cluster

    nodes_root, audit = tmp / "nodes", tmp / "audit"
    site = tmp / "site"
    for d in (nodes_root, audit, site):
        d.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    counter = iter(range(100))

    def add_node(cluster: Cluster):
        own = nodes_root / f"n{next(counter)}"
        own.mkdir()
        return cluster.add_node(num_cpus=2, env_vars={
            "FL_NODE_STATE_DIR": str(own), "PYTHONPATH": str(site), "FL_AUDIT_ROOT": str(nodes_root),
            "FL_AUDIT_LOG": str(audit), "OMP_NUM_THREADS": "1"})

    t0 = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(3):
            add_node(cluster)
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, configure_logging=False)
        report("cluster_up", True, {"seconds": round(time.perf_counter() - t0, 1)})
        cluster_cases(cluster, add_node, tmp, nodes_root, audit)
    finally:
        ray.shutdown()
        cluster.shutdown()


def remove_node_of(cluster, exp, worker: int) -> str:
    """Remove the node that hosts ``worker`` (with everything on it); returns its id."""
    node_id = exp.engine.pool.nodes[worker]
    (node,) = [n for n in cluster.worker_nodes if n.node_id == node_id]
    cluster.remove_node(node)
    return node_id


def cluster_cases(cluster, add_node, tmp: Path, nodes_root: Path, audit: Path) -> None:
    import ray

    refs = {"fedavg": run("algorithm=fedavg"), "scaffold": run("algorithm=scaffold")}

    def fedavg_equal():
        return same(run("algorithm=fedavg", *RAY3), refs["fedavg"])

    def scaffold_node_local_equal():
        got = run("algorithm=scaffold", *RAY3, "engine.state_store=distributed", "engine.state_cache_mb=0.001")
        ok, detail = same(got, refs["scaffold"])
        spread = len(set(got[0].engine.pool.nodes)) == 3
        return ok and spread, f"{detail}; one worker per node: {spread}"

    def missing_state_names_the_client():
        victim = 1

        def wipe(exp, round_done):
            if round_done == 2:  # the home's node-local files vanish and its process restarts
                info = ray.get(exp.engine.pool[victim].node_info.remote())
                shutil.rmtree(Path(info["state_dir"]) / f"worker-{victim}")
                ray.kill(exp.engine.pool[victim], no_restart=True)
                manifest.update(exp.engine.manifest.rounds)

        manifest: dict[int, int] = {}
        try:
            run("algorithm=scaffold", *RAY3, "engine.state_store=disk", on_round=wipe)
        except StateLost as err:
            import re

            found = re.search(r"client (\d+): its state from round (\d+) is missing on (its home )?worker (\d+)",
                              str(err))
            ok = (found is not None and int(found[1]) % 3 == victim and int(found[4]) == victim
                  and manifest.get(int(found[1])) == int(found[2]) - 1 and "no checkpoint" in str(err))
            return ok, str(err)[:600]
        return False, "the run finished: the missing state was not noticed"

    def node_lost_without_checkpoint_fails():
        lost = {}

        def kill(exp, round_done):
            if round_done == 2:
                lost["node"] = remove_node_of(cluster, exp, 1)

        try:
            run("algorithm=scaffold", *RAY3, "engine.state_store=memory", on_round=kill)
            return False, "the run finished although states were lost"
        except StateLost as err:
            msg = str(err)
            ok = f"node {lost['node'][:12]}" in msg and "Ray workers [1]" in msg and "no checkpoint" in msg
            return ok, msg[:600]
        finally:
            add_node(cluster)

    def node_lost_recovers_from_checkpoint():
        lost = {}

        def kill(exp, round_done):
            if round_done == 3 and not lost:  # the checkpoint is after round 2
                lost["node"] = remove_node_of(cluster, exp, 1)
                lost["exp"] = exp

        try:
            got = run("algorithm=scaffold", *RAY3, "engine.state_store=distributed", "checkpoint_every=2",
                      run_dir=tmp / "run-recover", on_round=kill)
        finally:
            add_node(cluster)
        ok, detail = same(got, refs["scaffold"])
        moved = bool(lost) and got[0].engine.pool.nodes[1] != lost["node"]
        rounds = [row["round"] for row in got[2]]
        rollbacks = got[0].simulation.rollbacks  # checkpoint round -> times rolled back to it
        return (ok and moved and rounds == [1, 2, 3, 4, 5] and rollbacks == {2: 1},
                f"{detail}; worker 1 moved: {moved}; rounds {rounds}; rollbacks {rollbacks}")

    def fedavg_node_lost_reruns_elsewhere():
        lost = {}

        def kill(exp, round_done):
            if round_done == 2 and not lost:
                lost["node"] = remove_node_of(cluster, exp, 2)

        try:
            got = run("algorithm=fedavg", *RAY3, on_round=kill)
        finally:
            add_node(cluster)
        ok, detail = same(got, refs["fedavg"])
        return ok and got[0].engine.restarts == 1, f"{detail}; restarts {got[0].engine.restarts}"

    def lent_states_lost_with_their_node():
        """Round 1, clients placed round-robin (so most train away from their homes), states of a 512-wide
        MLP (object-store objects, not inside the replies): the node of a worker that trained lent clients
        is lost after every result arrived, before their homes took the new states back. The round ends
        with StateLost naming the worker (a rollback; here, with no checkpoint, the run stops); it used to
        retry the homes' imports until engine.max_restarts and end with a RuntimeError."""
        lost = {}

        def prepare(exp):
            finish = exp.engine._finish_round

            def finish_round(ctx, lending):
                if not lost:
                    trainer = next(t for t in range(3) if any(lending.needs[h][t] for h in range(3) if h != t))
                    lost["worker"], lost["node"] = trainer, remove_node_of(cluster, exp, trainer)
                return finish(ctx, lending)

            exp.engine._finish_round = finish_round

        try:
            run("algorithm=scaffold", *RAY3, "engine.state_store=distributed", "engine.scheduler=round_robin",
                "model.hidden=[512]", "rounds=1", prepare=prepare)
            return False, "the run finished although the lent states were lost"
        except StateLost as err:
            msg = str(err)
            ok = (f"Ray workers [{lost['worker']}] died with node {lost['node'][:12]}" in msg
                  and "held this round's new states, not yet applied" in msg and "no checkpoint" in msg)
            return ok, msg[:600]
        finally:
            add_node(cluster)

    def node_folders_only():
        """Every access under the nodes' folders came from a process of that node, inside its own folder;
        the driver's run dir holds no client states."""
        lines = [line.split("\t") for f in audit.glob("*.log") for line in f.read_text().splitlines()]
        foreign = [(own, event, path) for own, event, path in lines
                   if not own or not (path == own or path.startswith(own + os.sep))]
        writers = {own for own, event, path in lines if path.endswith((".bin", ".tmp"))}
        in_run_dir = list((tmp / "run-recover").rglob("client_state*"))
        gathered = [p for p in in_run_dir if p.parent.name.startswith("round-")]
        ok = not foreign and len(writers) >= 3 and in_run_dir == gathered
        return ok, {"accesses": len(lines), "foreign": foreign[:5], "nodes_that_wrote_states": len(writers),
                    "run_dir_client_state": [str(p) for p in in_run_dir][:5]}

    case("fedavg_inline_equals_ray_3_nodes", fedavg_equal)
    case("scaffold_node_local_disk_equals_inline", scaffold_node_local_equal)
    case("missing_state_names_the_client", missing_state_names_the_client)
    case("node_lost_without_checkpoint_fails_naming_it", node_lost_without_checkpoint_fails)
    case("node_lost_recovers_from_checkpoint", node_lost_recovers_from_checkpoint)
    case("fedavg_node_lost_reruns_elsewhere", fedavg_node_lost_reruns_elsewhere)
    case("lent_states_lost_with_their_node_stop_the_round", lent_states_lost_with_their_node)
    case("nodes_touch_only_their_own_folders", node_folders_only)


# ---------------------------------------------------------------------------------------------- join


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def ray_start_head(port: int, env: dict) -> subprocess.Popen:
    """``ray start --head --block`` on loopback: SIGTERM stops it and every process it started."""
    client, agent, metrics, env_agent, manager, objects = free_ports(6)
    ray_bin = str(Path(sys.executable).with_name("ray"))
    return subprocess.Popen(
        [ray_bin, "start", "--head", "--block", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=0",
         "--include-dashboard=false", "--disable-usage-stats", f"--ray-client-server-port={client}",
         f"--dashboard-agent-listen-port={agent}", f"--metrics-export-port={metrics}",
         f"--runtime-env-agent-port={env_agent}", f"--node-manager-port={manager}", f"--object-manager-port={objects}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def start_node(address: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "node", address], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def node_mode(address: str) -> None:
    """A worker node (1 CPU) of the cluster at ``address``, until SIGTERM stops it and its processes."""
    import ray
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    agent, metrics, env_agent = free_ports(3)
    params = RayParams(gcs_address=address, node_ip_address="127.0.0.1", num_cpus=1, num_gpus=0,
                       object_store_memory=150 * 2**20, min_worker_port=0, max_worker_port=0, node_manager_port=0,
                       include_log_monitor=False, dashboard_agent_listen_port=agent, metrics_export_port=metrics,
                       runtime_env_agent_port=env_agent, env_vars={"OMP_NUM_THREADS": "1"},
                       # unique per process (a node numbers its sockets per process: two would collide)
                       raylet_socket_name=os.path.join(os.environ["RAY_TMPDIR"], f"raylet.{os.getpid()}"),
                       plasma_store_socket_name=os.path.join(os.environ["RAY_TMPDIR"], f"plasma.{os.getpid()}"))
    Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)  # its SIGTERM handler stops them all
    del ray
    while True:
        time.sleep(1)


def join_mode(tmp: Path) -> None:
    import ray

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    procs = [ray_start_head(port, env)]
    try:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 120:  # the head is up when a driver can connect
            try:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
                break
            except Exception:
                time.sleep(1)
        procs += [start_node(address, env) for _ in range(2)]
        while len([n for n in ray.nodes() if n["Alive"]]) < 3 and time.perf_counter() - t0 < 180:
            time.sleep(0.5)
        nodes = len([n for n in ray.nodes() if n["Alive"]])
        ray.shutdown()  # the engine connects itself, with the job's runtime_env
        report("cluster_up", nodes == 3, {"nodes": nodes, "seconds": round(time.perf_counter() - t0, 1)})

        def joined():
            ref = run("algorithm=fedavg", "rounds=2")
            cfg = ("algorithm=fedavg", "rounds=2", "engine=ray", f"engine.address={address}", "engine.num_workers=2")
            exp = build(compose_config(*COMMON, *cfg))
            try:
                infos = ray.get([a.node_info.remote() for a in exp.engine.pool])
                exp.simulation.run()
                weights = exp.simulation.server.weights.clone()
            finally:
                exp.engine.close()
            diff = float((weights - ref[1]).abs().max())
            shipped = all("runtime_resources" in i["code"] and "working_dir_files" in i["code"] for i in infos)
            nodes_used = len({i["node_id"] for i in infos})
            owned_shutdown = not ray.is_initialized()
            return (diff <= 1e-6 and shipped and nodes_used == 2 and owned_shutdown,
                    {"diff": diff, "code": [i["code"] for i in infos], "nodes": nodes_used})

        case("join_with_engine_address_ships_the_code", joined)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for p in reversed(procs):  # each blocking `ray start` stops the processes it started
            p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)


if __name__ == "__main__":
    mode, arg = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    if mode == "node":
        node_mode(arg)
    else:
        {"cluster": cluster_mode, "join": join_mode}[mode](Path(arg))
