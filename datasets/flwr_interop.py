"""Interop with flwr-datasets (optional extra ``fl-platform[hf]``): their partitioners on our data, and
our partitions as one of their partitioners.

* ``flwr_partition`` runs any ``flwr_datasets.partitioner`` class on a source's training labels and
  returns our CSR ``Partition`` (``partition=flwr partition.partitioner=DirichletPartitioner``);
* ``FlwrPartitioner(partition)`` is our partition as a flwr-datasets ``Partitioner``, so a run's
  ``partition.npz`` plugs into their tools (``load_partition``, ``flwr_datasets.visualization``);
* ``labels_dataset`` is the Hugging Face ``Dataset`` both sides share: a ``label`` column, the row's
  position in our training arrays (``row``), and optionally the flattened features (``x``).

Our partitioners stay the default: flwr-datasets materialises every client as a ``Dataset.select``
view, which is slow at 100,000 clients (docs/data.md has the measurement; scripts/bench/partition.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import numpy as np

from fl_platform.datasets.partition import Partition

try:  # the base class of FlwrPartitioner; without the extra, using it raises _import's error
    from flwr_datasets.partitioner import Partitioner as _Base
except ImportError:  # pragma: no cover - depends on the installation
    _Base = object

ROW = "row"  # the column holding a sample's position in our training arrays
LABEL = "label"


def _import() -> tuple[Any, Any]:
    try:
        import flwr_datasets.partitioner

        import datasets
    except ImportError as err:  # pragma: no cover - depends on the installation
        raise ImportError(
            "partition=flwr needs flwr-datasets: pip install 'fl-platform[hf]' (or `pip install flwr-datasets`)"
        ) from err
    return datasets, flwr_datasets.partitioner


def labels_dataset(labels: np.ndarray, x: np.ndarray | None = None, order: np.ndarray | None = None) -> Any:
    """A Hugging Face ``Dataset`` with columns ``row``, ``label`` (and ``x``: each sample flattened),
    its rows in ``order`` (positions in ``labels``; default: as they are)."""
    import pyarrow as pa

    datasets, _ = _import()
    labels = np.asarray(labels, dtype=np.int64)
    order = np.arange(len(labels), dtype=np.int64) if order is None else np.asarray(order, dtype=np.int64)
    columns = {ROW: pa.array(order), LABEL: pa.array(labels[order])}
    if x is not None:
        flat = np.ascontiguousarray(np.asarray(x)[order].reshape(len(order), -1))
        columns["x"] = pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), flat.shape[1])
    return datasets.Dataset(pa.table(columns))


def _rows(part: Any) -> np.ndarray:
    """The ``row`` column of one partition (a ``Dataset``, possibly a ``select``/``shard`` view)."""
    return np.asarray(part.with_format("numpy")[:][ROW], dtype=np.int64)


def flwr_partition(labels: np.ndarray, num_clients: int, seed: int, partitioner: str = "IidPartitioner",
                   options: Mapping[str, Any] | None = None) -> Partition:
    """flwr-datasets' ``partitioner`` (a class name in ``flwr_datasets.partitioner``) over ``labels``.

    Set here, not in ``options``: ``num_partitions`` (= num_clients), ``seed`` (the run's, where the
    class takes one) and ``partition_by`` (``label``, unless given). As their ``FederatedDataset``
    does, the rows are shuffled first (here with the run's seed), so order-based partitioners such as
    ``IidPartitioner`` do not hand out the data in its stored order. Client c of the result holds the
    rows of their partition c, in their order.
    """
    _, module = _import()
    cls = getattr(module, partitioner, None)
    valid = sorted(n for n in dir(module) if isinstance(getattr(module, n), type)
                   and issubclass(getattr(module, n), module.Partitioner) and n != "Partitioner")
    if cls is None or not isinstance(cls, type) or not issubclass(cls, module.Partitioner) or cls is module.Partitioner:
        raise ValueError(f"partition.partitioner={partitioner!r} is not a flwr-datasets partitioner; valid: "
                         f"{', '.join(valid)}")
    params = inspect.signature(cls.__init__).parameters
    kwargs = dict(options or {})
    for fixed in ("num_partitions", "seed"):
        if fixed in kwargs:
            raise ValueError(f"partition.options.{fixed} is set by the run (num_clients, seed); remove it")
    unknown = sorted(set(kwargs) - set(params) - {"self"})
    if unknown:
        raise ValueError(f"partition.options {', '.join(unknown)} not accepted by {partitioner}; it takes "
                         f"{', '.join(p for p in params if p not in ('self', 'num_partitions', 'seed'))}")
    if "num_partitions" in params:
        kwargs["num_partitions"] = num_clients
    if "seed" in params:
        kwargs["seed"] = seed
    if "partition_by" in params and "partition_by" not in kwargs:
        kwargs["partition_by"] = LABEL
    try:
        part = cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"partition=flwr: {partitioner}({kwargs}) failed: {err}") from err
    labels = np.asarray(labels)
    part.dataset = labels_dataset(labels, order=np.random.default_rng(seed).permutation(len(labels)))
    if part.num_partitions != num_clients:
        raise ValueError(f"partition=flwr: {partitioner} made {part.num_partitions} partitions, not num_clients="
                         f"{num_clients}; check partition.options")
    rows = [_rows(part.load_partition(c)) for c in range(num_clients)]
    offsets = np.zeros(num_clients + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    result = Partition(np.concatenate(rows) if rows else np.zeros(0, np.int64), offsets)
    result.validate(len(labels))  # disjoint and in range
    return result


class FlwrPartitioner(_Base):  # type: ignore[misc,valid-type]
    """Our ``partition`` as a flwr-datasets ``Partitioner``: ``load_partition(c)`` is client c's rows of
    the assigned dataset (``labels_dataset(...)`` in our row order, or any dataset aligned with our
    training arrays), in our order."""

    def __init__(self, partition: Partition) -> None:
        if _Base is object:
            _import()  # raises: flwr-datasets is not installed
        super().__init__()
        self.partition = partition

    def load_partition(self, partition_id: int) -> Any:
        if len(self.dataset) < self.partition.num_samples:
            raise ValueError(f"the dataset has {len(self.dataset)} rows; the partition covers "
                             f"{self.partition.num_samples}")
        return self.dataset.select(self.partition.client(partition_id))

    @property
    def num_partitions(self) -> int:
        return self.partition.num_clients
