"""scikit-learn's bundled 8x8 digits: the embedded default (no files, no network)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np

from fl_platform.datasets.source import SourceData, standardize, standardized_value

# Mean/std of all 1797 images after /16; fixed so the features never depend on the split.
MEAN = (0.30526,)
STD = (0.37605,)
# The split's own seed: the test set is the same in every run, whatever the run's seed.
SPLIT_SEED = 20240601


@functools.cache
def _raw_digits() -> tuple[np.ndarray, np.ndarray]:
    """(1797 x 64 pixel counts 0..16, labels), read once per process and never mutated.

    Reads the CSV that scikit-learn ships, without importing scikit-learn (that import alone costs
    about a second); falls back to ``sklearn.datasets.load_digits`` if the file moved.
    """
    spec = importlib.util.find_spec("sklearn")
    csv = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz" if spec else None
    if csv is not None and csv.is_file():
        table = np.loadtxt(csv, delimiter=",", dtype=np.float32)
        x, y = table[:, :-1], table[:, -1].astype(np.int64)
    else:  # pragma: no cover - depends on the scikit-learn layout
        from sklearn.datasets import load_digits as sk_load_digits

        bunch = sk_load_digits()
        x, y = bunch.data.astype(np.float32), bunch.target.astype(np.int64)
    x.setflags(write=False)
    y.setflags(write=False)
    return x, y


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted (train, test) positions with round(test_fraction * n_c) test samples from each class c."""
    rng = np.random.default_rng(seed)
    test_parts = []
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        test_parts.append(rng.permutation(members)[: round(test_fraction * len(members))])
    test = np.sort(np.concatenate(test_parts))
    train = np.setdiff1d(np.arange(len(labels)), test, assume_unique=True)
    return train, test


def load_digits(
    root: object = None,
    download: bool = False,
    seed: int = 0,
    *,
    test_fraction: float = 0.2,
    normalize: bool = True,
) -> SourceData:
    """1797 images (1 x 8 x 8, pixel values /16 then standardised), 10 classes.

    The stratified train/test split uses a fixed seed, not ``seed``: every run, whatever its seed,
    is evaluated on the same test set. ``root``/``download``/``seed`` are accepted for a uniform
    loader signature and ignored.
    """
    del root, download, seed
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"digits: test_fraction must be in (0, 1), got {test_fraction}")
    pixels, y = _raw_digits()
    x = (pixels / np.float32(16.0)).reshape(-1, 1, 8, 8)
    x = standardize(x, MEAN, STD, normalize)
    idx_train, idx_test = stratified_split(y, test_fraction, SPLIT_SEED)
    return SourceData(
        train_x=x[idx_train],
        train_y=y[idx_train],
        test_x=x[idx_test],
        test_y=y[idx_test],
        num_classes=10,
        input_shape=(1, 8, 8),
        name="digits",
        pad_value=standardized_value(0.0, MEAN, STD, normalize),
        class_names=[str(d) for d in range(10)],
    )
