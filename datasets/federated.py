"""The federated dataset: training tensors held once, clients as index ranges, a server test set.

Local training draws minibatches by indexing a client's training tensor with its indices, which
are slices of one cached index tensor on the same device: no DataLoader, no per-client Dataset or
tensor, no per-client host-to-device copy (DESIGN.md section 2).

The training features are held in row blocks: one for every source but Synthetic at scale, which
generates blocks of whole devices (``RowBlocks``) so that the Ray engine can ship them one object
per block, never holding them twice. A client's rows lie in one block, and a client's view is that
block, its labels and the client's indices into it.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from fl_platform.datasets import registry
from fl_platform.datasets.augment import Augmentation, AugmentConf
from fl_platform.datasets.partition import PARTITIONERS, Partition, make_partition
from fl_platform.datasets.source import RowBlocks, SourceData
from fl_platform.seeding import Stream, numpy_rng

log = logging.getLogger(__name__)


def _client_blocks(partition: Partition, starts: np.ndarray) -> np.ndarray | None:
    """The block of each client's rows, or None when some client's rows span several blocks."""
    sizes = partition.sizes()
    if len(starts) == 2:
        return np.zeros(len(sizes), dtype=np.int64)
    block = np.searchsorted(starts, partition.indices, side="right") - 1
    out = np.zeros(len(sizes), dtype=np.int64)
    held = sizes > 0
    if held.any():
        first = partition.offsets[:-1][held]
        lo, hi = np.minimum.reduceat(block, first), np.maximum.reduceat(block, first)
        if not np.array_equal(lo, hi):
            return None
        out[held] = lo
    return out


@dataclass(eq=False)
class FederatedDataset:
    """Training row blocks and labels, their client partition, and the server-side test set."""

    train_blocks: list[torch.Tensor]  # the training features, rows in blocks (most sources: one)
    train_y: torch.Tensor
    test_x: torch.Tensor | None  # None in a Ray worker's copy: only the server evaluates on it
    test_y: torch.Tensor | None
    partition: Partition
    num_classes: int
    input_shape: tuple[int, ...]
    name: str
    block_starts: np.ndarray  # each block's first row, then the number of rows
    client_block: np.ndarray  # each client's block
    vocab: list[str] | None = None
    augment: Augmentation | None = None  # of training minibatches (dataset.augment); None: off
    # Each client's local test rows (eval.local_test_fraction, ``with_local_test``), held out of
    # ``partition``; None: no local test split (the server's test set only).
    local_test: Partition | None = None
    _indices: torch.Tensor | None = field(default=None, init=False, repr=False)
    _labels: list[torch.Tensor] | None = field(default=None, init=False, repr=False)  # train_y per block
    _test_indices: torch.Tensor | None = field(default=None, init=False, repr=False)  # local_test's, cached

    @classmethod
    def from_source(cls, source: SourceData, partition: Partition,
                    augment: AugmentConf | Mapping[str, Any] | None = None) -> FederatedDataset:
        """Wrap a source's arrays (zero-copy) with a partition of its training samples.

        Row blocks (``RowBlocks``) stay blocks when every client's rows lie in one block; otherwise
        (a partition that mixes them, e.g. ``iid`` over a million Synthetic devices) they are joined
        into one, once, here.
        """
        partition.validate(source.num_train)
        if isinstance(augment, Mapping):
            augment = AugmentConf(**augment)
        blocks = source.train_x.blocks if isinstance(source.train_x, RowBlocks) else [source.train_x]
        starts = np.concatenate([[0], np.cumsum([len(b) for b in blocks])]).astype(np.int64)
        client_block = _client_blocks(partition, starts)
        if client_block is None:
            log.info("%s: partition spans the %d row blocks of its training features; they are joined into one "
                     "(%.0f MB copied once)", source.name, len(blocks), sum(b.nbytes for b in blocks) / 1e6)
            blocks, starts = [np.concatenate(blocks)], starts[[0, -1]]
            client_block = np.zeros(partition.num_clients, dtype=np.int64)
        return cls(
            train_blocks=[torch.from_numpy(np.ascontiguousarray(b)) for b in blocks],
            train_y=torch.from_numpy(np.ascontiguousarray(source.train_y)),
            test_x=torch.from_numpy(np.ascontiguousarray(source.test_x)),
            test_y=torch.from_numpy(np.ascontiguousarray(source.test_y)),
            partition=partition,
            num_classes=source.num_classes,
            input_shape=tuple(source.input_shape),
            name=source.name,
            vocab=source.vocab,
            augment=Augmentation.build(augment, source.input_shape, source.train_x.dtype, source.name,
                                       source.pad_value),
            block_starts=starts,
            client_block=client_block,
        )

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without its caches (index tensor, label views): rebuilt where they are read."""
        return {**vars(self), "_indices": None, "_labels": None, "_test_indices": None}

    @property
    def num_clients(self) -> int:
        return self.partition.num_clients

    @property
    def num_train(self) -> int:
        return int(self.block_starts[-1])

    @property
    def device(self) -> torch.device:
        return self.train_y.device

    @property
    def train_dtype(self) -> torch.dtype:
        return self.train_blocks[0].dtype

    @property
    def train_x(self) -> torch.Tensor:
        """The training features as one tensor: only when they are held in one block."""
        if len(self.train_blocks) != 1:
            raise ValueError(f"{self.name}: the training features are held in {len(self.train_blocks)} row blocks, "
                             "not one tensor; read a client's rows with client_view(c)")
        return self.train_blocks[0]

    def client_sizes(self) -> np.ndarray:
        return self.partition.sizes()

    def client_indices(self, c: int) -> torch.Tensor:
        """Client ``c``'s rows of its block (``client_view``) as an int64 tensor on the data's device;
        with one block, rows of ``train_x`` (a view of one cached index tensor)."""
        if not 0 <= c < self.num_clients:
            raise IndexError(f"client {c} out of range for {self.num_clients} clients")
        if self._indices is None or self._indices.device != self.train_y.device:
            self._indices = torch.from_numpy(self.partition.indices).to(self.train_y.device)
        return self._block_rows(c, self.partition, self._indices)

    def _block_rows(self, c: int, part: Partition, indices: torch.Tensor) -> torch.Tensor:
        """Client ``c``'s rows in ``part`` (whose indices, on the device, are ``indices``), counted from
        the start of the client's block."""
        lo, hi = part.offsets[c], part.offsets[c + 1]
        rows = indices[int(lo) : int(hi)]
        start = int(self.block_starts[self.client_block[c]])
        return rows - start if start else rows

    def client_view(self, c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Client ``c``'s block of features, the block's labels and the client's rows in it (views)."""
        return self._block_view(c, self.client_indices(c))

    def client_test_view(self, c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Client ``c``'s block, the block's labels and the client's local test rows in it (views)."""
        if self.local_test is None:
            raise ValueError(f"{self.name}: no local test split (set eval.local_test_fraction with eval.clients)")
        if self._test_indices is None or self._test_indices.device != self.train_y.device:
            self._test_indices = torch.from_numpy(self.local_test.indices).to(self.train_y.device)
        return self._block_view(c, self._block_rows(c, self.local_test, self._test_indices))

    def with_local_test(self, fraction: float, seed: int) -> FederatedDataset:
        """This dataset with ``fraction`` of each client's rows held out as its local test split.

        Stratified per client: the split keeps each class's share as closely as whole samples allow
        (largest remainder), and a client with at least two samples keeps one for training. The rows
        are drawn from (seed, client), so the split is the same whichever process or worker builds it.
        """
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"eval.local_test_fraction must be in (0, 1), got {fraction}")
        train, test = split_local_test(self.partition, self.train_y.numpy(), fraction, seed)
        return replace(self, partition=train, local_test=test)

    def _block_view(self, c: int, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self._labels is None:  # one view per block, so that clients of a block share their tensors
            starts = self.block_starts.tolist()
            self._labels = [self.train_y] if len(starts) == 2 else \
                [self.train_y[lo:hi] for lo, hi in itertools.pairwise(starts)]
        b = int(self.client_block[c])
        return self.train_blocks[b], self._labels[b], indices

    def client_data(self, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``c``'s (features, labels), gathered on the device (a copy: prefer index batches)."""
        x, y, idx = self.client_view(c)
        return x.index_select(0, idx), y.index_select(0, idx)

    def without_training_features(self) -> FederatedDataset:
        """This dataset without its training features and test set, to ship apart from them.

        The Ray engine ships the features one object per block (``attach_training_features`` puts them
        back on a worker); the test set stays with the driver's evaluation (or travels once to the worker
        that evaluates: fl_platform/rounds/evaluation.py).
        """
        return replace(self, train_blocks=[], test_x=None, test_y=None)

    def attach_training_features(self, blocks: Sequence[torch.Tensor]) -> None:
        """Hold ``blocks`` as the training features (what ``without_training_features`` left out);
        their number, rows, row shape and dtype are checked."""
        rows = np.diff(self.block_starts)
        if len(blocks) != len(rows):
            raise ValueError(f"{self.name}: {len(blocks)} blocks of training features for {len(rows)} expected")
        for i, (b, n) in enumerate(zip(blocks, rows, strict=True)):
            if b.shape != (int(n), *self.input_shape) or b.dtype != blocks[0].dtype:
                raise ValueError(f"{self.name}: training block {i} is {tuple(b.shape)} {b.dtype}, expected "
                                 f"{(int(n), *self.input_shape)} {blocks[0].dtype}")
        self.train_blocks = list(blocks)

    def hold_block(self, i: int, copy: torch.Tensor) -> None:
        """Read training block ``i`` from ``copy`` from now on (the same rows: shape and dtype are
        checked, values are a byte copy by construction), so that the block's own tensor is freed once
        nothing else refers to it.

        The Ray engine gives the driver the object-store copy of each block right after writing it
        (a zero-copy view): the driver's node then holds the data once, and never twice while the
        blocks are shipped one after another.
        """
        mine = self.train_blocks[i]
        if mine.shape != copy.shape or mine.dtype != copy.dtype:
            raise ValueError(f"hold_block: block {i} is {tuple(copy.shape)} {copy.dtype} in the copy, "
                             f"{tuple(mine.shape)} {mine.dtype} here")
        self.train_blocks[i] = copy

    def hold_copy(self, copy: FederatedDataset) -> None:
        """Read ``copy``'s labels and partition from now on in place of this dataset's own (kept by
        everyone holding this object), so that its own are freed once nothing else refers to them.

        The Ray engine gives the driver the object-store copy of what it shipped apart from the
        training features (zero-copy views). ``copy`` must hold the same data: the partition and the
        labels' shape and dtype are checked, the labels' values are not (a byte copy by construction).
        """
        if self.train_y.shape != copy.train_y.shape or self.train_y.dtype != copy.train_y.dtype:
            raise ValueError(f"hold_copy: train_y is {tuple(copy.train_y.shape)} {copy.train_y.dtype} in the "
                             f"copy, {tuple(self.train_y.shape)} {self.train_y.dtype} here")
        if not (np.array_equal(self.partition.offsets, copy.partition.offsets)
                and np.array_equal(self.partition.indices, copy.partition.indices)):
            raise ValueError("hold_copy: the copy's partition is not this dataset's")
        self.train_y, self.partition = copy.train_y, copy.partition
        self._indices = self._labels = self._test_indices = None

    def to(self, device: str | torch.device) -> FederatedDataset:
        """A copy whose tensors (and the cached index tensor) live on ``device``; moved once, here."""
        device = torch.device(device)
        moved = replace(
            self,
            train_blocks=[b.to(device) for b in self.train_blocks],
            train_y=self.train_y.to(device),
            test_x=None if self.test_x is None else self.test_x.to(device),
            test_y=None if self.test_y is None else self.test_y.to(device),
        )
        if moved.num_clients:
            moved.client_indices(0)  # builds the cached index tensor on the device, once
        return moved


def split_local_test(partition: Partition, labels: np.ndarray, fraction: float, seed: int,
                     stream: Stream = Stream.LOCAL_TEST) -> tuple[Partition, Partition]:
    """Each client's rows cut into (train, local test), stratified by label, from (seed, client)
    (``stream``: the early-stopping validation split is cut the same way from its own stream).

    A client of n >= 2 rows gets round(fraction * n) test rows, at least 1 and at most n - 1, shared
    among its classes by largest remainder of ``fraction * count`` (ties: the rarer class first, then
    the lower label); within a class the test rows are a random choice. Both parts keep ascending row
    order, so a client's minibatch draws depend only on its rows.
    """
    sizes = partition.sizes()
    train_parts, test_parts = [], []
    train_sizes = np.zeros(len(sizes), dtype=np.int64)
    test_sizes = np.zeros(len(sizes), dtype=np.int64)
    for c in range(len(sizes)):
        rows = partition.client(c)
        n = len(rows)
        k = min(max(int(np.floor(fraction * n + 0.5)), 1), n - 1) if n >= 2 else 0
        pick = np.zeros(n, dtype=bool)
        if k:
            ys = labels[rows]
            classes, counts = np.unique(ys, return_counts=True)
            quota = fraction * counts
            take = np.minimum(np.floor(quota).astype(np.int64), counts)
            order = np.lexsort((classes, counts, -(quota - take)))  # largest remainder first
            for i in order[: max(k - int(take.sum()), 0)]:
                take[i] += 1
            while take.sum() > k:  # (floors alone exceed k only through k's cap at n - 1)
                take[np.argmax(take)] -= 1
            rng = numpy_rng(seed, stream, c)
            for cls_, t in zip(classes, take):
                if t:
                    members = np.flatnonzero(ys == cls_)
                    pick[rng.choice(members, size=int(t), replace=False)] = True
        train_parts.append(np.sort(rows[~pick]))
        test_parts.append(np.sort(rows[pick]))
        train_sizes[c], test_sizes[c] = n - int(pick.sum()), int(pick.sum())
    empty = np.zeros(0, dtype=np.int64)
    train = Partition.from_sizes(np.concatenate(train_parts) if train_parts else empty, train_sizes)
    test = Partition.from_sizes(np.concatenate(test_parts) if test_parts else empty, test_sizes)
    return train, test


def default_partition(name: str) -> str:
    """``natural`` for sources with natural groups (synthetic, femnist, shakespeare), else ``iid``."""
    if name != registry.CUSTOM:
        registry.get_loader(name)
    return "natural" if name in registry.GROUPED_SOURCES else "iid"


def _select_groups(source: SourceData, num_clients: int) -> SourceData:
    """Keep the test samples of the groups that became clients (the first ``num_clients`` train groups).

    Test-only groups (ids absent from the training data, e.g. FEMNIST's unseen writers) are kept:
    they were asked for explicitly, as clients the model never trained on.
    """
    if source.test_groups is None or source.train_groups is None:
        return source
    if len(source.train_groups) and num_clients >= int(source.train_groups.max()) + 1:
        return source  # every train group is a client (without sorting a copy of the group ids)
    train_ids = np.unique(source.train_groups)
    keep = np.isin(source.test_groups, train_ids[:num_clients]) | ~np.isin(source.test_groups, train_ids)
    if keep.all():
        return source
    return replace(
        source,
        test_x=source.test_x[keep],
        test_y=source.test_y[keep],
        test_groups=source.test_groups[keep],
    )


def build_federated_dataset(
    name: str,
    num_clients: int | None,
    partition_name: str | None = None,
    seed: int = 0,
    root: str | os.PathLike[str] | None = None,
    download: bool = False,
    source_options: dict[str, Any] | None = None,
    partition_options: dict[str, Any] | None = None,
    augment: AugmentConf | Mapping[str, Any] | None = None,
) -> FederatedDataset:
    """Load source ``name`` and partition its training set over ``num_clients`` clients.

    ``partition_name`` defaults to ``natural`` for synthetic/femnist/shakespeare and ``iid`` otherwise.
    With ``natural`` each natural group is a client (the first ``num_clients`` groups; all when None),
    and the test set is the union of those groups' test splits. Synthetic gets ``num_clients`` devices.
    ``augment`` (``dataset.augment``) augments training minibatches (datasets/augment.py).
    """
    src_opts = dict(source_options or {})
    part_opts = dict(partition_options or {})
    partition_name = partition_name or default_partition(name)
    valid_source_opts = set(registry.source_options(name))
    # An option left unset or None (as a config file writes it) takes its value from num_clients.
    if name == "synthetic" and num_clients is not None and src_opts.get("num_clients") is None:
        src_opts["num_clients"] = num_clients
    if partition_name == "natural" and num_clients is not None:
        # Loading only the first N writers/speakers is both faster and what natural(num_clients) keeps.
        for option in ("max_writers", "max_speakers"):
            if option in valid_source_opts and src_opts.get(option) is None:
                src_opts[option] = num_clients
    source = registry.load_source(name, root=root, download=download, seed=seed, **src_opts)
    if partition_name == "natural" and not source.has_groups:
        raise ValueError(
            f"partition 'natural' needs natural groups, but source {name!r} has none; "
            f"use it with {', '.join(sorted(registry.GROUPED_SOURCES))}, or pick one of "
            f"{', '.join(sorted(set(PARTITIONERS) - {'natural'}))}"
        )
    partition = make_partition(
        partition_name, source.train_y, num_clients, seed, groups=source.train_groups, **part_opts
    )
    if empty := int((partition.sizes() == 0).sum()):
        log.warning("partition %s: %d of %d clients hold no training samples (options %s): a round that samples "
                    "them trains on fewer clients, and per-client evaluation (eval.clients) leaves them out of "
                    "eval_clients (as it does clients of one sample); give each client data (e.g. partition.min_size)",
                    partition_name, empty, partition.num_clients, part_opts or "default")
    if partition_name == "natural":
        source = _select_groups(source, partition.num_clients)
    return FederatedDataset.from_source(source, partition, augment)
