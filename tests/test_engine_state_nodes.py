"""Client state that belongs to nodes: round stamps and the manifest, gathered checkpoints that resume on
any engine and any number of workers (or refuse), the shared-folder option, and the cluster keys.
The multi-node cases (node loss, node-local folders, joining a cluster) are in test_engine_cluster.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fl_platform.engine.ray_cluster import EXCLUDES, runtime_env_for
from fl_platform.experiment import ConfigError, build, run_experiment
from fl_platform.rounds.simulation import is_timing_key
from fl_platform.state.manifest import ROUND_KEY, Manifest, MissingClientState, checked, stamp

from .conftest import REPO, compose_config, short_tmp

COMMON = ("algorithm=scaffold", "rounds=4", "checkpoint_every=2", "train.epochs=1", "clients_per_round=12",
          "engine.threads_per_worker=1")


def test_checked_refuses_missing_stale_and_foreign_states_by_name():
    state = {"c": torch.ones(3)}
    expected = {7: 2}
    assert torch.equal(checked(7, stamp(state, 2), expected, "worker 1")["c"], state["c"])  # stamp stripped
    assert ROUND_KEY not in checked(7, stamp(state, 2), expected, "worker 1")
    assert checked(8, None, expected, "worker 1") is None  # no state yet, none listed
    with pytest.raises(MissingClientState, match=r"client 7: its state from round 3 is missing on worker 1") as err:
        checked(7, None, expected, "worker 1")
    assert (err.value.client_id, err.value.round) == (7, 2)
    with pytest.raises(MissingClientState, match=r"client 7: worker 1 holds a state from round 2, but the manifest "
                                                 r"lists its state from round 3"):
        checked(7, stamp(state, 1), expected, "worker 1")
    with pytest.raises(MissingClientState, match="lists no state"):
        checked(8, stamp(state, 0), expected, "worker 1")
    assert checked(7, None, None, "worker 1") is None  # no manifest: nothing to check


def test_manifest_records_and_round_trips():
    m = Manifest()
    m.record(0, [3, 5])
    m.record(2, [5, 9])
    assert m.expected([3, 5, 9, 11]) == {3: 0, 5: 2, 9: 2}
    assert Manifest.from_state_dict(m.state_dict()).rounds == {3: 0, 5: 2, 9: 2}


def test_runtime_env_default_ships_the_checkout_only_when_joining():
    shipped = runtime_env_for("auto", joining=True)
    assert shipped == {"working_dir": str(REPO), "excludes": EXCLUDES}
    assert runtime_env_for("auto", joining=False) is None  # a local Ray runs on this machine
    assert runtime_env_for(None, joining=True) is None and runtime_env_for({}, joining=True) is None
    merged = runtime_env_for({"env_vars": {"A": "1"}}, joining=False)
    assert merged == {**shipped, "env_vars": {"A": "1"}}
    assert runtime_env_for({"working_dir": None, "pip": ["x"]}, joining=True) == {"pip": ["x"]}
    with pytest.raises(ValueError, match=r"engine\.runtime_env must be auto, null or a mapping"):
        runtime_env_for("yes", joining=True)


@pytest.mark.parametrize("overrides,key", [
    (("engine.state_dir_shared=true", "engine.state_store=disk"), "engine.state_dir_shared"),
    (("engine=ray", "engine.state_dir_shared=true"), "engine.state_dir_shared"),  # memory store
    (("engine.runtime_env=null",), "engine.runtime_env"),
    (("engine.address=127.0.0.1:6379",), "engine.address"),
    (("engine=ray", "engine.runtime_env=ship"), "engine.runtime_env"),
    (("engine.start_timeout_s=30",), "engine.start_timeout_s"),  # Ray-only keys under engine=inline
    (("engine.max_restarts=1",), "engine.max_restarts"),
    (("engine.cpus_per_worker=2",), "engine.cpus_per_worker"),
    (("engine.gpus_per_worker=0.5",), "engine.gpus_per_worker"),
])
def test_cluster_keys_are_refused_where_they_do_nothing(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        build(compose_config(*COMMON, *overrides))


def results(run_dir) -> list[dict]:
    import json

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not is_timing_key(k)} for r in rows]


class _Interrupt:
    """Reporter: Ctrl-C once ``after`` rounds are logged (round 3: the checkpoint is after round 2)."""

    def __init__(self, after: int = 3) -> None:
        self.after = after

    def round_done(self, row: dict) -> None:
        if row["round"] == self.after:
            raise KeyboardInterrupt

    def close(self, summary=None) -> None:
        pass


def interrupted(run_dir, *overrides: str):
    exp = build(compose_config(*COMMON, *overrides), run_dir)
    exp.simulation.reporter = _Interrupt()
    try:
        with pytest.raises(KeyboardInterrupt):
            exp.simulation.run()
    finally:
        exp.engine.close()
    return exp


LOOPBACK_SCRIPT = """
import json, os
import psutil
from fl_platform import api
from fl_platform.experiment import build

