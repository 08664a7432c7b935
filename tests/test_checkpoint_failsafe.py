"""Checkpoints that fail safe (fl_platform/rounds/checkpoint.py).

The previous checkpoint stays until the next one is published and the disk store's committed
base never runs ahead of it; an unusable latest checkpoint (truncated or garbage ``state.pt``, a
damaged client-state file, ``LATEST`` naming a missing folder or holding garbage) makes the
resume fall back to the one before, with a warning naming the file, and the run still ends with
the uninterrupted run's metrics; with nothing to fall back to, resume stops with a
``CheckpointError`` that names the file and ``resume=never`` (a clear CLI error, no traceback).
``engine.state_fsync`` fsyncs the client-state files.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fl_platform.experiment import ConfigError, build, run_experiment
from fl_platform.rounds import checkpoint as ckpt_mod
from fl_platform.rounds.checkpoint import Checkpointer, CheckpointError

from .conftest import REPO, compose_config
from .test_engine_resume import metric_rows

RUN = ("algorithm=scaffold", "rounds=4", "checkpoint_every=1", "train.epochs=1", "clients_per_round=10",
       "engine.threads_per_worker=1")
R4 = "round-00000004"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted 4-round SCAFFOLD runs (metrics and model), per state store."""
    out = {}
    for store in ("disk", "memory"):
        run_dir = tmp_path_factory.mktemp(f"ref-{store}")
        run_experiment(compose_config(*RUN, f"engine.state_store={store}"), run_dir)
        out[store] = (metric_rows(run_dir), torch.load(run_dir / "model.pt", weights_only=True))
    return out


def _truncate(run_dir: Path) -> str:
    f = run_dir / "checkpoint" / R4 / "state.pt"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return f"{R4}/state.pt is unreadable"


def _garbage(run_dir: Path) -> str:
    (run_dir / "checkpoint" / R4 / "state.pt").write_bytes(b"not a checkpoint \x00\xff" * 100)
    return f"{R4}/state.pt is unreadable"


def _missing(run_dir: Path) -> str:
    shutil.rmtree(run_dir / "checkpoint" / R4)
    return f"LATEST names {R4}, which does not exist"


def _damaged_client_state(run_dir: Path) -> str:
    f = run_dir / "checkpoint" / R4 / "client_state.pt"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte, same size: only the recorded hash tells
    f.write_bytes(bytes(raw))
    return f"{R4}/client_state.pt is damaged"


@pytest.mark.parametrize(("store", "damage"), [("disk", _truncate), ("disk", _garbage), ("disk", _missing),
                                               ("memory", _damaged_client_state)])
def test_unusable_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog, reference, store, damage):
    """Round 4 is trained again from the checkpoint of round 3, with the client states of round 3
    (SCAFFOLD's control variates: states of round 4 would change the result)."""
    cfg = compose_config(*RUN, f"engine.state_store={store}")
    run_dir = tmp_path / "run"
    run_experiment(cfg, run_dir)
    assert sorted(p.name for p in (run_dir / "checkpoint").iterdir()) == ["LATEST", "round-00000003", R4]
    expected = damage(run_dir)
    with caplog.at_level(logging.WARNING, logger="fl_platform"):
        exp = build(cfg, run_dir)
    assert exp.simulation.start_round == 3
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert expected in warning and "resuming from" in warning and "round-00000003" in warning
    exp.engine.close()
    summary = run_experiment(cfg, run_dir)
    want_rows, want_model = reference[store]
    assert metric_rows(run_dir) == want_rows
    model = torch.load(run_dir / "model.pt", weights_only=True)
    assert all(torch.equal(model[k], want_model[k]) for k in want_model)
    assert summary["rounds"] == 4
    assert (run_dir / "checkpoint" / "LATEST").read_text().strip() == R4
    if damage is not _missing:  # the bad checkpoint is kept aside for inspection
        assert (run_dir / "checkpoint" / f"bad-{R4}" / "state.pt").exists()


