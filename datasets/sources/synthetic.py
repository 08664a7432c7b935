"""FedProx Synthetic(alpha, beta) (Li et al. 2020), generated in vectorised chunks.

Recipe (see specs/datasets.md, section 3): device sizes int(lognormal(mean, sigma)) + min_size;
u_k ~ N(0, alpha) and B_k ~ N(0, beta) (std, as in the reference code); v_k ~ N(B_k, 1)^60;
W_k, b_k ~ N(u_k, 1); x ~ N(v_k, diag(j^-1.2)); y = argmax(x W_k + b_k); per device the first
int(0.9 n_k) samples are train, the rest test. The IID variant shares one W, b ~ N(0, 1) and v = 0.

Samples within a device are i.i.d., so the reference's per-device shuffle before the split changes
nothing in distribution and is skipped. Everything is drawn in a few large numpy calls and the
logits are computed over chunks of devices, so 100,000 devices cost seconds and no per-device
Python objects. The result depends only on the arguments (its own SeedSequence, fixed chunking).

Training features beyond ``BLOCK_BYTES`` are generated into separate blocks of whole devices
(``RowBlocks``), so that the Ray engine can ship them one object per block and free each as it goes:
a million devices never exist twice in the driver's memory. The values do not depend on the blocks.
"""

from __future__ import annotations

import itertools

import numpy as np

from fl_platform.datasets.source import RowBlocks, SourceData

# Samples per chunk when computing logits: bounds the temporary (samples x features x classes) gather.
_CHUNK_SAMPLES = 8192
#: Bytes of training features per block (whole chunks of devices): about 64 MiB.
BLOCK_BYTES = 64 << 20


def device_sizes(
    num_clients: int,
    rng: np.random.Generator,
    size_mean: float = 4.0,
    size_sigma: float = 2.0,
    min_size: int = 50,
    max_size: int | None = None,
) -> np.ndarray:
    """Per-device sample counts: int(lognormal(size_mean, size_sigma)) + min_size, capped at max_size."""
    sizes = rng.lognormal(size_mean, size_sigma, num_clients).astype(np.int64) + min_size
    if max_size is not None:
        np.minimum(sizes, max_size, out=sizes)
    return sizes


