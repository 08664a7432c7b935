"""Bit packing for payloads: signs and top-k bitmaps at 1 bit per coordinate, QSGD levels at b bits.

Packing is little-endian within each byte (element ``i`` is bit ``i % 8`` of byte ``i // 8``), so a
packed tensor is exactly ``ceil(n * bits / 8)`` bytes of ``uint8`` and its size on the wire is its
``numel()``. Everything is vectorised torch code that runs on the tensor's device.
"""

from __future__ import annotations

import torch

_WEIGHTS: dict[torch.device, torch.Tensor] = {}


def _bit_weights(device: torch.device) -> torch.Tensor:
    w = _WEIGHTS.get(device)
    if w is None:
        w = _WEIGHTS[device] = (2 ** torch.arange(8, device=device)).to(torch.uint8)
    return w


def packed_size(n: int, bits: int = 1) -> int:
    """Bytes that ``n`` values of ``bits`` bits each occupy once packed."""
    return (n * bits + 7) // 8


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Pack a bool (or 0/1) tensor of any shape, flattened, into ``uint8`` (8 per byte)."""
    flat = bits.reshape(-1).to(torch.uint8)
    n = flat.numel()
    pad = (-n) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8) * _bit_weights(flat.device)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` bits of ``packed`` as a bool tensor (inverse of :func:`pack_bits`)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed bits must be uint8, got {packed.dtype}")
    if packed.numel() < packed_size(n):
        raise ValueError(f"{packed.numel()} packed bytes hold fewer than n={n} bits")
    bits = packed.reshape(-1, 1).bitwise_and(_bit_weights(packed.device)).ne(0)
    return bits.reshape(-1)[:n]


def pack_uint(values: torch.Tensor, bits: int, checked: bool = True) -> torch.Tensor:
    """Pack non-negative integers below ``2**bits`` into ``bits`` bits each (``uint8`` output).

    The range check reads the values' min and max back to the host (a GPU stall); a caller whose
    values lie in range by construction passes ``checked=False`` and says why (QSGD's levels, once
    per segment per S-SGD step). The packing is the same either way; out-of-range values would not
    round-trip.
    """
    if not 1 <= bits <= 16:
        raise ValueError(f"bits must be in 1..16, got {bits}")
    v = values.reshape(-1)
    if checked and v.numel() and (int(v.min()) < 0 or int(v.max()) >= 2**bits):
        raise ValueError(f"values must lie in [0, {2**bits}) to fit {bits} bits")
    if 8 % bits == 0:  # whole values per byte: one shift-and-sum (the same bit layout, much faster)
        per = 8 // bits
        u = v.to(torch.uint8)
        pad = (-u.numel()) % per
        if pad:
            u = torch.cat([u, u.new_zeros(pad)])
        shifts = torch.arange(0, 8, bits, device=u.device, dtype=torch.uint8)
        return u.view(-1, per).bitwise_left_shift(shifts).sum(dim=1, dtype=torch.uint8)
    shifts = torch.arange(bits, device=v.device, dtype=torch.int32)
    return pack_bits(v.to(torch.int32).unsqueeze(1).bitwise_right_shift(shifts).bitwise_and(1))


def unpack_uint(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The first ``n`` ``bits``-bit integers of ``packed`` as int64 (inverse of :func:`pack_uint`)."""
    if 8 % bits == 0:
        if packed.numel() < packed_size(n, bits):
            raise ValueError(f"{packed.numel()} packed bytes hold fewer than n={n} values of {bits} bits")
        shifts = torch.arange(0, 8, bits, device=packed.device, dtype=torch.uint8)
        return packed.reshape(-1, 1).bitwise_right_shift(shifts).bitwise_and(2**bits - 1).reshape(-1)[:n].to(torch.int64)
    flat = unpack_bits(packed, n * bits).view(n, bits).to(torch.int64)
    shifts = torch.arange(bits, device=packed.device, dtype=torch.int64)
    return flat.bitwise_left_shift(shifts).sum(dim=1)
