"""Top-k sparsification: keep the k = ceil(ratio * d) largest magnitudes (biased; pair with EF).

The indices travel as int32 (int64 beyond 2**31 coordinates) or as a d-bit bitmap, whichever
``index`` asks for; ``auto`` picks the smaller (the bitmap wins once ratio > 1/32). With a bitmap
the values are sent in index order. Payloads are not summable: index sets differ by sender, so
an all-reduce would need all-gather, scatter-add (what ``decode`` then a sum does).
"""

from __future__ import annotations

import math

import torch

from fl_platform.compression.base import NO_KEY, Compressor, Key, Payload, State, check_ratio
from fl_platform.compression.bitpack import pack_bits, packed_size, unpack_bits

INDEX_FORMATS = ("int32", "bitmap", "auto")
_INT32_MAX = 2**31 - 1


class TopK(Compressor):
    name = "topk"

    def __init__(self, ratio: float = 0.01, index: str = "auto") -> None:
        self.ratio = check_ratio(ratio)
        if index not in INDEX_FORMATS:
            raise ValueError(f"compressor.index must be one of {', '.join(INDEX_FORMATS)}; got {index!r}")
        self.index = index

    def k(self, numel: int) -> int:
        return min(numel, max(1, math.ceil(self.ratio * numel)))

    def _index_bytes(self, numel: int) -> int:
        return 4 if numel <= _INT32_MAX else 8

    def index_format(self, numel: int) -> str:
        """``int32`` (also meaning int64 for huge tensors) or ``bitmap`` for a tensor of ``numel``."""
        if self.index != "auto":
            return self.index
        return "bitmap" if packed_size(numel) < self._index_bytes(numel) * self.k(numel) else "int32"

    def payload_nbytes(self, numel: int, value_bytes: int = 4) -> int:
        """The exact payload size for a tensor of ``numel`` elements (for planning budgets)."""
        k = self.k(numel)
        if self.index_format(numel) == "bitmap":
            return value_bytes * k + packed_size(numel)
        return (value_bytes + self._index_bytes(numel)) * k

    def encode(self, x: torch.Tensor, state: State | None = None, key: Key = NO_KEY) -> tuple[Payload, State]:
        flat = x.detach().reshape(-1)
        n = flat.numel()
        k = self.k(n)
        idx, _ = flat.abs().topk(k, sorted=False).indices.sort()  # ascending: a bitmap's order too
        if self.index_format(n) == "bitmap":
            mask = torch.zeros(n, dtype=torch.bool, device=flat.device)
            mask[idx] = True
            # (values gathered by index, not flat[mask]: a boolean mask's result size is read back from a GPU)
            tensors = {"values": flat[idx], "bitmap": pack_bits(mask)}
        else:
            dtype = torch.int32 if n <= _INT32_MAX else torch.int64
            tensors = {"values": flat[idx], "indices": idx.to(dtype)}
        return Payload(tensors, tuple(x.shape), x.dtype, {"k": k}), {}

    def check_payload(self, payload: Payload) -> None:
        """Indices in range and ascending (a negative one would wrap to the end, a repeated one be written
        twice), or a bitmap with one bit per value: what ``decode`` assumes of its own encoder's output."""
        count = payload.tensors["values"].numel()
        if "bitmap" in payload.tensors:
            kept = int(unpack_bits(payload.tensors["bitmap"], payload.numel).sum())
            if kept != count:
                raise ValueError(f"top-k bitmap marks {kept} coordinates for {count} values")
            return
        idx = payload.tensors["indices"].to(torch.int64)
        if idx.numel() != count:
            raise ValueError(f"top-k payload has {idx.numel()} indices for {count} values")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= payload.numel):
            raise ValueError(f"top-k indices must lie in [0, {payload.numel}), got {int(idx.min())}..{int(idx.max())}")
        if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise ValueError("top-k indices must be strictly ascending (as the encoder sends them)")

    def indices(self, payload: Payload) -> torch.Tensor:
        """The kept coordinates (int64, ascending)."""
        if "bitmap" in payload.tensors:
            return unpack_bits(payload.tensors["bitmap"], payload.numel).nonzero().squeeze(1)
        return payload.tensors["indices"].to(torch.int64)

    def mask(self, payload: Payload) -> torch.Tensor:
        """Bool mask of the kept coordinates, flat (what BAOW's overlap weights count)."""
        if "bitmap" in payload.tensors:
            return unpack_bits(payload.tensors["bitmap"], payload.numel)
        m = torch.zeros(payload.numel, dtype=torch.bool, device=payload.tensors["values"].device)
        m[self.indices(payload)] = True
        return m

    def decode(self, payload: Payload, state: State | None = None) -> torch.Tensor:
        """Scatter the values back. A bitmap is decoded without ``nonzero`` (whose result size a GPU would
        have to report to the host, once per tensor per S-SGD step): a kept coordinate's value is the one
        at its rank among the kept ones, the bitmap's running count."""
        values = payload.tensors["values"].to(payload.dtype)
        if "bitmap" in payload.tensors:
            mask = unpack_bits(payload.tensors["bitmap"], payload.numel)
            rank = mask.cumsum(0).sub_(1).clamp_(min=0)
            return torch.where(mask, values[rank], torch.zeros((), dtype=payload.dtype, device=values.device)
                               ).view(payload.shape)
        out = torch.zeros(payload.numel, dtype=payload.dtype, device=values.device)
        out[self.indices(payload)] = values
        return out.view(payload.shape)

    def __repr__(self) -> str:
        return f"TopK(ratio={self.ratio}, index={self.index!r})"
