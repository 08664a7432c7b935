"""CIFAR-10 / CIFAR-100 from the official python pickle batches (numpy only, torchvision optional).

Layouts: ``cifar-10-batches-py/`` (``data_batch_1..5``, ``test_batch``, ``batches.meta``) and
``cifar-100-python/`` (``train``, ``test``, ``meta``). Each batch is a pickled dict with
``b"data"`` (N x 3072 uint8, channel-major 3 x 32 x 32) and ``b"labels"`` (CIFAR-10) or
``b"fine_labels"``/``b"coarse_labels"`` (CIFAR-100).

Pickles can run code, so batches are read with an unpickler that only resolves the few numpy and
codec globals that array pickles use; anything else is refused.
"""

from __future__ import annotations

import codecs
import os
import pickle
import struct
import tarfile
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fl_platform.datasets.download import fetch
from fl_platform.datasets.paths import DatasetNotFoundError, data_root
from fl_platform.datasets.source import SourceData, class_ids, standardize, standardized_value, uint8_pixels

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)

_CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
_CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
_CIFAR100_URL = "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz"
_CIFAR100_MD5 = "eb9058c3a382ffc7106e4002c42a8d85"

_ARRAY_GLOBALS: dict[tuple[str, str], Any] = {}
for _module in ("numpy.core.multiarray", "numpy._core.multiarray"):
    _ARRAY_GLOBALS[(_module, "_reconstruct")] = np.ndarray((0,)).__reduce__()[0]
    _ARRAY_GLOBALS[(_module, "scalar")] = np.float64(0).__reduce__()[0]
for _module in ("numpy.core.numeric", "numpy._core.numeric"):
    _ARRAY_GLOBALS[(_module, "_frombuffer")] = np.zeros(1).__reduce_ex__(5)[0]
_ARRAY_GLOBALS[("numpy", "ndarray")] = np.ndarray
_ARRAY_GLOBALS[("numpy", "dtype")] = np.dtype
_ARRAY_GLOBALS[("_codecs", "encode")] = codecs.encode


class _RefusedGlobal(pickle.UnpicklingError):
    """A pickle names a global outside the array allow-list (it could run code)."""


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ARRAY_GLOBALS[(module, name)]
        except KeyError:
            raise _RefusedGlobal(f"refusing to load {module}.{name} from a CIFAR pickle") from None


# What a truncated or corrupt pickle raises while loading (each byte can decode as any opcode).
_CORRUPT = (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, AttributeError,
            UnicodeDecodeError, struct.error)


def read_cifar_pickle(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load one CIFAR batch/meta pickle (Python 2 or 3) as a dict with str keys."""
    try:
        with open(path, "rb") as fh:
            obj = _ArrayUnpickler(fh, encoding="bytes").load()
    except _RefusedGlobal as err:
        raise _RefusedGlobal(f"{path}: {err}") from None
    except _CORRUPT as err:
        raise ValueError(f"{path}: not a readable CIFAR pickle (truncated or corrupt?): "
                         f"{type(err).__name__}: {err}") from err
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a dict, got {type(obj).__name__}")
    return {k.decode() if isinstance(k, bytes) else k: v for k, v in obj.items()}


def _entry(batch: dict[str, Any], key: str, path: Path) -> Any:
    if key not in batch:
        raise ValueError(f"{path}: no {key!r} entry (it has {', '.join(map(repr, sorted(map(str, batch))))})")
    return batch[key]


def _images(batch: dict[str, Any], path: Path) -> np.ndarray:
    """N x 3 x 32 x 32 uint8; data of another dtype must hold integers in [0, 255] (never wrapped or cut)."""
    data = np.asarray(_entry(batch, "data", path))
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(f"{path}: 'data' has shape {data.shape}, expected N x 3072")
    return uint8_pixels(data, f"{path}: 'data'").reshape(-1, 3, 32, 32)


def _labels(batch: dict[str, Any], key: str, path: Path) -> np.ndarray:
    return class_ids(_entry(batch, key, path), f"{path}: {key!r}")


def _meta(path: Path) -> dict[str, Any] | None:
    """The meta file's dict, or None when there is no meta file (the class names are then left unset)."""
    return read_cifar_pickle(path) if path.is_file() else None


def _names(meta: dict[str, Any] | None, key: str, num_classes: int, path: Path) -> list[str] | None:
    """The class names of a meta file, one per class: a list of another length is refused, not cut or
    padded; a meta file without ``key`` is refused naming it (another data set's?). No meta file: None."""
    if meta is None:
        return None
    names = _entry(meta, key, path)
    if not isinstance(names, (list, tuple, np.ndarray)):
        raise ValueError(f"{path}: {key!r} is {type(names).__name__}, expected a list of {num_classes} class names")
    if len(names) != num_classes:
        raise ValueError(f"{path}: {key!r} has {len(names)} class name(s) for {num_classes} classes; expected one "
                         "name per class (a meta file of another data set or label mode?)")
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


def _to_float(
    images: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...], normalize: bool
) -> np.ndarray:
    x = images.astype(np.float32)
    x /= 255.0
    return standardize(x, mean, std, normalize)


