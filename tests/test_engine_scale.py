"""Scale: 10,000 registered clients cost two partition arrays, not 10,000 objects; a stateful
algorithm's states live on disk behind a bounded cache; under Ray the driver's node holds the data
once (the driver reads the object store's copies of its row blocks)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import fl_platform.experiment as experiment
from fl_platform.experiment import build
from fl_platform.rounds.sampling import sample_clients

from .conftest import compose_config

SMALL_DEVICES = ("dataset=synthetic", "partition=natural", "dataset.size_mean=1", "dataset.size_sigma=1",
                 "dataset.min_size=10")


def test_scaffold_on_10000_clients_keeps_state_on_disk_with_bounded_ram(tmp_path):
    rounds, per_round = 3, 100
    cfg = compose_config(*SMALL_DEVICES, "algorithm=scaffold", "num_clients=10000", f"clients_per_round={per_round}",
                         f"rounds={rounds}", "train.epochs=1", "engine.state_store=disk", "engine.state_cache_mb=0.5",
                         "engine.threads_per_worker=1")
    exp = build(cfg, tmp_path)
    try:
        assert exp.data.num_clients == 10_000
        part = exp.data.partition
        assert isinstance(part.indices, np.ndarray) and len(part.offsets) == 10_001  # CSR: two arrays
        summary = exp.simulation.run()
        store = exp.engine.workers[0].store
        trained = {c for r in range(rounds) for c in sample_clients(0, r, 10_000, per_round)}
        assert len(store._cache) <= store.capacity < per_round  # RAM holds a few states, not all
        assert len(store) == len(trained)  # every trained client's state is on disk, no other
        exp.engine.flush()  # write-behind: the cached states reach the disk on flush (or checkpoint, or close)
        files = list((tmp_path / "client_state").rglob("*.bin"))
        assert {int(f.stem) for f in files} == trained
        assert summary["rounds"] == rounds and 0.0 <= summary["final_test_accuracy"] <= 1.0
    finally:
        exp.engine.close()


def test_a_cohort_of_clients_from_several_row_blocks_trains_as_from_one_tensor(monkeypatch):
    """engine.cohort_size: the clients of a cohort may lie in different row blocks; their rows are
    gathered for the fit, and the run equals the run on the features held in one block."""
    import fl_platform.datasets.sources.synthetic as synthetic

    small = (*SMALL_DEVICES, "num_clients=3000", "engine.threads_per_worker=1", "rounds=2", "train.epochs=1",
             "clients_per_round=12", "engine.cohort_size=6", "algorithm=scaffold")
    runs = []
    for block_bytes in (synthetic.BLOCK_BYTES, 30_000):
        monkeypatch.setattr(synthetic, "BLOCK_BYTES", block_bytes)
        exp = build(compose_config("engine=inline", *small))
        try:
            exp.simulation.run()
            assert exp.engine.workers[0].cohort is not None  # trained as cohorts, not one by one
        finally:
            exp.engine.close()
        runs.append(exp)
    assert len(runs[0].data.train_blocks) == 1 and len(runs[1].data.train_blocks) >= 4
    assert float((runs[0].simulation.server.weights - runs[1].simulation.server.weights).abs().max()) <= 1e-6


@pytest.mark.ray
def test_the_ray_driver_ships_row_blocks_reads_the_store_copies_and_frees_its_own(ray_session, monkeypatch):
    """engine=ray: the training features go into the driver's object store one row block at a time and
    the driver reads each block (and the labels and partition) from the store's copy, as its node's
    workers do, its own tensors freed: the node holds the data once. The test set stays the driver's
    own (only the driver evaluates). Same values, and the run equals the inline run, which equals an
    inline run on the features held in one block."""
    import fl_platform.datasets.sources.synthetic as synthetic

    own: dict[str, list] = {}
    load = experiment.load_data

    def recording(cfg):
        data = load(cfg)
        tensors = (*data.train_blocks, data.train_y)
        own["refs"] = [weakref.ref(t) for t in tensors]
        own["values"] = [t.clone() for t in tensors]
        own["partition"] = [data.partition.indices.copy(), data.partition.offsets.copy()]
        own["test"] = data.test_x
        return data

    small = (*SMALL_DEVICES, "num_clients=3000", "engine.threads_per_worker=1", "rounds=2", "train.epochs=1",
             "clients_per_round=12")
    one_block = build(compose_config("engine=inline", *small))
    assert len(one_block.data.train_blocks) == 1
    one_block.simulation.run()
    one_block.engine.close()
    monkeypatch.setattr(synthetic, "BLOCK_BYTES", 30_000)  # a block per chunk of devices (~8,192 rows)
    inline = build(compose_config("engine=inline", *small))
    inline.simulation.run()
    inline.engine.close()
    monkeypatch.setattr(experiment, "load_data", recording)
    exp = build(compose_config("engine=ray", "engine.num_workers=2", *small))
    try:
        gc.collect()
        assert len(own["refs"]) >= 5  # row blocks, and the labels
        assert [r() is None for r in own["refs"]] == [True] * len(own["refs"])  # the driver's own are gone
        data = exp.data
        for got, want in zip((*data.train_blocks, data.train_y), own["values"], strict=True):
            assert torch.equal(got, want)
        assert data.test_x is own["test"]
        assert np.array_equal(data.partition.indices, own["partition"][0])
        assert np.array_equal(data.partition.offsets, own["partition"][1])
        assert not data.partition.indices.flags.writeable  # the received arrays (Ray's read-only views)
        exp.simulation.run()
    finally:
        exp.engine.close()
    assert torch.equal(inline.simulation.server.weights, one_block.simulation.server.weights)
    assert float((exp.simulation.server.weights - inline.simulation.server.weights).abs().max()) <= 1e-6
    assert exp.simulation.history[-1]["test_accuracy"] == pytest.approx(inline.simulation.history[-1]["test_accuracy"])