def test_garbage_latest_file_resumes_from_the_newest_good_checkpoint(tmp_path, caplog, reference):
    cfg = compose_config(*RUN, "engine.state_store=disk")
    run_experiment(cfg, tmp_path)
    (tmp_path / "checkpoint" / "LATEST").write_bytes(b"\x00\xffgarbage")
    with caplog.at_level(logging.WARNING, logger="fl_platform"):
        run_experiment(cfg, tmp_path)
    assert "LATEST holds" in caplog.text and "not a checkpoint name" in caplog.text
    assert metric_rows(tmp_path) == reference["disk"][0]
    assert (tmp_path / "checkpoint" / "LATEST").read_text().strip() == R4


ONE = ("rounds=2", "checkpoint_every=2", "train.epochs=1")


def test_nothing_to_fall_back_to_stops_with_a_clear_error(tmp_path):
    run_experiment(compose_config(*ONE), tmp_path)
    state = tmp_path / "checkpoint" / "round-00000002" / "state.pt"
    state.write_bytes(b"\x80garbage")
    with pytest.raises(CheckpointError, match=r"round-00000002/state\.pt is unreadable.*resume=never"):
        build(compose_config(*ONE), tmp_path)
    assert state.read_bytes() == b"\x80garbage"  # nothing is changed when nothing is usable
    exp = build(compose_config(*ONE, "resume=never"), tmp_path)  # the way out: start over
    assert exp.simulation.start_round == 0
    exp.engine.close()


