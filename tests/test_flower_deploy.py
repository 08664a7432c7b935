"""Deployment through real Flower processes on loopback: SuperLink, SuperNodes, ``flwr run``.

One federation with TLS and SuperNode authentication, reused by two runs: SCAFFOLD equals the
simulator (so each SuperNode kept its client's control variate across rounds) and a SuperNode with
an unregistered key is refused; a SuperNode killed mid-run does not stop the run. Two insecure ones
(``--insecure``, as docs/deploy.md's loopback recipe): one of 2 SuperNodes is killed whole after
round 1's checkpoint and restarted, and `flwr run` resumes it; one runs an installed plug-in.
Every process is stopped by PID.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from fl_platform.experiment import run_experiment
from fl_platform.flower.config import DeployConf, compose, flatten_config, to_toml

_spec = importlib.util.spec_from_file_location("flower_utils", Path(__file__).with_name("flower_utils.py"))
flower_utils = sys.modules.setdefault("flower_utils", importlib.util.module_from_spec(_spec))
if not hasattr(flower_utils, "Federation"):
    _spec.loader.exec_module(flower_utils)
Federation = flower_utils.Federation

pytestmark = [
    pytest.mark.flower,
    pytest.mark.slow,
    pytest.mark.xdist_group("flower_deploy"),  # one pytest worker: each federation fixture starts once
    pytest.mark.skipif(not (flower_utils.BIN / "flower-superlink").exists(), reason="flwr CLI not installed"),
]

DATA_ROOT = Path(__file__).resolve().parents[2] / "shared" / "data"
SMALL = ["num_clients=3", "clients_per_round=3", "rounds=3", "partition=iid", "train.epochs=1",
         "logger.progress=false"]
# Equality with the simulator needs a round after the first (SCAFFOLD: each node's c_i from round 1 is used in
# round 2; resume: a round after the checkpoint); the node-loss test needs three (a round without the node
# after the one it died in). Each round starts a ClientApp process per message, so runs are kept this short.
TWO_ROUNDS = ["rounds=2"]
RUN_TIMEOUT = 420.0  # seconds for one `flwr run` of 3 rounds (the machine is shared)


def node_config(i: int) -> str:
    return f'partition-id={i} num-partitions=3 data-root="{DATA_ROOT}" threads=1'


def start_nodes(fed: Federation, keys: list[Path] | None = None) -> None:
    for i in range(3):
        fed.start_supernode(node_config(i), name=f"node{i}", private_key=keys[i] if keys else None)


def write_run_config(tmp: Path, overrides: list[str], **deploy) -> tuple[Path, Path]:
    run_dir = tmp / "flower"
    deploy = {"round_timeout": 180.0, "connect_timeout": 180.0, "run_dir": str(run_dir), **deploy}
    path = tmp / "run_config.toml"
    path.write_text(to_toml(flatten_config(compose([*SMALL, *overrides]), DeployConf(**deploy))))
    return path, run_dir


def diagnostics(fed: Federation, proc_out: str = "") -> str:
    logs = "\n".join(f"--- {name}\n{fed.log(name)[-1500:]}" for name in ["superlink", "node0", "node1", "node2"])
    return f"{proc_out[-3000:]}\n{logs}"


@pytest.fixture(scope="module")
def app(tmp_path_factory) -> str:
    """The app folder every ``flwr run`` here packages (flower_utils.stage_app: the FAB of ``flwr run .``)."""
    return str(flower_utils.stage_app(tmp_path_factory.mktemp("app")))


def flower_run(fed: Federation, app: str, tmp: Path, overrides: list[str], **deploy) -> Path:
    path, run_dir = write_run_config(tmp, overrides, **deploy)
    proc = fed.flwr("run", app, fed.connection, "--run-config", str(path), "--stream", timeout=RUN_TIMEOUT,
                    check=False)
    assert (run_dir / "summary.json").exists(), f"flwr run did not finish:\n{diagnostics(fed, proc.stdout + proc.stderr)}"
    return run_dir


def simulate(tmp: Path, overrides: list[str]) -> Path:
    run_experiment(compose([*SMALL, *overrides]), tmp / "sim")
    return tmp / "sim"


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def assert_same_model(flower_dir: Path, sim_dir: Path) -> None:
    a = torch.load(flower_dir / "model.pt", weights_only=True)
    b = torch.load(sim_dir / "model.pt", weights_only=True)
    assert a.keys() == b.keys()
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff < 1e-5, f"final global model differs from the simulator's by {diff}"


def assert_run_dir_like_the_simulators(flower_dir: Path, sim_dir: Path) -> None:
    assert OmegaConf.load(flower_dir / "config.yaml") == OmegaConf.load(sim_dir / "config.yaml")
    rounds = OmegaConf.load(sim_dir / "config.yaml").rounds
    f_rows, s_rows = rows(flower_dir), rows(sim_dir)
    assert [r["round"] for r in f_rows] == [r["round"] for r in s_rows] == list(range(1, rounds + 1))
    core = {"round", "num_clients", "bytes_up", "bytes_down", "round_time_s", "wall_time_s", "train_loss",
            "train_accuracy", "test_loss", "test_accuracy"}
    for f, s in zip(f_rows, s_rows):
        assert core <= f.keys() and core <= s.keys()
        assert f["num_clients"] == 3 and f["test_accuracy"] == pytest.approx(s["test_accuracy"], abs=1e-6)
        assert f["train_loss"] == pytest.approx(s["train_loss"], rel=1e-5)
        # measured on the serialised messages: the dense tensors plus Flower's framing
        assert s["bytes_down"] < f["bytes_down"] < 1.1 * s["bytes_down"]
        assert s["bytes_up"] < f["bytes_up"] < 1.1 * s["bytes_up"]
    f_sum = json.loads((flower_dir / "summary.json").read_text())
    s_sum = json.loads((sim_dir / "summary.json").read_text())
    assert f_sum["engine"] == "flower" and f_sum["rounds"] == rounds
    assert f_sum["final_test_accuracy"] == pytest.approx(s_sum["final_test_accuracy"])


# ---------------------------------------------------------------- TLS + SuperNode authentication


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    home = tmp_path_factory.mktemp("flwr-secure")
    fed = Federation(home, tls=True, node_auth=True)
    try:
        fed.start_superlink()
        keys = [flower_utils.make_node_key(home / "keys", f"node{i}") for i in range(4)]
        for _, public in keys[:3]:
            out = fed.flwr("supernode", "register", str(public), fed.connection).stdout
            assert "registered" in out, out
        start_nodes(fed, [private for private, _ in keys[:3]])
        fed.start_supernode(node_config(0), name="intruder", private_key=keys[3][0])  # key never registered
        yield fed
    finally:
        fed.stop()


def test_tls_and_node_auth_scaffold_equals_the_simulator_and_refuses_unregistered_nodes(secure, app, tmp_path):
    """Over TLS with SuperNode authentication, SCAFFOLD through Flower equals the simulator: the final model,
    every result row and the run dir's layout (FedAvg's path with client state on top: it is equal only if
    every SuperNode kept its client's c_i from round to round, since from round 2 on each client's gradient
    correction is c - c_i; FedAvg alone is compared in the resume test below). The SuperNode with an
    unregistered key is refused. (One run for both: each Flower round starts a process per message.)"""
    flower_dir = flower_run(secure, app, tmp_path, ["algorithm=scaffold", *TWO_ROUNDS])
    sim_dir = simulate(tmp_path, ["algorithm=scaffold", *TWO_ROUNDS])
    assert_same_model(flower_dir, sim_dir)
    assert_run_dir_like_the_simulators(flower_dir, sim_dir)
    f_rows, s_rows = rows(flower_dir), rows(sim_dir)
    assert [r["control_norm"] for r in f_rows] == pytest.approx([r["control_norm"] for r in s_rows], rel=1e-5)
    assert (flower_dir / "partition.npz").exists() and (flower_dir / "run_config.toml").exists()
    intruder = secure.procs["intruder"]
    try:
        code = intruder.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the SuperNode with an unregistered key is still running:\n{secure.log('intruder')[-2000:]}")
    assert code != 0 and "Failed to activate SuperNode" in secure.log("intruder")
    listed = json.loads(secure.flwr("supernode", "list", secure.connection, "--format", "json").stdout)
    nodes = listed.get("nodes", listed) if isinstance(listed, dict) else listed
    assert len(nodes) == 3, listed  # only the registered ones
    summary = json.loads((flower_dir / "summary.json").read_text())
    assert len(summary["nodes"]) == 3


def test_a_supernode_killed_mid_run_does_not_stop_the_run(secure, app, tmp_path):
    """The node of client 2 disappears (SIGKILL, no goodbye) once it received its round-2 message.

    Round 2 ends when the SuperLink declares the node unavailable (its heartbeats stop: <= 60 s)
    or at ``deploy.round_timeout``, whichever comes first, with the two replies that arrived;
    round 3 goes on without the node. (The timeout path alone is tested in test_flower_unit.py.)
    """
    path, run_dir = write_run_config(tmp_path, ["algorithm=fedavg"], round_timeout=120.0, min_replies=1)
    proc = subprocess.Popen([str(flower_utils.BIN / "flwr"), "run", app, secure.connection, "--run-config", str(path),
                             "--stream"], env=secure.env, cwd=flower_utils.REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        seen = len(secure.log("node2"))
        while time.monotonic() < deadline:
            if re.search(r"ROUND 2\]\s*\n.*Receiving: train", secure.log("node2")[seen:]):
                break
            assert proc.poll() is None, f"run ended before round 2:\n{diagnostics(secure)}"
            time.sleep(0.2)
        else:
            pytest.fail(f"client 2 never received its round-2 message:\n{diagnostics(secure)}")
        secure.kill("node2", signal.SIGKILL)
        out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert (run_dir / "summary.json").exists(), f"the run did not complete:\n{diagnostics(secure, out)}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 3
    r = rows(run_dir)
    assert 2 not in r[0].get("rejected_clients", [])
    for row in r[1:]:
        assert 2 in row["rejected_clients"] and row["num_clients"] <= 2
        reason = row["rejected_reasons"]["2"]
        assert any(k in reason.lower() for k in ("no reply within", "unavailable", "no supernode")), reason
    log_text = (run_dir / "server.log").read_text()
    assert re.search(r"WARNING .*round 2: client 2 rejected", log_text), log_text[-3000:]


# ---------------------------------------------------------------- checkpoint/resume


@pytest.mark.xdist_group("own_federation")  # its own federation: may run beside the TLS one
def test_a_flower_run_resumes_after_the_superlink_and_serverapp_are_killed(app, tmp_path):
    """2 SuperNodes, 2 rounds, checkpoint_every=1. Once round 1's checkpoint is published the SuperLink's
    process group (the ServerApp with it) and the SuperNodes are killed (SIGKILL); a fresh SuperLink and
    SuperNodes are started and ``flwr run`` is given the same run config: it continues after the checkpoint
    (trains round 2 only) and ends with the model and rows of an uninterrupted run (the simulator's,
    which a Flower run equals: tests above)."""
    overrides = ["algorithm=fedavg", "num_clients=2", "clients_per_round=2", "checkpoint_every=1", *TWO_ROUNDS]
    fed = Federation(tmp_path / "fed")

    def start(tag: str) -> None:
        fed.start_superlink()
        for i in range(2):
            fed.start_supernode(f'partition-id={i} num-partitions=2 data-root="{DATA_ROOT}" threads=1',
                                name=f"node{i}{tag}")

    path, run_dir = write_run_config(tmp_path, overrides)
    latest = run_dir / "checkpoint" / "LATEST"
    proc = None
    try:
        start("a")
        first = tmp_path / "first_run.log"
        with open(first, "wb") as out_file:
            proc = subprocess.Popen([str(flower_utils.BIN / "flwr"), "run", app, fed.connection, "--run-config",
                                     str(path), "--stream"], env=fed.env, cwd=flower_utils.REPO, stdout=out_file,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + RUN_TIMEOUT
        while not (latest.exists() and latest.read_text().strip() == "round-00000001"):
            ended = proc.poll() is not None and not latest.exists()
            assert time.monotonic() < deadline and not ended and not (run_dir / "summary.json").exists(), (
                f"no round-1 checkpoint:\n{first.read_text()[-2000:]}\n{fed.log('superlink')[-2000:]}")
            time.sleep(0.05)
        for name in ["superlink", "node0a", "node1a"]:
            fed.kill(name, signal.SIGKILL)
        assert not (run_dir / "summary.json").exists(), "the run finished before it was killed"
        killed_at = latest.read_text().strip()
        before = (run_dir / "server.log").read_text()
        start("b")
        out = fed.flwr("run", app, fed.connection, "--run-config", str(path), "--stream", timeout=RUN_TIMEOUT,
                       check=False)
        assert (run_dir / "summary.json").exists(), (
            f"the resumed run did not finish:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}\n"
            + "\n".join(f"--- {n}\n{fed.log(n)[-1500:]}" for n in ["superlink", "node0b", "node1b"]))
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        fed.stop()
    resumed_log = (run_dir / "server.log").read_text()[len(before):]
    k = int(killed_at.split("-")[1])
    assert f"resumed from {run_dir / 'checkpoint' / killed_at} after round {k}" in resumed_log, resumed_log[-3000:]
    for node in ("node0b", "node1b"):  # the new SuperNodes trained the rounds after the checkpoint only
        assert fed.log(node).count("Receiving: train") == 2 - k, fed.log(node)[-2000:]
    sim_dir = simulate(tmp_path, overrides)
    assert_same_model(run_dir, sim_dir)
    f_rows, s_rows = rows(run_dir), rows(sim_dir)
    assert [r["round"] for r in f_rows] == [1, 2]
    for f, s in zip(f_rows, s_rows):
        assert f["num_clients"] == 2
        assert f["test_accuracy"] == pytest.approx(s["test_accuracy"], abs=1e-6)
        assert f["train_loss"] == pytest.approx(s["train_loss"], rel=1e-5)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["flower_run_id"] != 0


# ---------------------------------------------------------------- an installed plug-in


@pytest.mark.xdist_group("own_federation")  # its own federation: may run beside the TLS one
def test_an_entry_point_plugins_own_field_deploys_without_editing_pyproject(app, tmp_path, monkeypatch):
    """tests/plugin_pkg installed (an fl_platform.algorithms entry point, clip_ep) and on every process's path:
    its own field algorithm.max_norm and the custom loader's dataset.n travel in the run config's ``extra``
    (pyproject.toml untouched, so the SuperLink accepts the run) and the run equals the simulator's."""
    from fl_platform.config import unregister_algorithm_option

    from .test_plugins import DATA, MODEL, TESTS, install

    monkeypatch.syspath_prepend(str(TESTS))
    name = install(tmp_path, monkeypatch, "clip_ep")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), str(TESTS),
                                                      os.environ.get("PYTHONPATH", "")]))
    overrides = [*DATA, *MODEL, f"algorithm={name}", "algorithm.max_norm=0.05", "rounds=1"]
    fed = Federation(tmp_path / "fed")
    try:
        fed.start_superlink()
        for i in range(3):  # (no data-root: the plug-in's loader makes its data and takes no root)
            fed.start_supernode(f"partition-id={i} num-partitions=3 threads=1", name=f"node{i}")
        flower_dir = flower_run(fed, app, tmp_path, overrides)
        given = OmegaConf.load(flower_dir / "config.yaml")
        assert (given.algorithm.name, given.algorithm.max_norm, given.dataset.n) == (name, 0.05, 240)
        assert_same_model(flower_dir, simulate(tmp_path, overrides))
    finally:
        fed.stop()
        unregister_algorithm_option(name)
