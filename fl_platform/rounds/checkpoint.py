"""Checkpoint/resume: a killed run restarted with the same command ends as if never interrupted.

Every ``checkpoint_every`` rounds (and after the last one) the run saves, under
``<run dir>/checkpoint/``: the server half's state (global model and e.g. SCAFFOLD's c), the
engine's scheduler state, the global RNG states, the round index and the metrics rows so far;
the client-state store is flushed and its writes set aside for that round. Publication is one
atomic write of ``LATEST``, so a kill at any moment leaves either the previous or the new
checkpoint, never a mix::

    1. engine.checkpoint_state(tmp, k)   memory stores save into tmp; disk stores flush and set
                                          their writes since the last checkpoint aside for round k
    2. tmp/state.pt, then rename tmp -> round-<k>
    3. LATEST <- "round-<k>"              the checkpoint exists from here on
    4. engine.commit_state(k)            disk stores fold round k's writes into their base
    5. older round-* folders removed

On resume, ``restore`` returns the stores to round k (finishing an interrupted step 4 and dropping
every write made after the checkpoint), the server and engine load their state, metrics.jsonl is
rewritten from the checkpoint's rows (rows of rounds after it are dropped), and the round loop
continues at round k + 1. Since every random draw derives from (seed, round, client), the
remaining rounds are exactly those of an uninterrupted run.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_platform.outputs import atomic_torch_save, atomic_write_text

FORMAT = 1


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
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    def __init__(self, directory: Path | str, every: int) -> None:
        if every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {every}")
        self.directory = Path(directory)
        self.every = every

    @property
    def latest_file(self) -> Path:
        return self.directory / "LATEST"

    def due(self, rounds_done: int, total_rounds: int) -> bool:
        return self.every > 0 and (rounds_done % self.every == 0 or rounds_done == total_rounds)

    def latest_round(self) -> int | None:
        """Rounds completed by the published checkpoint, or None."""
        try:
            name = self.latest_file.read_text().strip()
        except FileNotFoundError:
            return None
        if not (self.directory / name / "state.pt").exists():
            raise FileNotFoundError(f"{self.latest_file} names {name}, which is missing or incomplete")
        return int(name.rsplit("-", 1)[1])

    def save(self, round: int, server: dict[str, Any], engine: Any, history: list[dict[str, Any]]) -> Path:
        """Checkpoint after ``round`` rounds (the protocol in the module docstring)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"round-{round:08d}"
        tmp = self.directory / f".{name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        engine.checkpoint_state(tmp, round)
        atomic_torch_save({"format": FORMAT, "round": round, "server": server, "engine": engine.state_dict(),
                           "history": history, "rng": rng_state()}, tmp / "state.pt")
        final = self.directory / name
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        atomic_write_text(self.latest_file, name + "\n")
        engine.commit_state(round)
        for old in self.directory.glob("round-*"):
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def load(self) -> Checkpoint | None:
        k = self.latest_round()
        if k is None:
            return None
        path = self.directory / f"round-{k:08d}"
        data = torch.load(path / "state.pt", weights_only=False)
        if data.get("format") != FORMAT:
            raise ValueError(f"checkpoint {path} has format {data.get('format')}, this code reads {FORMAT}")
        return Checkpoint(round=data["round"], path=path, server=data["server"], engine=data.get("engine", {}),
                          history=data.get("history", []), rng=data.get("rng", {}))

    def clear(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
