"""Source parsers on small files written here, and on the real offline copies when present."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import pickle
import re
import socket
import struct
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from fl_platform.datasets.download import fetch
from fl_platform.datasets.paths import ENV_VAR, DatasetNotFoundError, DownloadError, data_root
from fl_platform.datasets.registry import SOURCES, load_source, source_options
from fl_platform.datasets.source import RowBlocks, SourceData
from fl_platform.datasets.sources import synthetic
from fl_platform.datasets.sources.cifar import load_cifar10, load_cifar100, read_cifar_pickle
from fl_platform.datasets.sources.digits import load_digits
from fl_platform.datasets.sources.idx import (
    load_fashion_mnist,
    load_mnist,
    parse_idx,
    read_idx,
    read_idx_dir,
    write_idx,
)
from fl_platform.datasets.sources.leaf import load_femnist, peek_users, read_leaf_split
from fl_platform.datasets.sources.shakespeare import LEAF_LETTERS, load_shakespeare, parse_speakers
from fl_platform.datasets.sources.synthetic import device_sizes, load_synthetic

from .conftest import shared_dir

FILE_SOURCES = ["mnist", "fashion_mnist", "cifar10", "cifar100", "femnist", "shakespeare"]


# --- data root ------------------------------------------------------------------------------
def test_data_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_VAR, raising=False)
    import fl_platform

    assert data_root() == fl_platform.REPO_ROOT.parent / "shared" / "data"
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    assert data_root() == tmp_path / "env"
    assert data_root(tmp_path / "explicit") == tmp_path / "explicit"


# --- digits ---------------------------------------------------------------------------------
def test_a_data_root_that_is_a_file_is_named(monkeypatch, tmp_path):
    (tmp_path / "root.txt").write_text("x")
    with pytest.raises(NotADirectoryError, match=r"the data root .*root\.txt \(from the root argument"):
        load_mnist(root=tmp_path / "root.txt")
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "root.txt"))
    with pytest.raises(NotADirectoryError, match=rf"root\.txt \(from \${ENV_VAR}\) is a file"):
        load_femnist()


def test_digits_shapes_classes_and_fixed_split():
    a = load_digits(seed=0)
    b = load_digits(seed=7)
    assert a.train_x.shape == (1438, 1, 8, 8) and a.test_x.shape == (359, 1, 8, 8)
    assert a.train_x.dtype == np.float32 and a.train_y.dtype == np.int64
    assert a.num_classes == 10 and a.input_shape == (1, 8, 8) and a.train_groups is None
    assert np.array_equal(a.test_y, b.test_y) and np.array_equal(a.test_x, b.test_x)
    assert np.bincount(a.test_y).min() >= 35  # stratified: every class ~20% in test
    assert abs(float(a.train_x.mean())) < 0.05 and abs(float(a.train_x.std()) - 1) < 0.05
    raw = load_digits(normalize=False)
    assert raw.train_x.min() == 0.0 and raw.train_x.max() == 1.0
    assert load_digits(test_fraction=0.5).num_test in range(895, 902)


# --- synthetic ------------------------------------------------------------------------------
def test_synthetic_shapes_groups_and_determinism():
    s = load_synthetic(seed=1, num_clients=30, alpha=0.5, beta=0.5)
    assert s.train_x.shape[1:] == (60,) and s.input_shape == (60,) and s.num_classes == 10
    assert s.train_x.dtype == np.float32 and s.train_y.dtype == np.int64
    assert set(np.unique(s.train_groups)) == set(range(30)) == set(np.unique(s.test_groups))
    sizes = np.bincount(s.train_groups, minlength=30) + np.bincount(s.test_groups, minlength=30)
    assert sizes.min() >= 50
    assert np.array_equal(np.bincount(s.train_groups), (sizes * 0.9).astype(int))  # 90/10 per device
    again = load_synthetic(seed=1, num_clients=30, alpha=0.5, beta=0.5)
    other = load_synthetic(seed=2, num_clients=30, alpha=0.5, beta=0.5)
    assert np.array_equal(s.train_x, again.train_x) and np.array_equal(s.test_y, again.test_y)
    assert s.num_train != other.num_train or not np.array_equal(s.train_x, other.train_x)
    assert len(np.unique(s.train_y)) > 1


@pytest.mark.parametrize("block_bytes", [None, 100_000])
def test_synthetic_data_is_pinned(block_bytes, monkeypatch):
    """The same data as before for the same seed: the feature means, drawn chunk by chunk since they
    took 240 MB at a million devices, are the numbers of the former single draw (several chunks
    here). Pinned with numpy 2.4's Generator streams. The same numbers when the training features
    come in row blocks of whole devices (one per chunk here)."""
    if block_bytes is not None:
        monkeypatch.setattr(synthetic, "BLOCK_BYTES", block_bytes)
    s = load_synthetic(seed=0, num_clients=300, alpha=0.5, beta=0.5, max_size=400)
    if block_bytes is None:
        assert isinstance(s.train_x, np.ndarray)
    else:
        assert isinstance(s.train_x, RowBlocks) and len(s.train_x.blocks) == 7 and len(s.train_x) == s.num_train
        device_starts = np.searchsorted(s.train_groups, np.arange(300))  # blocks hold whole devices
        assert set(np.cumsum([len(b) for b in s.train_x.blocks])[:-1]) <= set(device_starts)
    digest = hashlib.sha256()
    for a in (s.train_x, s.train_y, s.test_x, s.test_y, s.train_groups, s.test_groups):
        digest.update(np.ascontiguousarray(a).tobytes())
    assert s.num_train == 47049 and digest.hexdigest()[:16] == "20acc613f5404170"


def test_synthetic_size_distribution_and_cap():
    sizes = device_sizes(20_000, np.random.default_rng(0))  # card defaults: lognormal(4, 2) + 50
    assert sizes.min() >= 50
    assert 40 <= np.median(sizes - 50) <= 70  # int(lognormal(4, 2)) has median e^4 ~ 54.6
    assert sizes.max() > 20 * np.median(sizes)  # heavy tail
    capped = load_synthetic(seed=0, num_clients=300, max_size=120)
    capped_sizes = np.bincount(capped.train_groups) + np.bincount(capped.test_groups)
    assert capped_sizes.max() <= 120 and capped_sizes.min() >= 50


def test_synthetic_feature_covariance_and_iid_variant():
    s = load_synthetic(seed=0, num_clients=200, iid=True, min_size=200, size_sigma=0.5)
    x = np.concatenate([s.train_x, s.test_x]).astype(np.float64)
    j = np.arange(1, 61)
    assert np.allclose(x.mean(axis=0), 0, atol=0.05)  # IID: feature mean 0 everywhere
    assert np.allclose(x.var(axis=0), j**-1.2, rtol=0.1)  # Sigma_jj = j^-1.2
    assert s.name == "synthetic_iid"
    # Non-IID with beta=1: device feature means differ (v_k ~ N(B_k, 1)).
    ni = load_synthetic(seed=0, num_clients=20, alpha=1.0, beta=1.0, min_size=200, size_sigma=0.5)
    device_means = np.stack([ni.train_x[ni.train_groups == k, 0].mean() for k in range(20)])
    assert device_means.std() > 0.5
    # IID labels follow one shared model: the label mix is the same on every device (roughly).
    counts = np.stack([np.bincount(s.train_y[s.train_groups == k], minlength=10) for k in range(200)])
    noniid_counts = np.stack([np.bincount(ni.train_y[ni.train_groups == k], minlength=10) for k in range(20)])
    assert (noniid_counts.max(1) / noniid_counts.sum(1)).mean() > (counts.max(1) / counts.sum(1)).mean()


@pytest.mark.slow
def test_synthetic_hundred_thousand_devices_each_hold_train_and_test_rows():
    """At scale every device has its rows (its generation time is scripts/bench/million.py's to measure)."""
    s = load_synthetic(
        seed=0, num_clients=100_000, size_mean=1.0, size_sigma=1.0, min_size=10, alpha=1, beta=1
    )
    assert s.train_groups.max() == 99_999 and s.test_groups.max() == 99_999
    assert np.bincount(s.test_groups).min() >= 1 and np.bincount(s.train_groups).min() >= 9


def test_synthetic_rejects_bad_options():
    with pytest.raises(ValueError, match="min_size"):
        load_synthetic(min_size=1)
    with pytest.raises(ValueError, match="max_size"):
        load_synthetic(min_size=50, max_size=10)
    with pytest.raises(ValueError, match=r"synthetic: size_sigma is the standard deviation .* got -0\.5"):
        load_synthetic(size_sigma=-0.5)


# --- IDX ------------------------------------------------------------------------------------
def idx_bytes(array: np.ndarray, code: int) -> bytes:
    """IDX written by hand (not by write_idx), so the reader is checked against the format itself."""
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_mnist_files(
    folder: Path, n_train: int, n_test: int, compress: bool, seed: int = 0
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train-labels-idx1-ubyte": (np.arange(n_train) % 10).astype(np.uint8),
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "t10k-labels-idx1-ubyte": (np.arange(n_test) % 10).astype(np.uint8),
    }
    for name, arr in arrays.items():
        payload = idx_bytes(arr, 0x08)
        if compress:
            (folder / f"{name}.gz").write_bytes(gzip.compress(payload))
        else:
            (folder / name).write_bytes(payload)
    return arrays


@pytest.mark.parametrize("compress", [False, True])
def test_idx_reader_images_and_labels(tmp_path, compress):
    arrays = write_mnist_files(tmp_path, 12, 5, compress)
    images_name = "train-images-idx3-ubyte" + (".gz" if compress else "")
    raw = (tmp_path / images_name).read_bytes()
    assert (gzip.decompress(raw) if compress else raw)[:4] == b"\x00\x00\x08\x03"  # magic 2051
    labels_raw = (tmp_path / ("t10k-labels-idx1-ubyte" + (".gz" if compress else ""))).read_bytes()
    assert (gzip.decompress(labels_raw) if compress else labels_raw)[:4] == b"\x00\x00\x08\x01"  # magic 2049
    images = read_idx(tmp_path / images_name)
    assert images.shape == (12, 28, 28) and images.dtype == np.uint8
    assert np.array_equal(images, arrays["train-images-idx3-ubyte"])
    found = read_idx_dir(tmp_path)
    assert set(found) == {"train_images", "train_labels", "test_images", "test_labels"}
    assert np.array_equal(found["test_labels"], arrays["t10k-labels-idx1-ubyte"])


def test_idx_other_dtypes_and_bad_files(tmp_path):
    for code, arr in [
        (0x0C, np.arange(-6, 6, dtype=np.int32).reshape(3, 4)),
        (0x0B, np.arange(5, dtype=np.int16)),
        (0x0D, np.linspace(0, 1, 8, dtype=np.float32).reshape(2, 2, 2)),
        (0x0E, np.array([1.5, -2.25])),
    ]:
        assert np.array_equal(parse_idx(idx_bytes(arr, code)), arr)
        path = write_idx(tmp_path / f"a{code}.gz", arr)
        assert np.array_equal(read_idx(path), arr) and read_idx(path).dtype.isnative
    with pytest.raises(ValueError, match="magic"):
        parse_idx(b"\x01\x02\x08\x01\x00\x00\x00\x01\x05")
    with pytest.raises(ValueError, match="type code"):
        parse_idx(b"\x00\x00\x07\x01\x00\x00\x00\x01\x05")
    with pytest.raises(ValueError, match="payload"):
        parse_idx(idx_bytes(np.zeros((4, 3), np.uint8), 0x08)[:-1])


@pytest.mark.parametrize(
    ("loader", "folder", "compress"),
    [
        (load_fashion_mnist, "FashionMNIST/raw", True),
        (load_fashion_mnist, "fashion-mnist", False),
        (load_mnist, "mnist", False),
    ],
)
def test_idx_loaders_on_small_roots(tmp_path, loader, folder, compress):
    arrays = write_mnist_files(tmp_path / folder, 20, 10, compress)
    s = loader(root=tmp_path)
    assert s.train_x.shape == (20, 1, 28, 28) and s.test_x.shape == (10, 1, 28, 28)
    assert s.num_classes == 10 and s.input_shape == (1, 28, 28) and s.train_x.dtype == np.float32
    raw = loader(root=tmp_path, normalize=False)
    assert np.allclose(raw.train_x[:, 0] * 255, arrays["train-images-idx3-ubyte"], atol=1e-3)
    assert np.array_equal(raw.test_y, arrays["t10k-labels-idx1-ubyte"])


@pytest.mark.parametrize("name, array, code, message", [
    ("train-labels-idx1-ubyte", np.array([0, 1.7, 2, 3.9, 4, 5.5], np.float32), 0x0D,
     r"train-labels-idx1-ubyte: labels must be integer class ids; 3 of 6 are not"),
    ("train-labels-idx1-ubyte", np.zeros((6, 2), np.uint8), 0x08,
     r"train-labels-idx1-ubyte: labels must be a 1-d array of class ids, got shape \(6, 2\)"),
    ("train-images-idx3-ubyte", np.full((6, 28, 28), 1000, np.int16), 0x0B,
     r"train-images-idx3-ubyte \(int16\) has 4704 value\(s\) that are not integer pixels 0..255, e.g. 1000"),
])
def test_idx_labels_and_pixels_that_would_be_cut_are_refused_naming_the_file(tmp_path, name, array, code, message):
    write_mnist_files(tmp_path / "mnist", 6, 4, False)
    (tmp_path / "mnist" / name).write_bytes(idx_bytes(array, code))
    with pytest.raises(ValueError, match=message):
        load_mnist(root=tmp_path)


def test_idx_whole_pixels_of_a_wider_dtype_load_and_a_truncated_gzip_is_named(tmp_path):
    arrays = write_mnist_files(tmp_path / "mnist", 6, 4, True)
    wide = arrays["train-images-idx3-ubyte"].astype(np.int16)
    (tmp_path / "mnist" / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(idx_bytes(wide, 0x0B)))
    assert np.allclose(load_mnist(root=tmp_path, normalize=False).train_x[:, 0] * 255, wide, atol=1e-3)
    whole = (tmp_path / "mnist" / "t10k-images-idx3-ubyte.gz").read_bytes()
    (tmp_path / "mnist" / "t10k-images-idx3-ubyte.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz: not a readable gzip file \(truncated or corrupt"):
        load_mnist(root=tmp_path)


@pytest.mark.slow
@pytest.mark.shared_data
def test_real_fashion_mnist():
    folder = shared_dir("fashion-mnist", "train-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte.gz")
    s = load_fashion_mnist(root=folder.parent)
    assert s.train_x.shape == (60000, 1, 28, 28) and s.test_x.shape == (10000, 1, 28, 28)
    assert s.num_classes == 10
    assert np.bincount(s.train_y).tolist() == [6000] * 10
    assert np.bincount(s.test_y).tolist() == [1000] * 10
    assert abs(float(s.train_x.mean())) < 0.01 and abs(float(s.train_x.std()) - 1) < 0.01


# --- SourceData (what a custom loader returns) ----------------------------------------------
def _arrays() -> dict:
    rng = np.random.default_rng(0)
    return {"train_x": rng.normal(size=(12, 4)).astype(np.float32), "train_y": np.arange(12) % 3,
            "test_x": rng.normal(size=(6, 4)).astype(np.float32), "test_y": np.arange(6) % 3}


@pytest.mark.parametrize("change, error, message", [
    ({"train_x": lambda a: a.astype(np.float64)}, TypeError,
     r"mine: train_x must be a numpy array of float32 features or int64 token ids, got dtype float64"),
    ({"test_x": lambda a: a.astype(object)}, TypeError, r"mine: test_x must be .* got dtype object"),
    ({"train_x": lambda a: a.tolist()}, TypeError, r"mine: train_x must be a numpy array .* got list"),
    ({"train_x": lambda a: a.astype(np.int32)}, TypeError, r"mine: train_x must be .* got dtype int32"),
    ({"train_x": lambda a: a.astype(np.int64)}, TypeError, r"mine: train_x is int64 but test_x is float32"),
    ({"train_y": lambda y: y + 0.6}, ValueError, r"mine: train_y: labels must be integer class ids; 12 of 12"),
    ({"test_y": lambda y: np.where(y == 1, np.nan, y)}, ValueError, r"mine: test_y: labels must be integer class ids"),
    ({"train_y": lambda y: y.astype(str)}, ValueError, r"mine: train_y: labels must be integer class ids, got dtype <U"),
    ({"train_y": lambda y: y[:, None]}, ValueError, r"mine: train_y: labels must be a 1-d array .* shape \(12, 1\)"),
    ({"test_x": lambda a: a[:0], "test_y": lambda y: y[:0]}, ValueError, r"mine: the test set is empty \(0 rows\)"),
    ({"train_x": lambda a: a[:0], "train_y": lambda y: y[:0]}, ValueError, r"mine: the train set is empty"),
])
def test_source_data_refuses_dtypes_labels_and_empty_splits_it_cannot_train_on(change, error, message):
    arrays = _arrays()
    arrays.update({k: f(arrays[k]) for k, f in change.items()})
    with pytest.raises(error, match=message):
        SourceData(**arrays, num_classes=3, input_shape=(4,), name="mine")


def test_source_data_takes_whole_float_labels_as_class_ids():
    arrays = _arrays()
    s = SourceData(**{**arrays, "train_y": arrays["train_y"].astype(np.float64)}, num_classes=3, input_shape=(4,),
                   name="mine")
    assert s.train_y.dtype == np.int64 and s.train_y.tolist() == arrays["train_y"].tolist()


# --- CIFAR ----------------------------------------------------------------------------------
def write_cifar_batch(path: Path, images: np.ndarray, labels: dict[bytes, list[int]]) -> None:
    batch = {
        b"batch_label": b"testing batch",
        b"data": images.reshape(len(images), -1),
        b"filenames": [b"x.png"] * len(images),
    }
    batch.update(labels)
    with open(path, "wb") as fh:
        pickle.dump(batch, fh, protocol=2)


def test_cifar10_reader(tmp_path):
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(0)
    all_images = []
    for i in range(1, 6):
        images = rng.integers(0, 256, (4, 3, 32, 32), dtype=np.uint8)
        all_images.append(images)
        write_cifar_batch(folder / f"data_batch_{i}", images, {b"labels": [i, i + 1, 0, 9]})
    test_images = rng.integers(0, 256, (3, 3, 32, 32), dtype=np.uint8)
    write_cifar_batch(folder / "test_batch", test_images, {b"labels": [1, 2, 3]})
    names = [
        b"airplane",
        b"automobile",
        b"bird",
        b"cat",
        b"deer",
        b"dog",
        b"frog",
        b"horse",
        b"ship",
        b"truck",
    ]
    with open(folder / "batches.meta", "wb") as fh:
        pickle.dump({b"label_names": names, b"num_cases_per_batch": 4, b"num_vis": 3072}, fh, protocol=2)
    s = load_cifar10(root=tmp_path)
    assert s.train_x.shape == (20, 3, 32, 32) and s.test_x.shape == (3, 3, 32, 32)
    assert s.train_y.tolist()[:4] == [1, 2, 0, 9] and s.test_y.tolist() == [1, 2, 3]
    assert s.class_names[0] == "airplane" and s.num_classes == 10
    raw = load_cifar10(root=tmp_path, normalize=False)
    # Row layout is channel-major: the first 1024 bytes are the red plane.
    assert np.allclose(raw.train_x * 255, np.concatenate(all_images), atol=1e-3)
    assert abs(float(s.train_x[:, 0].mean()) - (float(raw.train_x[:, 0].mean()) - 0.4914) / 0.2470) < 1e-4


def test_cifar100_reader_fine_and_coarse(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    images = np.arange(5 * 3072, dtype=np.int64).astype(np.uint8).reshape(5, 3, 32, 32)
    write_cifar_batch(
        folder / "train", images, {b"fine_labels": [0, 99, 50, 7, 3], b"coarse_labels": [0, 19, 10, 1, 2]}
    )
    write_cifar_batch(folder / "test", images[:2], {b"fine_labels": [5, 6], b"coarse_labels": [1, 1]})
    with open(folder / "meta", "wb") as fh:
        pickle.dump(
            {
                b"fine_label_names": [f"f{i}".encode() for i in range(100)],
                b"coarse_label_names": [f"c{i}".encode() for i in range(20)],
            },
            fh,
            protocol=2,
        )
    fine = load_cifar100(root=tmp_path)
    coarse = load_cifar100(root=tmp_path, label_mode="coarse")
    assert (
        fine.num_classes == 100
        and fine.train_y.tolist() == [0, 99, 50, 7, 3]
        and fine.class_names[99] == "f99"
    )
    assert (
        coarse.num_classes == 20
        and coarse.train_y.tolist() == [0, 19, 10, 1, 2]
        and coarse.class_names[19] == "c19"
    )
    assert fine.train_x.shape == (5, 3, 32, 32)
    with pytest.raises(ValueError, match="label_mode"):
        load_cifar100(root=tmp_path, label_mode="middle")


def write_cifar10_root(root: Path, batch_2: np.ndarray, labels_2: list) -> Path:
    """A CIFAR-10 folder of 4-image batches whose data_batch_2 holds ``batch_2`` and ``labels_2``."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    ok = np.zeros((4, 3072), np.uint8)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        write_cifar_batch(folder / name, ok, {b"labels": [0, 1, 2, 3]})
    with open(folder / "data_batch_2", "wb") as fh:
        pickle.dump({b"data": batch_2, b"labels": labels_2}, fh, protocol=2)
    return folder


@pytest.mark.parametrize("data", [np.full((4, 3072), 300, np.int64), np.full((4, 3072), -1, np.int16),
                                  np.full((4, 3072), 0.7), np.full((4, 3072), np.nan)])
def test_cifar_pixels_outside_0_255_are_refused_not_wrapped(tmp_path, data):
    write_cifar10_root(tmp_path, data, [0, 1, 2, 3])
    with pytest.raises(ValueError, match=r"data_batch_2: 'data' \((int64|int16|float64)\) has 12288 value\(s\) "
                                         r"that are not integer pixels 0..255"):
        load_cifar10(root=tmp_path)


def test_cifar_whole_pixels_of_a_wider_dtype_and_whole_float_labels_load(tmp_path):
    write_cifar10_root(tmp_path, np.tile(np.arange(4, dtype=np.int64)[:, None] * 85, (1, 3072)), [3.0, 2.0, 1.0, 0.0])
    s = load_cifar10(root=tmp_path, normalize=False)
    assert np.allclose(s.train_x[4:8, 0, 0, 0] * 255, [0, 85, 170, 255]) and s.train_y[4:8].tolist() == [3, 2, 1, 0]


@pytest.mark.parametrize("labels, message", [
    ([0.5, 1.9, 2.0, 3.0], r"data_batch_2: 'labels': labels must be integer class ids; 2 of 4 are not \(e.g. 0.5\)"),
    ([b"cat", b"dog", b"x", b"y"], r"data_batch_2: 'labels': labels must be integer class ids, got dtype \|S3"),
])
def test_cifar_labels_that_are_not_class_ids_are_refused(tmp_path, labels, message):
    write_cifar10_root(tmp_path, np.zeros((4, 3072), np.uint8), labels)
    with pytest.raises(ValueError, match=message):
        load_cifar10(root=tmp_path)


def test_cifar_corrupt_or_incomplete_batches_name_the_file(tmp_path):
    folder = write_cifar10_root(tmp_path, np.zeros((4, 3072), np.uint8), [0, 1, 2, 3])
    whole = (folder / "data_batch_3").read_bytes()
    (folder / "data_batch_3").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ValueError, match=r"data_batch_3: not a readable CIFAR pickle \(truncated or corrupt\?\)"):
        load_cifar10(root=tmp_path)
    (folder / "data_batch_3").write_bytes(whole)
    write_cifar_batch(folder / "test_batch", np.zeros((4, 3072), np.uint8), {b"fine_labels": [0, 1, 2, 3]})
    with pytest.raises(ValueError, match=r"test_batch: no 'labels' entry \(it has 'batch_label', 'data', "):
        load_cifar10(root=tmp_path)


def write_cifar100_root(root: Path) -> Path:
    """A CIFAR-100 folder of 2-image train and test batches, without a meta file."""
    folder = root / "cifar-100-python"
    folder.mkdir(parents=True)
    for name in ("train", "test"):
        write_cifar_batch(folder / name, np.zeros((2, 3072), np.uint8),
                          {b"fine_labels": [0, 1], b"coarse_labels": [0, 1]})
    return folder


@pytest.mark.parametrize("count", [9, 11])
def test_a_cifar10_meta_file_with_another_number_of_class_names_is_refused(tmp_path, count):
    folder = write_cifar10_root(tmp_path, np.zeros((4, 3072), np.uint8), [0, 1, 2, 3])
    with open(folder / "batches.meta", "wb") as fh:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(count)], b"num_vis": 3072}, fh, protocol=2)
    with pytest.raises(ValueError, match=rf"batches\.meta: 'label_names' has {count} class name\(s\) for 10 classes"):
        load_cifar10(root=tmp_path)


@pytest.mark.parametrize("label_mode, key, count, classes", [("fine", b"fine_label_names", 20, 100),
                                                              ("coarse", b"coarse_label_names", 100, 20)])
def test_a_cifar100_meta_file_with_another_number_of_class_names_is_refused(tmp_path, label_mode, key, count,
                                                                            classes):
    folder = write_cifar100_root(tmp_path)
    with open(folder / "meta", "wb") as fh:
        pickle.dump({key: [f"n{i}".encode() for i in range(count)]}, fh, protocol=2)
    with pytest.raises(ValueError, match=rf"meta: '{label_mode}_label_names' has {count} class name\(s\) for "
                                         rf"{classes} classes"):
        load_cifar100(root=tmp_path, label_mode=label_mode)


def test_a_cifar_meta_file_without_its_class_names_is_refused_and_no_meta_file_loads(tmp_path):
    folder = write_cifar10_root(tmp_path / "10", np.zeros((4, 3072), np.uint8), [0, 1, 2, 3])
    assert load_cifar10(root=tmp_path / "10").class_names is None  # no batches.meta: no names, as before
    with open(folder / "batches.meta", "wb") as fh:  # the real file's other entries, without b"label_names"
        pickle.dump({b"num_cases_per_batch": 10000, b"num_vis": 3072}, fh, protocol=2)
    with pytest.raises(ValueError, match=r"batches\.meta: no 'label_names' entry \(it has "
                                         r"'num_cases_per_batch', 'num_vis'\)"):
        load_cifar10(root=tmp_path / "10")
    folder = write_cifar100_root(tmp_path / "100")
    with open(folder / "meta", "wb") as fh:  # fine names only: label_mode=coarse finds none
        pickle.dump({b"fine_label_names": [f"f{i}".encode() for i in range(100)]}, fh, protocol=2)
    assert load_cifar100(root=tmp_path / "100").class_names[99] == "f99"
    with pytest.raises(ValueError, match=r"meta: no 'coarse_label_names' entry \(it has 'fine_label_names'"):
        load_cifar100(root=tmp_path / "100", label_mode="coarse")


def test_cifar_pickles_cannot_run_code(tmp_path):
    class Exploit:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    path = tmp_path / "evil"
    path.write_bytes(pickle.dumps({b"data": Exploit()}, protocol=2))
    with pytest.raises(pickle.UnpicklingError, match=f"{path}: refusing to load posix.system"):
        read_cifar_pickle(path)
    path.write_bytes(pickle.dumps({"data": np.zeros((2, 3072), np.uint8)}, protocol=5))  # modern pickles load
    assert read_cifar_pickle(path)["data"].shape == (2, 3072)


# --- LEAF / FEMNIST -------------------------------------------------------------------------
def write_leaf_file(path: Path, users: dict[str, tuple[list, list]], compress: bool) -> None:
    obj = {
        "users": list(users),
        "num_samples": [len(y) for _, y in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }
    text = json.dumps(obj)
    path.parent.mkdir(parents=True, exist_ok=True)
    if compress:
        path.with_name(path.name + ".gz").write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)


def femnist_user(rng: np.random.Generator, n: int) -> tuple[list, list]:
    """n images in LEAF's convention: white background (1.0) with a dark stroke."""
    x = np.ones((n, 784))
    x[:, 300:310] = rng.uniform(0, 0.2, (n, 10))
    return x.round(4).tolist(), rng.integers(0, 62, n).astype(float).tolist()  # FedProx-style float labels


def make_femnist_root(root: Path) -> dict[str, int]:
    rng = np.random.default_rng(0)
    folder = root / "femnist-leaf"
    sizes = {"f0002_11": 6, "f0001_03": 4, "f0005_20": 3}
    train_a = {u: femnist_user(rng, sizes[u]) for u in ("f0002_11", "f0001_03")}
    train_b = {"f0005_20": femnist_user(rng, sizes["f0005_20"])}
    write_leaf_file(folder / "train" / "a_train.json", train_a, compress=True)
    write_leaf_file(folder / "train" / "b_train.json", train_b, compress=False)
    write_leaf_file(
        folder / "test" / "a_test.json", {u: femnist_user(rng, 2) for u in train_a}, compress=True
    )
    write_leaf_file(folder / "test" / "b_test.json", {"f0005_20": femnist_user(rng, 1)}, compress=False)
    write_leaf_file(
        folder / "test_only_writers" / "c_test.json", {"f0009_01": femnist_user(rng, 2)}, compress=True
    )
    return sizes


def test_leaf_reader_and_femnist_loader(tmp_path):
    sizes = make_femnist_root(tmp_path)
    folder = tmp_path / "femnist-leaf"
    assert peek_users(folder / "train" / "a_train.json.gz") == ["f0002_11", "f0001_03"]
    assert peek_users(folder / "train" / "b_train.json") == ["f0005_20"]
    split = read_leaf_split(folder / "train")
    assert split.users == ["f0001_03", "f0002_11", "f0005_20"]
    s = load_femnist(root=tmp_path)
    assert s.group_names == ["f0001_03", "f0002_11", "f0005_20"]  # sorted writer ids -> group ids 0..2
    assert s.train_x.shape == (13, 1, 28, 28) and s.input_shape == (1, 28, 28) and s.num_classes == 62
    assert np.bincount(s.train_groups).tolist() == [sizes[u] for u in s.group_names]
    assert np.bincount(s.test_groups).tolist() == [2, 2, 1]
    raw = load_femnist(root=tmp_path, normalize=False)
    assert raw.train_x[:, 0, 0, 0].max() == 0.0  # inverted: background 0, ink bright, as Fashion-MNIST
    assert raw.train_x.reshape(13, -1)[:, 300:310].min() >= 0.8
    assert load_femnist(root=tmp_path, normalize=False, invert=False).train_x[:, 0, 0, 0].min() == 1.0
    few = load_femnist(root=tmp_path, max_writers=2)
    assert few.group_names == ["f0001_03", "f0002_11"] and few.num_train == 10 and few.num_test == 4
    extra = load_femnist(root=tmp_path, test_only_writers=True)
    assert extra.group_names[-1] == "f0009_01" and extra.num_test == 7
    assert extra.test_groups.max() == 3 and extra.train_groups.max() == 2


def _leaf_obj(users: dict[str, tuple[list, list]]) -> dict:
    return {"users": list(users), "num_samples": [len(y) for _, y in users.values()],
            "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}


def _leaf_root(root: Path, edit=lambda obj: None, raw: bytes | None = None) -> Path:
    """A FEMNIST root of writers a (3 images) and b (2); ``edit`` changes the train file's JSON object."""
    rng = np.random.default_rng(0)
    folder = root / "femnist-leaf"
    train = _leaf_obj({"a": femnist_user(rng, 3), "b": femnist_user(rng, 2)})
    edit(train)
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "t.json").write_bytes(raw if raw is not None else json.dumps(train).encode())
    write_leaf_file(folder / "test" / "t.json", {u: femnist_user(rng, 1) for u in ("a", "b")}, compress=False)
    return folder / "train" / "t.json"


def _set(key, value):
    return lambda obj: obj.update({key: value})


@pytest.mark.parametrize("edit, message", [
    (lambda o: o["users"].append("ghost"), r"t\.json: 1 user\(s\) of 'users' have no entry in 'user_data' \(e\.g\. 'ghost'\)"),
    (lambda o: o["user_data"].update(extra=o["user_data"]["a"]), r"t\.json: 'user_data' holds 1 user\(s\) not in 'users' \(e\.g\. 'extra'\)"),
    (_set("num_samples", [30, 2]), r"t\.json: user 'a' has num_samples 30 but 3 samples"),
    (_set("num_samples", [3]), r"t\.json: 'num_samples' has 1 entries for 2 users"),
    (lambda o: o["users"].append("a"), r"t\.json: users \['a'\] appear more than once in its 'users'"),
    (lambda o: o["user_data"]["a"].update(y=[3.7, 1.0, 2.0]), r"t\.json: user 'a' 'y': labels must be integer class ids; 1 of 3"),
    (lambda o: o["user_data"]["a"].update(y=["a", "b", "c"]), r"t\.json: user 'a' 'y': labels must be integer class ids, got dtype <U1"),
    (lambda o: o["user_data"]["a"].update(x=[[1.0] * 783] * 3), r"t\.json: user 'a': cannot read 'x': cannot reshape"),
    (lambda o: o["user_data"]["a"].update(x=[["0.5"] * 784] * 3),
     r"t\.json: user 'a': cannot read 'x': it must hold JSON numbers, found '0\.5' \(str\)"),
    (lambda o: o["user_data"]["b"]["x"][1].__setitem__(5, "1"),
     r"t\.json: user 'b': cannot read 'x': it must hold JSON numbers, found '1' \(str\)"),
    (lambda o: o["user_data"]["a"]["x"][0].__setitem__(0, None),
     r"t\.json: user 'a': cannot read 'x': it must hold JSON numbers, found None \(NoneType\)"),
    (lambda o: o["user_data"]["a"].update(x=[[True] * 784] * 3),
     r"t\.json: user 'a': cannot read 'x': it must hold JSON numbers, found True \(bool\)"),
    # true/false among numbers: numpy reads [0.1, true] as floats, [1, false] as ints, without a word
    (lambda o: o["user_data"]["b"]["x"][1].__setitem__(300, True),
     r"t\.json: user 'b': cannot read 'x': it must hold JSON numbers, found True \(bool\)"),
    (lambda o: o["user_data"]["a"].update(x=[[1] * 783 + [False]] * 3),
     r"t\.json: user 'a': cannot read 'x': it must hold JSON numbers, found False \(bool\)"),
    (lambda o: o["user_data"]["b"].update(y=[1, False]),
     r"t\.json: user 'b' 'y': labels must be integer class ids written as JSON numbers, found False"),
    (lambda o: o["user_data"]["b"].update(y=[True, False]),
     r"t\.json: user 'b' 'y': labels must be integer class ids written as JSON numbers, found True \(bool\)"),
])
def test_leaf_files_whose_parts_disagree_are_refused_naming_file_and_user(tmp_path, edit, message):
    _leaf_root(tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        load_femnist(root=tmp_path)


def test_leaf_pixels_given_as_json_integers_or_floats_load(tmp_path):
    _leaf_root(tmp_path, lambda o: o["user_data"]["a"].update(x=[[1] * 783 + [0.25]] * 2 + [[0] * 784]))
    s = load_femnist(root=tmp_path, invert=False, normalize=False)
    a = s.train_x[s.train_groups == s.group_names.index("a")]
    assert a.dtype == np.float32 and a.reshape(3, -1)[:, -2:].tolist() == [[1, 0.25], [1, 0.25], [0, 0]]


@pytest.mark.parametrize("compress", [False, True])
def test_truncated_leaf_files_are_refused_naming_the_file(tmp_path, compress):
    path = _leaf_root(tmp_path)
    text = path.read_bytes()[:-50]
    path.unlink()
    if compress:
        (path.parent / "t.json.gz").write_bytes(gzip.compress(text)[:-20])
    else:
        path.write_bytes(text)
    with pytest.raises(ValueError, match=r"t\.json(\.gz)?: not readable LEAF JSON \(truncated or corrupt\?\)"):
        load_femnist(root=tmp_path)


def test_leaf_numeric_user_ids_match_their_string_keys(tmp_path):
    def numeric(o):
        o["users"] = [1, 2]
        o["user_data"] = {"1": o["user_data"]["a"], "2": o["user_data"]["b"]}
    path = _leaf_root(tmp_path, numeric)
    write_leaf_file(path.parent.parent / "test" / "t.json", {"1": femnist_user(np.random.default_rng(1), 1),
                                                             "2": femnist_user(np.random.default_rng(2), 1)}, False)
    assert load_femnist(root=tmp_path).group_names == ["1", "2"]


def test_a_writer_without_training_samples_is_left_out_with_its_test_rows_and_logged(tmp_path, caplog):
    _leaf_root(tmp_path, lambda o: (o["user_data"]["b"].update(x=[], y=[]), o.update(num_samples=[3, 0])))
    with caplog.at_level("WARNING", logger="fl_platform.datasets.sources.leaf"):
        s = load_femnist(root=tmp_path)
    assert s.group_names == ["a"] and (s.num_train, s.num_test) == (3, 1)
    assert "1 writer(s) in" in caplog.text and "have no training samples (e.g. 'b'): left out, with their 1 test" \
        in caplog.text


def test_femnist_requires_same_users_in_train_and_test(tmp_path):
    make_femnist_root(tmp_path)
    (tmp_path / "femnist-leaf" / "test" / "b_test.json").unlink()
    with pytest.raises(ValueError, match="same users"):
        load_femnist(root=tmp_path)


def femnist_readme_counts(folder: Path) -> dict[str, tuple[int, int]]:
    """(writers, samples) per folder from the README's table, e.g. "| `train/` | 20 | 105 | 14,708 |"."""
    text = (folder / "README.md").read_text() if (folder / "README.md").is_file() else ""
    rows = re.findall(r"\|\s*`(\w+)/`\s*\|\s*\d+[^|]*\|\s*([\d,]+)\s*\|\s*([\d,]+)\s*\|", text)
    counts = {name: (int(w.replace(",", "")), int(n.replace(",", ""))) for name, w, n in rows}
    return counts or {"train": (105, 14708), "test": (105, 1685), "test_only_writers": (79, 2403)}


@pytest.mark.slow
@pytest.mark.shared_data
def test_real_femnist_matches_its_readme():
    folder = shared_dir("femnist-leaf", "train", "test", "README.md")
    expected = femnist_readme_counts(folder)
    s = load_femnist(root=folder.parent, test_only_writers=True)
    train_writers = len(np.unique(s.train_groups))
    assert (train_writers, s.num_train) == expected["train"]
    seen_test = s.test_groups < train_writers
    assert (len(np.unique(s.test_groups[seen_test])), int(seen_test.sum())) == expected["test"]
    assert (len(np.unique(s.test_groups[~seen_test])), int((~seen_test).sum())) == expected[
        "test_only_writers"
    ]
    assert s.num_classes == 62 and s.train_y.max() <= 61 and len(np.unique(s.train_y)) > 50
    assert abs(float(s.train_x.mean())) < 0.01 and abs(float(s.train_x.std()) - 1) < 0.01
    few = load_femnist(root=folder.parent, max_writers=3)
    assert few.group_names == s.group_names[:3]
    assert np.array_equal(few.train_x, s.train_x[s.train_groups < 3])


# --- Shakespeare ----------------------------------------------------------------------------
SMALL_PLAY = """First Citizen:
Before we proceed any further, hear me speak.
We are accounted poor citizens, the patricians good.

All:
Speak, speak.

First Citizen:
You are all resolved rather to die than to famish? What authority surfeits on would relieve us.



MENENIUS:
Why, masters, my good friends, mine honest neighbours, will you undo yourselves? I tell you, friends,
most charitable care have the patricians of you. For your wants, your suffering in this dearth, you may
as well strike at the heaven with your staves as lift them against the Roman state$
"""


def test_shakespeare_on_a_small_text(tmp_path, caplog):
    (tmp_path / "tiny-shakespeare").mkdir()
    (tmp_path / "tiny-shakespeare" / "input.txt").write_text(SMALL_PLAY)
    speakers = parse_speakers(SMALL_PLAY)
    assert set(speakers) == {"First Citizen", "All", "MENENIUS"}
    assert speakers["All"] == "Speak, speak."
    assert speakers["First Citizen"].startswith("Before we proceed any further, hear me speak. We are")
    with caplog.at_level("WARNING", logger="fl_platform.datasets.sources.shakespeare"):
        s = load_shakespeare(root=tmp_path, seq_len=10, stride=3)
    assert s.group_names == ["First Citizen", "MENENIUS"]  # "All" is too short for a test window
    assert "1 speaker(s) of" in caplog.text and "0 with fewer than min_chars=0 characters, 1 with too little text " \
        "for a train and a test window of seq_len=10 (e.g. 'All')" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fl_platform.datasets.sources.shakespeare"):
        assert load_shakespeare(root=tmp_path, seq_len=10, min_chars=200).group_names == ["MENENIUS"]
    assert "2 speaker(s) of" in caplog.text and "2 with fewer than min_chars=200 characters, 0 with" in caplog.text
    assert s.vocab == list(LEAF_LETTERS) and s.num_classes == 80 and s.input_shape == (10,)
    assert s.train_x.dtype == np.int64 and s.train_x.shape[1] == 10
    decode = lambda ids: "".join(s.vocab[i] for i in ids)  # noqa: E731
    text = speakers["MENENIUS"].replace("$", " ")  # '$' is not in LEAF's alphabet: mapped to space
    cut = int(len(text) * 0.8)
    rows = np.flatnonzero(s.train_groups == 1)
    for r, start in zip(rows[:5], range(0, 15, 3)):
        assert decode(s.train_x[r]) == text[start : start + 10] and s.vocab[s.train_y[r]] == text[start + 10]
    first_test = np.flatnonzero(s.test_groups == 1)[0]
    assert decode(s.test_x[first_test]) == text[cut : cut + 10]  # test windows start after the 80% cut
    assert load_shakespeare(root=tmp_path, seq_len=10, max_speakers=1).group_names == ["First Citizen"]
    file_vocab = load_shakespeare(root=tmp_path, seq_len=10, vocab="file")
    assert file_vocab.vocab[-1] == "<unk>" and "$" in file_vocab.vocab


@pytest.mark.shared_data
def test_real_shakespeare():
    folder = shared_dir("tiny-shakespeare", "input.txt")
    s = load_shakespeare(root=folder.parent)
    assert s.num_classes == 80 and s.input_shape == (80,)
    num_speakers = len(s.group_names)
    assert 100 < num_speakers <= 309
    assert set(np.unique(s.train_groups)) == set(np.unique(s.test_groups)) == set(range(num_speakers))
    assert s.group_names == sorted(s.group_names)
    assert 20_000 < s.num_train < 80_000 and s.num_test > 0.1 * s.num_train


# --- registry, missing data and network -----------------------------------------------------
def test_registry_names_and_options():
    assert set(SOURCES) == {
        "digits",
        "synthetic",
        "mnist",
        "fashion_mnist",
        "cifar10",
        "cifar100",
        "femnist",
        "shakespeare",
        "hf",
    }
    with pytest.raises(ValueError, match=r"unknown dataset source 'imagenet'.*cifar10.*digits"):
        load_source("imagenet")
    with pytest.raises(TypeError, match=r"unknown option\(s\) 'colour' for source 'digits'.*test_fraction"):
        load_source("digits", colour=True)
    s = load_source("synthetic", seed=3, num_clients=5, min_size=20)
    assert s.num_groups == 5
    assert "max_writers" in source_options("femnist")


@pytest.mark.parametrize("name", FILE_SOURCES)
def test_missing_root_names_dataset_and_paths(tmp_path, name):
    empty = tmp_path / "nowhere"
    with pytest.raises(DatasetNotFoundError) as info:
        load_source(name, root=empty)
    message = str(info.value)
    assert repr(name) in message and str(empty) in message and ENV_VAR in message
    assert isinstance(info.value, FileNotFoundError)


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection or URL is recorded and fails."""
    calls: list[object] = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    return calls


@pytest.mark.parametrize("name", FILE_SOURCES)
def test_download_false_never_touches_the_network(tmp_path, no_network, name):
    with pytest.raises(DatasetNotFoundError):
        load_source(name, root=tmp_path)
    assert no_network == []
    assert list(tmp_path.iterdir()) == []  # nothing created either


def test_download_true_offline_gives_a_clear_error(tmp_path, monkeypatch):
    def offline(url, timeout=None):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(DownloadError, match=r"(?s)offline.*fashion-mnist.*Name or service not known"):
        load_fashion_mnist(root=tmp_path, download=True)
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert leftovers == []  # no partial files


def test_fetch_is_atomic_and_checks_md5(tmp_path):
    src = tmp_path / "remote.bin"
    src.write_bytes(b"payload" * 100)
    md5 = hashlib.md5(src.read_bytes()).hexdigest()
    dest = tmp_path / "data" / "file.bin"
    with pytest.raises(DownloadError, match="md5"):
        fetch("demo", [src.as_uri()], dest, md5="0" * 32)
    assert list(dest.parent.iterdir()) == []
    assert fetch("demo", [src.as_uri()], dest, md5=md5).read_bytes() == src.read_bytes()
