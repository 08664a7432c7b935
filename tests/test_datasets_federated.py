"""FederatedDataset: tensors held once, clients as slices of one index tensor, fixed test set."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from fl_platform.datasets.federated import FederatedDataset, build_federated_dataset, default_partition
from fl_platform.datasets.partition import Partition, iid
from fl_platform.datasets.sources import synthetic
from fl_platform.datasets.sources.digits import load_digits
from fl_platform.datasets.sources.synthetic import load_synthetic

from .conftest import shared_dir


@pytest.fixture(scope="module")
def digits_fd() -> FederatedDataset:
    return build_federated_dataset("digits", 20, "dirichlet", seed=0, partition_options={"alpha": 0.5})


def test_client_indices_are_slices_of_one_device_tensor(digits_fd):
    fd = digits_fd
    assert fd.num_clients == 20 and fd.client_sizes().sum() == fd.train_x.shape[0] == 1438
    assert fd.client_sizes().min() >= 10  # dirichlet's default min_size
    for c in range(fd.num_clients):
        idx = fd.client_indices(c)
        assert idx.dtype == torch.int64 and idx.device == fd.train_x.device
        assert np.array_equal(idx.numpy(), fd.partition.client(c))
    # One cached tensor, sliced: every client's indices share its storage.
    ptrs = {fd.client_indices(c).untyped_storage().data_ptr() for c in range(fd.num_clients)}
    assert len(ptrs) == 1
    x, y = fd.client_data(3)
    assert torch.equal(y, fd.train_y[fd.client_indices(3)]) and x.shape[1:] == (1, 8, 8)
    with pytest.raises(IndexError):
        fd.client_indices(20)


def test_to_moves_tensors_once(digits_fd):
    moved = digits_fd.to("cpu")
    assert moved is not digits_fd and moved.device == torch.device("cpu")
    assert moved._indices is not None and moved._indices.device == torch.device("cpu")
    assert torch.equal(moved.client_indices(5), digits_fd.client_indices(5))
    assert (
        moved.partition is digits_fd.partition and moved.num_classes == 10 and moved.input_shape == (1, 8, 8)
    )


def test_hold_copy_and_hold_block_read_the_copy_and_refuse_other_data():
    fd = build_federated_dataset("digits", 5, "iid", seed=0)
    copy = fd.to("cpu")
    copy.train_y, copy.partition = fd.train_y.clone(), Partition(fd.partition.indices.copy(), fd.partition.offsets)
    fd.client_indices(0)  # cached from the old partition: dropped by hold_copy
    fd.hold_copy(copy)
    assert fd.train_y is copy.train_y and fd.partition is copy.partition
    assert fd.client_indices(1).numpy().tolist() == copy.partition.client(1).tolist()
    assert fd.client_view(1)[1] is copy.train_y  # the label views too
    other = build_federated_dataset("digits", 5, "iid", seed=1)  # same shapes, another partition
    with pytest.raises(ValueError, match="partition"):
        fd.hold_copy(other)
    wrong = fd.to("cpu")
    wrong.train_y = fd.train_y[:-1]
    with pytest.raises(ValueError, match="train_y"):
        fd.hold_copy(wrong)
    assert fd.train_y is copy.train_y and fd.partition is copy.partition  # a refused copy changes nothing
    block = fd.train_x.clone()
    fd.hold_block(0, block)
    assert fd.train_x is block
    with pytest.raises(ValueError, match="block 0"):
        fd.hold_block(0, block[:-1])
    assert fd.train_x is block


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_cuda(digits_fd):
    moved = digits_fd.to("cuda")
    assert moved.train_x.is_cuda and moved.client_indices(2).is_cuda
    assert torch.equal(
        moved.train_y[moved.client_indices(2)].cpu(), digits_fd.train_y[digits_fd.client_indices(2)]
    )


def test_test_set_is_fixed_across_seeds_and_partitions(digits_fd):
    reference = load_digits()
    for seed, name in [(1, "iid"), (2, "shards"), (3, "power_law")]:
        fd = build_federated_dataset("digits", 10, name, seed=seed)
        assert torch.equal(fd.test_y, digits_fd.test_y) and torch.equal(fd.test_x, digits_fd.test_x)
        fd.partition.validate(fd.train_x.shape[0], complete=True)
    assert np.array_equal(digits_fd.test_y.numpy(), reference.test_y)


def test_digits_dirichlet_hundred_clients_is_fast():
    build_federated_dataset(
        "digits", 100, "dirichlet", seed=0, partition_options={"alpha": 1.0, "min_size": 2}
    )
    start = time.perf_counter()
    fd = build_federated_dataset(
        "digits", 100, "dirichlet", seed=1, partition_options={"alpha": 1.0, "min_size": 2}
    )
    assert time.perf_counter() - start < 0.5
    assert fd.num_clients == 100 and fd.client_sizes().min() >= 2


def test_synthetic_natural_partition_has_num_clients_clients():
    fd = build_federated_dataset("synthetic", 12, None, seed=4, source_options={"alpha": 1.0, "beta": 1.0})
    src = load_synthetic(seed=4, num_clients=12, alpha=1.0, beta=1.0)
    assert default_partition("synthetic") == "natural" and fd.num_clients == 12
    assert fd.client_sizes().tolist() == np.bincount(src.train_groups).tolist()
    assert fd.test_x.shape[0] == src.num_test and fd.input_shape == (60,)
    for c in (0, 11):
        assert np.array_equal(fd.client_indices(c).numpy(), np.flatnonzero(src.train_groups == c))
    other = build_federated_dataset(
        "synthetic", 12, "dirichlet", seed=4, partition_options={"alpha": 0.3, "min_size": 1}
    )
    assert other.num_clients == 12 and other.train_x.shape == fd.train_x.shape


def test_from_source_and_saved_partition_round_trip(tmp_path):
    src = load_digits()
    part = iid(src.train_y, 7, seed=9)
    fd = FederatedDataset.from_source(src, Partition.load(part.save(tmp_path / "p.npz")))
    assert fd.partition == part and fd.name == "digits"
    assert np.shares_memory(fd.train_x.numpy(), src.train_x)  # zero-copy wrap of the numpy arrays
    with pytest.raises(ValueError, match="outside"):
        FederatedDataset.from_source(src, Partition(np.array([0, 10**6]), np.array([0, 2])))


def test_bad_names_give_clear_errors():
    with pytest.raises(ValueError, match=r"unknown dataset source 'cifar11'.*valid names"):
        build_federated_dataset("cifar11", 10, "iid", seed=0)
    with pytest.raises(ValueError, match=r"unknown partitioner 'pathological'.*shards"):
        build_federated_dataset("digits", 10, "pathological", seed=0)
    with pytest.raises(ValueError, match=r"'natural' needs natural groups.*'digits'"):
        build_federated_dataset("digits", 10, "natural", seed=0)
    with pytest.raises(TypeError, match="alpah"):
        build_federated_dataset("digits", 10, "dirichlet", seed=0, partition_options={"alpah": 0.1})
    with pytest.raises(ValueError, match=r"num_clients=5000 is more than the 1438 samples"):
        build_federated_dataset("digits", 5000, "iid", seed=0)


@pytest.mark.shared_data
def test_real_femnist_and_shakespeare_natural_clients():
    shared_dir("femnist-leaf", "train", "test")
    shared_dir("tiny-shakespeare", "input.txt")
    # Options left None (as config files write them) still load only the clients asked for.
    fem = build_federated_dataset("femnist", 4, None, seed=0, source_options={"max_writers": None})
    assert fem.num_clients == 4 and fem.num_classes == 62 and fem.test_x.shape[0] > 0
    assert fem.train_x.shape[0] == fem.client_sizes().sum()
    shk = build_federated_dataset("shakespeare", 6, None, seed=0, source_options={"max_speakers": None})
    assert shk.train_x.shape[0] == shk.client_sizes().sum()
    assert shk.num_clients == 6 and shk.vocab is not None and shk.train_x.dtype == torch.int64
    assert (shk.client_sizes() > 0).all()
    with pytest.raises(ValueError, match="more than the"):
        build_federated_dataset("shakespeare", 5000, None, seed=0)


def test_row_blocks_clients_views_and_a_partition_that_mixes_blocks(monkeypatch, caplog):
    """Synthetic features in row blocks stay blocks under the natural partition: each client reads its
    block with indices into it, the same rows as from one tensor; a partition that mixes the blocks
    joins them into one; shipping without the features and attaching them back is checked."""
    opts = {"size_mean": 1.0, "size_sigma": 1.0, "min_size": 10}
    whole = build_federated_dataset("synthetic", 3000, "natural", seed=2, source_options=opts)
    monkeypatch.setattr(synthetic, "BLOCK_BYTES", 30_000)
    fd = build_federated_dataset("synthetic", 3000, "natural", seed=2, source_options=opts)
    assert len(whole.train_blocks) == 1 and len(fd.train_blocks) >= 4 and fd.num_train == whole.num_train
    assert fd.block_starts[-1] == fd.num_train and fd.client_block[-1] == len(fd.train_blocks) - 1
    for c in range(fd.num_clients):
        x, y = fd.client_data(c)
        want_x, want_y = whole.client_data(c)
        assert torch.equal(x, want_x) and torch.equal(y, want_y)
    block, labels, idx = fd.client_view(2999)
    assert block is fd.train_blocks[-1] and labels.shape[0] == block.shape[0] and int(idx.max()) < block.shape[0]
    assert fd.client_view(2998)[1] is labels  # the clients of a block share its tensors
    with pytest.raises(ValueError, match="row blocks"):
        fd.train_x  # noqa: B018
    shell = fd.without_training_features()
    assert shell.train_blocks == [] and shell.test_x is None and fd.test_x is not None
    with pytest.raises(ValueError, match="blocks of training features"):
        shell.attach_training_features(fd.train_blocks[:-1])
    with pytest.raises(ValueError, match="training block 1"):
        shell.attach_training_features([fd.train_blocks[0], fd.train_blocks[0], *fd.train_blocks[2:]])
    shell.attach_training_features(fd.train_blocks)
    assert torch.equal(shell.client_data(7)[0], whole.client_data(7)[0])
    with caplog.at_level("INFO"):
        mixed = build_federated_dataset("synthetic", 3000, "iid", seed=2, source_options=opts)
    assert len(mixed.train_blocks) == 1 and torch.equal(mixed.train_x, whole.train_x)
    assert "joined into one" in caplog.text


def test_empty_clients_are_logged_with_the_consequence(caplog):
    with caplog.at_level("WARNING", logger="fl_platform.datasets.federated"):
        fd = build_federated_dataset("digits", 200, "dirichlet", partition_options={"alpha": 0.05, "min_size": 0})
    empty = int((fd.client_sizes() == 0).sum())
    assert empty > 0
    assert f"partition dirichlet: {empty} of 200 clients hold no training samples" in caplog.text
    assert "leaves them out of eval_clients" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="fl_platform.datasets.federated"):
        build_federated_dataset("digits", 10, "iid")
    assert "no training samples" not in caplog.text
