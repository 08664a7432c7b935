"""Checkpoint/resume: a killed run restarted with the same command ends as if never interrupted.

Every ``checkpoint_every`` rounds (and after the last one) the run saves, under
``<run dir>/checkpoint/``: the server half's state (global model and e.g. SCAFFOLD's c), the
engine's scheduler state, the global RNG states, the round index and the metrics rows so far;
the client-state store is flushed and its writes set aside for that round. Publication is one
atomic write of ``LATEST``, so a kill (or a machine crash: files and folders are fsynced) at any
moment leaves either the previous or the new checkpoint, never a mix::

    1. engine.checkpoint_state(tmp, k)   memory stores save into tmp; disk stores flush and set
                                          their writes since the last checkpoint aside for round k
    2. tmp/state.pt (with the size and sha256 of tmp's other files), then rename
       tmp -> round-<k> and fsync the checkpoint folder
    3. LATEST <- "round-<k>"              the checkpoint exists from here on
    4. round-* folders other than round-<k> and the previous checkpoint round-<j> removed
    5. engine.commit_state(j)            disk stores fold the writes up to round j into their base

The previous checkpoint is kept until the next one is published, and the stores' committed base
is never ahead of the oldest kept checkpoint (step 5 commits j, not k; step 4 runs first), so the
stores can return to either.

On resume, ``load`` checks the checkpoint ``LATEST`` names (``state.pt`` loads, the other files
match their recorded size and hash). When it is unusable (truncated, garbage, missing, or
``LATEST`` itself unreadable) the bad folder is moved aside to ``bad-round-<k>``, a warning names
the file and the reason, and the newest earlier checkpoint that checks out is used: the rounds
after it are trained again. When none is usable, ``load`` raises ``CheckpointError`` naming the
files and the ways out; nothing is changed then. Before the stores restore round r every other
round-* folder is removed, because ``restore(r)`` folds the stores' writes up to r into their base,
after which no earlier checkpoint matches them.

``restore`` returns the stores to round r (finishing an interrupted commit and dropping every
write made after the checkpoint), the server and engine load their state, metrics.jsonl is
rewritten from the checkpoint's rows (rows of rounds after it are dropped), and the round loop
continues at round r + 1. Since every random draw derives from (seed, round, client), the
remaining rounds are exactly those of an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_platform.outputs import atomic_torch_save, atomic_write_text, fsync_dir

log = logging.getLogger("fl_platform")

FORMAT = 1
_NAME = re.compile(r"round-(\d+)")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from, with what to do about it."""


@dataclass
class Checkpoint:
    round: int  # rounds completed
    path: Path
    server: dict[str, Any]
    engine: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    rng: dict[str, Any] = field(default_factory=dict)


