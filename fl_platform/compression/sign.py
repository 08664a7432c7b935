"""Sign compressors: 1 bit per coordinate, bit-packed.

``Sign`` (signSGD): the message is sign(x), decoded as +-1 (a zero is sent as +1: one bit has no
room for 0). Use it with a small server/learning rate (Signum-style ~1e-4); averaging decoded
signs over senders is the "mean of signs" aggregate.

``ScaledSign`` (the EF-SignSGD compressor, Karimireddy et al. 2019): delta = (||x||_1 / d) sign(x),
with one float32 scale per tensor. Wrapped in :class:`ErrorFeedback` (``efsign`` in the
registry) it is EF-SignSGD: a = x + e, delta = C(a), e <- a - delta.

Neither is summable: packed bits cannot be added, and the scales differ by sender.
"""

from __future__ import annotations

import torch

from fl_platform.compression.base import NO_KEY, Compressor, Key, Payload, State
from fl_platform.compression.bitpack import pack_bits, unpack_bits


def _signs(payload: Payload) -> torch.Tensor:
    return 1.0 - 2.0 * unpack_bits(payload.tensors["signs"], payload.numel).to(torch.float32)


class Sign(Compressor):
    name = "sign"

    def encode(self, x: torch.Tensor, state: State | None = None, key: Key = NO_KEY) -> tuple[Payload, State]:
        return Payload({"signs": pack_bits(x.detach().reshape(-1) < 0)}, tuple(x.shape), x.dtype), {}

    def decode(self, payload: Payload, state: State | None = None) -> torch.Tensor:
        return _signs(payload).to(payload.dtype).view(payload.shape)


class ScaledSign(Compressor):
    name = "efsign"

    def encode(self, x: torch.Tensor, state: State | None = None, key: Key = NO_KEY) -> tuple[Payload, State]:
        flat = x.detach().reshape(-1)
        scale = (flat.abs().sum(dtype=torch.float32) / max(flat.numel(), 1)).reshape(1)
        return Payload({"signs": pack_bits(flat < 0), "scale": scale}, tuple(x.shape), x.dtype), {}

    def decode(self, payload: Payload, state: State | None = None) -> torch.Tensor:
        return (payload.tensors["scale"] * _signs(payload)).to(payload.dtype).view(payload.shape)