exp = build(api.compose(["engine=ray", "engine.num_workers=1", "rounds=1", "num_clients=4",
                         "clients_per_round=2", "engine.threads_per_worker=1", "logger.progress=false"]))
try:
    import ray  # (after the engine: its first import decides the address)

    pids = {p.pid for p in psutil.Process().children(recursive=True)}
    listen = {c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.pid in pids}
    print(json.dumps({"env": os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"), "listen": sorted(listen),
                      "nodes": [n["NodeManagerAddress"] for n in ray.nodes()]}))
finally:
    exp.engine.close()
"""


@pytest.mark.ray
def test_a_ray_the_engine_starts_listens_on_loopback_only():
    """Without engine.address the engine starts a local Ray; Ray has no authentication, so its
    processes (GCS, raylet, workers) listen on 127.0.0.1 only, never on the machine's network
    addresses (Ray's default on Linux), in a process whose environment does not say so."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_ADDRESS")}
    with short_tmp() as tmp:
        proc = subprocess.run([sys.executable, "-c", LOOPBACK_SCRIPT], capture_output=True, text=True, timeout=300,
                              env={**env, "RAY_TMPDIR": tmp, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["env"] == "0" and row["nodes"] == ["127.0.0.1"], row
    assert row["listen"] and set(row["listen"]) <= {"127.0.0.1", "::ffff:127.0.0.1"}, row


@pytest.mark.parametrize("address,warned", [("127.0.0.1", False), ("::1", False), ("192.0.2.2", True)])
def test_a_local_ray_on_a_network_address_is_reported(address, warned, caplog):
    """When Ray was imported before the engine could keep it on loopback (a notebook), the Ray it starts
    listens where Ray chose: the run says where, and how to prevent it."""
    from types import SimpleNamespace

    from fl_platform.engine.ray_cluster import warn_if_listening_beyond_loopback

    fake = SimpleNamespace(get_runtime_context=lambda: SimpleNamespace(get_node_id=lambda: "n1"),
                           nodes=lambda: [{"NodeID": "n0", "NodeManagerAddress": "10.0.0.9"},
                                          {"NodeID": "n1", "NodeManagerAddress": address}])
    with caplog.at_level("WARNING"):
        warn_if_listening_beyond_loopback(fake)
    assert (f"listens on {address}, not only on 127.0.0.1" in caplog.text) is warned
    assert ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in caplog.text) is warned


@pytest.mark.ray
def test_checkpoint_parts_are_written_by_the_nodes_that_see_the_folder(ray_session, tmp_path, monkeypatch):
    """Every home worker whose node sees the checkpoint folder writes its own parts: on one node no client
    state goes through the driver. A node that does not see it (no probe file: here, the driver leaves
    none) has its parts gathered by the driver: the same parts, byte counts logged. Restoring them the same:
    each home worker reads its own part, or the driver reads them all and sends them."""
    from fl_platform.engine import ray_engine

    def parts(run_dir):
        found = sorted((run_dir / "checkpoint").glob("round-*/client_state/part-*.pt"))
        return {p.name: torch.load(p, weights_only=True) for p in found}, sum(p.stat().st_size for p in found)

    ray2 = ("engine=ray", "engine.num_workers=2")
    by_nodes = interrupted(tmp_path / "nodes", *ray2)
    written, nbytes = parts(tmp_path / "nodes")
    assert len(written) == 2 and nbytes > 0 and by_nodes.engine.checkpoint_driver_bytes == 0
    assert not list((tmp_path / "nodes" / "checkpoint").glob("round-*/client_state/.reach-*"))  # probe removed
    monkeypatch.setattr(ray_engine, "leave_probe", lambda directory, sub="": Path(sub) / ".reach-absent")
    by_driver = interrupted(tmp_path / "driver", *ray2)
    gathered, nbytes_driver = parts(tmp_path / "driver")
    assert by_driver.engine.checkpoint_driver_bytes == nbytes_driver > 0
    assert gathered.keys() == written.keys()
    for name in written:
        assert written[name].keys() == gathered[name].keys()
        for cid in written[name]:
            assert all(torch.equal(written[name][cid][k], gathered[name][cid][k]) for k in written[name][cid])
    # Resumed: with the probe (still patched away) the driver reads the parts and sends them to the homes;
    # without, each home worker reads its own part. Both end where the other does.
    through_driver = resume(tmp_path / "driver", *ray2)
    monkeypatch.undo()
    by_nodes = resume(tmp_path / "nodes", *ray2)
    assert by_nodes.engine.restore_driver_bytes == 0
    assert through_driver.engine.restore_driver_bytes == nbytes_driver
    assert torch.equal(by_nodes.simulation.server.weights, through_driver.simulation.server.weights)
    assert results(tmp_path / "nodes") == results(tmp_path / "driver")


def resume(run_dir, *overrides: str):
    exp = build(compose_config(*COMMON, *overrides), run_dir)
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    return exp


@pytest.mark.ray
def test_ray_checkpoint_resumes_inline_and_inline_checkpoint_resumes_on_ray(ray_session, tmp_path):
    """Ray gathers its homes' states into the checkpoint: an inline run resumes from it, and a Ray run with
    another number of workers resumes from an inline checkpoint, both equal to the uninterrupted run."""
    summary = run_experiment(compose_config(*COMMON), tmp_path / "ref")
    ray2 = ("engine=ray", "engine.num_workers=2")
    interrupted(tmp_path / "ray-then-inline", *ray2)
    parts = list((tmp_path / "ray-then-inline" / "checkpoint").glob("round-*/client_state/part-*.pt"))
    assert len(parts) == 2 and not (tmp_path / "ray-then-inline" / "client_state").exists()
    resumed = run_experiment(compose_config(*COMMON), tmp_path / "ray-then-inline")
    assert resumed["final_test_accuracy"] == summary["final_test_accuracy"]
    assert results(tmp_path / "ray-then-inline") == results(tmp_path / "ref")
    interrupted(tmp_path / "inline-then-ray")
    run_experiment(compose_config(*COMMON, *ray2), tmp_path / "inline-then-ray")
    assert results(tmp_path / "inline-then-ray") == results(tmp_path / "ref")


@pytest.mark.ray
def test_ray_resume_refuses_a_checkpoint_without_its_states(ray_session, tmp_path):
    ray2 = ("engine=ray", "engine.num_workers=2")
    interrupted(tmp_path / "run", *ray2)
    (state_file,) = (tmp_path / "run" / "checkpoint").glob("round-*/state.pt")
    saved = torch.load(state_file, weights_only=False)
    manifest = Manifest.from_state_dict(saved["engine"]["client_states"]["manifest"])
    absent = next(c for c in range(100) if c not in manifest)
    manifest.record(1, [absent])  # the manifest lists a state that the checkpoint's parts lack
    saved["engine"]["client_states"]["manifest"] = manifest.state_dict()
    torch.save(saved, state_file)
    with pytest.raises(RuntimeError, match=rf"lacks the states of 1 clients its manifest lists \(e\.g\. \[{absent}\]\)"):
        build(compose_config(*COMMON, *ray2), tmp_path / "run")
    interrupted(tmp_path / "inline-disk", "engine.state_store=disk")  # states stay in <run dir>/client_state
    with pytest.raises(RuntimeError, match="holds no client states, and this run keeps some"):
        build(compose_config(*COMMON, "engine.state_store=disk", *ray2), tmp_path / "inline-disk")


@pytest.mark.ray
def test_ray_shared_state_folder_equals_inline(ray_session, tmp_path):
    """engine.state_dir_shared=true: both workers use the one declared folder (its files are there)."""
    shared = tmp_path / "shared"
    base = ("algorithm=scaffold", "rounds=3", "train.epochs=1", "clients_per_round=12", "engine.threads_per_worker=1")
    ref = build(compose_config(*base))
    ref.simulation.run()
    exp = build(compose_config(*base, "engine=ray", "engine.num_workers=2", "engine.state_store=disk",
                               "engine.state_dir_shared=true", f"engine.state_dir={shared}"))
    try:
        exp.simulation.run()
        assert exp.engine.shared and not exp.engine.lend
        assert len(list(shared.glob("pending/*/*.bin"))) == len(exp.engine.manifest) > 0
    finally:
        exp.engine.close()
    assert float((exp.simulation.server.weights - ref.simulation.server.weights).abs().max()) <= 1e-6


def test_state_dir_is_expanded_on_each_node_not_made_absolute_on_the_driver(monkeypatch, tmp_path):
    """engine.state_dir reaches Ray workers as given and each node expands ~ itself (the driver's home
    means nothing there); inline it is made absolute here; a relative path under Ray is refused."""
    from fl_platform.engine.ray_actors import RayWorker
    from fl_platform.engine.worker import WorkerOptions
    from fl_platform.experiment import make_setup
    from fl_platform.run_config import read_config

    base = ("dataset=digits", "num_clients=4", "clients_per_round=2", "model=mlp", "algorithm=scaffold",
            "engine.state_store=disk")
    exp = build(compose_config(*base, "engine.state_dir='~/fl_node_states'"))
    exp.engine.close()
    assert exp.setup.state_options["directory"] == str(Path.home() / "fl_node_states")  # inline: here
    cfg = compose_config(*base, "engine=ray", "engine.state_dir='~/fl_node_states'", "engine.state_dir_shared=true")
    setup = make_setup(read_config(cfg), exp.setup.dataset)
    assert setup.state_options["directory"] == "~/fl_node_states"  # as given: not the driver's home
    node = RayWorker.__new__(RayWorker)  # its store_options runs on the worker's node
    node.setup, node.worker_id, node.options = setup, 0, WorkerOptions()
    monkeypatch.setenv("HOME", str(tmp_path))  # this "node"'s home
    assert node.store_options()["directory"] == str(tmp_path / "fl_node_states")
    with pytest.raises(ConfigError, match=r"engine\.state_dir is relative \(states\): with engine=ray"):
        build(compose_config(*base, "engine=ray", "engine.state_dir=states"))
