"""Any Hugging Face ``datasets`` data set as a source: the Hub, or local parquet/arrow/CSV/JSON files,
image folders and ``save_to_disk`` folders (optional extra: ``pip install 'fl-platform[hf]'``).

``path`` is looked up locally first (as given, then under the data root); only a ``path`` that is no
local file or folder is a Hub name. Network use follows ``download`` as for every other source:

* a local path never touches the network (loaded with the Hub switched off, cached in a temporary
  folder, so a read-only data root works);
* a Hub name with ``download=False`` (the default) loads the copy cached under
  ``<data root>/huggingface`` with the Hub switched off, and fails, naming the fix, when there is none;
* a Hub name with ``download=True`` may fetch it into that cache (pin ``revision`` to make it
  reproducible).

Conversion: an image column (``datasets.Image``) becomes float32 N x C x H x W in [0, 1] (C = 1 for
grayscale, 3 for colour; every image must have the same size), standardised per channel; a tabular
source stacks numeric ``feature_columns`` into N x F float32, standardised per feature. Standardising
uses ``mean``/``std`` when given, else the statistics of the whole training split (fixed for a data
set, whatever the clients). Labels become int64 class ids: a ``ClassLabel`` keeps its ids and names,
strings are numbered in sorted order, integers are kept. ``group_column`` (a writer or device id)
gives the samples natural groups for ``partition=natural``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fl_platform.datasets.paths import DatasetNotFoundError, data_root
from fl_platform.datasets.source import (
    SourceData,
    check_finite,
    check_test_classes,
    standardize,
    standardized_value,
)
from fl_platform.datasets.sources.digits import stratified_split

# The stratified test_fraction split's own seed: the same test set in every run, as for digits.
SPLIT_SEED = 20240601
_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json", ".jsonl": "json"}
_GRAY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "F"})
_CACHE_FOLDER = "huggingface"  # under the data root: where Hub downloads are kept

log = logging.getLogger(__name__)


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise ImportError(
            "dataset=hf needs Hugging Face datasets: pip install 'fl-platform[hf]' (or `pip install datasets`)"
        ) from err
    return datasets


@contextlib.contextmanager
def _hub_off(datasets: Any) -> Iterator[None]:
    """No request to the Hugging Face Hub inside: both libraries read these flags at call time."""
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def _local(path: str, root: str | os.PathLike[str] | None) -> tuple[Path | None, list[Path]]:
    """The local file or folder ``path`` names (as given, else under the data root), and where we looked."""
    given = Path(path).expanduser()
    tried = [given] if given.is_absolute() else [given, data_root(root) / given]
    return next((p for p in tried if p.exists()), None), tried


def _split_of(loaded: Any, name: str, path: str) -> Any:
    """Split ``name`` of a DatasetDict (or the lone Dataset of a single-split folder)."""
    if not hasattr(loaded, "keys"):
        return loaded
    if name not in loaded:
        raise ValueError(
            f"hf: {path!r} has no split {name!r}; its splits: {', '.join(sorted(loaded))}. Set dataset.split / "
            "dataset.test_split to one of them, or dataset.test_split=null dataset.test_fraction=0.2 to hold "
            "out part of dataset.split")
    return loaded[name]


def _load_splits(datasets: Any, path: str, root: str | os.PathLike[str] | None, download: bool, subset: str | None,
                 revision: str | None, split: str, test_split: str | None, cache: str) -> tuple[Any, Any | None]:
    """(train, test or None) as ``datasets.Dataset``s."""
    local, tried = _local(path, root)
    wanted = [split] + ([test_split] if test_split is not None else [])
    if local is not None:
        if revision is not None:
            raise ValueError(f"hf: dataset.revision={revision!r} pins a Hugging Face Hub version; {path!r} is a "
                             "local path (leave revision null)")
        with _hub_off(datasets):
            if local.is_file():
                return _load_file(datasets, local, root, subset, split, test_split, cache)
            if (local / "dataset_dict.json").is_file() or (local / "state.json").is_file():
                if subset is not None:
                    raise ValueError(f"hf: dataset.subset={subset!r}: a save_to_disk folder has no subsets")
                loaded = datasets.load_from_disk(str(local))
            else:  # a folder of data files or images, splits inferred from file and folder names
                loaded = datasets.load_dataset(str(local), name=subset, cache_dir=cache)
        if not hasattr(loaded, "keys") and test_split is not None:
            raise ValueError(f"hf: {path!r} holds one split; set dataset.test_split=null and dataset.test_fraction")
        parts = [_split_of(loaded, s, path) for s in wanted]
        return parts[0], parts[1] if len(parts) > 1 else None
    if Path(path).suffix.lower() in _BUILDERS or path.startswith(("/", ".", "~")):
        raise DatasetNotFoundError("hf", tried, f"dataset.path={path!r} is a local path, but nothing is there.")
    hub_cache = str(data_root(root) / _CACHE_FOLDER)
    context = contextlib.nullcontext() if download else _hub_off(datasets)
    try:
        with context:
            parts = [datasets.load_dataset(path, name=subset, revision=revision, split=s, cache_dir=hub_cache)
                     for s in wanted]
    except (FileNotFoundError, ConnectionError) as err:
        how = ("it could not be fetched" if download else
               "it is not in the local cache and dataset.download=false keeps the network off; pass "
               "dataset.download=true to fetch it from the Hugging Face Hub")
        raise DatasetNotFoundError("hf", [*tried, Path(hub_cache)],
                                   f"{path!r} is no local path and was taken for a Hub name, but {how} ({err})") from err
    except ValueError as err:
        if "split" in str(err).lower():
            raise ValueError(f"hf: {path!r}: {err}. Set dataset.split / dataset.test_split, or "
                             "dataset.test_split=null dataset.test_fraction=0.2") from err
        raise
    return parts[0], parts[1] if len(parts) > 1 else None


def _load_file(datasets: Any, file: Path, root: str | os.PathLike[str] | None, subset: str | None, split: str,
               test_split: str | None, cache: str) -> tuple[Any, Any | None]:
    """A single data file is the training split; ``test_split`` may name a second file for the test split."""
    builder = _BUILDERS.get(file.suffix.lower())
    if builder is None:
        raise ValueError(f"hf: cannot read {file}: a local file must end in {', '.join(sorted(_BUILDERS))} "
                         "(or give a folder: an image folder, a folder of data files, or a save_to_disk folder)")
    if subset is not None:
        raise ValueError(f"hf: dataset.subset={subset!r}: a single file has no subsets")
    files = {"train": str(file)}
    if test_split is not None:
        test_file, tried = _local(test_split, root)
        if test_file is None or not test_file.is_file():
            raise ValueError(
                f"hf: dataset.path is a single file ({file.name}), so dataset.test_split must name the test file "
                f"(looked for {', '.join(map(str, tried))}), or be null with dataset.test_fraction set")
        if _BUILDERS.get(test_file.suffix.lower()) != builder:
            raise ValueError(f"hf: the test file {test_file.name} is not of the same kind as {file.name}")
        files["test"] = str(test_file)
    if split != "train":
        raise ValueError(f"hf: dataset.split={split!r} selects a split of a folder or Hub data set; the single file "
                         f"{file.name} is the training split (leave dataset.split=train)")
    # One load per file: loaded together, the test file would take the train file's columns, a missing one
    # filled with nulls.
    train, test = (_read_file(datasets, builder, Path(files[s]), s, cache) if s in files else None
                   for s in ("train", "test"))
    return train, test


def _read_file(datasets: Any, builder: str, file: Path, split: str, cache: str) -> Any:
    """One local data file as a ``datasets.Dataset``; a file that cannot be read, or holds no rows, is
    refused naming it (not pyarrow's or datasets' bare error, the path only in a log line)."""
    kind = "CSV" if builder == "csv" else builder
    try:
        if builder == "csv":  # read here: datasets' CSV builder leaves the file open (a ResourceWarning)
            import pandas as pd

            with open(file, "rb") as fh:
                frame = pd.read_csv(fh)
            ds = datasets.Dataset.from_pandas(frame, preserve_index=False)
        elif builder == "parquet" and _parquet_rows(file) == 0:
            ds = None  # datasets fails on it with "BatchSize must be greater than 0"
        else:
            ds = datasets.load_dataset(builder, data_files={split: str(file)}, split=split, cache_dir=cache)
    except StopIteration:  # datasets' JSON builder on an empty file
        ds = None
    except (ValueError, OSError, datasets.exceptions.DatasetGenerationError) as err:
        if "corresponds to no data" in str(err):  # datasets' words for a split of no rows
            ds = None
        else:
            reason = err.__cause__ if isinstance(err, datasets.exceptions.DatasetGenerationError) else err
            raise ValueError(f"hf: {file}: not a readable {kind} file: {type(reason).__name__}: {reason}") from err
    if ds is None or len(ds) == 0:
        raise ValueError(f"hf: {file}: no rows (a header or schema only?); the {split} file needs data")
    return ds


def _parquet_rows(file: Path) -> int:
    """The row count in a parquet file's footer (pyarrow's ArrowInvalid, a ValueError, when it has none)."""
    import pyarrow.parquet as pq

    return pq.read_metadata(file).num_rows


# ------------------------------------------------------------------ conversion


def _pick_columns(datasets: Any, features: Any, image_column: str | None, label_column: str | None,
                  feature_columns: Sequence[str] | None, group_column: str | None,
                  path: str) -> tuple[str | None, str, list[str]]:
    """(image column or None, label column, tabular feature columns)."""
    names = list(features)

    def need(col: str, key: str) -> str:
        if col not in features:
            raise ValueError(f"hf: dataset.{key}={col!r} is not a column of {path!r}; columns: {', '.join(names)}")
        return col

    if label_column is None:
        class_labels = [c for c in names if isinstance(features[c], datasets.ClassLabel)]
        label_column = class_labels[0] if len(class_labels) == 1 else next(
            (c for c in ("label", "labels") if c in features), None)
        if label_column is None:
            raise ValueError(f"hf: cannot tell the label column of {path!r} (columns: {', '.join(names)}); "
                             "set dataset.label_column")
    need(label_column, "label_column")
    if group_column is not None:
        need(group_column, "group_column")
    if feature_columns is not None:
        if image_column is not None:
            raise ValueError("hf: set dataset.image_column or dataset.feature_columns, not both")
        if not feature_columns:
            raise ValueError("hf: dataset.feature_columns is empty")
        return None, label_column, [need(c, "feature_columns") for c in feature_columns]
    if image_column is not None:
        if not isinstance(features[need(image_column, "image_column")], datasets.Image):
            raise ValueError(f"hf: dataset.image_column={image_column!r} holds {features[image_column]}, not images")
        return image_column, label_column, []
    images = [c for c in names if isinstance(features[c], datasets.Image)]
    if len(images) > 1:
        raise ValueError(f"hf: {path!r} has several image columns ({', '.join(images)}); set dataset.image_column")
    if images:
        return images[0], label_column, []
    skip = {label_column, group_column}
    numeric = [c for c in names if c not in skip and _is_numeric(datasets, features[c])]
    if not numeric:
        raise ValueError(f"hf: {path!r} has no image column and no numeric feature column (columns: "
                         f"{', '.join(names)}); text is not supported: tokenise it first")
    if left := [c for c in names if c not in skip and c not in numeric]:
        log.warning("hf: %r: feature columns %s are not numeric, left out of the features (using %s); a number "
                    "column with a text cell reads as text: fix that cell, or set dataset.feature_columns",
                    path, ", ".join(f"{c!r} ({features[c]})" for c in left), ", ".join(numeric))
    return None, label_column, numeric


def _is_numeric(datasets: Any, feature: Any) -> bool:
    return isinstance(feature, datasets.Value) and (
        feature.dtype == "bool" or feature.dtype.startswith(("int", "uint", "float")))


def _images(datasets: Any, ds: Any, column: str, mode: str, split: str) -> np.ndarray:
    """N x C x H x W float32 in [0, 1]."""
    arrays = ds.cast_column(column, datasets.Image(mode=mode)).with_format("numpy")[:][column]
    if arrays.dtype == object:
        shapes = [a.shape for a in arrays]
        bad = next(i for i, s in enumerate(shapes) if s != shapes[0])
        raise ValueError(f"hf: the {split} images differ in size (row 0: {shapes[0][:2]}, row {bad}: "
                         f"{shapes[bad][:2]}); resize them to one size first")
    x = arrays.astype(np.float32)
    x /= 255.0
    return x[:, None] if x.ndim == 3 else np.ascontiguousarray(x.transpose(0, 3, 1, 2))


def _tabular(datasets: Any, ds: Any, columns: list[str], split: str) -> np.ndarray:
    for c in columns:
        if not _is_numeric(datasets, ds.features[c]):
            raise ValueError(f"hf: feature column {c!r} holds {ds.features[c]}, not numbers")
    table = ds.with_format("numpy")[:]
    return np.stack([np.asarray(table[c], dtype=np.float32) for c in columns], axis=1)


def _ids(values: list[np.ndarray]) -> tuple[list[np.ndarray], list[str]]:
    """Map the values of every split to ids 0..K-1 in sorted order of the values (K = distinct values)."""
    uniq = np.unique(np.concatenate(values))
    return [np.searchsorted(uniq, v).astype(np.int64) for v in values], [str(u) for u in uniq]


def _missing(values: np.ndarray) -> np.ndarray:
    """Which of ``values`` are empty cells (None, or NaN in a float column)."""
    if values.dtype.kind == "f":
        return np.isnan(values)
    if values.dtype.kind == "O":
        return np.array([v is None or (isinstance(v, float) and v != v) for v in values], dtype=bool)
    return np.zeros(len(values), dtype=bool)


def _labels(datasets: Any, parts: list[Any], column: str,
            sources: list[str]) -> tuple[list[np.ndarray], int, list[str] | None]:
    """Class ids per split (``sources``: where each split was read, for messages); the classes are the
    training split's: a test label that no training row has is refused."""
    feature = parts[0].features[column]
    raw = [np.asarray(p.with_format("numpy")[:][column]) for p in parts]
    for where, r in zip(sources, raw):
        if (gaps := _missing(r)).any():
            raise ValueError(f"hf: {where}: {int(gaps.sum())} of {len(r)} row(s) have no label in column {column!r} "
                             f"(first: row {int(np.argmax(gaps))}, counting from 0); label or drop them")
    raw = [r.astype(type(r.flat[0])) if r.dtype == object and len(r) else r for r in raw]  # None-free: plain dtype
    if isinstance(feature, datasets.ClassLabel):
        ys, num_classes, names = [r.astype(np.int64) for r in raw], feature.num_classes, list(feature.names)
    elif raw[0].dtype.kind in "USO":
        train_classes = np.unique(raw[0])  # numbered in sorted order; test-only values after them (refused)
        uniq = np.concatenate([train_classes, np.setdiff1d(np.concatenate(raw), train_classes)])
        order = np.argsort(uniq)
        ys = [order[np.searchsorted(uniq[order], r)].astype(np.int64) for r in raw]
        num_classes, names = len(train_classes), [str(u) for u in uniq]
    elif raw[0].dtype.kind in "biu" or (raw[0].dtype.kind == "f" and all(np.all(r == np.round(r)) for r in raw)):
        ys, names = [r.astype(np.int64) for r in raw], None
        num_classes = int(ys[0].max()) + 1 if len(ys[0]) else 0
    else:
        raise ValueError(f"hf: label column {column!r} holds {feature}: labels must be class ids, integers or strings")
    for split, y in zip(("train", "test"), ys):
        if len(y) and y.min() < 0:
            raise ValueError(f"hf: the {split} labels of {column!r} include {int(y.min())} (unlabelled rows?); "
                             "class ids must be >= 0")
    if len(ys) > 1:
        check_test_classes(f"hf: {sources[1]}", ys[1], num_classes, "Fix the labels, or drop those rows", names)
    return ys, num_classes, None if names is None else names[:num_classes]


