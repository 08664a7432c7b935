"""What a researcher meets at the command line: values refused at start-up naming the key, logger keys
that act or are refused, the per-round log lines, a rerun in an old run directory, and a sweep whose
job fails."""

from __future__ import annotations

import json

import pytest

from fl_platform.experiment import build, execute

from .conftest import compose_config
from .test_cli import run_cli

TINY = ("rounds=1", "num_clients=4", "clients_per_round=2", "train.epochs=1", "model.hidden=[8]")


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
