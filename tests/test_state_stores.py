"""Client-state stores: memory, disk (write-behind LRU, atomic files, two-phase checkpoints), distributed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from fl_platform.algorithms.base import StateSpec
from fl_platform.state import DiskStore, DistributedStore, MemoryStore, home_worker, make_store
from fl_platform.state.distributed import lending_plan

SPECS = {"c": StateSpec(6), "m": StateSpec(3, torch.float64)}


def state(v: float) -> dict[str, torch.Tensor]:
    return {"c": torch.full((6,), v), "m": torch.full((3,), 2 * v, dtype=torch.float64)}


def value(st: dict[str, torch.Tensor] | None) -> float | None:
    return None if st is None else float(st["c"][0])


@pytest.fixture(params=["memory", "disk"])
def store(request, tmp_path):
    s = make_store(request.param, SPECS, directory=tmp_path / "s", cache_mb=0.0001)
    yield s
    s.close()


def test_get_put_roundtrip_and_isolation(store):
    assert store.get(3) is None
    store.put(3, state(1.5))
    got = store.get(3)
    assert torch.equal(got["c"], torch.full((6,), 1.5)) and got["m"].dtype == torch.float64
    got["c"].add_(100)  # the caller's copy: the stored state must not change
    assert value(store.get(3)) == 1.5


def test_rejects_undeclared_or_missized_state(store):
    with pytest.raises(KeyError, match="not declared"):
        store.put(0, {"zz": torch.zeros(6)})
    with pytest.raises(ValueError, match="elements"):
        store.put(0, {"c": torch.zeros(5), "m": torch.zeros(3)})


def test_disk_cache_is_bounded_and_writes_behind(tmp_path):
    s = DiskStore(SPECS, tmp_path, cache_mb=3 * 56 / 2**20)  # room for 3 states of 56 bytes
    assert s.capacity == 3
    for c in range(10):
        s.put(c, state(c))
    assert len(s._cache) == 3 and s.writes == 7  # the 7 least recently used went to disk
    assert all(value(s.get(c)) == c for c in range(10))
    s.flush()
    reopened = DiskStore(SPECS, tmp_path)
    assert [value(reopened.get(c)) for c in range(10)] == list(range(10))
    assert len(reopened) == 10
    assert not list(tmp_path.rglob("*.tmp"))


def test_disk_two_phase_checkpoint_and_restore(tmp_path):
    s = DiskStore(SPECS, tmp_path)
    s.put(1, state(1.0))
    s.put(2, state(2.0))
    s.checkpoint(tmp_path, round=2)  # phase 1: pending -> committing-2
    assert (tmp_path / "committing-00000002").is_dir()
    s.commit(2)  # phase 2: into base
    assert not (tmp_path / "committing-00000002").exists() and (tmp_path / "base").is_dir()
    s.put(1, state(10.0))  # written after the checkpoint...
    s.put(3, state(3.0))
    s.flush()
    fresh = DiskStore(SPECS, tmp_path)  # ...so a resume from round 2 must not see them
    fresh.restore(tmp_path, 2)
    assert [value(fresh.get(c)) for c in (1, 2, 3)] == [1.0, 2.0, None]


def test_disk_restore_finishes_an_interrupted_commit_and_drops_a_later_one(tmp_path):
    s = DiskStore(SPECS, tmp_path)
    s.put(1, state(1.0))
    s.checkpoint(tmp_path, round=4)  # killed before commit(4), after LATEST was published
    s.put(1, state(5.0))
    s.checkpoint(tmp_path, round=6)  # killed before LATEST named round 6
    fresh = DiskStore(SPECS, tmp_path)
    assert value(fresh.get(1)) == 5.0  # a live run reads its newest write
    fresh.restore(tmp_path, 4)
    assert value(fresh.get(1)) == 1.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base"]
    fresh.restore(tmp_path, None)  # no checkpoint at all: empty
    assert fresh.get(1) is None


def test_disk_staged_round_is_invisible_until_applied(tmp_path):
    s = DiskStore(SPECS, tmp_path)
    s.put(7, state(1.0))
    s.flush()
    s.stage(0, {7: state(2.0)}, tag="-w0")
    assert value(s.get(7)) == 1.0  # a rerun of the round still reads the old state
    other = DiskStore(SPECS, tmp_path)  # a restarted worker completes the round from the staged copy
    assert other.apply_staged(0, tag="-w0") == 1
    assert other.apply_staged(0, tag="-w0") == 0  # idempotent
    assert value(other.get(7)) == 2.0


def test_disk_file_size_mismatch_is_a_clear_error(tmp_path):
    s = DiskStore(SPECS, tmp_path)
    s.put(1, state(1.0))
    s.flush()
    other = DiskStore({"c": StateSpec(7)}, tmp_path)
    with pytest.raises(ValueError, match="different algorithm or model"):
        other.get(1)


def test_disk_atomic_write_leaves_old_file_on_failure(tmp_path, monkeypatch):
    s = DiskStore(SPECS, tmp_path, cache_mb=0)
    s.put(1, state(1.0))
    s.flush()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    s.put(1, state(2.0))
    with pytest.raises(OSError, match="disk full"):
        s.flush()
    monkeypatch.undo()
    assert value(DiskStore(SPECS, tmp_path).get(1)) == 1.0


def test_memory_store_checkpoint_restore(tmp_path):
    s = MemoryStore(SPECS)
    s.put(4, state(4.0))
    s.checkpoint(tmp_path, 1)
    s.put(4, state(9.0))
    s.restore(tmp_path, 1)
    assert value(s.get(4)) == 4.0
    s.restore(None, None)
    assert len(s) == 0


@pytest.mark.parametrize("backend", ["memory", "disk"])
def test_distributed_lending_protocol(tmp_path, backend):
    w = 3
    homes = [DistributedStore.create(SPECS, worker_id=i, num_workers=w, backend=backend, directory=tmp_path)
             for i in range(w)]
    for cid in range(9):
        homes[home_worker(cid, w)].put(cid, state(cid))
    assignment = [[1, 2], [0, 4], [3, 5, 6, 7, 8]]
    plan = lending_plan(assignment, w)
    assert plan[2][0] == [2] and plan[1][0] == [1] and plan[0][1] == [0]
    outboxes = []
    for trainer, clients in enumerate(assignment):
        lent: dict = {}
        for home in range(w):
            lent.update(homes[home].export(plan[home][trainer]))
        homes[trainer].begin_round(lent)
        for cid in clients:
            st = homes[trainer].get(cid)
            homes[trainer].put(cid, {k: v + 100 for k, v in st.items()})
        outboxes.append(homes[trainer].end_round())
    for home in homes:
        home.import_states({c: s for box in outboxes for c, s in box.items() if home.is_home(c)})
    for cid in range(9):
        assert value(homes[home_worker(cid, w)].get(cid)) == cid + 100
    with pytest.raises(KeyError, match="lives on worker"):
        homes[0].get(1)  # not lent outside a round


def test_make_store_unknown_kind_names_the_key():
    with pytest.raises(ValueError, match=r"engine\.state_store.*memory, disk, distributed"):
        make_store("s3", SPECS)


def test_disk_store_memory_is_bounded_for_many_clients(tmp_path):
    """10,000 clients through a 64-state cache: RAM holds 64 states, the rest is files."""
    specs = {"c": StateSpec(256)}
    s = DiskStore(specs, tmp_path, cache_mb=64 * 1024 / 2**20)
    for c in range(10_000):
        s.put(c, {"c": torch.full((256,), float(c))})
    assert len(s._cache) == 64
    s.flush()
    assert sum(1 for _ in Path(tmp_path, "pending").glob("*/*.bin")) == 10_000
    assert max(len(list(d.iterdir())) for d in Path(tmp_path, "pending").iterdir()) <= 1000
    assert float(s.get(9_999)["c"][0]) == 9_999.0 and float(s.get(0)["c"][0]) == 0.0
