"""Random-k sparsification with indices from a seed every sender shares (summable).

The k = ceil(ratio * d) coordinates are drawn from the step key's shared stream (seed, step,
tensor), so all senders of a step pick the same set and only the k values travel (no indices);
payloads add element-wise. ``unbiased=True`` scales by d/k on decode, so E[decode] = x with
per-coordinate variance x_i^2 (d/k - 1); ``unbiased=False`` keeps the values as they are (biased,
pair it with error feedback).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from fl_platform.compression.base import NO_KEY, Compressor, Key, Payload, State, check_ratio


class RandomK(Compressor):
    name = "randomk"
    summable = True

    def __init__(self, ratio: float = 0.01, unbiased: bool = True) -> None:
        self.ratio = check_ratio(ratio)
        self.unbiased = bool(unbiased)

    def k(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def indices(self, numel: int, key: Key, device: torch.device | str = "cpu") -> torch.Tensor:
        """The shared coordinates of step ``key`` (identical for every sender)."""
        gen = key.generator(device, scope="step")
        return torch.randperm(numel, generator=gen, device=device)[: self.k(numel)]

    def encode(self, x: torch.Tensor, state: State | None = None, key: Key = NO_KEY) -> tuple[Payload, State]:
        flat = x.detach().reshape(-1)
        idx = self.indices(flat.numel(), key, flat.device)
        # The receiver needs the step key, not the sender: every sender's payload has the same one.
        shared = replace(key, sender=0)
        return Payload({"values": flat[idx].clone()}, tuple(x.shape), x.dtype, {"key": shared}), {}

    def decode(self, payload: Payload, state: State | None = None) -> torch.Tensor:
        values = payload.tensors["values"]
        n = payload.numel
        idx = self.indices(n, payload.meta["key"], values.device)
        out = torch.zeros(n, dtype=payload.dtype, device=values.device)
        scale = n / idx.numel() if self.unbiased else 1.0
        out[idx] = values.to(payload.dtype) * scale
        return out.view(payload.shape)

    def __repr__(self) -> str:
        return f"RandomK(ratio={self.ratio}, unbiased={self.unbiased})"
