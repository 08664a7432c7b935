"""A SuperNode's on-disk cache of its client's prepared settings and data.

Flower 1.42 runs a ClientApp in a fresh process per message, so whatever the ClientApp prepares
(the composed configuration, the dataset loaded and partitioned) is lost after each round: every
device paid 0.5 s of Hydra and 2-4 s of data loading every round (issue 26). This cache keeps that
work on the node's disk, one entry per (run config, node config, code):

* **Keyed by everything that decides it**: the whole run config, the node config (partition id,
  data root, data mode, ...), ``$FL_DATA_ROOT`` and the code (the stat of every source file and
  conf/ YAML of the running app: a new FAB or an edited checkout is another key). The files the
  build read (recorded with an audit hook while it runs: the dataset's files and the folders it
  listed) are stored with their size and mtime, and checked on every hit: a changed data file makes
  the entry stale, and it is rebuilt (logged).
* **Atomic**: an entry is written to a temporary file in the same folder and renamed into place,
  so a reader sees a whole entry or none. A checksum over the payload catches a corrupt file
  (truncated, overwritten); it is rebuilt (logged), never used.
* **Safe when runs share a node**: entries are keyed, not one slot; two processes writing the
  same key each rename a complete file. At most ``max_entries`` per folder (least recently
  used evicted). What goes in is the caller's choice; the ClientApp stores its client's own rows only.

The folder is the node's own (``$FLWR_HOME/fl_platform-cache/node-<hash of its node config>``, or
the node config's ``cache-dir``), created private (0700) and refused if another user owns it or can
write to it, since entries are pickles.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import stat
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("flwr.fl_platform.node_cache")  # under flwr's logger: shown in the SuperNode's log

FORMAT = 1  # bump when the entry layout changes: older entries become misses
MAGIC = b"FLNC"
SUFFIX = ".entry"
DEFAULT_ENTRIES = 4
CODE_PARTS = ("fl_platform", "algorithms", "datasets", "conf")  # what the app runs (fab-include)
CODE_SUFFIXES = (".py", ".yaml")
T = TypeVar("T")


# ---------------------------------------------------------------- keys


def code_identity(root: Path | None = None) -> str:
    """A hash of (path, size, mtime) of the app's source files: another FAB or an edit is another key."""
    if root is None:
        import fl_platform

        root = fl_platform.REPO_ROOT
    h = hashlib.sha256(str(root).encode())
    for part in CODE_PARTS:
        for dirpath, dirnames, filenames in os.walk(root / part):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if name.endswith(CODE_SUFFIXES):
                    st = os.stat(os.path.join(dirpath, name))
                    h.update(f"{dirpath}/{name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class CacheKey:
    """What a cached value depends on (``material``, stored in the entry and compared on load)."""

    material: str  # canonical JSON

    @classmethod
    def of(cls, **parts: Any) -> CacheKey:
        return cls(json.dumps({"format": FORMAT, **parts}, sort_keys=True, default=repr))

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.material.encode()).hexdigest()[:32]


# ---------------------------------------------------------------- which files a build reads

_recorders: list[set[str]] = []
_hook_lock = threading.Lock()
_hooked = False
_SKIP_SUFFIXES = (".py", ".pyc", ".pyo", ".so", ".pyd", ".pth")  # code: keyed by code_identity / installs
_SKIP_PREFIXES = ("/proc/", "/sys/", "/dev/")


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _recorders or event not in ("open", "os.listdir", "os.scandir"):
        return
    path = args[0] if args else None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    elif isinstance(path, os.PathLike):
        path = os.fspath(path)
    if isinstance(path, str) and path:
        for seen in _recorders:
            seen.add(path)


@contextlib.contextmanager
def recording_reads() -> Iterator[set[str]]:
    """The paths opened or listed (in this process) while the block runs, for ``file_identity``."""
    global _hooked
    with _hook_lock:
        if not _hooked:  # audit hooks cannot be removed; this one returns at once unless recording
            sys.addaudithook(_audit)
            _hooked = True
    seen: set[str] = set()
    _recorders.append(seen)
    try:
        yield seen
    finally:
        _recorders.remove(seen)


def _code_folders() -> tuple[str, ...]:
    """Where imports and the config list folders (sys.path, the interpreter's prefixes, the app's own
    tree, keyed by ``code_identity``): not data."""
    import fl_platform

    roots = {os.path.abspath(p or os.curdir) for p in sys.path} | {sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                                 str(fl_platform.REPO_ROOT)}
    return tuple(sorted(r.rstrip(os.sep) + os.sep for r in roots))


def file_identity(paths: set[str]) -> list[tuple[str, int, int]]:
    """(path, size, mtime_ns) of the data files and folders among ``paths``: code files, /proc and the
    folders imports list (on sys.path, the app's tree; a data folder under one is watched through its
    files only) are left out."""
    code = _code_folders()
    out = []
    for raw in paths:
        path = os.path.abspath(raw)
        if path.endswith(_SKIP_SUFFIXES) or path.startswith(_SKIP_PREFIXES) or ".dist-info" in path \
                or "__pycache__" in path:
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue  # probed and absent (a loader trying candidate folders): nothing to watch
        if stat.S_ISREG(st.st_mode):
            out.append((path, st.st_size, st.st_mtime_ns))
        elif stat.S_ISDIR(st.st_mode) and not (path + os.sep).startswith(code):
            out.append((path, 0, st.st_mtime_ns))
    return sorted(set(out))


