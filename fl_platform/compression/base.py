"""The compressor interface shared by FL uplinks and the S-SGD gradient all-reduce.

A :class:`Compressor` turns one tensor into a :class:`Payload` (the tensors that really travel,
in their wire dtypes: float32 values, int32 indices, bit-packed ``uint8`` signs) and back. Its
size on the wire is exact: ``Payload.nbytes`` is the byte length of ``Payload.to_bytes()``.

Compressors hold no per-sender memory themselves. Whatever must persist between calls (an
error-feedback residual, PowerSGD's warm-start ``Q``, ACP-SGD's shared factors) is a
:data:`State` dict passed in and returned, so the caller decides where it lives: the client-state
store in FL, one dict per worker and bucket in S-SGD. ``state_sizes(shape)`` declares it.

``summable`` says that payloads from different senders, encoded with the same step key (and the
same shared state), can be added element-wise before decoding: ``decode(a + b) == decode(a) +
decode(b)``, so a ring all-reduce can carry them. The others must be gathered and decoded one by
one. Random draws come from a :class:`Key`, never from global RNG state.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from fl_platform.seeding import Stream, torch_generator

State = dict[str, torch.Tensor]

# Scopes of a random draw (see Key.generator); the integers keep the streams apart.
_SCOPES = {"sender": 0, "step": 1, "init": 2}


@dataclass(frozen=True)
class Key:
    """Where a compressor's random draws come from.

    ``seed`` is the run seed, ``step`` the FL round or S-SGD iteration, ``sender`` the client id or
    rank, ``tensor`` the position of the tensor (segment / bucket) being compressed. A draw that
    every sender must share (random-k indices, PowerSGD's initial ``Q``) ignores ``sender``.
    """

    seed: int = 0
    step: int = 0
    sender: int = 0
    tensor: tuple[int, ...] = ()

    def child(self, *index: int) -> Key:
        return replace(self, tensor=(*self.tensor, *index))

    def generator(self, device: torch.device | str = "cpu", scope: str = "sender") -> torch.Generator:
        """A fresh generator: ``sender`` (own per step), ``step`` (shared by all senders this step),
        ``init`` (shared by all senders and steps: initial low-rank factors)."""
        s = _SCOPES[scope]
        if scope == "sender":
            keys: tuple[int, ...] = (Stream.COMPRESSION, s, self.step, self.sender, *self.tensor)
        elif scope == "step":
            keys = (Stream.COMPRESSION, s, self.step, *self.tensor)
        else:
            keys = (Stream.COMPRESSION, s, *self.tensor)
        return torch_generator(self.seed, *keys, device=device)


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty((), dtype=dtype).numpy().dtype


NO_KEY = Key()


@dataclass
class Payload:
    """One compressed tensor as it travels.

    ``tensors`` is everything that goes on the wire. ``shape``/``dtype`` and ``meta`` are known to
    the receiver already (the model's layout, the compressor's config, the step key), so they
    are not counted in :attr:`nbytes`.
    """

    tensors: dict[str, torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Exact bytes on the wire (the length of :meth:`to_bytes`)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def to_bytes(self) -> bytes:
        """The wire format: each tensor's raw bytes, in name order, concatenated."""
        return b"".join(self.tensors[name].detach().contiguous().cpu().numpy().tobytes()
                        for name in sorted(self.tensors))

    def from_bytes(self, data: bytes) -> Payload:
        """Rebuild a payload of this one's layout from ``data`` (what the receiver does)."""
        out: dict[str, torch.Tensor] = {}
        pos = 0
        for name in sorted(self.tensors):
            t = self.tensors[name]
            n = t.numel() * t.element_size()
            if pos + n > len(data):
                raise ValueError(f"payload data ends inside tensor {name!r}")
            arr = np.frombuffer(data[pos:pos + n], dtype=_numpy_dtype(t.dtype)).copy()
            out[name] = torch.from_numpy(arr).view(t.shape).to(t.device)
            pos += n
        if pos != len(data):
            raise ValueError(f"payload data has {len(data) - pos} trailing bytes")
        return Payload(out, self.shape, self.dtype, dict(self.meta))

    def to(self, device: torch.device | str) -> Payload:
        return Payload({k: v.to(device) for k, v in self.tensors.items()}, self.shape, self.dtype, dict(self.meta))


def dense_payload(x: torch.Tensor) -> Payload:
    """A tensor sent as it is (BatchNorm buffers, tensors a compressor declines to compress)."""
    return Payload({"values": x.detach().reshape(-1).clone()}, tuple(x.shape), x.dtype, {"dense": True})


def decode_dense(payload: Payload) -> torch.Tensor:
    return payload.tensors["values"].view(payload.shape)


class Compressor(ABC):
    """Encode a tensor into a payload and decode it back (one tensor, any shape)."""

    name: str = "compressor"
    summable: bool = False  # payloads add element-wise before decoding (all-reduce compatible)
    unbiased: bool = False  # E[decode(encode(x))] = x over the key's random draws

    def state_sizes(self, shape: tuple[int, ...]) -> dict[str, int]:
        """Persistent state per tensor of this shape (flat sizes; besides any EF residual)."""
        return {}

    def init_state(self, shape: tuple[int, ...], key: Key, device: torch.device | str = "cpu") -> State:
        """The state before the first call (zeros unless a compressor needs shared random factors)."""
        return {name: torch.zeros(size, device=device) for name, size in self.state_sizes(shape).items()}

    @abstractmethod
    def encode(self, x: torch.Tensor, state: State | None = None, key: Key = NO_KEY) -> tuple[Payload, State]:
        """Compress ``x``; returns the payload and the new state (``{}`` when stateless)."""

    @abstractmethod
    def decode(self, payload: Payload, state: State | None = None) -> torch.Tensor:
        """The tensor the receiver reconstructs (``state``: the one ``encode`` returned)."""

    def check_payload(self, payload: Payload) -> None:
        """Refuse a payload from an untrusted sender (a deployment's client) that its layout admits but
        ``decode`` would misread (raise ValueError naming it); the server calls it once per reply, before
        decoding. The default has nothing to check: ``Payload.from_bytes`` checked the sizes."""

    def nbytes(self, payload: Payload) -> int:
        return payload.nbytes

    def add(self, a: Payload, b: Payload) -> Payload:
        """Sum two payloads without decoding (only for summable compressors)."""
        if not self.summable:
            raise TypeError(f"compressor {self.name!r} is not summable: decode each payload, then sum")
        if a.shape != b.shape or set(a.tensors) != set(b.tensors) or a.meta.get("key") != b.meta.get("key"):
            raise ValueError(f"{self.name}: payloads of different layouts or step keys cannot be summed")
        return Payload({k: a.tensors[k] + b.tensors[k] for k in a.tensors}, a.shape, a.dtype, dict(a.meta))

    def sum(self, payloads: Iterable[Payload]) -> Payload:
        it = iter(payloads)
        total = next(it)
        for p in it:
            total = self.add(total, p)
        return total

    def after_aggregate(self, state: State, total: Payload, count: int) -> State:
        """Update state that all senders share from the summed payload of ``count`` senders
        (ACP-SGD's factors); a no-op for the others."""
        return state

    def roundtrip(self, x: torch.Tensor, state: State | None = None, key: Key = NO_KEY
                  ) -> tuple[torch.Tensor, Payload, State]:
        """Encode then decode: (reconstruction, payload, new state)."""
        payload, new_state = self.encode(x, state, key)
        return self.decode(payload, new_state), payload, new_state

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def check_ratio(ratio: float, key: str = "ratio") -> float:
    ratio = float(ratio)
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"compressor.{key} must be in (0, 1], got {ratio}")
    return ratio
