"""wandb resumes with the run (fl_platform/reporting.py), offline: no network, no API key.

A run interrupted after round 3 (checkpoint after round 2) and resumed to round 4 logs both
sessions under the one wandb run id kept in ``<run dir>/wandb_id``; the offline transaction logs
read back hold the config and the metrics of rounds 1..4, equal to metrics.jsonl's. wandb 0.31 has
no public reader of offline ``.wandb`` files, so ``wandb_records`` decodes them: the LevelDB log
framing wandb-core writes, each record one ``wandb.proto.wandb_internal_pb2.Record``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import psutil
import pytest
from omegaconf import OmegaConf

from fl_platform.experiment import run_experiment
from fl_platform.reporting import Reporter
from fl_platform.rounds.simulation import is_timing_key

from .conftest import compose_config
from .test_engine_resume import metric_rows

wandb = pytest.importorskip("wandb")

_BLOCK, _HEADER = 32768, 7  # LevelDB log: 32 KiB blocks, records framed by crc32 (4) length (2) type (1)


def wandb_records(path: Path) -> list[Any]:
    """The records of one offline run's ``run-<id>.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    pos, parts, payloads = 7, b"", []  # after the file header: ":W&B", magic (2), version (1)
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 1:  # full
            payloads.append(chunk)
        elif kind == 2:  # first
            parts = chunk
        elif kind == 3:  # middle
            parts += chunk
        elif kind == 4:  # last
            payloads.append(parts + chunk)
    records = []
    for raw in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        records.append(record)
    return records


def read_offline_run(path: Path) -> dict[str, Any]:
    """id, config, exit code and history rows (by ``_step``) of one offline session."""
    out: dict[str, Any] = {"history": [], "exit_code": None}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            out["id"] = record.run.run_id
            out["config"] = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "history":
            out["history"].append({item.key or ".".join(item.nested_key): json.loads(item.value_json)
                                   for item in record.history.item})
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    return out


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    wandb.teardown()  # stops wandb-core: no background process outlives the test
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"wandb left processes running: {[p.name() for p in left]}"


def test_resumed_run_continues_its_wandb_run(tmp_path, monkeypatch, offline_wandb):
    cfg = compose_config("logger.wandb=true", "rounds=4", "checkpoint_every=2", "train.epochs=1", "eval_every=1")
    run_dir = tmp_path / "run"
    round_done = Reporter.round_done

    def interrupted(self, row):  # like Ctrl-C once round 3 is logged: the checkpoint is of round 2
        round_done(self, row)
        if row["round"] == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(Reporter, "round_done", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_experiment(cfg, run_dir)
    run_id = (run_dir / "wandb_id").read_text().strip()
    monkeypatch.setattr(Reporter, "round_done", round_done)
    run_experiment(cfg, run_dir)
    wandb.teardown()  # finish() returns before wandb-core has written everything; teardown waits for it

    sessions = [read_offline_run(p) for p in run_dir.glob("wandb/offline-run-*/run-*.wandb")]
    first, second = sorted(sessions, key=lambda s: s["history"][0]["_step"])  # folders may share a second
    assert first["id"] == second["id"] == run_id
    assert (run_dir / "wandb_id").read_text().strip() == run_id
    assert [row["_step"] for row in first["history"]] == [1, 2, 3]
    assert [row["_step"] for row in second["history"]] == [3, 4]  # round 3 again, from the checkpoint
    assert (first["exit_code"], second["exit_code"]) == (1, 0)  # the interrupted session is marked failed
    want_config = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    for session in (first, second):
        assert {k: v for k, v in session["config"].items() if k != "_wandb"} == want_config
    rows = {r["round"]: r for r in metric_rows(run_dir)}
    for session in (first, second):
        for logged in session["history"]:
            row = rows[logged["_step"]]
            assert {k: logged[k] for k in row if not is_timing_key(k)} == row

    run_experiment(compose_config("logger.wandb=true", "rounds=4", "checkpoint_every=2", "train.epochs=1",
                                  "eval_every=1", "resume=never"), run_dir)  # starting over: a new wandb run
    assert (run_dir / "wandb_id").read_text().strip() != run_id


def test_reporter_asks_wandb_to_resume_the_stored_run(tmp_path, monkeypatch):
    """What a resumed run passes to wandb.init (online, resume="allow" continues the run on the
    server; the offline test above cannot tell that apart from a new run with the same id)."""
    calls: list[dict] = []

    class FakeRun:
        summary: dict = {}

        def finish(self, exit_code=None):
            pass

    def init(**kwargs):
        calls.append(kwargs)
        return FakeRun()

    monkeypatch.setattr(wandb, "init", init)
    Reporter(4, progress=False, wandb=True, run_dir=str(tmp_path)).close()
    run_id = (tmp_path / "wandb_id").read_text().strip()
    Reporter(4, progress=False, wandb=True, run_dir=str(tmp_path), start_round=2).close()
    fresh, resumed = calls
    assert fresh["id"] == run_id and fresh["resume"] is None
    assert resumed["id"] == run_id and resumed["resume"] == "allow"
    assert fresh["reinit"] == resumed["reinit"] == "create_new"  # not the deprecated reinit=True
