"""Run-directory files, written so that no result file is ever left half-written.

Whole files go through a temporary file in the same directory, ``fsync`` and ``os.replace``, and
the directory is fsynced after the rename, so a written file survives a machine crash as well as a
killed process; metrics are appended one complete JSON line per round (and truncated back to a
checkpoint on resume).
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch


def fsync_dir(path: Path | str) -> None:
    """Make the entries of directory ``path`` (files created, renamed or removed in it) durable."""
    if os.name == "nt":  # directories cannot be opened for fsync there; NTFS journals renames
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: Path, text: str) -> None:
    _atomic_write(path, lambda fh: fh.write(text.encode()))


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value


def atomic_write_bytes(path: Path, data: bytes) -> None:
    _atomic_write(path, lambda fh: fh.write(data))


def atomic_write_json(path: Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(_jsonable(data), indent=2, sort_keys=True) + "\n")


def atomic_torch_save(obj: Any, path: Path) -> None:
    _atomic_write(path, lambda fh: torch.save(obj, fh))


class MetricsLog:
    """``metrics.jsonl``: one JSON object per round, appended whole."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        rows = []
        for line in self.path.read_text().splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a torn last line from a killed process
                break
        return rows

    def append(self, row: dict[str, Any]) -> None:
        line = json.dumps(_jsonable(row), sort_keys=True) + "\n"
        with open(self.path, "a") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    def truncate_after(self, last_round: int) -> list[dict[str, Any]]:
        """Keep rows with ``round <= last_round`` (resume: drop rows written after the checkpoint)."""
        rows = [r for r in self.read() if r.get("round", 0) <= last_round]
        self.replace(rows)
        return rows

    def replace(self, rows: list[dict[str, Any]]) -> None:
        """The file := ``rows``, atomically (a reader or a crash sees the old rows or the new, never a part)."""
        atomic_write_text(self.path, "".join(json.dumps(_jsonable(r), sort_keys=True) + "\n" for r in rows))


class RunDir:
    """The files of one run: config.yaml, metrics.jsonl, partition.npz, summary.json, checkpoint/,
    wandb_id (the wandb run a resumed run continues)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path).resolve()
        self.path.mkdir(parents=True, exist_ok=True)

    config = property(lambda self: self.path / "config.yaml")
    metrics = property(lambda self: self.path / "metrics.jsonl")
    partition = property(lambda self: self.path / "partition.npz")
    summary = property(lambda self: self.path / "summary.json")
    model = property(lambda self: self.path / "model.pt")
    checkpoint = property(lambda self: self.path / "checkpoint")
    wandb_id = property(lambda self: self.path / "wandb_id")


def plugin_name(group: str, name: str, target: Any = None) -> str:
    """What a run directory, a sweep folder and summary.json call option ``name`` of ``group``: its own
    name, or for the user's code (``algorithm=plugin``, ``dataset=custom``, ``model=custom``) the
    plug-in's: an algorithm spec's ``name``, else the last part of the import path (``mypkg.nets:WideNet``:
    ``WideNet``); data given to ``fl_platform.api`` as objects: their source's name."""
    if name not in ("plugin", "custom") or not target or str(target) == "???":
        return str(name)
    ref = str(target)
    try:  # (resolving the reference imports the user's module: it is imported for the run anyway)
        from fl_platform.plugins import load

        obj = load(ref, f"{group}._target_")
    except Exception:  # named by its text when it does not load here
        obj = None
    own = getattr(obj, "name", None) if group == "algorithm" else getattr(getattr(obj, "source", None), "name", None)
    if isinstance(own, str) and own:
        return own
    text = ref.split("@", 1)[0].removeprefix("object:")  # object:Name@id -> Name
    return text.replace(":", ".").rsplit(".", 1)[-1] or str(name)
