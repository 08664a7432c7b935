"""A data loader: Gaussian class blobs, returned in the platform's source form (SourceData)."""

from __future__ import annotations

import numpy as np

from fl_platform.datasets.source import SourceData


def blobs(seed: int, n: int = 600, features: int = 6, classes: int = 3, spread: float = 1.0) -> SourceData:
    """``n`` training and ``n // 3`` test samples; class c is centred at 2 e_c (so classes <= features)."""
    if classes > features:
        raise ValueError(f"classes={classes} needs features >= classes, got {features}")
    rng = np.random.default_rng(seed)
    centres = 2.0 * np.eye(classes, features, dtype=np.float32)

    def draw(count: int) -> tuple[np.ndarray, np.ndarray]:
        y = rng.integers(0, classes, size=count)
        x = centres[y] + spread * rng.standard_normal((count, features)).astype(np.float32)
        return x.astype(np.float32), y.astype(np.int64)

    train_x, train_y = draw(n)
    test_x, test_y = draw(n // 3)
    return SourceData(train_x, train_y, test_x, test_y, num_classes=classes, input_shape=(features,),
                      name="blobs")
