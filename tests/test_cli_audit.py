"""What a researcher meets at the command line: values refused at start-up naming the key, logger keys
that act or are refused, the per-round log lines, a rerun in an old run directory, and a sweep whose
job fails."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from fl_platform.config_checks import ConfigError, check_run
from fl_platform.experiment import build, execute
from fl_platform.reporting import Reporter
from fl_platform.run_config import read_config

from .conftest import CONF_DIR, compose_config, interruptible
from .test_cli import REPO, cli_call, run_cli

TINY = ("rounds=1", "num_clients=4", "clients_per_round=2", "train.epochs=1", "model.hidden=[8]")


@pytest.mark.parametrize(("overrides", "expected"), [
    (["seed=-1"], "seed must be >= 0, got -1"),
    (["logger.log_every=0"], "logger.log_every must be >= 1, got 0"),
    (["logger=wandb", "logger.wandb_mode=onlinex"], "logger.wandb_mode must be one of online, offline"),
    (["logger.wandb_project=mine"], "logger.wandb_project='mine' has no effect in this run: a wandb setting, and "
                                    "logger.wandb=false"),
    (["logger.wandb_mode=online"], "logger.wandb_mode='online' has no effect in this run"),
    (["engine.num_workers=0"], "engine.num_workers must be >= 1"),
    (["engine=ray", "engine.num_workers=0"], "engine.num_workers must be >= 1"),
    (["engine.device=tpu"], "engine.device must be auto, cpu, cuda[:k] or another torch device; got 'tpu'"),
    (["engine.state_store=disk", "engine.state_backend=memory"],
     "engine.state_backend='memory' has no effect in this run: what a distributed store's home workers keep"),
])
def test_values_are_checked_at_start_up_naming_the_key(overrides, expected):
    with pytest.raises(ConfigError) as err:
        check_run(read_config(compose_config(*TINY, *overrides)))
    assert expected in str(err.value)


def test_log_every_thins_the_round_lines_even_when_every_round_is_evaluated(caplog):
    reporter = Reporter(5, progress=False, log_every=2)
    with caplog.at_level(logging.INFO, logger="fl_platform"):
        for r in range(1, 6):
            reporter.round_done({"round": r, "train_loss": 0.5, "test_accuracy": 0.9})
    reporter.close()
    logged = [m.getMessage().split(":")[0] for m in caplog.records if m.getMessage().startswith("round ")]
    assert logged == ["round 2", "round 4", "round 5"]  # every 2nd, and the last


@pytest.mark.parametrize("cosmetic", [["logger=wandb"], ["logger.progress=true", "logger.log_every=5"]])
def test_the_resumable_run_dir_ignores_the_logger_settings(cosmetic):
    """Rerunning an interrupted command with the logger changed (logger=wandb to watch it) finds its checkpoint,
    as docs/engine.md says ("ignoring resume and logger.*"), instead of starting over in another folder."""
    def run_dir(*extra: str) -> str:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=["checkpoint_every=1", *extra], return_hydra_config=True)
            return str(cfg.hydra.run.dir)

    GlobalHydra.instance().clear()
    try:
        assert run_dir(*cosmetic) == run_dir() != run_dir("seed=1")
    finally:
        GlobalHydra.instance().clear()


def test_a_new_run_in_an_old_run_dir_removes_that_runs_summary_and_model(tmp_path):
    """Until it finishes, the directory must not look like a finished run of the new config."""
    execute(compose_config(*TINY, "seed=1"), tmp_path)
    assert (tmp_path / "summary.json").exists() and (tmp_path / "model.pt").exists()
    exp = build(compose_config(*TINY, "seed=2"), tmp_path)  # started, not finished (killed, or failed mid-run)
    exp.engine.close()
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "model.pt").exists()
    assert "seed: 2" in (tmp_path / "config.yaml").read_text()


@pytest.mark.slow
def test_a_failed_job_does_not_stop_the_sweep_and_is_named_at_the_end(tmp_path):
    """The default (basic) launcher: the jobs after the failed one run; the sweep exits non-zero naming it."""
    sweep = tmp_path / "sweep"
    proc = run_cli("-m", *TINY, "train.lr=-1,0.05", f"hydra.sweep.dir={sweep}")
    assert proc.returncode != 0
    assert "error: job #0 (" in proc.stderr and "train.lr=-1) failed: ConfigError: train.lr must be > 0" in proc.stderr
    assert "Traceback" not in proc.stderr
    summaries = list(sweep.rglob("summary.json"))
    assert [p.parent.name for p in summaries] == ["1_fedavg_digits_s0"]
    assert json.loads(summaries[0].read_text())["rounds"] == 1


@pytest.mark.slow
def test_ctrl_c_ends_a_run_with_one_line_and_no_traceback(tmp_path):
    """SIGINT mid-training: exit status 130, one ``error: interrupted`` line saying how to continue, no
    summary.json."""
    argv, env = cli_call(("num_clients=20", "clients_per_round=10", "rounds=100000", "checkpoint_every=2",
                          f"hydra.run.dir={tmp_path / 'run'}"))
    proc = subprocess.Popen([sys.executable, "-m", "fl_platform.run", *argv], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=interruptible)
    try:
        for line in proc.stdout:  # the run logs every round
            if "round 3:" in line:
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [f"error: interrupted; rerun the same command to continue after the last "
                                        f"checkpoint (run dir {tmp_path / 'run'})"], err
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow
def test_the_fl_run_console_script_finds_the_config():
    """README: ``fl-run --help``, the same CLI as a console script (a relative config_path is looked up as a
    Python package there, and 'conf' is none)."""
    script = Path(sys.executable).parent / "fl-run"
    assert script.exists(), f"{script}: the package's console script is not installed (scripts/setup.sh)"
    proc = subprocess.run([str(script), "--help"], cwd=REPO.parent, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "algorithm: " in proc.stdout and "rounds: 30" in proc.stdout