def _moments(a: np.ndarray, chunk: int = 4096) -> tuple[np.ndarray, np.ndarray]:
    """Mean and standard deviation per column of axis 1, in float64, a chunk of samples at a time
    (a float64 copy of CIFAR's training images alone would take 1.2 GB)."""
    axes = tuple(i for i in range(a.ndim) if i != 1)
    total, squares = np.zeros(a.shape[1]), np.zeros(a.shape[1])
    for lo in range(0, len(a), chunk):
        block = a[lo : lo + chunk].astype(np.float64)
        total += block.sum(axis=axes)
        squares += np.square(block).sum(axis=axes)
    count = max(a.size // max(a.shape[1], 1), 1)
    mean = total / count
    return mean, np.sqrt(np.maximum(squares / count - mean**2, 0.0))


def _standardise(train: np.ndarray, rest: list[np.ndarray], mean: Sequence[float] | None,
                 std: Sequence[float] | None, normalize: bool, width: int, what: str):
    """Standardise with the given constants or the training split's statistics, per ``what`` (channel/feature)."""
    if (mean is None) != (std is None):
        raise ValueError("hf: give both dataset.mean and dataset.std, or neither")
    if not normalize and mean is not None:
        raise ValueError("hf: dataset.mean and dataset.std have no effect with dataset.normalize=false; drop them")
    if mean is None:
        m, s = _moments(train)
        mean, std = m.tolist(), [v if v > 0 else 1.0 for v in s.tolist()]
    if len(mean) != width or len(std) != width:
        raise ValueError(f"hf: dataset.mean/std have {len(mean)}/{len(std)} values for {width} {what}s")
    if any(s <= 0 for s in std):
        raise ValueError(f"hf: dataset.std must be > 0, got {list(std)}")
    shape = (1, -1) + (1,) * (train.ndim - 2)

    def apply(a: np.ndarray) -> np.ndarray:
        if train.ndim == 4:
            return standardize(a, mean, std, normalize)
        if not normalize:
            return a
        return (a - np.asarray(mean, np.float32).reshape(shape)) / np.asarray(std, np.float32).reshape(shape)

    return apply(train), [apply(a) for a in rest], mean, std


def load_hf(
    root: str | os.PathLike[str] | None = None,
    download: bool = False,
    seed: int = 0,
    *,
    path: str | None = None,
    subset: str | None = None,
    revision: str | None = None,
    split: str = "train",
    test_split: str | None = "test",
    test_fraction: float | None = None,
    image_column: str | None = None,
    label_column: str | None = None,
    feature_columns: Sequence[str] | None = None,
    group_column: str | None = None,
    channels: int | None = None,
    normalize: bool = True,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
) -> SourceData:
    """A Hugging Face data set (module docstring); the test set is ``test_split``, or a stratified
    ``test_fraction`` of ``split`` (a fixed seed, not ``seed``: the same test set in every run)."""
    del seed
    if not path:
        raise ValueError("hf: dataset.path is required: a Hugging Face Hub name or a local file or folder")
    if (test_split is None) == (test_fraction is None):
        raise ValueError("hf: set exactly one of dataset.test_split (a split or test file) and dataset.test_fraction "
                         f"(got test_split={test_split!r}, test_fraction={test_fraction!r})")
    if test_fraction is not None and not 0.0 < test_fraction < 1.0:
        raise ValueError(f"hf: dataset.test_fraction must be in (0, 1), got {test_fraction}")
    if channels not in (None, 1, 3):
        raise ValueError(f"hf: dataset.channels must be 1, 3 or null (from the first image), got {channels}")
    datasets = _import_datasets()
    with tempfile.TemporaryDirectory(prefix="fl-hf-") as cache:
        train, test = _load_splits(datasets, path, root, download, subset, revision, split, test_split, cache)
        image_col, label_col, columns = _pick_columns(datasets, train.features, image_column, label_column,
                                                      None if feature_columns is None else list(feature_columns),
                                                      group_column, path)
        if channels is not None and image_col is None:
            raise ValueError("hf: dataset.channels applies to image data; this source is tabular")
        parts = [train] + ([test] if test is not None else [])
        single_file = (_local(path, root)[0] or Path()).is_file()
        sources = [path] + ([test_split if single_file else f"{path} (split {test_split})"] if test is not None else [])
        for p, where in zip(parts[1:], sources[1:]):
            missing = [c for c in (image_col, label_col, group_column, *columns) if c is not None and c not in p.features]
            if missing:
                raise ValueError(f"hf: the test split {where} lacks column(s) {', '.join(missing)}")
        if image_col is not None:
            first = train[0][image_col] if len(train) else None
            mode = {1: "L", 3: "RGB"}.get(channels) or ("L" if first is not None and first.mode in _GRAY_MODES else "RGB")
            xs = [_images(datasets, p, image_col, mode, s) for p, s in zip(parts, ("train", "test"))]
        else:
            xs = [_tabular(datasets, p, columns, s) for p, s in zip(parts, ("train", "test"))]
        for s_name, x, where in zip(("train", "test"), xs, sources):
            check_finite(f"hf: {where}", s_name, x)  # rows as read, before the test_fraction split and standardising
        ys, num_classes, class_names = _labels(datasets, parts, label_col, sources)
        groups, group_names = (None, None)
        if group_column is not None:
            groups, group_names = _ids([np.asarray(p.with_format("numpy")[:][group_column]) for p in parts])
    if test is None:
        idx_train, idx_test = stratified_split(ys[0], float(test_fraction), SPLIT_SEED)
        xs = [xs[0][idx_train], xs[0][idx_test]]
        ys = [ys[0][idx_train], ys[0][idx_test]]
        if groups is not None:
            groups = [groups[0][idx_train], groups[0][idx_test]]
    width = xs[0].shape[1]
    what = "channel" if xs[0].ndim == 4 else "feature"
    train_x, (test_x,), mean, std = _standardise(xs[0], [xs[1]], mean, std, normalize, width, what)
    return SourceData(
        train_x=train_x,
        train_y=ys[0],
        test_x=test_x,
        test_y=ys[1],
        num_classes=num_classes,
        input_shape=train_x.shape[1:],
        name=f"hf:{path}",
        train_groups=None if groups is None else groups[0],
        test_groups=None if groups is None else groups[1],
        group_names=group_names,
        class_names=class_names,
        pad_value=standardized_value(0.0, mean, std, normalize) if what == "channel" else None,
    )
