"""The CLI contract: last line `run_dir: <path>`, the run-directory files, sweeps, and clear errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each test runs the CLI in a process of its own

REPO = Path(__file__).resolve().parents[1]


def cli_call(args: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """The CLI's arguments (progress bar off) and environment for ``args``, as the tests run it."""
    # tests/ on the path: tests/plugin_pkg is a user's package (the bad-input list's plug-ins).
    env = {**os.environ, "HYDRA_FULL_ERROR": "0", "PYTHONPATH": str(REPO / "tests")}
    flags = [a for a in args if a.startswith("-")]  # Hydra wants -m before the overrides
    overrides = [a for a in args if not a.startswith("-")]
    return [*flags, "logger.progress=false", *overrides], env


def run_cli(*args: str, cwd: Path = REPO, timeout: int = 240) -> subprocess.CompletedProcess:
    argv, env = cli_call(args)
    return subprocess.run([sys.executable, "-m", "fl_platform.run", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=env)


class ForkServer:
    """tests/cli_forkserver.py: ``python -m fl_platform.run`` as a child forked from one process that has
    the CLI's modules imported, so that each bad-input case does not pay for importing torch and Hydra."""

    def __init__(self) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "cli_forkserver.py")], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, *args: str, tmp: Path, timeout: int = 240) -> subprocess.CompletedProcess:
        argv, env = cli_call(args)
        out, err = tmp / "cli.stdout", tmp / "cli.stderr"
        request = {"args": argv, "cwd": str(REPO), "env": env, "stdout": str(out), "stderr": str(err),
                   "timeout": timeout}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        assert reply, f"the CLI fork server exited with {self.proc.poll()}"
        return subprocess.CompletedProcess(argv, json.loads(reply)["returncode"], out.read_text(), err.read_text())

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def cli():
    server = ForkServer()
    try:
        yield server
    finally:
        server.close()


def test_the_fork_server_runs_the_cli_as_a_fresh_process_would(cli, tmp_path):
    """The bad-input cases below go through the fork server: it must report what ``python -m`` does
    (the same exit code and stderr for a failure, the run's lines and files for a success)."""
    bad = ["train.lr_schedule.name=linear", f"hydra.run.dir={tmp_path / 'bad'}"]
    forked, fresh = cli.run(*bad, tmp=tmp_path), run_cli(*bad)
    assert forked.returncode == fresh.returncode == 1
    assert forked.stderr.strip().splitlines()[-1] == fresh.stderr.strip().splitlines()[-1]
    good = cli.run("rounds=1", "num_clients=5", "clients_per_round=2", f"hydra.run.dir={tmp_path / 'good'}",
                   tmp=tmp_path)
    assert good.returncode == 0, good.stderr
    assert good.stdout.strip().splitlines()[-1] == f"run_dir: {tmp_path / 'good'}"
    assert (tmp_path / "good" / "summary.json").exists()


