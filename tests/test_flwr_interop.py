"""flwr-datasets interop (datasets/flwr_interop.py): their partitioners on our labels give exactly
their partitions as our CSR form, and our partitions work as one of their partitioners."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr_datasets", reason="flwr-datasets (extra fl-platform[hf]) is not installed")

from flwr_datasets.metrics import compute_counts
from flwr_datasets.partitioner import DirichletPartitioner, ShardPartitioner

from fl_platform.datasets.flwr_interop import FlwrPartitioner, flwr_partition, labels_dataset
from fl_platform.datasets.partition import make_partition
from fl_platform.experiment import load_data
from fl_platform.run_config import read_config

from .conftest import compose_config

LABELS = np.random.default_rng(0).integers(0, 4, 300)


def _theirs(part, seed: int) -> list[list[int]]:
    """Their partitioner run by hand on the rows shuffled with ``seed``: each client's original rows."""
    import datasets

    perm = np.random.default_rng(seed).permutation(len(LABELS))
    part.dataset = datasets.Dataset.from_dict({"label": LABELS[perm], "row": perm})
    return [list(part.load_partition(c).with_format("numpy")[:]["row"]) for c in range(part.num_partitions)]


def test_their_dirichlet_partition_becomes_ours_row_for_row():
    ours = flwr_partition(LABELS, 6, 3, "DirichletPartitioner", {"alpha": 0.3, "min_partition_size": 0})
    want = _theirs(DirichletPartitioner(6, "label", 0.3, min_partition_size=0, seed=3), seed=3)
    assert [ours.client(c).tolist() for c in range(6)] == want
    assert sorted(ours.indices.tolist()) == list(range(300))  # every row once
    for c in range(6):  # the rows are our rows: their labels are the labels flwr-datasets assigned
        np.testing.assert_array_equal(LABELS[ours.client(c)], LABELS[np.asarray(want[c], dtype=np.int64)])
    other = flwr_partition(LABELS, 6, 4, "DirichletPartitioner", {"alpha": 0.3, "min_partition_size": 0})
    assert other != ours  # the run's seed reaches their partitioner


def test_their_shard_partitioner_and_iid():
    shards = flwr_partition(LABELS, 5, 1, "ShardPartitioner", {"num_shards_per_partition": 2})
    assert [shards.client(c).tolist() for c in range(5)] == _theirs(
        ShardPartitioner(5, "label", num_shards_per_partition=2, seed=1), seed=1)
    iid = flwr_partition(LABELS, 7, 2)
    assert iid.num_clients == 7 and set(iid.sizes().tolist()) <= {42, 43} and iid.num_samples == 300
    assert iid.client(0).tolist() != list(range(43))  # shuffled first, as their FederatedDataset does
    assert flwr_partition(LABELS, 7, 2) == iid and flwr_partition(LABELS, 7, 3) != iid


def test_bad_partitioner_settings_are_refused():
    with pytest.raises(ValueError, match=r"'Nope' is not a flwr-datasets partitioner; valid: .*DirichletPartitioner"):
        flwr_partition(LABELS, 3, 0, "Nope")
    with pytest.raises(ValueError, match=r"partition\.options\.num_partitions is set by the run"):
        flwr_partition(LABELS, 3, 0, "IidPartitioner", {"num_partitions": 3})
    with pytest.raises(ValueError, match=r"partition\.options alpah not accepted by DirichletPartitioner; it takes"):
        flwr_partition(LABELS, 3, 0, "DirichletPartitioner", {"alpah": 0.5})


def test_our_partition_as_their_partitioner():
    ours = make_partition("dirichlet", LABELS, 5, seed=2, alpha=0.5, min_size=5)
    exported = FlwrPartitioner(ours)
    exported.dataset = labels_dataset(LABELS, x=np.arange(300 * 2, dtype=np.float32).reshape(300, 2))
    assert exported.num_partitions == 5
    for c in range(5):
        part = exported.load_partition(c).with_format("numpy")[:]
        np.testing.assert_array_equal(part["row"], ours.client(c))
        np.testing.assert_array_equal(part["x"], np.arange(600, dtype=np.float32).reshape(300, 2)[ours.client(c)])
    counts = compute_counts(exported, "label")  # their metrics on our partition
    np.testing.assert_array_equal(counts.sort_index(axis=1).to_numpy(), ours.label_counts(LABELS, 4))


def test_partition_flwr_in_a_run_config():
    base = ("num_clients=5", "partition=flwr", "partition.partitioner=DirichletPartitioner",
            "+partition.options.min_partition_size=0")
    data = load_data(read_config(compose_config(*base, "+partition.options.alpha=0.5")))
    labels = data.train_y.numpy()
    assert data.partition == flwr_partition(labels, 5, 0, "DirichletPartitioner",
                                            {"alpha": 0.5, "min_partition_size": 0})
    assert load_data(read_config(compose_config(*base, "+partition.options.alpha=50.0"))).partition != data.partition
    assert load_data(read_config(compose_config(*base[:2], "partition.partitioner=IidPartitioner"))).partition \
        != data.partition
