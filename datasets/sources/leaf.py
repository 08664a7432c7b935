"""LEAF JSON directories (FEMNIST and friends), read without LEAF's code.

A LEAF data directory has ``train/`` and ``test/`` holding ``*.json`` or ``*.json.gz`` files, each one
object with ``users`` (ids), ``num_samples`` (same order), ``user_data`` ({user: {"x": [...], "y": [...]}})
and optionally ``hierarchies``. As LEAF does, train and test must hold the same users; LEAF-style
samples also ship test-only users, which we can load separately.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from fl_platform.datasets.paths import DatasetNotFoundError, data_root
from fl_platform.datasets.source import SourceData, class_ids, standardize, standardized_value

# FEMNIST pixel statistics after inversion (ink = 1), computed once on the 14,708 train images of the
# LEAF sample in shared/data; fixed so features never depend on which writers a run loads.
FEMNIST_MEAN = (0.03884,)
FEMNIST_STD = (0.16556,)
FEMNIST_NUM_CLASSES = 62

log = logging.getLogger(__name__)


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


def _load(path: Path) -> dict[str, Any]:
    """One LEAF file's JSON object; a truncated or corrupt file (JSON or gzip) is refused naming it."""
    try:
        with _open(path) as fh:
            obj = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError, EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise ValueError(f"{path}: not readable LEAF JSON (truncated or corrupt?): {type(err).__name__}: {err}") from err
    for key in ("users", "user_data"):
        if not isinstance(obj, dict) or key not in obj:
            raise ValueError(f"{path}: LEAF file without {key!r}")
    return obj


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
            head = [str(u) for u in _load(path)["users"]]
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
        obj = _load(path)
        users = [str(u) for u in obj["users"]]  # JSON object keys are strings: user 7 is user_data["7"]
        _check_users(path, folder, users, obj, seen)
        for user in users:
            seen.add(user)
            split.all_users.append(user)
            if wanted is not None and user not in wanted:
                continue
            data = obj["user_data"][user]
            if not isinstance(data, dict) or "x" not in data or "y" not in data:
                raise ValueError(f"{path}: user_data[{user!r}] must be an object with 'x' and 'y'")
            try:
                split.x[user] = convert_x(_numbers(data["x"]))
            except (ValueError, TypeError) as err:
                raise ValueError(f"{path}: user {user!r}: cannot read 'x': {err}") from err
            split.y[user] = _labels(data["y"], f"{path}: user {user!r} 'y'")  # FedProx's floats: 3.0 is 3
            if len(split.x[user]) != len(split.y[user]):
                raise ValueError(
                    f"{path}: user {user!r} has {len(split.x[user])} inputs but {len(split.y[user])} labels"
                )
        for user, hier in zip(users, obj.get("hierarchies") or []):
            if wanted is None or user in wanted:
                split.hierarchies[user] = hier
    return split


def _numbers(rows: Any) -> np.ndarray:
    """A user's ``x`` as an array of the JSON numbers it holds; strings ("0.5"), null or true/false are
    refused naming the first one (numpy would turn "0.5" into 0.5, and [0.1, true] into [0.1, 1.0], without
    a word)."""
    x = np.asarray(rows)
    if x.dtype.kind not in "iuf" or _holds_bool(rows):
        raise ValueError(f"it must hold JSON numbers, found {_first_non_number(rows, x)}; write the values "
                         "as numbers, not strings, null or true/false")
    return x


def _labels(y: Any, where: str) -> np.ndarray:
    """A user's ``y`` as class ids (``class_ids``); JSON true/false among them is refused naming ``where``
    and the value (Python's bool is an int: [1, false] would load as [1, 0])."""
    if _holds_bool(y):
        raise ValueError(f"{where}: labels must be integer class ids written as JSON numbers, found "
                         f"{_first_non_number(y)}; write them as numbers, not true/false")
    return class_ids(y, where)


def _holds_bool(value: Any) -> bool:
    """Whether nested lists hold a bool (JSON true/false) anywhere. Fast on FEMNIST's rows of 784 floats
    (one C-level pass per row); nesting is uniform wherever numpy read them as a numeric array."""
    if not isinstance(value, list):
        return isinstance(value, bool)
    if value and isinstance(value[0], list):
        return any(map(_holds_bool, value))
    return bool in set(map(type, value))


def _first_non_number(values: Any, array: np.ndarray | None = None) -> str:
    """The first entry of nested lists that is not a JSON number, as ``'0.5' (str)``, for messages (else
    the dtype numpy read them as)."""
    for value in _non_numbers(values):
        return f"{value!r} ({type(value).__name__})"
    return f"dtype {getattr(array, 'dtype', '?')}"


def _non_numbers(value: Any) -> Any:
    """The entries of nested lists that are not int or float (bools included), depth first."""
    if isinstance(value, list):
        for item in value:
            yield from _non_numbers(item)
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        yield value


def _check_users(path: Path, folder: str | os.PathLike[str], users: list[str], obj: dict[str, Any],
                 seen: set[str]) -> None:
    """``users``, ``user_data`` and ``num_samples`` of one file agree, and no user is in an earlier file."""
    if len(set(users)) != len(users):
        twice = sorted({u for u in users if users.count(u) > 1})
        raise ValueError(f"{path}: users {twice[:5]} appear more than once in its 'users'")
    if dup := seen.intersection(users):
        raise ValueError(f"{path}: users {sorted(dup)[:5]} appear in more than one file of {folder}")
    data = obj["user_data"]
    if absent := [u for u in users if u not in data]:
        raise ValueError(f"{path}: {len(absent)} user(s) of 'users' have no entry in 'user_data' (e.g. {absent[0]!r})")
    if unlisted := sorted(set(map(str, data)) - set(users)):
        raise ValueError(f"{path}: 'user_data' holds {len(unlisted)} user(s) not in 'users' (e.g. {unlisted[0]!r}); "
                         "list them in 'users' (with 'num_samples') or remove them")
    counts = obj.get("num_samples")
    if counts is not None:
        if len(counts) != len(users):
            raise ValueError(f"{path}: 'num_samples' has {len(counts)} entries for {len(users)} users")
        for user, n in zip(users, counts):
            y = data[user].get("y") if isinstance(data[user], dict) else None
            if y is not None and len(y) != n:
                raise ValueError(f"{path}: user {user!r} has num_samples {n} but {len(y)} samples")


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
    if idle := [u for u in users if not len(train.y[u])]:
        users = [u for u in users if len(train.y[u])]
        log.warning("femnist: %d writer(s) in %s have no training samples (e.g. %r): left out, with their %d test "
                    "row(s), so that every writer is a client", len(idle), folder / "train", idle[0],
                    sum(len(test.y[u]) for u in idle))
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
