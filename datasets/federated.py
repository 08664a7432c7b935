"""The federated dataset: training tensors held once, clients as index ranges, a server test set.

Local training draws minibatches by indexing ``train_x``/``train_y`` with a client's indices, which
are slices of one cached index tensor on the same device: no DataLoader, no per-client Dataset or
tensor, no per-client host-to-device copy (DESIGN.md section 2).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from fl_platform.datasets import registry
from fl_platform.datasets.augment import Augmentation, AugmentConf
from fl_platform.datasets.partition import PARTITIONERS, Partition, make_partition
from fl_platform.datasets.source import SourceData


@dataclass(eq=False)
class FederatedDataset:
    """Training tensors, their client partition, and the server-side test set."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    partition: Partition
    num_classes: int
    input_shape: tuple[int, ...]
    name: str
    vocab: list[str] | None = None
    augment: Augmentation | None = None  # of training minibatches (dataset.augment); None: off
    _indices: torch.Tensor | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_source(cls, source: SourceData, partition: Partition,
                    augment: AugmentConf | Mapping[str, Any] | None = None) -> FederatedDataset:
        """Wrap a source's arrays (zero-copy) with a partition of its training samples."""
        partition.validate(source.num_train)
        if isinstance(augment, Mapping):
            augment = AugmentConf(**augment)
        return cls(
            train_x=torch.from_numpy(np.ascontiguousarray(source.train_x)),
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
        )

    @property
    def num_clients(self) -> int:
        return self.partition.num_clients

    @property
    def device(self) -> torch.device:
        return self.train_x.device

    def client_sizes(self) -> np.ndarray:
        return self.partition.sizes()

    def client_indices(self, c: int) -> torch.Tensor:
        """Client ``c``'s rows of ``train_x`` as an int64 tensor on ``train_x``'s device (a view)."""
        if not 0 <= c < self.num_clients:
            raise IndexError(f"client {c} out of range for {self.num_clients} clients")
        if self._indices is None or self._indices.device != self.train_x.device:
            self._indices = torch.from_numpy(self.partition.indices).to(self.train_x.device)
        lo, hi = self.partition.offsets[c], self.partition.offsets[c + 1]
        return self._indices[int(lo) : int(hi)]

    def client_data(self, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``c``'s (features, labels), gathered on the device (a copy: prefer index batches)."""
        idx = self.client_indices(c)
        return self.train_x.index_select(0, idx), self.train_y.index_select(0, idx)

    def hold_copy(self, copy: FederatedDataset) -> None:
        """Read ``copy``'s tensors and partition from now on in place of this dataset's own (kept by
        everyone holding this object), so that its own are freed once nothing else refers to them.

        The Ray engine gives the driver the object-store copy it has just written (zero-copy views):
        the driver's node then holds the data once for the whole run, not its own copy besides.
        ``copy`` must hold the same data: the partition and the tensors' shapes and dtypes are
        checked, the tensors' values are not (a byte copy of this dataset by construction).
        """
        for name in ("train_x", "train_y", "test_x", "test_y"):
            mine, theirs = getattr(self, name), getattr(copy, name)
            if mine.shape != theirs.shape or mine.dtype != theirs.dtype:
                raise ValueError(f"hold_copy: {name} is {tuple(theirs.shape)} {theirs.dtype} in the copy, "
                                 f"{tuple(mine.shape)} {mine.dtype} here")
        if not (np.array_equal(self.partition.offsets, copy.partition.offsets)
                and np.array_equal(self.partition.indices, copy.partition.indices)):
            raise ValueError("hold_copy: the copy's partition is not this dataset's")
        for name in ("train_x", "train_y", "test_x", "test_y", "partition"):
            setattr(self, name, getattr(copy, name))
        self._indices = None

    def to(self, device: str | torch.device) -> FederatedDataset:
        """A copy whose tensors (and the cached index tensor) live on ``device``; moved once, here."""
        device = torch.device(device)
        moved = replace(
            self,
            train_x=self.train_x.to(device),
            train_y=self.train_y.to(device),
            test_x=self.test_x.to(device),
            test_y=self.test_y.to(device),
        )
        moved._indices = torch.from_numpy(self.partition.indices).to(device)
        return moved


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
    if partition_name == "natural":
        source = _select_groups(source, partition.num_clients)
    return FederatedDataset.from_source(source, partition, augment)
