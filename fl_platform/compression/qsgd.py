"""QSGD: unbiased stochastic quantisation to s levels per bucket (Alistarh et al. 2017).

For a bucket v of B coordinates, q_i = ||v||_2 sign(v_i) xi_i / s with xi_i = floor(r_i) +
Bernoulli(r_i - floor(r_i)), r_i = s |v_i| / ||v||. E[q] = v; per coordinate
Var(q_i) = (||v|| / s)^2 f_i (1 - f_i), f_i = frac(r_i). With ``bits`` = b, s = 2^b - 1 (as in
GossipFL), so xi fits b bits. The wire format is naive packing: one float32 norm per bucket, one
sign bit and b level bits per coordinate (no Elias coding). Norms differ by sender, so payloads
are not summable. The Bernoulli draws come from the sender's own stream of the step key.
"""

from __future__ import annotations

import torch

from fl_platform.compression.base import NO_KEY, Compressor, Key, Payload, State
from fl_platform.compression.bitpack import pack_bits, pack_uint, packed_size, unpack_bits, unpack_uint


class QSGD(Compressor):
    name = "qsgd"
    unbiased = True

    def __init__(self, bits: int = 4, bucket: int = 512) -> None:
        if not 1 <= int(bits) <= 16:
            raise ValueError(f"compressor.bits must be in 1..16, got {bits}")
        if int(bucket) < 1:
            raise ValueError(f"compressor.bucket must be >= 1, got {bucket}")
        self.bits = int(bits)
        self.levels = 2 ** self.bits - 1
        self.bucket = int(bucket)

    def payload_nbytes(self, numel: int) -> int:
        buckets = -(-numel // self.bucket)
        return 4 * buckets + packed_size(numel) + packed_size(numel, self.bits)

    def _buckets(self, flat: torch.Tensor) -> torch.Tensor:
        pad = (-flat.numel()) % self.bucket
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(-1, self.bucket)

    def encode(self, x: torch.Tensor, state: State | None = None, key: Key = NO_KEY) -> tuple[Payload, State]:
        flat = x.detach().reshape(-1).to(torch.float32)
        n = flat.numel()
        v = self._buckets(flat)
        norms = v.norm(dim=1)
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        r = (self.levels * v.abs() / safe.unsqueeze(1)).clamp_(max=self.levels)
        low = r.floor()
        u = torch.rand(r.shape, generator=key.generator(flat.device), device=flat.device)
        xi = (low + (u < (r - low)).to(r.dtype)).clamp_(max=self.levels).reshape(-1)[:n]
        negative = (v < 0).reshape(-1)[:n]
        # xi is in [0, levels] = [0, 2**bits - 1] by construction (floor of r in [0, levels], plus 0 or 1,
        # clamped to levels), so pack_uint's range check (a host read per segment per step) is skipped.
        # A NaN coordinate has no level, but it makes its bucket's norm NaN: the bucket decodes to NaN.
        levels = pack_uint(xi.to(torch.int32), self.bits, checked=False)
        tensors = {"norms": norms, "signs": pack_bits(negative), "levels": levels}
        return Payload(tensors, tuple(x.shape), x.dtype), {}

    def decode(self, payload: Payload, state: State | None = None) -> torch.Tensor:
        n = payload.numel
        norms = payload.tensors["norms"]
        xi = unpack_uint(payload.tensors["levels"], self.bits, n).to(torch.float32)
        sign = 1.0 - 2.0 * unpack_bits(payload.tensors["signs"], n).to(torch.float32)
        scale = (norms / self.levels).repeat_interleave(self.bucket)[:n]
        return (scale * sign * xi).to(payload.dtype).view(payload.shape)

    def variance(self, x: torch.Tensor) -> torch.Tensor:
        """Per-coordinate variance of decode(encode(x)) (for tests and error budgets)."""
        flat = x.detach().reshape(-1).to(torch.float64)
        v = self._buckets(flat)
        norms = v.norm(dim=1, keepdim=True)
        r = self.levels * v.abs() / torch.where(norms > 0, norms, torch.ones_like(norms))
        f = r - r.floor()
        return ((norms / self.levels) ** 2 * f * (1 - f)).reshape(-1)[: flat.numel()].view(x.shape)

    def __repr__(self) -> str:
        return f"QSGD(bits={self.bits}, bucket={self.bucket})"
