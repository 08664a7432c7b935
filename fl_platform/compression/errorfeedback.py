"""Error feedback: compress x plus what earlier compressions left out, and remember the new remainder.

a = x + e;  payload = C(a);  e <- a - decode(payload)      (Seide et al. 2014; Stich et al. 2018)

The residual e is state passed in and returned (``state["residual"]``, flat), so it lives where the
caller keeps per-sender state: the client-state store in FL (one residual per client, applied when
that client is next sampled), one dict per worker and bucket in S-SGD. By construction
``residual + decode(payload) == x + old residual`` up to rounding. The residual is against the
sender's own decoded message; PowerSGD's all-reduce variant (EF against the global approximation)
is computed by the caller from ``PowerSGD.reconstruct``.
"""

from __future__ import annotations

from typing import Any

import torch

from fl_platform.compression.base import NO_KEY, Compressor, Key, Payload, State


class ErrorFeedback(Compressor):
    def __init__(self, inner: Compressor) -> None:
        if isinstance(inner, ErrorFeedback):
            raise ValueError("error feedback is already applied")
        self.inner = inner
        self.name = inner.name
        self.summable = inner.summable
        self.unbiased = False  # the residual makes the message depend on history

    def state_sizes(self, shape: tuple[int, ...]) -> dict[str, int]:
        return {"residual": int(torch.Size(shape).numel()), **self.inner.state_sizes(shape)}

    def init_state(self, shape: tuple[int, ...], key: Key, device: torch.device | str = "cpu") -> State:
        return {"residual": torch.zeros(int(torch.Size(shape).numel()), device=device),
                **self.inner.init_state(shape, key, device)}

    def _inner(self, state: State | None) -> State | None:
        if not state:
            return None
        inner = {k: v for k, v in state.items() if k != "residual"}
        return inner or None

    def encode(self, x: torch.Tensor, state: State | None = None, key: Key = NO_KEY,
               **options: Any) -> tuple[Payload, State]:
        """``options`` go to the inner compressor's ``encode`` (ACP-SGD's ``phase``)."""
        residual = (state or {}).get("residual")
        a = x.detach() if residual is None else x.detach() + residual.view(x.shape).to(x.dtype)
        payload, inner_state = self.inner.encode(a, self._inner(state), key, **options)
        new_residual = (a - self.inner.decode(payload, inner_state)).reshape(-1)
        return payload, {"residual": new_residual, **inner_state}

    def decode(self, payload: Payload, state: State | None = None) -> torch.Tensor:
        return self.inner.decode(payload, self._inner(state))

    def check_payload(self, payload: Payload) -> None:
        self.inner.check_payload(payload)

    def add(self, a: Payload, b: Payload) -> Payload:
        return self.inner.add(a, b)

    def after_aggregate(self, state: State, total: Payload, count: int) -> State:
        inner = self.inner.after_aggregate(self._inner(state) or {}, total, count)
        return {**state, **inner}

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.inner!r})"


def ef_encode(compressor: Compressor, x: torch.Tensor, residual: torch.Tensor | None,
              key: Key = NO_KEY) -> tuple[Payload, torch.Tensor]:
    """The plain contract ``encode(x, residual) -> (payload, new_residual)`` for a stateless compressor."""
    if compressor.state_sizes(tuple(x.shape)):
        raise ValueError(f"{compressor.name} keeps state besides the residual; use ErrorFeedback(...).encode")
    payload, state = ErrorFeedback(compressor).encode(x, None if residual is None else {"residual": residual}, key)
    return payload, state["residual"]
