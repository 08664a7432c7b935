"""Identity: the tensor travels uncompressed (the reference for bytes and error; summable)."""

from __future__ import annotations

import torch

from fl_platform.compression.base import NO_KEY, Compressor, Key, Payload, State, decode_dense, dense_payload


class Identity(Compressor):
    name = "identity"
    summable = True
    unbiased = True

    def encode(self, x: torch.Tensor, state: State | None = None, key: Key = NO_KEY) -> tuple[Payload, State]:
        return dense_payload(x), {}

    def decode(self, payload: Payload, state: State | None = None) -> torch.Tensor:
        return decode_dense(payload)
