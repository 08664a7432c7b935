"""Partitioners: disjoint and complete, seeded, skewed as promised, cheap at 100,000 clients."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fl_platform.datasets.partition import (
    PARTITIONERS,
    Partition,
    dirichlet,
    iid,
    lognormal,
    make_partition,
    natural,
    partition_options,
    power_law,
    shards,
)

SEEDED = ["iid", "dirichlet", "shards", "power_law", "lognormal"]


def balanced_labels(num_classes: int, per_class: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(num_classes), per_class))


def mean_tv_distance(p: Partition, labels: np.ndarray, num_classes: int) -> float:
    """Mean total-variation distance between each client's label distribution and the global one."""
    counts = p.label_counts(labels, num_classes).astype(float)
    local = counts / counts.sum(axis=1, keepdims=True)
    glob = np.bincount(labels, minlength=num_classes) / len(labels)
    return float(0.5 * np.abs(local - glob).sum(axis=1).mean())


@st.composite
def labelled_problem(draw):
    n = draw(st.integers(min_value=10, max_value=400))
    num_classes = draw(st.integers(min_value=1, max_value=12))
    labels = np.asarray(
        draw(st.lists(st.integers(0, num_classes - 1), min_size=n, max_size=n)), dtype=np.int64
    )
    num_clients = draw(st.integers(min_value=1, max_value=max(1, n // 4)))
    seed = draw(st.integers(min_value=0, max_value=2**32 - 1))
    return labels, num_clients, seed


@settings(max_examples=25, deadline=None)
@given(problem=labelled_problem(), name=st.sampled_from(SEEDED))
def test_partitions_are_disjoint_and_cover_all_samples(problem, name):
    labels, num_clients, seed = problem
    params = {"min_size": 0} if name == "dirichlet" else {}
    if name == "shards":
        params["classes_per_client"] = 2
        num_clients = max(1, min(num_clients, len(labels) // 2))
    p = make_partition(name, labels, num_clients, seed, **params)
    assert p.num_clients == num_clients
    p.validate(len(labels), complete=True)
    assert np.array_equal(np.sort(p.indices), np.arange(len(labels)))
    assert p.sizes().sum() == len(labels)
    assert p.label_counts(labels).sum(axis=0).tolist() == np.bincount(labels).tolist()


@settings(max_examples=15, deadline=None)
@given(problem=labelled_problem())
def test_natural_partition_is_one_client_per_group(problem):
    labels, _, seed = problem
    groups = np.random.default_rng(seed).integers(0, 7, len(labels)) * 3 + 100  # sparse, unsorted ids
    p = natural(groups)
    uniq = np.unique(groups)
    assert p.num_clients == len(uniq)
    p.validate(len(groups), complete=True)
    for c, g in enumerate(uniq):
        assert np.array_equal(p.client(c), np.flatnonzero(groups == g))
    first = natural(groups, num_clients=2) if len(uniq) >= 2 else None
    if first is not None:
        assert first.num_clients == 2
        assert set(np.unique(groups[first.indices])) == set(uniq[:2])


@settings(max_examples=15, deadline=None)
@given(problem=labelled_problem())
def test_natural_partition_of_sorted_groups_is_their_runs(problem):
    """Sorted group ids (Synthetic's devices) take the runs' boundaries instead of np.unique: same result."""
    labels, _, seed = problem
    groups = np.sort(np.random.default_rng(seed).integers(0, 7, len(labels)) * 3 + 100)
    uniq = np.unique(groups)
    for k in (None, 1, len(uniq) // 2 or 1, len(uniq)):
        p = natural(groups, k)
        assert p.num_clients == (k or len(uniq))
        for c in range(p.num_clients):
            assert np.array_equal(p.client(c), np.flatnonzero(groups == uniq[c]))
        p.validate(len(groups), complete=p.num_clients == len(uniq))
    with pytest.raises(ValueError, match=f"more than the {len(uniq)} groups"):
        natural(groups, len(uniq) + 1)


@pytest.mark.parametrize("name", SEEDED)
def test_same_seed_same_partition_different_seed_different(name):
    labels = balanced_labels(10, 100)
    a = make_partition(name, labels, 20, seed=3)
    b = make_partition(name, labels, 20, seed=3)
    c = make_partition(name, labels, 20, seed=4)
    assert a == b
    assert np.array_equal(a.indices, b.indices) and np.array_equal(a.offsets, b.offsets)
    assert a != c


@pytest.mark.parametrize("name", SEEDED)
def test_partitioners_never_touch_the_global_rng(name):
    labels = balanced_labels(10, 50)
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    make_partition(name, labels, 10, seed=0)
    assert np.array_equal(np.random.get_state()[1], before)


def test_dirichlet_skew_grows_as_alpha_shrinks():
    labels = balanced_labels(10, 500)
    seeds = range(5)
    tv = {
        alpha: np.mean(
            [mean_tv_distance(dirichlet(labels, 20, s, alpha=alpha, min_size=1), labels, 10) for s in seeds]
        )
        for alpha in (0.05, 0.5, 100.0)
    }
    assert tv[0.05] > tv[0.5] > tv[100.0]
    assert tv[100.0] < 0.1 < 0.5 < tv[0.05]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("min_size", [5, 20])
def test_dirichlet_respects_min_size(seed, min_size):
    labels = balanced_labels(10, 200)
    p = dirichlet(labels, 30, seed, alpha=0.3, min_size=min_size)
    assert p.sizes().min() >= min_size
    p.validate(len(labels), complete=True)


def test_shards_give_each_client_k_distinct_classes():
    labels = balanced_labels(10, 100)  # 100 shards of 10 samples line up with the classes
    for seed in range(3):
        p = shards(labels, 50, seed, classes_per_client=2)
        classes_per_client = (p.label_counts(labels, 10) > 0).sum(axis=1)
        assert classes_per_client.tolist() == [2] * 50
        p.validate(len(labels), complete=True)
    p3 = shards(labels, 20, 0, classes_per_client=5)
    assert ((p3.label_counts(labels, 10) > 0).sum(axis=1) == 5).all()


def test_quantity_skew_is_skewed_but_label_iid():
    labels = balanced_labels(10, 2000)
    for p in (power_law(labels, 200, 0, exponent=1.0), lognormal(labels, 200, 0, sigma=1.5)):
        sizes = p.sizes()
        assert sizes.min() >= 1 and sizes.sum() == len(labels)
        assert sizes.max() > 5 * np.median(sizes)
        # Labels are drawn at random: the pooled label counts of the big clients stay balanced.
        big = p.label_counts(labels, 10)[sizes >= np.median(sizes)].sum(axis=0)
        assert big.max() / big.min() < 1.3
    heavier = np.mean([power_law(labels, 200, s, exponent=0.7).sizes().max() for s in range(3)])
    lighter = np.mean([power_law(labels, 200, s, exponent=3.0).sizes().max() for s in range(3)])
    assert heavier > lighter


def test_iid_sizes_are_equal():
    p = iid(np.zeros(103, dtype=np.int64), 10, 0)
    assert sorted(p.sizes().tolist()) == [10] * 7 + [11] * 3


@pytest.mark.parametrize("name", ["iid", "power_law"])
def test_hundred_thousand_clients_are_two_int64_arrays(name):
    labels = np.random.default_rng(0).integers(0, 10, 1_000_000)
    start = time.perf_counter()
    p = make_partition(name, labels, 100_000, seed=1)
    counts = p.label_counts(labels, 10)
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, f"{name} over 100,000 clients took {elapsed:.2f}s"
    assert set(vars(p)) == {"indices", "offsets"}
    assert p.indices.dtype == np.int64 and p.offsets.dtype == np.int64
    assert p.indices.shape == (1_000_000,) and p.offsets.shape == (100_001,)
    assert counts.shape == (100_000, 10) and counts.sum() == 1_000_000
    assert p.sizes().min() >= 1
    p.validate(len(labels), complete=True)


def test_save_and_load_round_trip(tmp_path):
    labels = balanced_labels(10, 30)
    p = dirichlet(labels, 7, 0, alpha=0.5, min_size=1)
    path = p.save(tmp_path / "runs" / "partition.npz")
    assert sorted(f.name for f in path.parent.iterdir()) == ["partition.npz"]  # no temp files left behind
    q = Partition.load(path)
    assert q == p and q.indices.dtype == np.int64
    p.save(path)  # overwriting an existing file is atomic too
    assert Partition.load(path) == p


def test_partition_accessors():
    p = Partition(np.array([4, 2, 0, 1, 3]), np.array([0, 2, 2, 5]))
    assert p.num_clients == 3 and p.num_samples == 5
    assert p.sizes().tolist() == [2, 0, 3]
    assert (
        p.client(0).tolist() == [4, 2] and p.client(1).tolist() == [] and p.client(-1).tolist() == [0, 1, 3]
    )
    assert p.owners().tolist() == [0, 0, 2, 2, 2]
    assert p.label_counts(np.array([0, 1, 0, 1, 1]), 2).tolist() == [[1, 1], [0, 0], [1, 2]]
    with pytest.raises(IndexError):
        p.client(3)


def test_partition_validation_errors():
    with pytest.raises(ValueError, match="offsets"):
        Partition(np.arange(3), np.array([0, 2]))
    with pytest.raises(ValueError, match="non-decreasing"):
        Partition(np.arange(3), np.array([0, 2, 1, 3]))
    overlapping = Partition(np.array([0, 1, 1]), np.array([0, 2, 3]))
    with pytest.raises(ValueError, match="not disjoint"):
        overlapping.validate(3)
    with pytest.raises(ValueError, match="outside"):
        Partition(np.array([0, 5]), np.array([0, 2])).validate(3)
    with pytest.raises(ValueError, match="covers 2 of 3"):
        Partition(np.array([0, 2]), np.array([0, 2])).validate(3, complete=True)
    with pytest.raises(ValueError, match="not disjoint"):  # increasing within clients, not overall
        Partition(np.array([0, 1, 1, 2]), np.array([0, 2, 4])).validate(3)
    Partition(np.array([2, 0, 1]), np.array([0, 1, 3])).validate(3, complete=True)  # disjoint, not sorted


def test_unknown_partitioner_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown partitioner 'lda'") as info:
        make_partition("lda", np.zeros(10), 2, 0)
    for name in PARTITIONERS:
        assert name in str(info.value)


@pytest.mark.parametrize("alpha", [0.0, -1.0])
def test_dirichlet_rejects_non_positive_alpha(alpha):
    with pytest.raises(ValueError, match=r"alpha must be > 0, got alpha="):
        dirichlet(balanced_labels(2, 10), 2, 0, alpha=alpha)


@pytest.mark.parametrize("name", SEEDED)
def test_more_clients_than_samples_is_an_error(name):
    with pytest.raises(ValueError, match=r"num_clients=11 .*10 samples"):
        make_partition(name, np.zeros(10, dtype=np.int64), 11, 0)


def test_dirichlet_min_size_errors_name_the_numbers_and_the_fix():
    labels = balanced_labels(10, 10)
    with pytest.raises(ValueError, match=r"num_clients=20 x min_size=10 = 200 is more than the 100 samples"):
        dirichlet(labels, 20, 0, min_size=10)
    with pytest.raises(ValueError, match=r"larger alpha.*smaller\s+min_size"):
        dirichlet(labels, 10, 0, alpha=0.01, min_size=9, max_retries=5)


def test_other_bad_inputs():
    labels = balanced_labels(10, 10)
    with pytest.raises(TypeError, match=r"unknown parameter\(s\) 'beta' for partitioner 'dirichlet'.*alpha"):
        make_partition("dirichlet", labels, 5, 0, beta=0.1)
    with pytest.raises(ValueError, match=r"natural.*group"):
        make_partition("natural", labels, 5, 0)
    with pytest.raises(ValueError, match="num_clients=4 is more than the 3 groups"):
        natural(np.array([0, 1, 2, 2]), 4)
    with pytest.raises(ValueError, match="classes_per_client"):
        shards(labels, 60, 0, classes_per_client=2)
    with pytest.raises(ValueError, match="exponent"):
        power_law(labels, 5, 0, exponent=0)
    with pytest.raises(ValueError, match="positive integer"):
        iid(labels, 0, 0)


def test_partition_options_lists_tunables():
    assert partition_options("dirichlet") == {"alpha": 0.5, "min_size": 10, "max_retries": 100}
    assert partition_options("shards") == {"classes_per_client": 2}
    assert partition_options("iid") == {}
