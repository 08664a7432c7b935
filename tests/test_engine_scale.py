"""Scale: 10,000 registered clients cost two partition arrays, not 10,000 objects; a stateful
algorithm's states live on disk behind a bounded cache."""

from __future__ import annotations

import numpy as np

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