@pytest.mark.slow
def test_cli_reports_an_unusable_checkpoint_without_a_traceback(tmp_path):
    run_dir = tmp_path / "run"
    run_experiment(compose_config(*ONE), run_dir)
    (run_dir / "checkpoint" / "round-00000002" / "state.pt").write_bytes(b"\x80garbage")
    proc = subprocess.run([sys.executable, "-m", "fl_platform.run", "logger.progress=false", *ONE,
                           f"hydra.run.dir={run_dir}"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HYDRA_FULL_ERROR": "0"})
    assert proc.returncode != 0
    assert "CheckpointError" in proc.stderr and "round-00000002/state.pt is unreadable" in proc.stderr
    assert "resume=never" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


class _Engine:
    """Records the store calls the Checkpointer makes and which checkpoint folders exist then."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.commits = directory, []

    def checkpoint_state(self, directory: Path, round: int) -> None:
        (directory / "client_state.pt").write_bytes(bytes([round]) * 10)

    def state_dict(self) -> dict:
        return {}

    def commit_state(self, round: int) -> None:
        self.commits.append((round, sorted(p.name for p in self.directory.glob("round-*"))))


def test_save_keeps_the_previous_checkpoint_and_commits_only_up_to_it(tmp_path, monkeypatch):
    """The stores' base never runs ahead of a kept checkpoint: older folders go before the commit,
    and the commit is of the previous round, not the new one. Folder entries are fsynced."""
    synced: list[tuple[str, str | None, bool]] = []

    def record(path):
        latest = tmp_path / "LATEST"
        synced.append((Path(path).name, latest.read_text().strip() if latest.exists() else None,
                       (tmp_path / "round-00000003").exists()))

    monkeypatch.setattr(ckpt_mod, "fsync_dir", record)
    monkeypatch.setattr("fl_platform.outputs.fsync_dir", record)
    engine = _Engine(tmp_path)
    ckpt = Checkpointer(tmp_path, 1)
    for r in (1, 2, 3):
        ckpt.save(r, {"w": torch.tensor([float(r)])}, engine, [])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "round-00000002", "round-00000003"]
    assert engine.commits == [(1, ["round-00000001", "round-00000002"]), (2, ["round-00000002", "round-00000003"])]
    # the rename of round-3 into place is fsynced before LATEST names it, and LATEST once it does
    assert (tmp_path.name, "round-00000002", True) in synced and (tmp_path.name, "round-00000003", True) in synced
    assert (".round-00000003.tmp", "round-00000002", False) in synced  # state.pt's entry, before the rename
    loaded = Checkpointer(tmp_path, 1).load()
    assert loaded.round == 3 and loaded.server["w"].item() == 3.0


def test_state_fsync_fsyncs_every_client_state_file(tmp_path, monkeypatch):
    """engine.state_fsync=true: each client-state file written is fsynced (and the folders at a
    checkpoint); false: none. Counted by the path of the fsynced descriptor (Linux /proc)."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to name fsynced files")
    real_fsync = os.fsync
    for flag in (False, True):
        files: list[str] = []
        dirs: list[str] = []

        def counting_fsync(fd, files=files, dirs=dirs):
            path = os.readlink(f"/proc/self/fd/{fd}")
            if "/client_state" in path:
                (dirs if os.path.isdir(path) else files).append(path)
            return real_fsync(fd)

        monkeypatch.setattr(os, "fsync", counting_fsync)
        run_dir = tmp_path / str(flag)
        exp = build(compose_config("algorithm=scaffold", "engine.state_store=disk", f"engine.state_fsync={flag}",
                                   "rounds=2", "checkpoint_every=1", "train.epochs=1"), run_dir)
        exp.simulation.run()
        exp.engine.close()
        monkeypatch.setattr(os, "fsync", real_fsync)
        writes = exp.engine.workers[0].store.writes
        assert writes > 0
        if flag:
            assert len(files) == writes and all(f.endswith(".tmp") for f in files)
            assert any(d.endswith("/client_state") for d in dirs)  # the root after pending -> committing
        else:
            assert files == [] and dirs == []


def test_state_fsync_needs_a_store_with_files():
    with pytest.raises(ConfigError, match=r"engine\.state_fsync needs client-state files"):
        build(compose_config("engine.state_fsync=true"))


def test_metrics_are_rewritten_whole_or_not_at_all(tmp_path, monkeypatch):
    """A resume rewrites metrics.jsonl (MetricsLog.replace): a crash mid-write leaves the old rows, never a
    part of the new ones (it used to empty the file, then append row by row)."""
    from fl_platform.outputs import MetricsLog

    log = MetricsLog(tmp_path / "metrics.jsonl")
    old = [{"round": r, "loss": 1.0 / r} for r in (1, 2, 3)]
    log.replace(old)
    assert log.read() == old

    def crash(*args):
        raise OSError("disk gone")

    new = old[:2]
    with monkeypatch.context() as m:  # a crash while rows are written one by one
        m.setattr(MetricsLog, "append", crash)
        with contextlib.suppress(OSError):
            log.replace(new)
        assert log.read() in (old, new)
    with monkeypatch.context() as m:  # a crash before the new file takes the old one's place
        m.setattr(os, "replace", crash)
        with pytest.raises(OSError, match="disk gone"):
            log.replace(old[:1])
    assert log.read() in (old, new) and [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]


@pytest.mark.parametrize("present", [1, 2, 4])
def test_cuda_rng_states_restore_onto_the_gpus_present(monkeypatch, caplog, present):
    """A checkpoint written with 2 GPUs resumes on 1, 2 or 4: the states of the devices present are set
    (set_rng_state_all would index a missing device and crash), with a warning when the counts differ."""
    seen: list[tuple[int, torch.Tensor]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: present)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": seen.append((device, s)))
    saved = [torch.full((4,), 10 + i, dtype=torch.uint8) for i in range(2)]
    with caplog.at_level(logging.WARNING, logger="fl_platform"):
        ckpt_mod.set_rng_state({"cuda": saved})
    assert [d for d, _ in seen] == list(range(min(2, present)))
    assert all(torch.equal(s, saved[d]) for d, s in seen)
    warned = [r for r in caplog.records if "CUDA RNG states of 2 devices" in r.getMessage()]
    assert len(warned) == (present != 2)
