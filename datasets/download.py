"""Opt-in downloads (``download=True``): atomic, checksummed, with a clear error when offline.

Nothing calls these unless a loader was asked to download, so tests and offline runs never touch
the network.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from fl_platform.datasets.paths import DownloadError

_CHUNK = 1 << 20


def md5sum(path: Path) -> str:
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(
    dataset: str, urls: Sequence[str], dest: Path, md5: str | None = None, timeout: float = 60.0
) -> Path:
    """Download the first reachable URL of ``urls`` to ``dest`` (skipped when ``dest`` already matches).

    The file is written to a temporary sibling and moved into place, so an interrupted download
    never leaves a truncated file that a later run would mistake for the real one.
    """
    if dest.is_file() and (md5 is None or md5sum(dest) == md5):
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise DownloadError(dataset, [dest], f"download=True cannot write to {dest.parent}: {exc}") from exc
    errors: list[str] = []
    for url in urls:
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
                for block in iter(lambda resp=resp: resp.read(_CHUNK), b""):
                    out.write(block)
            if md5 is not None and (got := md5sum(tmp)) != md5:
                errors.append(f"{url}: md5 {got} != expected {md5}")
                continue
            os.replace(tmp, dest)
            return dest
        except (urllib.error.URLError, OSError, TimeoutError) as exc:
            errors.append(f"{url}: {exc}")
        finally:
            tmp.unlink(missing_ok=True)
    raise DownloadError(
        dataset,
        [dest],
        "download=True could not fetch the file (offline or blocked?):\n"
        + "\n".join(f"  {e}" for e in errors)
        + f"\nCopy the file to {dest} by hand instead.",
    )