def _locate(
    name: str,
    root: str | os.PathLike[str] | None,
    folder: str,
    required: list[str],
    download: bool,
    url: str,
    md5: str,
) -> Path:
    base = data_root(root)
    candidates = [base / folder, base / name / folder, base]
    found = next((c for c in candidates if all((c / f).is_file() for f in required)), None)
    if found is None and download:
        archive = fetch(name, [url], base / url.rsplit("/", 1)[-1], md5=md5)
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(base, filter="data")
        found = base / folder if all((base / folder / f).is_file() for f in required) else None
    if found is None:
        raise DatasetNotFoundError(
            name,
            candidates,
            f"Each folder must hold {', '.join(required)}. Pass download=True to fetch {url}.",
        )
    return found


def load_cifar10(
    root: str | os.PathLike[str] | None = None,
    download: bool = False,
    seed: int = 0,
    *,
    normalize: bool = True,
) -> SourceData:
    """CIFAR-10: 50,000 train + 10,000 test images, 3 x 32 x 32, 10 classes."""
    del seed
    train_files = [f"data_batch_{i}" for i in range(1, 6)]
    folder = _locate(
        "cifar10",
        root,
        "cifar-10-batches-py",
        [*train_files, "test_batch"],
        download,
        _CIFAR10_URL,
        _CIFAR10_MD5,
    )
    parts = [(read_cifar_pickle(folder / f), folder / f) for f in train_files]
    test, test_path = read_cifar_pickle(folder / "test_batch"), folder / "test_batch"
    meta_path = folder / "batches.meta"
    meta = _meta(meta_path)
    train_x = np.concatenate([_images(b, p) for b, p in parts])
    train_y = np.concatenate([_labels(b, "labels", p) for b, p in parts])
    return SourceData(
        train_x=_to_float(train_x, CIFAR10_MEAN, CIFAR10_STD, normalize),
        train_y=train_y,
        test_x=_to_float(_images(test, test_path), CIFAR10_MEAN, CIFAR10_STD, normalize),
        test_y=_labels(test, "labels", test_path),
        num_classes=10,
        input_shape=(3, 32, 32),
        name="cifar10",
        pad_value=standardized_value(0.0, CIFAR10_MEAN, CIFAR10_STD, normalize),
        class_names=_names(meta, "label_names", 10, meta_path),
    )


def load_cifar100(
    root: str | os.PathLike[str] | None = None,
    download: bool = False,
    seed: int = 0,
    *,
    label_mode: Literal["fine", "coarse"] = "fine",
    normalize: bool = True,
) -> SourceData:
    """CIFAR-100: 50,000 train + 10,000 test images, 100 fine or 20 coarse classes."""
    del seed
    if label_mode not in ("fine", "coarse"):
        raise ValueError(f"cifar100: label_mode must be 'fine' or 'coarse', got {label_mode!r}")
    folder = _locate(
        "cifar100", root, "cifar-100-python", ["train", "test"], download, _CIFAR100_URL, _CIFAR100_MD5
    )
    train, test = read_cifar_pickle(folder / "train"), read_cifar_pickle(folder / "test")
    meta = _meta(folder / "meta")
    key = f"{label_mode}_labels"
    num_classes = 100 if label_mode == "fine" else 20
    return SourceData(
        train_x=_to_float(_images(train, folder / "train"), CIFAR100_MEAN, CIFAR100_STD, normalize),
        train_y=_labels(train, key, folder / "train"),
        test_x=_to_float(_images(test, folder / "test"), CIFAR100_MEAN, CIFAR100_STD, normalize),
        test_y=_labels(test, key, folder / "test"),
        num_classes=num_classes,
        input_shape=(3, 32, 32),
        name="cifar100" if label_mode == "fine" else "cifar100_coarse",
        pad_value=standardized_value(0.0, CIFAR100_MEAN, CIFAR100_STD, normalize),
        class_names=_names(meta, f"{label_mode}_label_names", num_classes, folder / "meta"),
    )
