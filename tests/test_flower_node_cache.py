"""The SuperNode's disk cache of its client's prepared settings and data (fl_platform/flower/node_cache.py).

In-process and cheap: the keying through the ClientApp's ``prepared_for`` (a counting stand-in for
``_prepare``), corrupt and stale entries, eviction, the folder's safety, one real ``build_runtime`` on
digits (the entry holds the client's own rows only) and the ClientApp's lazy imports.
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fl_platform.flower import client_app as ca
from fl_platform.flower.node_cache import MAGIC, CacheKey, CacheUnusable, NodeCache

RUN = {"rounds": 3, "seed": 0, "dataset.name": "digits", "num_clients": 3}


@pytest.fixture
def builds(monkeypatch):
    """``_prepare`` replaced by a stand-in that records each build and returns what it was built from."""
    calls: list[tuple[int, int]] = []

    def fake(run_config, node):
        calls.append((run_config["seed"], node.partition_id))
        return {"seed": run_config["seed"], "partition": node.partition_id}

    monkeypatch.setattr(ca, "_prepare", fake)
    return calls


def prepared(run: dict, partition: int, folder: Path, **node) -> tuple[dict, str]:
    node_config = {"partition-id": partition, "num-partitions": 3, "cache-dir": str(folder), **node}
    return ca.prepared_for(run, node_config, ca.NodeSettings.from_node_config(node_config))


def test_a_hit_after_the_first_build_and_a_miss_when_config_or_partition_change(tmp_path, builds):
    folder = tmp_path / "node"
    assert prepared(RUN, 0, folder) == ({"seed": 0, "partition": 0}, "miss")
    assert prepared(RUN, 0, folder) == ({"seed": 0, "partition": 0}, "hit")
    assert builds == [(0, 0)]
    # another run config (a second run on this node) and another partition are other entries
    assert prepared({**RUN, "seed": 1}, 0, folder) == ({"seed": 1, "partition": 0}, "miss")
    assert prepared(RUN, 1, folder) == ({"seed": 0, "partition": 1}, "miss")
    # ... which do not replace the first: both runs keep their own entry on the shared node
    assert prepared(RUN, 0, folder) == ({"seed": 0, "partition": 0}, "hit")
    assert prepared({**RUN, "seed": 1}, 0, folder) == ({"seed": 1, "partition": 0}, "hit")
    assert builds == [(0, 0), (1, 0), (0, 1)]
    # cache-entries=0 switches the cache off: built every time
    assert prepared(RUN, 0, folder, **{"cache-entries": 0}) == ({"seed": 0, "partition": 0}, "off")
    assert builds[-1] == (0, 0) and len(builds) == 4


def test_the_default_folder_is_the_nodes_own_under_flwr_home(tmp_path, builds, monkeypatch):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr"))
    for partition in (0, 1):
        node_config = {"partition-id": partition, "num-partitions": 3}
        ca.prepared_for(RUN, node_config, ca.NodeSettings.from_node_config(node_config))
    folders = sorted((tmp_path / "flwr" / ca.CACHE_FOLDER).iterdir())
    assert len(folders) == 2 and all(len(list(f.glob("*.entry"))) == 1 for f in folders)
    assert all(oct(f.stat().st_mode & 0o777) == "0o700" for f in folders)


def test_old_entries_are_evicted(tmp_path, builds):
    folder = tmp_path / "node"
    for seed in range(4):
        prepared({**RUN, "seed": seed}, 0, folder, **{"cache-entries": 2})
    assert len(list(folder.glob("*.entry"))) == 2
    assert prepared({**RUN, "seed": 3}, 0, folder, **{"cache-entries": 2})[1] == "hit"
    assert prepared({**RUN, "seed": 0}, 0, folder, **{"cache-entries": 2})[1] == "miss"


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_a_corrupt_entry_is_rebuilt_with_a_log_line(tmp_path, caplog, damage):
    cache = NodeCache(tmp_path / "node")
    key = CacheKey.of(what="x")
    cache.get_or_build(key, lambda: torch.arange(1000))
    path = cache.path(key)
    blob = bytearray(path.read_bytes())
    if damage == "flip":
        blob[len(blob) // 2] ^= 0xFF
    elif damage == "truncate":
        blob = blob[: len(blob) // 2]
    else:
        blob = bytearray(MAGIC + b"\0" * 40)
    path.write_bytes(bytes(blob))
    assert cache.load(key)[0] == "corrupt"
    with caplog.at_level(logging.WARNING, logger="flwr.fl_platform.node_cache"):
        value = cache.get_or_build(key, lambda: torch.arange(1000) * 2)
    assert cache.last.outcome == "corrupt" and "corrupt" in caplog.text and "rebuilding" in caplog.text
    assert torch.equal(value, torch.arange(1000) * 2)
    assert cache.load(key)[0] == "hit"


def test_an_entry_is_stale_when_a_data_file_it_read_changes(tmp_path, caplog):
    data = tmp_path / "data.bin"
    data.write_bytes(b"12345")
    cache = NodeCache(tmp_path / "node")
    key = CacheKey.of(what="data")
    read = lambda: data.read_bytes()  # noqa: E731 - the build reads the file: recorded, then watched
    assert cache.get_or_build(key, read) == b"12345"
    assert cache.get_or_build(key, read) == b"12345" and cache.last.outcome == "hit"
    data.write_bytes(b"123456")
    with caplog.at_level(logging.WARNING, logger="flwr.fl_platform.node_cache"):
        assert cache.get_or_build(key, read) == b"123456"
    assert cache.last.outcome == "stale" and "data.bin" in caplog.text


def test_a_folder_others_can_write_is_refused(tmp_path, builds):
    folder = tmp_path / "shared"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(CacheUnusable, match="writable by others"):
        NodeCache(folder)
    assert prepared(RUN, 0, folder)[1] == "off"  # the ClientApp goes on without a cache (logged)


@pytest.mark.slow
def test_the_entry_holds_the_clients_own_rows_only(tmp_path):
    """A real build on digits: the cached dataset is client 1's rows, in the simulator's order, no test set;
    the next build is a hit with the same data."""
    from fl_platform.datasets.federated import build_federated_dataset
    from fl_platform.flower import config as fc

    run_config = fc.flatten_config(fc.compose(["num_clients=3", "clients_per_round=3", "rounds=2", "partition=iid"]),
                                   fc.DeployConf())
    node_config = {"partition-id": 1, "num-partitions": 3, "threads": 1, "cache-dir": str(tmp_path / "node")}
    threads = torch.get_num_threads()
    try:
        miss = ca.build_runtime(run_config, node_config)
        hit = ca.build_runtime(run_config, node_config)
    finally:
        torch.set_num_threads(threads)
    assert (miss.cache, hit.cache) == ("miss", "hit")
    full = build_federated_dataset("digits", num_clients=3, partition_name="iid", seed=0)
    x, y = full.client_data(1)
    (entry,) = (tmp_path / "node").glob("*.entry")
    stored = pickle.loads(entry.read_bytes()[16:])["value"].setup.dataset
    assert stored.test_x is None and stored.num_clients == 1
    for rows in (stored.train_x, hit.data.x, miss.data.x):
        assert torch.equal(rows, x)
    assert torch.equal(stored.train_y, y) and torch.equal(hit.data.y, y)
    assert x.shape[0] < full.num_train / 2
    assert entry.stat().st_size < x.nbytes + y.nbytes + 200_000  # its rows and the settings, nothing else


def test_the_client_app_imports_no_torch_or_config_code_at_load():
    """A node answers Flower's identify query (and loads the app each round) without torch, Hydra or the
    experiment code: they are imported when a train message comes."""
    code = ("import sys, fl_platform.flower.client_app as ca; assert ca.IDENTIFY_QUERY == 'identify'; "
            "print(sorted(m for m in ('torch', 'omegaconf', 'hydra', 'fl_platform.experiment', "
            "'fl_platform.config', 'fl_platform.flower.records') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
    from fl_platform.flower.records import IDENTIFY

    assert f"query.{ca.IDENTIFY_QUERY}" == IDENTIFY