def load_synthetic(
    root: object = None,
    download: bool = False,
    seed: int = 0,
    *,
    num_clients: int = 30,
    alpha: float = 0.0,
    beta: float = 0.0,
    iid: bool = False,
    size_mean: float = 4.0,
    size_sigma: float = 2.0,
    min_size: int = 50,
    max_size: int | None = None,
    num_features: int = 60,
    num_classes: int = 10,
    train_fraction: float = 0.9,
) -> SourceData:
    """Generate FedProx Synthetic(alpha, beta) (or the IID variant) for ``num_clients`` devices.

    ``train_groups``/``test_groups`` are the device ids: the natural partition is the data set itself.
    ``root`` and ``download`` are accepted for a uniform loader signature and ignored.
    """
    del root, download
    if num_clients < 1:
        raise ValueError(f"synthetic: num_clients must be >= 1, got {num_clients}")
    if alpha < 0 or beta < 0:
        raise ValueError(
            f"synthetic: alpha and beta are standard deviations, must be >= 0 (got {alpha}, {beta})"
        )
    if size_sigma < 0:
        raise ValueError(f"synthetic: size_sigma is the standard deviation of the log sample counts, must be >= 0, "
                         f"got {size_sigma}")
    if min_size < 2:
        raise ValueError(
            f"synthetic: min_size must be >= 2 so every device has train and test data, got {min_size}"
        )
    if max_size is not None and max_size < min_size:
        raise ValueError(f"synthetic: max_size ({max_size}) must be >= min_size ({min_size})")
    if not 0.0 < train_fraction < 1.0:
        raise ValueError(f"synthetic: train_fraction must be in (0, 1), got {train_fraction}")

    rng_sizes, rng_priors, rng_model, rng_x = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4)
    )
    sizes = device_sizes(num_clients, rng_sizes, size_mean, size_sigma, min_size, max_size)
    n_train = (sizes * train_fraction).astype(np.int64)  # int(0.9 n) as in the reference
    n_train = np.clip(n_train, 1, sizes - 1)  # every device keeps >= 1 train and >= 1 test sample
    n_test = sizes - n_train

    # Per-device priors (one small array each; no per-device objects). The feature means v_k
    # (devices x features) are drawn chunk by chunk below, in the same order as one draw of them
    # all: the same numbers, without a devices x features array (240 MB at a million devices).
    if iid:
        u = np.zeros(num_clients, dtype=np.float32)
        shared_w = rng_model.standard_normal((num_features, num_classes), dtype=np.float32)
        shared_b = rng_model.standard_normal(num_classes, dtype=np.float32)
    else:
        u = (rng_priors.standard_normal(num_clients) * alpha).astype(np.float32)
        big_b = rng_priors.standard_normal(num_clients) * beta
    feature_std = np.arange(1, num_features + 1, dtype=np.float64) ** (-1.2 / 2)  # sqrt(Sigma_jj)
    feature_std = feature_std.astype(np.float32)

    offsets = np.concatenate([[0], np.cumsum(sizes)])
    train_off = np.concatenate([[0], np.cumsum(n_train)])
    test_off = np.concatenate([[0], np.cumsum(n_test)])
    test_x = np.empty((int(test_off[-1]), num_features), dtype=np.float32)
    train_y = np.empty(int(train_off[-1]), dtype=np.int64)
    test_y = np.empty(len(test_x), dtype=np.int64)

    # Chunks of whole devices holding about _CHUNK_SAMPLES samples; boundaries depend only on sizes.
    cuts = np.searchsorted(offsets, np.arange(0, offsets[-1], _CHUNK_SAMPLES), side="right") - 1
    bounds = np.unique(np.concatenate([cuts, [num_clients]]))
    # Blocks of whole chunks, each closed once it holds BLOCK_BYTES of features (the last: the rest).
    rows_per_block = max(1, BLOCK_BYTES // (num_features * np.dtype(np.float32).itemsize))
    edges = [int(bounds[0])]
    for d in bounds[1:-1]:
        if train_off[d] - train_off[edges[-1]] >= rows_per_block:
            edges.append(int(d))
    edges.append(num_clients)
    blocks = [np.empty((int(train_off[e1] - train_off[e0]), num_features), dtype=np.float32)
              for e0, e1 in itertools.pairwise(edges)]
    block_of_chunk = np.searchsorted(edges, bounds[:-1], side="right") - 1
    for (d0, d1), k in zip(itertools.pairwise(bounds), block_of_chunk, strict=True):
        nd = int(d1 - d0)
        local_dev = np.repeat(np.arange(nd), sizes[d0:d1])
        x = rng_x.standard_normal((len(local_dev), num_features), dtype=np.float32)
        x *= feature_std
        if not iid:  # (IID: v = 0)
            means = (big_b[d0:d1, None] + rng_priors.standard_normal((nd, num_features))).astype(np.float32)
            x += means[local_dev]
        if iid:
            logits = x @ shared_w + shared_b
        else:
            w = rng_model.standard_normal((nd, num_features, num_classes), dtype=np.float32)
            w += u[d0:d1, None, None]
            b = rng_model.standard_normal((nd, num_classes), dtype=np.float32)
            b += u[d0:d1, None]
            logits = np.matmul(x[:, None, :], w[local_dev])[:, 0, :] + b[local_dev]
        y = logits.argmax(axis=1)
        pos = np.arange(len(local_dev)) - (offsets[d0:d1] - offsets[d0])[local_dev]
        is_train = pos < n_train[d0:d1][local_dev]
        row0 = train_off[edges[k]]
        blocks[k][train_off[d0] - row0 : train_off[d1] - row0] = x[is_train]
        train_y[train_off[d0] : train_off[d1]] = y[is_train]
        test_x[test_off[d0] : test_off[d1]] = x[~is_train]
        test_y[test_off[d0] : test_off[d1]] = y[~is_train]

    devices = np.arange(num_clients, dtype=np.int64)
    kind = "iid" if iid else f"{alpha:g}_{beta:g}"
    return SourceData(
        train_x=RowBlocks(blocks) if len(blocks) > 1 else blocks[0],
        train_y=train_y,
        test_x=test_x,
        test_y=test_y,
        num_classes=num_classes,
        input_shape=(num_features,),
        name=f"synthetic_{kind}",
        train_groups=np.repeat(devices, n_train),
        test_groups=np.repeat(devices, n_test),
        group_names=None,
    )
