"""LEAF JSON directories (FEMNIST and friends), read without LEAF's code.

A LEAF data directory has ``train/`` and ``test/`` holding ``*.json`` or ``*.json.gz`` files, each one
object with ``users`` (ids), ``num_samples`` (same order), ``user_data`` ({user: {"x": [...], "y": [...]}})
and optionally ``hierarchies``. As LEAF does, train and test must hold the same users; LEAF-style
samples also ship test-only users, which we can load separately.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from fl_platform.datasets.paths import DatasetNotFoundError, data_root
from fl_platform.datasets.source import SourceData, standardize, standardized_value

# FEMNIST pixel statistics after inversion (ink = 1), computed once on the 14,708 train images of the
# LEAF sample in shared/data; fixed so features never depend on which writers a run loads.
FEMNIST_MEAN = (0.03884,)
FEMNIST_STD = (0.16556,)
FEMNIST_NUM_CLASSES = 62


@dataclass
class LeafSplit:
    """One split of a LEAF directory: per-user arrays (converted by ``convert_x``) and hierarchies."""

    x: dict[str, np.ndarray] = field(default_factory=dict)
    y: dict[str, np.ndarray] = field(default_factory=dict)
    hierarchies: dict[str, Any] = field(default_factory=dict)
    all_users: list[str] = field(default_factory=list)  # every user seen, also those not converted

    @property
    def users(self) -> list[str]:
        return sorted(self.x)


def leaf_files(folder: str | os.PathLike[str]) -> list[Path]:
    """The ``*.json``/``*.json.gz`` files of a LEAF split folder, in name order."""
    folder = Path(folder)
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and (p.name.endswith(".json") or p.name.endswith(".json.gz"))
    )


def _open(path: Path) -> IO[str]:
    return (
        gzip.open(path, "rt", encoding="utf-8") if path.name.endswith(".gz") else open(path, encoding="utf-8")
    )


def peek_users(path: str | os.PathLike[str], max_bytes: int = 1 << 20) -> list[str] | None:
    """Read only the ``users`` list from the head of a LEAF file, or None if it is not there.

    LEAF writes ``users`` first, so a selective load (a few writers) can skip whole files without
    parsing megabytes of pixel floats.
    """
    path = Path(path)
    with open(path, "rb") as fh:
        head = fh.read(max_bytes)
    if path.name.endswith(".gz"):
        try:
            head = zlib.decompressobj(wbits=31).decompress(head, max_bytes)
        except zlib.error:
            return None
    text = head.decode("utf-8", errors="ignore")
    start = text.find('"users"')
    colon = text.find(":", start)
    if start < 0 or colon < 0:
        return None
    begin = colon + 1
    while begin < len(text) and text[begin].isspace():
        begin += 1
    try:
        users, _ = json.JSONDecoder().raw_decode(text, begin)
    except json.JSONDecodeError:
        return None
    return [str(u) for u in users] if isinstance(users, list) else None


def split_users(folder: str | os.PathLike[str]) -> list[str]:
    """All user ids of a LEAF split folder, peeking at file heads where possible."""
    users: list[str] = []
    for path in leaf_files(folder):
        head = peek_users(path)
        if head is None:
            with _open(path) as fh:
                head = [str(u) for u in json.load(fh)["users"]]
        users.extend(head)
    return users


def read_leaf_split(
    folder: str | os.PathLike[str],
    users: Iterable[str] | None = None,
    convert_x: Callable[[list[Any]], np.ndarray] = lambda x: np.asarray(x, dtype=np.float32),
) -> LeafSplit:
    """Read every LEAF file in ``folder``; convert only ``users`` (all when None).

    Each file's JSON is dropped as soon as its users are converted, so peak memory is one file's
    Python objects plus the numpy arrays.
    """
    wanted = None if users is None else set(users)
    split = LeafSplit()
    seen: set[str] = set()
    for path in leaf_files(folder):
        if wanted is not None:
            head = peek_users(path)
            if head is not None and not wanted.intersection(head):
                if dup := seen.intersection(head):
                    raise ValueError(
                        f"{path}: users {sorted(dup)[:5]} appear in more than one file of {folder}"
                    )
                seen.update(head)
                split.all_users.extend(head)
                continue
        with _open(path) as fh:
            obj = json.load(fh)
        for key in ("users", "user_data"):
            if key not in obj:
                raise ValueError(f"{path}: LEAF file without {key!r}")
        for user in obj["users"]:
            if user in seen:
                raise ValueError(f"{path}: user {user!r} appears in more than one file of {folder}")
            seen.add(user)
            split.all_users.append(user)
            if wanted is not None and user not in wanted:
                continue
            data = obj["user_data"][user]
            split.x[user] = convert_x(data["x"])
            split.y[user] = np.asarray(data["y"], dtype=np.float64).astype(np.int64)  # FedProx stores floats
            if len(split.x[user]) != len(split.y[user]):
                raise ValueError(
                    f"{path}: user {user!r} has {len(split.x[user])} inputs but {len(split.y[user])} labels"
                )
        for user, hier in zip(obj["users"], obj.get("hierarchies") or []):
            if wanted is None or user in wanted:
                split.hierarchies[user] = hier
    return split


def _check_same_users(train: list[str], test: list[str], folder: Path) -> None:
    a, b = set(train), set(test)
    if a != b:
        only_train, only_test = sorted(a - b)[:5], sorted(b - a)[:5]
        raise ValueError(
            f"LEAF data in {folder}: train and test must hold the same users (as LEAF requires); "
            f"{len(a - b)} only in train (e.g. {only_train}), {len(b - a)} only in test (e.g. {only_test})"
        )


def _femnist_x(invert: bool) -> Callable[[list[Any]], np.ndarray]:
    def convert(rows: list[Any]) -> np.ndarray:
        x = np.asarray(rows, dtype=np.float32).reshape(-1, 1, 28, 28)
        if invert:
            np.subtract(1.0, x, out=x)
        return x

    return convert


def _stack(split: LeafSplit, users: list[str], first_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    xs = [split.x[u] for u in users]
    ys = [split.y[u] for u in users]
    groups = np.repeat(np.arange(first_id, first_id + len(users), dtype=np.int64), [len(y) for y in ys])
    x = np.concatenate(xs) if xs else np.empty((0, 1, 28, 28), np.float32)
    y = np.concatenate(ys) if ys else np.empty(0, np.int64)
    return x, y, groups


def find_leaf_dir(name: str, root: str | os.PathLike[str] | None, folders: Iterable[str]) -> Path:
    """First candidate that holds both ``train/`` and ``test/``; DatasetNotFoundError otherwise."""
    base = data_root(root)
    candidates = [base / f for f in folders] + [base]
    for c in candidates:
        if (c / "train").is_dir() and (c / "test").is_dir():
            return c
    raise DatasetNotFoundError(
        name,
        candidates,
        "Each folder must hold LEAF's train/ and test/ directories of *.json or *.json.gz files "
        "(generate them with LEAF's preprocess.sh; there is no automatic download).",
    )


def load_femnist(
    root: str | os.PathLike[str] | None = None,
    download: bool = False,
    seed: int = 0,
    *,
    max_writers: int | None = None,
    test_only_writers: bool = False,
    invert: bool = True,
    normalize: bool = True,
) -> SourceData:
    """FEMNIST in LEAF JSON: 1 x 28 x 28 images, 62 classes, grouped by writer.

    LEAF stores ink dark on a white (1.0) background; ``invert`` (default) flips it to bright ink on 0,
    the MNIST/Fashion-MNIST convention, before standardising. Writers are numbered in sorted id
    order; ``max_writers`` loads only the first N of them. ``test_only_writers`` appends the writers
    of ``test_only_writers/`` to the test set with group ids after the training writers'.
    ``seed`` is accepted for a uniform signature and ignored; LEAF data cannot be downloaded.
    """
    del seed, download
    folder = find_leaf_dir("femnist", root, ("femnist-leaf", "femnist/data", "femnist"))
    if max_writers is not None and max_writers < 1:
        raise ValueError(f"femnist: max_writers must be >= 1 or None, got {max_writers}")
    convert = _femnist_x(invert)
    selected = None
    if max_writers is not None:  # train and test hold the same users, and test files are the small ones
        selected = sorted(split_users(folder / "test"))[:max_writers]
    train = read_leaf_split(folder / "train", selected, convert)
    test = read_leaf_split(folder / "test", selected, convert)
    _check_same_users(train.all_users, test.all_users, folder)
    users = train.users
    if not users:
        raise ValueError(f"femnist: no writers found in {folder / 'train'}")
    train_x, train_y, train_groups = _stack(train, users, 0)
    test_x, test_y, test_groups = _stack(test, users, 0)
    names = list(users)
    if test_only_writers:
        extra_dir = folder / "test_only_writers"
        if not extra_dir.is_dir():
            raise DatasetNotFoundError("femnist (test_only_writers)", [extra_dir])
        extra = read_leaf_split(extra_dir, None, convert)
        overlap = set(extra.users) & set(users)
        if overlap:
            raise ValueError(
                f"femnist: test_only_writers overlap the training writers: {sorted(overlap)[:5]}"
            )
        ex, ey, eg = _stack(extra, extra.users, len(users))
        test_x, test_y, test_groups = (
            np.concatenate(a) for a in ((test_x, ex), (test_y, ey), (test_groups, eg))
        )
        names += extra.users
    mean = FEMNIST_MEAN if invert else tuple(1.0 - m for m in FEMNIST_MEAN)
    return SourceData(
        train_x=standardize(train_x, mean, FEMNIST_STD, normalize),
        train_y=train_y,
        test_x=standardize(test_x, mean, FEMNIST_STD, normalize),
        test_y=test_y,
        num_classes=FEMNIST_NUM_CLASSES,
        input_shape=(1, 28, 28),
        name="femnist",
        train_groups=train_groups,
        test_groups=test_groups,
        group_names=names,
        pad_value=standardized_value(0.0 if invert else 1.0, mean, FEMNIST_STD, normalize),  # the background
        class_names=[str(d) for d in range(10)]
        + [chr(c) for c in range(65, 91)]
        + [chr(c) for c in range(97, 123)],
    )
