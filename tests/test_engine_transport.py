"""The Ray engine's tensor transport: numpy buffers for CPU tensors, torch.save for the rest,
bit-identical either way."""

from __future__ import annotations

import pickle

import pytest
import torch

from fl_platform.engine.ray_engine import _tensor_from_payload, _tensor_payload


def _roundtrip(t: torch.Tensor) -> torch.Tensor:
    return _tensor_from_payload(pickle.loads(pickle.dumps(_tensor_payload(t), protocol=5)))


@pytest.mark.parametrize("t", [
    torch.randn(7, 5),
    torch.randn(7, 5).t(),  # non-contiguous
    torch.randn(4, dtype=torch.float64),
    torch.arange(10) > 4,
    torch.randint(0, 255, (3, 3), dtype=torch.uint8),
    torch.randn(3, dtype=torch.complex64).conj(),  # a lazy conjugate
    torch.randn(5).to(torch.bfloat16),  # no numpy dtype: torch.save fallback
    torch.empty(0, 3),
])
def test_tensors_survive_the_transport_bit_identically(t):
    got = _roundtrip(t)
    assert got.dtype == t.dtype and got.shape == t.shape
    assert torch.equal(got, t.resolve_conj())
    got.add_(1) if got.dtype != torch.bool else got.logical_not_()  # writable, not a read-only buffer view


def test_requires_grad_is_kept():
    t = torch.randn(3, requires_grad=True)
    got = _roundtrip(t)
    assert got.requires_grad and torch.equal(got.detach(), t.detach())
