"""The common in-memory form of every data source, before partitioning.

Parsers return plain numpy arrays (torch is only needed once the data goes on a device, in
``federated.py``), so they can be tested and reused without torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class RowBlocks:
    """The rows of one array held as separate arrays (blocks), in order.

    A source that generates more than fits in memory twice (a million Synthetic devices) hands its
    training features over this way: whoever ships them (the Ray engine puts one object per block)
    frees each block once it is copied, so the whole array never exists twice. Every block has the
    same row shape and dtype. ``np.asarray`` gives the one array (a copy) to readers that need it.
    """

    __slots__ = ("blocks",)

    def __init__(self, blocks: Sequence[np.ndarray]) -> None:
        if not blocks:
            raise ValueError("RowBlocks needs at least one block")
        first = blocks[0]
        for i, b in enumerate(blocks):
            if b.shape[1:] != first.shape[1:] or b.dtype != first.dtype:
                raise ValueError(f"RowBlocks: block {i} has rows {b.shape[1:]} {b.dtype}, block 0 "
                                 f"{first.shape[1:]} {first.dtype}")
        self.blocks = list(blocks)

    def __len__(self) -> int:
        return sum(len(b) for b in self.blocks)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.blocks[0].shape[1:])

    @property
    def dtype(self) -> np.dtype:
        return self.blocks[0].dtype

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        out = np.concatenate(self.blocks) if len(self.blocks) > 1 else self.blocks[0]
        return out if dtype is None else out.astype(dtype, copy=False)


def class_ids(values: object, where: str) -> np.ndarray:
    """``values`` as a 1-d int64 array of class ids. Integer (or bool) labels pass; float labels must
    hold whole numbers (a FedProx JSON writes 3.0); 3.7, NaN, strings and 2-d labels are refused
    naming ``where`` (never truncated to 3)."""
    y = np.asarray(values)
    if y.ndim != 1:
        raise ValueError(f"{where}: labels must be a 1-d array of class ids, got shape {y.shape}")
    if y.dtype.kind == "f":
        refuse_fractions(y, f"{where}: labels must be integer class ids")
    elif y.dtype.kind not in "biu":
        raise ValueError(f"{where}: labels must be integer class ids, got dtype {y.dtype}"
                         + (f" (e.g. {y[:1].tolist()[0]!r})" if len(y) else ""))
    return y.astype(np.int64, copy=False)


def refuse_fractions(values: np.ndarray, rule: str) -> None:
    """Refuse float ``values`` that are not whole numbers (NaN included: NaN != NaN), never cutting 3.7 to
    3; ``rule`` says what they must be ("labels must be integer class ids")."""
    bad = values != np.round(values)
    if bad.any():
        raise ValueError(f"{rule}; {int(bad.sum())} of {values.size} are not (e.g. {values[bad][0]})")


def uint8_pixels(data: np.ndarray, where: str) -> np.ndarray:
    """``data`` as uint8 pixels; another dtype must hold whole numbers 0..255 (300, -1 or 0.7 are refused,
    never wrapped or cut)."""
    if data.dtype == np.uint8:
        return data
    if data.dtype.kind not in "iuf":
        raise ValueError(f"{where} holds {data.dtype}, expected uint8 pixels 0..255")
    bad = ~((data >= 0) & (data <= 255) & (data == np.round(data)))  # NaN compares False: bad
    if bad.any():
        raise ValueError(f"{where} ({data.dtype}) has {int(bad.sum())} value(s) that are not integer pixels 0..255, "
                         f"e.g. {data[bad][0]}; expected uint8 pixels")
    return data.astype(np.uint8)


def check_test_classes(where: str, test_y: np.ndarray, num_classes: int, fix: str,
                       class_names: Sequence[str] | None = None) -> None:
    """Refuse test labels >= ``num_classes``, the training labels' range: no client can learn them."""
    if len(test_y) and test_y.max() >= num_classes:
        unseen = np.unique(test_y[test_y >= num_classes])[:5].tolist()
        named = f" ({', '.join(repr(class_names[i]) for i in unseen)})" if class_names is not None else ""
        raise ValueError(f"{where}: test_y holds class id(s) {', '.join(map(str, unseen))}{named} outside the "
                         f"training labels' range 0..{num_classes - 1}: no client can learn them, so the test "
                         f"accuracy would count them as errors. {fix}")


def check_finite(name: str, split: str, x: np.ndarray | RowBlocks) -> None:
    """Refuse float features holding NaN or inf at load (one pass, block by block): they would surface
    only as a NaN loss mid-training, whose hints point at the learning rate."""
    for start, block in _blocks(x):
        if not np.issubdtype(block.dtype, np.floating):
            return
        if not len(block) or np.isfinite(block.sum(dtype=np.float64)):  # (buffered: no copy of the block)
            continue
        rows = np.flatnonzero(~np.isfinite(block.reshape(len(block), -1)).all(axis=1))
        if len(rows):
            raise ValueError(f"{name}: {split}_x has non-finite values (NaN or inf) in {len(rows)} row(s), first "
                             f"row {start + int(rows[0])}: drop or impute them before training (a NaN feature "
                             "makes the loss NaN)")


def _blocks(x: np.ndarray | RowBlocks) -> list[tuple[int, np.ndarray]]:
    blocks = x.blocks if isinstance(x, RowBlocks) else [x]
    starts = np.cumsum([0, *(len(b) for b in blocks)])
    return [(int(s), np.asarray(b)) for s, b in zip(starts, blocks)]


