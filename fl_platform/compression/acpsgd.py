"""ACP-SGD (Zhang et al., ICDCS 2023): PowerSGD with alternating P and Q steps, one all-reduce each.

State shared by every sender: factors P (a x r), Q (b x r) and a step counter. On an even step
(P-step) Q <- orth(Q) and each sender sends P_i = M_i Q; on an odd step (Q-step) P <- orth(P) and
each sender sends Q_i = M_i^T P. The factor that is not sent is identical everywhere (it came out
of the previous aggregation), so decode is linear in the payload and payloads are summable:
decode(sum_i P_i) = (sum_i P_i) Q^T. After the all-reduce, :meth:`after_aggregate` stores the
mean of the sent factor and flips the step. Error feedback, when wanted, is local
(E_i = M_i^ - decode(own payload)), as in the paper's code: wrap in :class:`ErrorFeedback`.

Tensors PowerSGD would not compress travel dense. The initial P and Q come from the key's
``init`` stream, identical for every sender (the reference code's "check: set seed" note).
"""

from __future__ import annotations

import torch

from fl_platform.compression.base import NO_KEY, Key, Payload, State, decode_dense, dense_payload
from fl_platform.compression.powersgd import LowRank, matrix_shape, orthonormalize


class ACPSGD(LowRank):
    name = "acpsgd"
    summable = True

    def state_sizes(self, shape: tuple[int, ...]) -> dict[str, int]:
        if not self.compressible(shape):
            return {}
        a, b = matrix_shape(shape)
        return {"p": a * self.rank, "q": b * self.rank, "step": 1}

    def init_state(self, shape: tuple[int, ...], key: Key, device: torch.device | str = "cpu") -> State:
        if not self.compressible(shape):
            return {}
        a, b = matrix_shape(shape)
        return {"p": self.random_factor(a, key.child(0), device).reshape(-1),
                "q": self.random_factor(b, key.child(1), device).reshape(-1),
                "step": torch.zeros(1, device=device)}

    def payload_nbytes(self, shape: tuple[int, ...], value_bytes: int = 4, phase: str = "p") -> int:
        if not self.compressible(shape):
            return value_bytes * int(torch.Size(shape).numel())
        a, b = matrix_shape(shape)
        return value_bytes * self.rank * (a if phase == "p" else b)

    def encode(self, x: torch.Tensor, state: State | None = None, key: Key = NO_KEY,
               phase: str | None = None) -> tuple[Payload, State]:
        """``phase`` ("p" or "q"), when the caller counts the steps itself (:class:`ACPSGDSync` does, on the
        host): the state's counter is then not read, a read that would make the host wait for the device
        once per tensor per step. Left out, it is read from the state (tests, one-off calls)."""
        if phase not in (None, "p", "q"):
            raise ValueError(f"acpsgd: phase must be 'p' or 'q', got {phase!r}")
        shape = tuple(x.shape)
        if not self.compressible(shape):
            return dense_payload(x), {}
        st = state if state else self.init_state(shape, key, x.device)
        a, b = matrix_shape(shape)
        m = x.detach().reshape(a, b).to(torch.promote_types(x.dtype, torch.float32))
        p, q, step = st["p"].view(a, self.rank), st["q"].view(b, self.rank), st["step"]
        if phase is None:
            phase = "p" if int(step.item()) % 2 == 0 else "q"
        if phase == "p":
            q = orthonormalize(q).to(m.dtype)
            payload = Payload({"p": (m @ q).to(torch.float32)}, shape, x.dtype, {"phase": "p"})
        else:
            p = orthonormalize(p).to(m.dtype)
            payload = Payload({"q": (m.t() @ p).to(torch.float32)}, shape, x.dtype, {"phase": "q"})
        new_state = {"p": p.reshape(-1).to(torch.float32), "q": q.reshape(-1).to(torch.float32),
                     "step": step.clone()}
        return payload, new_state

    def decode(self, payload: Payload, state: State | None = None) -> torch.Tensor:
        if payload.meta.get("dense"):
            return decode_dense(payload)
        if not state:
            raise ValueError("acpsgd: decode needs the state encode returned (the factor that was not sent)")
        a, b = matrix_shape(payload.shape)
        if "p" in payload.tensors:
            out = payload.tensors["p"] @ state["q"].view(b, self.rank).t()
        else:
            out = state["p"].view(a, self.rank) @ payload.tensors["q"].t()
        return out.to(payload.dtype).view(payload.shape)

    def add(self, a: Payload, b: Payload) -> Payload:
        if a.meta.get("phase") != b.meta.get("phase"):
            raise ValueError("acpsgd: a P-step payload cannot be added to a Q-step payload")
        return super().add(a, b)

    def after_aggregate(self, state: State, total: Payload, count: int) -> State:
        if total.meta.get("dense") or not state:
            return state
        new = dict(state)
        name = "p" if "p" in total.tensors else "q"
        new[name] = (total.tensors[name] / count).reshape(-1).to(torch.float32)
        new["step"] = state["step"] + 1
        return new