def rng_state() -> dict[str, Any]:
    """Global RNG states (the run's own draws are keyed by (seed, round, client); these cover code we
    do not control)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "python" in state:
        random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        saved, present = state["cuda"], torch.cuda.device_count()
        if len(saved) != present:  # resumed on a machine with another number of GPUs
            log.warning("the checkpoint holds the CUDA RNG states of %d devices, this process sees %d: restoring "
                        "those of devices 0..%d only (the run's own draws are keyed by (seed, round, client), "
                        "not drawn from these)", len(saved), present, min(len(saved), present) - 1)
        for index, device_state in enumerate(saved[:present]):
            torch.cuda.set_rng_state(device_state, index)


def _digest(path: Path) -> tuple[int, str]:
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            sha.update(chunk)
    return path.stat().st_size, sha.hexdigest()


def _round_of(name: str) -> int | None:
    match = _NAME.fullmatch(name)
    return int(match.group(1)) if match else None


class Checkpointer:
    def __init__(self, directory: Path | str, every: int) -> None:
        if every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {every}")
        self.directory = Path(directory)
        self.every = every
        self.published: int | None = None  # round of the checkpoint LATEST names (set by load and save)

    @property
    def latest_file(self) -> Path:
        return self.directory / "LATEST"

    def due(self, rounds_done: int, total_rounds: int) -> bool:
        return self.every > 0 and (rounds_done % self.every == 0 or rounds_done == total_rounds)

    def _folders(self) -> dict[int, Path]:
        if not self.directory.is_dir():
            return {}
        found = {_round_of(p.name): p for p in self.directory.iterdir() if p.is_dir()}
        return {r: p for r, p in found.items() if r is not None}

    def _prune(self, keep: set[int]) -> None:
        """Remove round-* folders not in ``keep`` and unfinished ``.round-*.tmp`` folders."""
        for r, path in self._folders().items():
            if r not in keep:
                shutil.rmtree(path, ignore_errors=True)
        for tmp in self.directory.glob(".round-*.tmp"):
            shutil.rmtree(tmp, ignore_errors=True)

    def save(self, round: int, server: dict[str, Any], engine: Any, history: list[dict[str, Any]]) -> Path:
        """Checkpoint after ``round`` rounds (the protocol in the module docstring)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"round-{round:08d}"
        tmp = self.directory / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        engine.checkpoint_state(tmp, round)
        files = {p.relative_to(tmp).as_posix(): _digest(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        atomic_torch_save({"format": FORMAT, "round": round, "server": server, "engine": engine.state_dict(),
                           "history": history, "rng": rng_state(), "files": files}, tmp / "state.pt")
        final = self.directory / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        fsync_dir(self.directory)
        atomic_write_text(self.latest_file, name + "\n")
        previous, self.published = self.published, round
        if previous == round:
            previous = None
        self._prune({round} if previous is None else {round, previous})
        if previous is not None:
            engine.commit_state(previous)
        return final

    def _read(self, r: int, path: Path) -> Checkpoint:
        """The checkpoint in ``path``, checked; CheckpointError says what is wrong with it."""
        state = path / "state.pt"
        if not state.is_file():
            raise CheckpointError(f"{state} is missing")
        try:
            data = torch.load(state, map_location="cpu", weights_only=False)
        except Exception as err:  # whatever the unpickler or zip reader raises means unreadable
            raise CheckpointError(f"{state} is unreadable ({type(err).__name__}: {err})") from None
        if not isinstance(data, dict) or "server" not in data:
            raise CheckpointError(f"{state} is not a checkpoint")
        if data.get("format") != FORMAT:
            raise CheckpointError(f"{state} has format {data.get('format')}, this code reads {FORMAT}")
        if data.get("round") != r:
            raise CheckpointError(f"{state} is for round {data.get('round')}, its folder says {r}")
        for rel, (size, sha) in data.get("files", {}).items():
            f = path / rel
            if not f.is_file():
                raise CheckpointError(f"{f} is missing")
            if _digest(f) != (size, sha):
                raise CheckpointError(f"{f} is damaged (size or sha256 differs from when it was saved)")
        return Checkpoint(round=r, path=path, server=data["server"], engine=data.get("engine", {}),
                          history=data.get("history", []), rng=data.get("rng", {}))

    def load(self) -> Checkpoint | None:
        """The checkpoint to resume from (None: none published), falling back to an earlier one
        when the latest is unusable; removes every other checkpoint folder (module docstring)."""
        folders = self._folders()
        try:
            text = self.latest_file.read_bytes().decode(errors="replace").strip()
        except FileNotFoundError:  # nothing published; folders left by a kill before step 3 go
            self._prune(set())
            self.published = None
            return None
        except OSError as err:
            text, problems = None, [f"{self.latest_file} is unreadable ({type(err).__name__}: {err})"]
        else:
            problems = []
        named = _round_of(text) if text is not None else None
        if text is not None and named is None:
            problems.append(f"{self.latest_file} holds {text[:40]!r}, not a checkpoint name")
        if named is not None and named not in folders:
            problems.append(f"{self.latest_file} names {text}, which does not exist")
        bad: list[Path] = []
        for r in sorted((r for r in folders if named is None or r <= named), reverse=True):
            try:
                ckpt = self._read(r, folders[r])
            except CheckpointError as err:
                problems.append(str(err))
                bad.append(folders[r])
                continue
            if problems:
                log.warning("checkpoint: %s; resuming from %s instead (the rounds after %d are trained again)",
                            "; ".join(problems), ckpt.path, r)
                for path in bad:
                    aside = path.with_name(f"bad-{path.name}")
                    shutil.rmtree(aside, ignore_errors=True)
                    os.replace(path, aside)
                    log.warning("checkpoint: moved the unusable %s to %s", path, aside)
                atomic_write_text(self.latest_file, ckpt.path.name + "\n")
            self._prune({r})
            self.published = r
            return ckpt
        raise CheckpointError(
            f"cannot resume from {self.directory}: {'; '.join(problems)}; no earlier checkpoint is usable. "
            f"Rerun with resume=never to start over (this deletes {self.directory} and the run's client "
            f"state); move the folder elsewhere first to keep it.")

    def clear(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
        self.published = None