@dataclass
class SourceData:
    """Train and test arrays of one data source plus what the partitioners and models need to know.

    Features are float32 (images N x C x H x W, scaled to [0, 1] then standardised with fixed
    per-dataset constants) or int64 token ids (text), the same dtype in both splits; other dtypes are
    refused, not converted. Labels are class ids (whole numbers, stored int64). Neither split may be empty. ``train_x`` may be
    :class:`RowBlocks` (Synthetic at scale: see there).
    ``train_groups``/``test_groups`` hold a natural group id per sample (writer, speaker, synthetic
    device), numbered 0..G-1 in sorted order of ``group_names``; None when the source has no groups.
    """

    train_x: np.ndarray | RowBlocks
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int
    input_shape: tuple[int, ...]
    name: str
    train_groups: np.ndarray | None = None
    test_groups: np.ndarray | None = None
    vocab: list[str] | None = None
    group_names: list[str] | None = None
    class_names: list[str] | None = None
    # Image sources: the features of a background (raw 0, black) pixel per channel, what crop
    # padding fills with (augment.py); None: 0.0 in every channel.
    pad_value: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        self.train_y = class_ids(self.train_y, f"{self.name}: train_y")
        self.test_y = class_ids(self.test_y, f"{self.name}: test_y")
        self.input_shape = tuple(int(d) for d in self.input_shape)
        for split, x, y in (("train", self.train_x, self.train_y), ("test", self.test_x, self.test_y)):
            if not isinstance(x, np.ndarray | RowBlocks) or x.dtype not in (np.float32, np.int64):
                got = f"dtype {x.dtype}" if isinstance(x, np.ndarray | RowBlocks) else type(x).__name__
                raise TypeError(f"{self.name}: {split}_x must be a numpy array of float32 features or int64 token "
                                f"ids, got {got} (convert it, e.g. np.asarray(x, dtype=np.float32))")
            if not len(y):
                raise ValueError(f"{self.name}: the {split} set is empty (0 rows): a run would report "
                                 f"{'test accuracy over no samples' if split == 'test' else 'nothing learned'}; "
                                 f"give the source {split} rows")
            if len(x) != len(y):
                raise ValueError(f"{self.name}: {split}_x has {len(x)} rows but {split}_y has {len(y)}")
            if tuple(x.shape[1:]) != self.input_shape:
                raise ValueError(
                    f"{self.name}: {split}_x rows have shape {x.shape[1:]}, not {self.input_shape}"
                )
            if len(y) and (y.min() < 0 or y.max() >= self.num_classes):
                bad = y[(y < 0) | (y >= self.num_classes)]
                raise ValueError(f"{self.name}: {split} labels outside [0, {self.num_classes}) (num_classes="
                                 f"{self.num_classes}): {len(bad)} of {len(y)}, e.g. {int(bad[0])}; fix the labels "
                                 "or num_classes")
            check_finite(self.name, split, x)
        if self.train_x.dtype != self.test_x.dtype:
            raise TypeError(f"{self.name}: train_x is {self.train_x.dtype} but test_x is {self.test_x.dtype}; give both "
                            "the same dtype (float32 features or int64 token ids)")
        for split, groups, y in (
            ("train", self.train_groups, self.train_y),
            ("test", self.test_groups, self.test_y),
        ):
            if groups is not None and len(groups) != len(y):
                raise ValueError(
                    f"{self.name}: {split}_groups has {len(groups)} entries for {len(y)} samples"
                )
        if self.train_groups is not None:
            self.train_groups = np.asarray(self.train_groups, dtype=np.int64)
        if self.test_groups is not None:
            self.test_groups = np.asarray(self.test_groups, dtype=np.int64)

    @property
    def num_train(self) -> int:
        return len(self.train_y)

    @property
    def num_test(self) -> int:
        return len(self.test_y)

    @property
    def has_groups(self) -> bool:
        return self.train_groups is not None

    @property
    def num_groups(self) -> int:
        """Number of natural groups (0 without groups); ids in test may go beyond train's (unseen groups)."""
        if self.train_groups is None:
            return 0
        top = [int(g.max()) + 1 for g in (self.train_groups, self.test_groups) if g is not None and len(g)]
        return max(top, default=0)


def standardize(
    images: np.ndarray, mean: Sequence[float], std: Sequence[float], normalize: bool = True
) -> np.ndarray:
    """Standardise N x C x H x W float32 images in place with fixed per-channel constants.

    Fixed constants (not statistics of whatever subset was loaded) keep a sample's features
    identical whichever clients, writers or options a run picks.
    """
    images = np.asarray(images, dtype=np.float32)
    if not normalize:
        return images
    m = np.asarray(mean, dtype=np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(std, dtype=np.float32).reshape(1, -1, 1, 1)
    images -= m
    images /= s
    return images


def standardized_value(
    raw: float, mean: Sequence[float], std: Sequence[float], normalize: bool = True
) -> tuple[float, ...]:
    """Per channel, the feature value ``standardize`` gives a pixel of value ``raw`` (bit-exact)."""
    pixel = np.full((1, len(mean), 1, 1), raw, dtype=np.float32)
    return tuple(float(v) for v in standardize(pixel, mean, std, normalize).reshape(-1))
