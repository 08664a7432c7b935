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
