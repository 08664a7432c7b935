"""PowerSGD (Vogels et al. 2019): rank-r approximation by one step of subspace iteration.

Each tensor is viewed as a matrix M (a x b; conv weights as out x in*kh*kw). Tensors with fewer
than two dimensions, or where (a + b) r * ``min_compression_rate`` >= a b, travel dense (as in
torch's hook). Two ways to use it:

* one sender, one message (FL uplink, tests): P = M Q, P^ = orth(P), Q' = M^T P^; the payload is
  (P^, Q'), 4 r (a + b) bytes, decoded as P^ Q'^T. With ``warm_start`` the next call starts from
  Q' (kept in the caller's state as ``q``). Such payloads are not summable.
* the all-reduce protocol (S-SGD), exposed step by step so collectives sit between them:
  ``p_step`` -> all-reduce(P) -> ``q_step`` -> all-reduce(Q) -> ``reconstruct``. Q is identical
  on every rank after its all-reduce, which keeps each step linear (summable). The error
  feedback of torch's hook is against the global approximation: E = M^ - reconstruct(...).

The initial Q comes from the key's ``init`` stream, identical for every sender.
"""

from __future__ import annotations

import math

import torch

from fl_platform.compression.base import (
    NO_KEY,
    Compressor,
    Key,
    Payload,
    State,
    decode_dense,
    dense_payload,
)


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of the matrix view of a tensor: the first dimension against the rest."""
    return (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else (1, math.prod(shape))


def orthonormalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``p``'s (reduced QR, at least float32: fp16 QR is unstable)."""
    dtype = torch.promote_types(p.dtype, torch.float32)
    q, _ = torch.linalg.qr(p.to(dtype), mode="reduced")
    return q


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


class LowRank(Compressor):
    """What PowerSGD and ACP-SGD share: rank, the dense fallback and the shared random factors."""

    def __init__(self, rank: int = 1, min_compression_rate: float = 2.0) -> None:
        if int(rank) < 1:
            raise ValueError(f"compressor.rank must be >= 1, got {rank}")
        if float(min_compression_rate) < 1.0:
            raise ValueError(f"compressor.min_compression_rate must be >= 1, got {min_compression_rate}")
        self.rank = int(rank)
        self.min_compression_rate = float(min_compression_rate)

    def compressible(self, shape: tuple[int, ...]) -> bool:
        if len(shape) < 2:
            return False
        a, b = matrix_shape(shape)
        return (a + b) * self.rank * self.min_compression_rate < a * b

    def random_factor(self, rows: int, key: Key, device: torch.device | str, scope: str = "init") -> torch.Tensor:
        return torch.randn(rows, self.rank, generator=key.generator(device, scope), device=device)

    def payload_nbytes(self, shape: tuple[int, ...], value_bytes: int = 4) -> int:
        """Bytes of one single-sender message (PowerSGD: P and Q; ACP-SGD overrides)."""
        if not self.compressible(shape):
            return value_bytes * math.prod(shape)
        a, b = matrix_shape(shape)
        return value_bytes * self.rank * (a + b)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, min_compression_rate={self.min_compression_rate})"


class PowerSGD(LowRank):
    name = "powersgd"

    def __init__(self, rank: int = 1, min_compression_rate: float = 2.0, warm_start: bool = True) -> None:
        super().__init__(rank, min_compression_rate)
        self.warm_start = bool(warm_start)

    def state_sizes(self, shape: tuple[int, ...]) -> dict[str, int]:
        if not (self.warm_start and self.compressible(shape)):
            return {}
        return {"q": matrix_shape(shape)[1] * self.rank}

    def init_state(self, shape: tuple[int, ...], key: Key, device: torch.device | str = "cpu") -> State:
        if not self.state_sizes(shape):
            return {}
        return {"q": self.random_factor(matrix_shape(shape)[1], key, device).reshape(-1)}

    def _query(self, shape: tuple[int, ...], state: State | None, key: Key, device) -> torch.Tensor:
        b = matrix_shape(shape)[1]
        if self.warm_start:
            q = (state or {}).get("q")
            if q is None:
                q = self.init_state(shape, key, device)["q"]
            return q.view(b, self.rank)
        return self.random_factor(b, key, device, scope="step")

    # -- one sender, one message ------------------------------------------------------------
    def encode(self, x: torch.Tensor, state: State | None = None, key: Key = NO_KEY) -> tuple[Payload, State]:
        shape = tuple(x.shape)
        if not self.compressible(shape):
            return dense_payload(x), {}
        m = self.matrix(x)
        q = self._query(shape, state, key, x.device).to(m.dtype)
        p_hat = orthonormalize(self.p_step(m, q))
        q_new = m.t() @ p_hat
        payload = Payload({"p": p_hat.to(torch.float32), "q": q_new.to(torch.float32)}, shape, x.dtype)
        return payload, ({"q": q_new.reshape(-1).to(torch.float32)} if self.warm_start else {})

    def decode(self, payload: Payload, state: State | None = None) -> torch.Tensor:
        if payload.meta.get("dense"):
            return decode_dense(payload)
        p, q = payload.tensors["p"], payload.tensors["q"]
        return (p @ q.t()).to(payload.dtype).view(payload.shape)

    # -- the all-reduce protocol (S-SGD) -----------------------------------------------------
    def matrix(self, x: torch.Tensor) -> torch.Tensor:
        """The a x b matrix view of ``x`` in the compute dtype (>= float32)."""
        return x.detach().reshape(matrix_shape(tuple(x.shape))).to(_compute_dtype(x))

    def p_step(self, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """P = M Q (all-reduce P next: it is linear in M for a Q shared by every rank)."""
        return m @ q

    def q_step(self, m: torch.Tensor, p_sum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(P^, Q = M^T P^) from the all-reduced P; all-reduce Q next."""
        p_hat = orthonormalize(p_sum).to(m.dtype)
        return p_hat, m.t() @ p_hat

    def reconstruct(self, p_hat: torch.Tensor, q_sum: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the averaged approximation P^ (Q_sum / count)^T, the next warm-start Q)."""
        q_mean = q_sum / count
        return p_hat @ q_mean.t(), q_mean