def changed_files(identity: list[tuple[str, int, int]]) -> list[str]:
    """The recorded files and folders whose size or mtime differ now (or that are gone)."""
    changed = []
    for path, size, mtime in identity:
        try:
            st = os.stat(path)
        except OSError:
            changed.append(path)
            continue
        if st.st_mtime_ns != mtime or (stat.S_ISREG(st.st_mode) and st.st_size != size):
            changed.append(path)
    return changed


# ---------------------------------------------------------------- the cache


class CacheUnusable(OSError):
    """The cache folder cannot be used safely (another user's, writable by others, not creatable)."""


def private_folder(path: Path) -> Path:
    """``path``, created 0700; refused when another user owns it or others may write to it."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = os.stat(path)
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise CacheUnusable(f"cache folder {path} belongs to uid {st.st_uid}, not this user")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheUnusable(f"cache folder {path} is writable by others (mode {stat.filemode(st.st_mode)}); "
                            "entries are pickles, so it is not used")
    return path


@dataclass
class CacheStats:
    """What the last ``get_or_build`` did: hit, miss, stale (data changed) or corrupt, and its seconds."""

    outcome: str = ""
    seconds: float = 0.0
    detail: str = ""


@dataclass
class NodeCache:
    """Entries ``<digest>.entry`` in ``directory``: MAGIC, crc32 and length of the payload, payload
    (a pickle of {key, files, value})."""

    directory: Path
    max_entries: int = DEFAULT_ENTRIES
    last: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        if self.max_entries < 1:
            raise ValueError(f"a node cache holds at least one entry, got max_entries={self.max_entries}")
        self.directory = private_folder(Path(self.directory))

    def path(self, key: CacheKey) -> Path:
        return self.directory / f"{key.digest}{SUFFIX}"

    def entries(self) -> list[Path]:
        return sorted(self.directory.glob(f"*{SUFFIX}"))

    def load(self, key: CacheKey) -> tuple[str, Any]:
        """(outcome, value): ("hit", value), or ("miss" | "stale" | "corrupt", reason)."""
        path = self.path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return "miss", "no entry"
        try:
            if blob[:4] != MAGIC:
                raise ValueError("bad magic")
            crc, length = int.from_bytes(blob[4:8], "little"), int.from_bytes(blob[8:16], "little")
            payload = memoryview(blob)[16:]
            if len(payload) != length or zlib.crc32(payload) != crc:
                raise ValueError(f"checksum or length mismatch ({len(payload)} of {length} bytes)")
            entry = pickle.loads(payload)
            if entry["key"] != key.material:
                raise ValueError("the entry's key differs from its name's")
        except Exception as err:  # any damage: rebuilt, never used
            return "corrupt", f"{type(err).__name__}: {err}"
        changed = changed_files(entry["files"])
        if changed:
            return "stale", f"changed since it was built: {', '.join(changed[:3])}"
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: evicted last
        return "hit", entry["value"]

    def store(self, key: CacheKey, value: Any, files: list[tuple[str, int, int]]) -> Path:
        """Write the entry atomically (temporary file + rename), then evict beyond ``max_entries``."""
        payload = pickle.dumps({"key": key.material, "files": files, "value": value}, protocol=5)
        header = MAGIC + zlib.crc32(payload).to_bytes(4, "little") + len(payload).to_bytes(8, "little")
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key.digest}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(header)
                fh.write(payload)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path(key))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self.evict()
        return self.path(key)

    def evict(self) -> None:
        """Keep the ``max_entries`` most recently used entries; drop temporary files of dead writers."""
        now = time.time()
        for tmp in self.directory.glob(".*.tmp"):
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > 600:
                    tmp.unlink()
        dated = []
        for path in self.entries():
            with contextlib.suppress(OSError):
                dated.append((path.stat().st_mtime_ns, path))
        for _, path in sorted(dated, reverse=True)[self.max_entries:]:
            with contextlib.suppress(OSError):
                path.unlink()

    def get_or_build(self, key: CacheKey, build: Callable[[], T]) -> T:
        """The cached value of ``key``, or ``build()`` (recording the files it reads), stored."""
        start = time.perf_counter()
        outcome, value = self.load(key)
        if outcome == "hit":
            self.last = CacheStats("hit", time.perf_counter() - start)
            return value
        if outcome in ("stale", "corrupt"):
            log.warning("node cache entry %s is %s (%s): rebuilding it", self.path(key).name, outcome, value)
        with recording_reads() as seen:
            built = build()
        files = file_identity(seen)
        try:
            self.store(key, built, files)
        except OSError as err:  # a full or read-only disk costs speed, not the round
            log.warning("node cache: could not store %s (%s)", self.path(key).name, err)
        self.last = CacheStats(outcome, time.perf_counter() - start, value)
        return built


def node_folder(base: Path, node_config: Mapping[str, Any], ignore: tuple[str, ...] = ()) -> Path:
    """This node's own folder under ``base``: named by its node config, so a restarted SuperNode
    (a new node id, the same node config) finds its entries."""
    ident = json.dumps({k: v for k, v in node_config.items() if k not in ignore}, sort_keys=True, default=repr)
    return base / f"node-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"
