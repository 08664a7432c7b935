"""Client state on disk: one small file per client, a write-behind LRU cache, atomic writes.

RAM stays bounded whatever the number of clients: at most ``cache_mb`` of states are held, the
least recently used dirty entry is written out when the cache is full, and ``flush`` writes the
rest. A file is written to a temporary name and renamed into place, so a reader (or a resumed
run) never sees a torn state.

Layout under ``directory`` (``<shard>`` = client id // 1000, so no folder holds more than 1000 files)::

    base/<shard>/<cid>.bin            state as of the last committed checkpoint
    committing-<round>/<shard>/...    writes set aside by a checkpoint, being folded into base
    pending/<shard>/...               writes since the last checkpoint
    staged-<round><tag>/<shard>/...   a round's new states, written but not yet applied (``stage``)

A read looks in pending, then the committing folders (newest first), then base. A checkpoint
renames ``pending`` to ``committing-<round>`` (one atomic rename), the run publishes its
checkpoint, and ``commit`` moves the files into ``base``. Resuming from round k keeps folders of
rounds <= k (finishing an interrupted commit) and deletes ``pending`` and later folders, so the
states are exactly those of the checkpoint. Several processes may share one directory as long
as no two write the same client between flushes (the engine guarantees that: a client trains
once per round).

``fsync=True`` (``engine.state_fsync``) also makes the files survive a machine crash, not only a
killed process: every state file is fsynced before its rename, and the folders whose entries a
checkpoint relies on (``pending``'s shards before the rename to ``committing-<round>``, the root
after it, ``base``'s shards after a commit) are fsynced too.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from fl_platform.algorithms.base import StateSpec
from fl_platform.outputs import fsync_dir
from fl_platform.state.store import State, StateStore

_SHARD = 1000
_ALIGN = 8


def _area_round(name: str) -> int | None:
    if name.startswith("committing-"):
        try:
            return int(name.split("-", 1)[1])
        except ValueError:
            return None
    return None


class DiskStore(StateStore):
    def __init__(self, specs: dict[str, StateSpec], directory: str | os.PathLike[str] | None = None,
                 cache_mb: float = 256.0, fsync: bool = False) -> None:
        super().__init__(specs)
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if directory is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="fl_state_")
            directory = self._tmp.name
        self.root = Path(directory)
        self.root.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        # (name, dtype, numel, byte offset, byte length) in a fixed (sorted) order.
        self._layout: list[tuple[str, torch.dtype, int, int, int]] = []
        offset = 0
        for name in sorted(self.specs):
            spec = self.specs[name]
            nbytes = spec.size * torch.empty((), dtype=spec.dtype).element_size()
            self._layout.append((name, spec.dtype, spec.size, offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.state_bytes = offset
        if cache_mb < 0:
            raise ValueError(f"engine.state_cache_mb must be >= 0, got {cache_mb}")
        self.capacity = max(1, int(cache_mb * 2**20) // max(self.state_bytes, 1))
        self._cache: OrderedDict[int, tuple[State, bool]] = OrderedDict()
        self._made: set[Path] = set()
        # Committing folders exist only between a checkpoint's two phases or after a crash there;
        # they are listed once per flush/commit/restore, not on every read.
        self._committing_list: list[tuple[int, Path]] = self._committing()
        self.reads = self.writes = 0

    # ------------------------------------------------------------------ files

    def _path(self, area: str, client_id: int) -> Path:
        return self.root / area / str(client_id // _SHARD) / f"{client_id}.bin"

    def _committing(self) -> list[tuple[int, Path]]:
        found = [(_area_round(p.name), p) for p in self.root.glob("committing-*") if p.is_dir()]
        return sorted((r, p) for r, p in found if r is not None)

    def _encode(self, state: State) -> bytes:
        out = bytearray(self.state_bytes)
        view = memoryview(out)
        for name, dtype, numel, offset, nbytes in self._layout:
            t = state[name].detach().reshape(-1).to("cpu", dtype).contiguous()
            if t.numel() != numel:
                raise ValueError(f"state {name!r} has {t.numel()} elements, the spec says {numel}")
            view[offset : offset + nbytes] = t.view(torch.uint8).numpy()
        return bytes(out)

    def _decode(self, raw: np.ndarray, path: Path) -> State:
        if raw.size != self.state_bytes:
            raise ValueError(f"client state file {path} has {raw.size} bytes, expected {self.state_bytes} "
                             f"(was it written for a different algorithm or model?)")
        buf = torch.from_numpy(raw)
        return {name: buf[offset : offset + nbytes].view(dtype).clone()
                for name, dtype, _numel, offset, nbytes in self._layout}

    def _write(self, client_id: int, state: State, area: str = "pending") -> None:
        path = self._path(area, client_id)
        if path.parent not in self._made:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._made.add(path.parent)
        tmp = path.with_name(f".{client_id}.{os.getpid()}.tmp")
        try:
            fh = open(tmp, "wb")  # noqa: SIM115 (closed below)
        except FileNotFoundError:  # the folder was removed since we made it (a merge, a restore)
            path.parent.mkdir(parents=True, exist_ok=True)
            fh = open(tmp, "wb")  # noqa: SIM115
        with fh:
            fh.write(self._encode(state))
            if self.fsync:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
        self.writes += 1

    def _read(self, client_id: int) -> State | None:
        areas = ["pending", *(p.name for _, p in reversed(self._committing_list)), "base"]
        for area in areas:
            path = self._path(area, client_id)
            try:
                raw = np.fromfile(path, dtype=np.uint8)
            except FileNotFoundError:
                continue
            self.reads += 1
            return self._decode(raw, path)
        return None

    def _rescan(self) -> None:
        self._committing_list = self._committing()
        self._made.clear()

    # ------------------------------------------------------------------ StateStore

    def get(self, client_id: int) -> State | None:
        entry = self._cache.get(client_id)
        if entry is not None:
            self._cache.move_to_end(client_id)
            return {k: v.clone() for k, v in entry[0].items()}
        state = self._read(client_id)
        if state is None:
            return None
        self._insert(client_id, state, dirty=False)
        return {k: v.clone() for k, v in state.items()}

    def put(self, client_id: int, state: State) -> None:
        self._check(client_id, state)
        missing = set(self.specs) - set(state)
        if missing:
            raise KeyError(f"client {client_id}: state lacks {sorted(missing)}; a disk store keeps whole states")
        self._insert(client_id, {k: v.detach().to("cpu", copy=True) for k, v in state.items()}, dirty=True)

    def _insert(self, client_id: int, state: State, dirty: bool) -> None:
        self._cache[client_id] = (state, dirty)
        self._cache.move_to_end(client_id)
        while len(self._cache) > self.capacity:
            cid, (old, old_dirty) = self._cache.popitem(last=False)
            if old_dirty:
                self._write(cid, old)

    def flush(self) -> None:
        for cid, (state, dirty) in self._cache.items():
            if dirty:
                self._write(cid, state)
                self._cache[cid] = (state, False)

    def stage(self, round: int, states: dict[int, State], tag: str = "") -> None:
        area = f"staged-{round:08d}{tag}"
        shutil.rmtree(self.root / area, ignore_errors=True)  # a rerun of the round replaces it
        for cid, state in states.items():
            self._check(cid, state)
            self._write(cid, state, area)

    def apply_staged(self, round: int, tag: str = "") -> int:
        src = self.root / f"staged-{round:08d}{tag}"
        if not src.exists():
            return 0
        ids = [int(f.stem) for f in src.glob("*/*.bin")]
        for cid in ids:  # the files below replace whatever the cache holds for these clients
            self._cache.pop(cid, None)
        self._merge(src, self.root / "pending")
        return len(ids)

    def invalidate(self) -> None:
        self.flush()
        self._cache.clear()
        self._rescan()

    def checkpoint(self, directory: Path | None = None, round: int | None = None) -> None:
        self.flush()
        pending = self.root / "pending"
        if round is None or not pending.exists():
            return
        target = self.root / f"committing-{round:08d}"
        if target.exists():  # a second checkpoint of the same round: fold the new writes in
            self._merge(pending, target)
        else:
            if self.fsync:
                for shard in pending.iterdir():
                    fsync_dir(shard)
            os.replace(pending, target)
            if self.fsync:
                fsync_dir(self.root)
        self._rescan()

    def commit(self, round: int) -> None:
        for r, path in self._committing():
            if r <= round:
                self._merge(path, self.root / "base")
        self._rescan()

    def restore(self, directory: Path | None = None, round: int | None = None) -> None:
        self._cache.clear()
        shutil.rmtree(self.root / "pending", ignore_errors=True)
        for staged in self.root.glob("staged-*"):  # every round up to a checkpoint was applied before it
            shutil.rmtree(staged, ignore_errors=True)
        for r, path in self._committing():
            if round is not None and r <= round:
                self._merge(path, self.root / "base")
            else:
                shutil.rmtree(path, ignore_errors=True)
        if round is None:
            shutil.rmtree(self.root / "base", ignore_errors=True)
        self._rescan()

    def _merge(self, src: Path, dst: Path) -> None:
        """Move every file of ``src`` into ``dst`` (replacing older versions), then remove ``src``.

        Safe to interrupt and repeat: moved files are gone from ``src``.
        """
        for shard in sorted(p for p in src.iterdir() if p.is_dir()):
            target = dst / shard.name
            target.mkdir(parents=True, exist_ok=True)
            for f in shard.iterdir():
                if f.name.endswith(".tmp"):
                    f.unlink(missing_ok=True)
                else:
                    os.replace(f, target / f.name)
            if self.fsync:
                fsync_dir(target)
            shard.rmdir()
        shutil.rmtree(src, ignore_errors=True)

    def close(self) -> None:
        self.flush()
        self._cache.clear()
        if self._tmp is not None:  # a private temporary store: nothing to keep
            self._tmp.cleanup()
            self._tmp = None

    def client_ids(self) -> list[int]:
        """Clients with a readable state (cache, pending, committing, base; not staged rounds)."""
        ids: set[int] = set(self._cache)
        for area in self.root.iterdir():
            if area.is_dir() and not area.name.startswith("staged-"):
                ids.update(int(f.stem) for f in area.glob("*/*.bin"))
        return sorted(ids)

    def __len__(self) -> int:
        """Number of clients with a stored state (walks the folders: for tests and reports)."""
        return len(self.client_ids())
