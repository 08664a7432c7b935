"""Client state off and onto the device without stalls (fl_platform/state/transfer.py, issue 25 item 5):
the new state leaves the device when folded in; the next client's state is loaded on a background
thread while the current one trains. On CPU: same values, loaded once, errors surface by name."""

from __future__ import annotations

import threading

import pytest
import torch

from fl_platform.state.transfer import Prefetcher, offload


def _state(cid: int) -> dict[str, torch.Tensor]:
    return {"c": torch.full((4,), float(cid)), "r": torch.arange(3.0) + cid}


def test_offload_detaches_and_keeps_values():
    w = torch.ones(3, requires_grad=True)
    state = {"c": w * 2}
    out = offload(state, torch.device("cpu"))
    assert not out["c"].requires_grad and torch.equal(out["c"], torch.full((3,), 2.0))
    assert offload(None, torch.device("cpu")) is None


def test_prefetcher_loads_the_next_state_on_its_thread_once_and_in_any_order():
    loads: list[tuple[int, str]] = []
    release = threading.Event()

    def load(cid: int):
        loads.append((cid, threading.current_thread().name))
        if cid == 2:
            release.wait(5)  # still loading while the "current client" trains
        return _state(cid)

    pre = Prefetcher(load, torch.device("cpu"))
    try:
        pre.prefetch(1)
        pre.prefetch(2)
        pre.prefetch(1)  # already in flight: not loaded again
        first = pre.take(1)
        release.set()
        second = pre.take(2)
        third = pre.take(3)  # not prefetched: loaded now, on the caller's thread
    finally:
        pre.close()
    for cid, got in ((1, first), (2, second), (3, third)):
        for k, v in _state(cid).items():
            assert torch.equal(got[k], v)
    assert [c for c, _ in loads] == [1, 2, 3]
    assert all(name.startswith("state-prefetch") for c, name in loads if c in (1, 2))
    assert loads[2][1] == threading.current_thread().name


def test_prefetcher_surfaces_a_missing_state_by_name_at_take():
    def load(cid: int):
        raise KeyError(f"client {cid}: no state for round 3 (expected by the manifest)")

    pre = Prefetcher(load, torch.device("cpu"))
    try:
        pre.prefetch(7)
        with pytest.raises(KeyError, match="client 7: no state for round 3"):
            pre.take(7)
        pre.prefetch(8)
        pre.drop()  # a round that ends early forgets what it prefetched
        assert pre._pending == {}
    finally:
        pre.close()


# ---------------------------------------------------------------- wired into the worker

WORKER_RUN = ("dataset=digits", "num_clients=6", "clients_per_round=4", "rounds=2", "train.epochs=1",
              "train.batch_size=16", "save_model=false", "seed=3", "engine.threads_per_worker=1",
              "algorithm=scaffold")


def test_the_worker_offloads_each_new_state_at_its_fold_and_reads_through_the_prefetcher(monkeypatch):
    """Each client's new state is handed to ``offload`` as that client's update is folded in (before the
    next client trains), and what the store receives at round end is exactly what ``offload`` returned;
    during the round the store is read only on the prefetch thread, the next client ahead of its training."""
    from fl_platform.core import RoundContext
    from fl_platform.engine import worker as worker_mod
    from fl_platform.experiment import build

    from .conftest import compose_config

    exp = build(compose_config(*WORKER_RUN))
    exp.engine.close()
    events: list[tuple[str, int | None]] = []
    returned: dict[int, torch.Tensor] = {}

    def spy_offload(state, device):
        out = offload(state, device)
        events.append(("offload", None))
        returned.update({id(v): v for v in out.values()})
        return out

    monkeypatch.setattr(worker_mod, "offload", spy_offload)
    worker, server = worker_mod.Worker(0, exp.setup), exp.simulation.server
    train = worker.client.train

    def spy_train(ctx, cid, *args, **kwargs):
        events.append(("train", cid))
        return train(ctx, cid, *args, **kwargs)

    worker.client.train = spy_train
    get, put = worker.store.get, worker.store.put
    reads: list[tuple[int, str]] = []
    puts: list[dict[str, torch.Tensor]] = []
    monkeypatch.setattr(worker.store, "get", lambda cid: (reads.append((cid, threading.current_thread().name)),
                                                         get(cid))[1])
    monkeypatch.setattr(worker.store, "put", lambda cid, state: (puts.append(state), put(cid, state))[1])
    clients = [4, 1, 5, 0]
    try:
        for r in range(2):
            events.clear(), reads.clear(), puts.clear(), returned.clear()
            ctx = RoundContext(round=r, seed=3, clients=tuple(clients), num_rounds=2, num_clients=6)
            res = worker.run_round(ctx, server.broadcast(ctx), clients)
            server.aggregate(ctx, res.aggregate)
            assert events == [e for c in clients for e in (("train", c), ("offload", None))]
            assert len(puts) == len(clients)
            for state in puts:  # (the round stamp is added at round end)
                assert all(id(v) in returned for k, v in state.items() if k != "__round__")
            assert sorted(c for c, _ in reads) == sorted(clients)
            assert all(name.startswith("state-prefetch") for _, name in reads)
    finally:
        worker.close()
