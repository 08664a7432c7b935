"""Client state between the store (host memory or disk) and the training device, without stalls.

Two moves per stateful client (SCAFFOLD's control variate, FedDyn's gradient state, an error-feedback
residual: on ResNet-18 45 MB each), both off the device's critical path:

* :func:`offload`: a client's new state leaves the device as soon as its update is folded in (not at
  round end, where a round's states would all sit on the device, outside the cohort memory budget):
  on CUDA, non-blocking copies into pinned host buffers, which the worker's per-client synchronisation
  completes before anything reads them.
* :class:`Prefetcher`: while one client trains, the next client's state is read from the store (a
  disk read for ``engine.state_store=disk``) on a background thread and copied to the device from
  pinned memory on a side CUDA stream; ``take`` hands it over, ordered after the copy on the
  training stream. Pinned memory is used only when CUDA is available.

Values are unchanged (copies only), so results do not depend on whether or when a state was prefetched.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from fl_platform.state.store import State


def offload(state: State | None, device: torch.device) -> State | None:
    """``state`` on the host: from a CUDA device by non-blocking copies into pinned memory (complete
    after the device's next synchronisation); detached tensors otherwise (CPU states stay as they are)."""
    if state is None:
        return None
    if device.type != "cuda":
        return {k: v.detach() for k, v in state.items()}
    out = {}
    for k, v in state.items():
        host = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
        host.copy_(v.detach(), non_blocking=True)
        out[k] = host
    return out


class Prefetcher:
    """Loads client states ahead of their training, one client in flight at a time.

    ``load(client_id)`` returns the client's host state (or None, or raises: the error surfaces from
    ``take``, so a missing or stale state still stops the run by name). ``prefetch(cid)`` starts the
    load and, on CUDA, the copy to ``device``; ``take(cid)`` returns the state on ``device``, prefetched
    or loaded now. ``load`` runs on one background thread: it must not be called from elsewhere
    meanwhile (the worker loads every state through this object).
    """

    def __init__(self, load: Callable[[int], State | None], device: torch.device) -> None:
        self.load = load
        self.device = torch.device(device)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-prefetch")
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pending: dict[int, Future] = {}

    def prefetch(self, client_id: int) -> None:
        if client_id not in self._pending:
            self._pending[client_id] = self._pool.submit(self._fetch, client_id)

    def take(self, client_id: int) -> State | None:
        future = self._pending.pop(client_id, None)
        state, event = future.result() if future is not None else self._fetch(client_id)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
            for t in state.values():  # (the side stream's memory is now used on the training stream)
                t.record_stream(torch.cuda.current_stream(self.device))
        return state

    def drop(self) -> None:
        """Forget prefetched states not taken (the round ended early, or its client list changed). A load
        already running is waited for (its result discarded): the caller may write the store next."""
        for future in self._pending.values():
            if not future.cancel():
                wait([future])
        self._pending.clear()

    def close(self) -> None:
        self.drop()
        self._pool.shutdown(wait=True)

    def _fetch(self, client_id: int) -> tuple[State | None, torch.cuda.Event | None]:
        state = self.load(client_id)
        if state is None or self.device.type == "cpu":
            return state, None
        if self._stream is None:
            return {k: v.to(self.device) for k, v in state.items()}, None
        with torch.cuda.stream(self._stream):
            moved = {k: (v if v.is_pinned() else v.pin_memory()).to(self.device, non_blocking=True)
                     for k, v in state.items()}
            event = torch.cuda.Event()
            event.record(self._stream)
        return moved, event
