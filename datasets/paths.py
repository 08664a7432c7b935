"""Where the data lives: one configurable root shared by every file-backed source.

The root is resolved as: an explicit ``root`` argument, else ``$FL_DATA_ROOT``, else
``<repo>/../shared/data`` (the offline copies that sit next to the repository checkout).
Nothing here hard-codes an absolute path, so the same code runs on a laptop, in CI and on a cluster.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import fl_platform

ENV_VAR = "FL_DATA_ROOT"


def data_root(root: str | os.PathLike[str] | None = None) -> Path:
    """Resolve the data root (a missing one is not an error here: loaders report what is missing; a file is)."""
    if root is not None and str(root) != "":
        path, origin = Path(root).expanduser(), "the root argument (dataset.root)"
    elif os.environ.get(ENV_VAR):
        path, origin = Path(os.environ[ENV_VAR]).expanduser(), f"${ENV_VAR}"
    else:
        return fl_platform.REPO_ROOT.parent / "shared" / "data"
    if path.is_file():
        raise NotADirectoryError(f"the data root {path} (from {origin}) is a file; it must be the folder that holds "
                                 "the data sets")
    return path


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are not where we looked; the message says where we looked and what to do."""

    def __init__(self, dataset: str, tried: Iterable[str | os.PathLike[str]], hint: str = "") -> None:
        self.dataset = dataset
        self.tried = [str(p) for p in tried]
        lines = [f"dataset {dataset!r} not found. Looked in:"]
        lines += [f"  - {p}" for p in self.tried] or ["  (no candidate paths)"]
        lines.append(
            f"Set the data root with the `root` argument or the {ENV_VAR} environment variable "
            f"(currently {os.environ.get(ENV_VAR, '<unset>')!r})."
        )
        if hint:
            lines.append(hint)
        super().__init__("\n".join(lines))


class DownloadError(DatasetNotFoundError):
    """``download=True`` was asked for but the files could not be fetched (offline, bad checksum)."""


def first_existing(candidates: Sequence[Path], required: Sequence[str] = ()) -> Path | None:
    """Return the first directory among ``candidates`` that holds every name in ``required``.

    A name matches a plain file or its ``.gz`` sibling, so raw and gzip-compressed copies both count.
    """
    for folder in candidates:
        if not folder.is_dir():
            continue
        if all((folder / name).is_file() or (folder / f"{name}.gz").is_file() for name in required):
            return folder
    return None
