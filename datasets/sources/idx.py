"""IDX files (MNIST, Fashion-MNIST): a numpy-only reader and the two loaders.

IDX layout: two zero bytes, a type code (0x08 ubyte, 0x09 byte, 0x0B short, 0x0C int, 0x0D float,
0x0E double), the number of dimensions, one big-endian uint32 per dimension, then the data in
big-endian C order. Files may be gzip-compressed (``.gz``). Our own reader keeps torchvision optional.
"""

from __future__ import annotations

import gzip
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fl_platform.datasets.download import fetch
from fl_platform.datasets.paths import DatasetNotFoundError, data_root
from fl_platform.datasets.source import SourceData, class_ids, standardize, standardized_value, uint8_pixels

IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def parse_idx(data: bytes, source: str = "<bytes>") -> np.ndarray:
    """Decode one IDX payload (already decompressed) into a native-endian numpy array."""
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{source}: not an IDX file (bad magic number {data[:4].hex()})")
    code, ndim = data[2], data[3]
    if code not in IDX_DTYPES:
        raise ValueError(f"{source}: unknown IDX type code 0x{code:02x}")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{source}: truncated IDX header")
    shape = struct.unpack(f">{ndim}I", data[4:header])
    dtype = IDX_DTYPES[code]
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(data) - header != expected:
        raise ValueError(
            f"{source}: IDX payload has {len(data) - header} bytes, shape {shape} needs {expected}"
        )
    array = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return array.astype(dtype.newbyteorder("="), copy=True)


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file, gzip-compressed or raw (detected from the content, not the name)."""
    path = Path(path)
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (EOFError, gzip.BadGzipFile, zlib.error) as err:
            raise ValueError(f"{path}: not a readable gzip file (truncated or corrupt?): {err}") from err
    return parse_idx(raw, str(path))


def write_idx(path: str | os.PathLike[str], array: np.ndarray, compress: bool | None = None) -> Path:
    """Write ``array`` as IDX (gzip when ``compress`` or the name ends in .gz): fixtures and exports."""
    path = Path(path)
    array = np.asarray(array)
    codes = {dt.newbyteorder("=").str[1:]: c for c, dt in IDX_DTYPES.items()}
    key = array.dtype.newbyteorder("=").str[1:]
    if key not in codes:
        raise ValueError(f"IDX cannot store dtype {array.dtype}")
    code = codes[key]
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = header + np.ascontiguousarray(array, dtype=IDX_DTYPES[code]).tobytes()
    if compress or (compress is None and path.suffix == ".gz"):
        payload = gzip.compress(payload)
    path.write_bytes(payload)
    return path


def _find(folder: Path, name: str) -> Path | None:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


def read_idx_dir(folder: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Read whichever of the four standard files a directory holds (any subset; .gz or raw)."""
    folder = Path(folder)
    found = {key: _find(folder, name) for key, name in FILES.items()}
    return {key: read_idx(p) for key, p in found.items() if p is not None}


@dataclass(frozen=True)
class _IdxSpec:
    """Where a torchvision-style IDX data set may sit, where to fetch it, and its fixed constants."""

    folders: tuple[str, ...]
    mirrors: tuple[str, ...]
    md5: dict[str, str]  # of each .gz, keyed like FILES
    download_to: str
    mean: tuple[float, ...]
    std: tuple[float, ...]


_SPECS = {
    "mnist": _IdxSpec(
        folders=("mnist", "MNIST/raw", "MNIST"),
        mirrors=("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"),
        md5={
            "train_images": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "train_labels": "d53e105ee54ea40749a09fcbcd1e9432",
            "test_images": "9fb629c4189551a2d022fa330f9573f3",
            "test_labels": "ec29112dd5afa0611ce80d1b7f02629c",
        },
        download_to="MNIST/raw",
        mean=(0.1307,),
        std=(0.3081,),
    ),
    "fashion_mnist": _IdxSpec(
        folders=("fashion-mnist", "FashionMNIST/raw", "FashionMNIST", "fashion_mnist"),
        mirrors=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
        md5={
            "train_images": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "train_labels": "25c81989df183df01b3e8a0aad5dffbe",
            "test_images": "bef4ecab320f06d8554ea6380940ec79",
            "test_labels": "bb300cfdad3c16e7a12a480ee83cd310",
        },
        download_to="FashionMNIST/raw",
        mean=(0.2860,),
        std=(0.3530,),
    ),
}


def _load_idx_dataset(
    name: str, root: str | os.PathLike[str] | None, download: bool, normalize: bool
) -> SourceData:
    spec = _SPECS[name]
    base = data_root(root)
    candidates = [base / f for f in spec.folders] + [base]
    folder = next((c for c in candidates if c.is_dir() and all(_find(c, f) for f in FILES.values())), None)
    if folder is None and download:
        folder = base / spec.download_to
        for key, fname in FILES.items():
            urls = [m + fname + ".gz" for m in spec.mirrors]
            fetch(name, urls, folder / f"{fname}.gz", md5=spec.md5[key])
    if folder is None:
        wanted = ", ".join(f"{f}[.gz]" for f in FILES.values())
        raise DatasetNotFoundError(
            name,
            candidates,
            f"Each folder must hold all four IDX files ({wanted}). "
            f"Pass download=True to fetch them into {base / spec.download_to}.",
        )
    paths = {key: folder / fname if (folder / fname).is_file() else folder / f"{fname}.gz"
             for key, fname in FILES.items()}
    arrays = {key: read_idx(path) for key, path in paths.items()}
    images, labels = {}, {}
    for split in ("train", "test"):
        imgs = arrays[f"{split}_images"]
        labels[split] = class_ids(arrays[f"{split}_labels"], str(paths[f"{split}_labels"]))
        if imgs.ndim != 3 or len(imgs) != len(labels[split]):
            raise ValueError(
                f"{name}: {split} images {imgs.shape} do not match labels {arrays[f'{split}_labels'].shape}"
            )
        x = uint8_pixels(imgs, str(paths[f"{split}_images"])).astype(np.float32)[:, None, :, :]
        x /= 255.0
        images[split] = standardize(x, spec.mean, spec.std, normalize)
    return SourceData(
        train_x=images["train"],
        train_y=labels["train"],
        test_x=images["test"],
        test_y=labels["test"],
        num_classes=10,
        input_shape=images["train"].shape[1:],
        name=name,
        pad_value=standardized_value(0.0, spec.mean, spec.std, normalize),
    )


def load_mnist(
    root: str | os.PathLike[str] | None = None,
    download: bool = False,
    seed: int = 0,
    *,
    normalize: bool = True,
) -> SourceData:
    """MNIST from ``<root>/mnist/``, ``<root>/MNIST/raw/`` or ``<root>/MNIST/`` (1 x 28 x 28, 10 classes)."""
    del seed
    return _load_idx_dataset("mnist", root, download, normalize)


def load_fashion_mnist(
    root: str | os.PathLike[str] | None = None,
    download: bool = False,
    seed: int = 0,
    *,
    normalize: bool = True,
) -> SourceData:
    """Fashion-MNIST from ``<root>/fashion-mnist/``, ``<root>/FashionMNIST/raw/`` or ``<root>/FashionMNIST/``."""
    del seed
    return _load_idx_dataset("fashion_mnist", root, download, normalize)
