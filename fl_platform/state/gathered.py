"""Client states gathered into a checkpoint folder, whatever held them while the run was going.

The Ray engine keeps states on the nodes of their home workers; a checkpoint writes them here, in
parts of bounded size (each home worker its own where its node sees this folder, the driver those
it gathers through the object store from the others; a restore reads them the same way), so a resumed run
restores them exactly on any set of nodes (and any number of workers: each state goes to its new
home). The in-process memory stores' checkpoint files (``client_state.pt``, one per home worker
``client_state-worker-<w>.pt``) hold the same ``{client id: state}`` dictionaries, so either engine
can resume from the other's checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from fl_platform.state.manifest import stamp_of
from fl_platform.state.store import State

FOLDER = "client_state"


def part_path(directory: Path, home: int, index: int) -> Path:
    return Path(directory) / FOLDER / f"part-{home:05d}-{index:06d}.pt"


def save_part(directory: Path, home: int, index: int, states: dict[int, State]) -> None:
    from fl_platform.outputs import atomic_torch_save

    path = part_path(directory, home, index)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(states, path)


def state_files(directory: Path | None) -> list[Path]:
    """The files holding a checkpoint's client states: gathered parts, else memory stores' files."""
    if directory is None:
        return []
    d = Path(directory)
    parts = sorted((d / FOLDER).glob("part-*.pt"))
    if parts:
        return parts
    return sorted(p for p in (d / "client_state.pt", *d.glob("client_state-worker-*.pt")) if p.is_file())


def checked_stamp(directory: Path | str, client_id: int, state: State, expect: dict[int, int] | None) -> int:
    """The round stamp of checkpoint ``directory``'s state of ``client_id``, which must be the round its
    manifest lists (``expect``; None: a checkpoint without a manifest, whose stamps stand)."""
    got = stamp_of(state)
    want = expect.get(client_id) if expect is not None else got
    if got is None or got != want:
        raise RuntimeError(
            f"checkpoint {directory}: client {client_id}'s state is "
            f"{'without a round stamp' if got is None else f'from round {got + 1}'}, its manifest lists "
            f"{'none' if want is None else f'round {want + 1}'}; it cannot be restored exactly")
    return got


def iter_states(files: list[Path]) -> Iterator[dict[int, State]]:
    """One ``{client id: state}`` dictionary per file (at most one part in memory at a time)."""
    for path in files:
        yield torch.load(path, map_location="cpu", weights_only=True)