def test_run_writes_the_run_directory(tmp_path):
    proc = run_cli("rounds=3", "eval_every=2", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    assert last == f"run_dir: {tmp_path / 'run'}"
    run_dir = Path(last.split(": ", 1)[1])
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("final_test_accuracy", "best_test_accuracy", "rounds", "wall_time_s"):
        assert key in summary
    assert summary["rounds"] == 3
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    for row in rows:
        for key in ("train_loss", "num_clients", "bytes_up", "bytes_down", "wall_time_s"):
            assert key in row
    assert "test_accuracy" in rows[1] and "test_accuracy" in rows[2] and "test_accuracy" not in rows[0]
    assert (run_dir / "config.yaml").exists() and (run_dir / "partition.npz").exists()
    from fl_platform.datasets.partition import Partition

    assert Partition.load(run_dir / "partition.npz").num_clients == 100


def test_sweep_makes_one_run_dir_per_job_and_plot_turns_them_into_a_figure_and_table(tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", "algorithm=fedavg,fedprox,scaffold", "seed=0,1", "rounds=2",
                   f"hydra.sweep.dir={sweep}", timeout=400)
    assert proc.returncode == 0, proc.stderr
    summaries = sorted(sweep.rglob("summary.json"))
    assert len(summaries) == 6
    assert len({p.parent for p in summaries}) == 6
    out = tmp_path / "plots"
    plot = subprocess.run([sys.executable, str(REPO / "scripts" / "plot.py"), str(sweep), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr
    assert (out / "test_accuracy_vs_round.png").stat().st_size > 1000
    table = (out / "table.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| algorithm=")]
    assert len(rows) == 3
    assert all("| 2 |" in row for row in rows)  # two seeds per algorithm


_MODEL = ("model=custom", "model._target_=plugin_pkg.nets:TinyNet")
_DATA = ("dataset=custom", "dataset._target_=plugin_pkg.data:blobs")


@pytest.mark.parametrize(("args", "expected"), [
    (["algorithm=fedavgx"], ["Could not find 'algorithm/fedavgx'", "fedavg", "scaffold"]),
    (["dataset=mnistx"], ["Could not find 'dataset/mnistx'", "digits"]),
    (["algorithm.mux=1"], ["Key 'mux' not in 'FedAvgConf'"]),
    (["rounds=abc"], ["rounds", "could not be converted to Integer"]),
    (["dataset=fashion_mnist", "dataset.root=/nonexistent/fl-data"], ["fashion_mnist", "/nonexistent/fl-data",
                                                                       "FL_DATA_ROOT"]),
    (["partition.alpha=0"], ["partition.alpha must be > 0"]),
    (["partition.alpha=-1"], ["partition.alpha must be > 0"]),
    (["num_clients=5000"], ["num_clients=5000", "1438 samples"]),
    (["train.lr=1e30", "rounds=2"], ["non-finite", "client", "round 1", "train.lr"]),
    (["clients_per_round=500"], ["clients_per_round"]),
    (["train.steps=20", "train.epochs=3"], ["train.epochs has no effect when train.steps is set", "train.steps=20"]),
    # the user's own code (tests/plugin_pkg): arguments against their annotations, algorithm halves, data
    ([*_MODEL, "+model.width=abc"], ["model.width='abc'", "parameter width of plugin_pkg.nets:TinyNet",
                                     "annotated int, got str 'abc'"]),
    (["model=custom", "model._target_=plugin_pkg.bad:DropNet", "+model.dropout=high"],
     ["model.dropout='high'", "plugin_pkg.bad:DropNet", "annotated float, got str 'high'"]),
    (["dataset=custom", "dataset._target_=plugin_pkg.bad:tagged", "+dataset.tag=nan"],
     ["dataset.tag=nan", "annotated str, got float nan", "quote it"]),
    ([*_DATA, "+dataset.n=1.5"], ["dataset.n=1.5", "plugin_pkg.data:blobs", "annotated int, got float 1.5"]),
    (["algorithm=plugin", "algorithm._target_=plugin_pkg.bad:NO_AGGREGATE"],
     ["its server half plugin_pkg.bad:Lazy does not define aggregate"]),
    (["algorithm=plugin", "algorithm._target_=plugin_pkg.bad:NOT_A_DATACLASS"],
     ["its conf plugin_pkg.bad:PlainConf is not a dataclass"]),
    (["algorithm=plugin", "algorithm._target_=plugin_pkg.bad:NOT_A_CLIENT"],
     ["its client half plugin_pkg.bad:NotAClient", "not a subclass of fl_platform.algorithms.base.ClientAlgorithm"]),
    (["algorithm=plugin", "algorithm._target_=plugin_pkg.nets:TinyNet"], ["is a type, not an AlgorithmSpec"]),
    (["model=custom", "model._target_=plugin_pkg.nets:Nope"], ["module plugin_pkg.nets", "has no attribute 'Nope'"]),
    ([*_MODEL, "+model.widht=3"], ["model.widht: not a parameter of plugin_pkg.nets:TinyNet"]),
    (["dataset=custom", "dataset._target_=plugin_pkg.bad:labelled"],
     ["test labels outside [0, 3) (num_classes=3)", "e.g. 3"]),
    (["dataset=custom", "dataset._target_=plugin_pkg.bad:labelled", "+dataset.split=train", "+dataset.label=-1"],
     ["train labels outside [0, 3)", "e.g. -1"]),
    (["dataset=custom", "dataset._target_=plugin_pkg.bad:holed"],
     ["holed: train_x has non-finite values (NaN or inf)", "first row 5"]),
    # rounds with a schedule, callbacks, threads
    (["train.lr_schedule.name=linear"], ["train.lr_schedule.name must be one of constant, step, cosine; got 'linear'"]),
    (["train.lr_schedule.gamma=0.5"], ["train.lr_schedule.gamma=0.5 has no effect in this run: a step schedule's "
                                       "setting, and the schedule is constant"]),
    (["early_stop.patience=2", "early_stop.val_fraction=1.5"], ["early_stop.val_fraction must be in (0, 1), got 1.5"]),
    (["early_stop.min_delta=0.1"], ["early_stop.min_delta=0.1 has no effect in this run: early stopping is off"]),
    (["callbacks=[{_target_: 'plugin_pkg.cb:StopAt', round: abc}]"],
     ["callbacks[0].round='abc': parameter round of plugin_pkg.cb:StopAt", "annotated int, got str 'abc'"]),
    (["engine.threads_per_worker=0"], ["engine.threads_per_worker must be >= 1"]),
    (["dataset=synthetic", "partition=natural", "dataset.iid=true", "dataset.alpha=1.0"],
     ["dataset.alpha=1.0 has no effect in this run", "dataset.iid=true gives every device one shared model"]),
])
def test_bad_input_fails_with_a_clear_message(args, expected, tmp_path, cli):
    proc = cli.run(*args, f"hydra.run.dir={tmp_path / 'run'}", tmp=tmp_path)
    assert proc.returncode != 0
    for text in expected:
        assert text in proc.stderr, f"{text!r} not in stderr:\n{proc.stderr}"
    assert not (tmp_path / "run" / "summary.json").exists()
