"""Compressor library: the acceptance properties of specs/compressors.md, per compressor."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fl_platform.compression import (
    ACPSGD,
    QSGD,
    ErrorFeedback,
    Identity,
    Key,
    Layout,
    PowerSGD,
    RandomK,
    ScaledSign,
    Sign,
    TopK,
    VectorCompressor,
    build_compressor,
    ef_encode,
    make_compressor,
)
from fl_platform.compression.bitpack import pack_bits, pack_uint, packed_size, unpack_bits, unpack_uint
from fl_platform.training.flat import FlatModel

ALL = [Identity(), TopK(0.1, "int32"), TopK(0.3, "bitmap"), TopK(0.05), RandomK(0.2), RandomK(0.2, unbiased=False),
       QSGD(4, 64), QSGD(2, 512), Sign(), ScaledSign(), PowerSGD(2), PowerSGD(1, warm_start=False), ACPSGD(2)]


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------ bit packing


@settings(max_examples=60, deadline=None)
@given(st.lists(st.booleans(), max_size=70))
def test_pack_bits_roundtrip(bits):
    t = torch.tensor(bits, dtype=torch.bool)
    packed = pack_bits(t)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_size(len(bits))
    assert torch.equal(unpack_bits(packed, len(bits)), t)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9).flatmap(lambda b: st.tuples(st.just(b), st.lists(st.integers(0, 2**b - 1), max_size=40))))
def test_pack_uint_roundtrip(case):
    bits, values = case
    packed = pack_uint(torch.tensor(values, dtype=torch.int64), bits)
    assert packed.numel() == packed_size(len(values), bits)
    assert unpack_uint(packed, bits, len(values)).tolist() == values


def test_pack_uint_rejects_values_that_do_not_fit():
    with pytest.raises(ValueError, match="fit 3 bits"):
        pack_uint(torch.tensor([8]), 3)


# ------------------------------------------------------------------ top-k


@pytest.mark.parametrize("index", ["int32", "bitmap", "auto"])
@pytest.mark.parametrize("shape,ratio", [((1000,), 0.01), ((20, 30), 0.1), ((8, 4, 3, 3), 0.5), ((7,), 1.0)])
def test_topk_keeps_exactly_the_k_largest_magnitudes(index, shape, ratio):
    n = math.prod(shape)
    # distinct magnitudes, random signs and positions
    g = torch.Generator().manual_seed(1)
    mags = (torch.randperm(n, generator=g).float() + 1.0) / n
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    x = (mags * signs).view(shape)
    comp = TopK(ratio, index)
    y, payload, _ = comp.roundtrip(x)
    k = math.ceil(ratio * n)
    kept = y.reshape(-1).ne(0)
    assert int(kept.sum()) == k == payload.meta["k"]
    expected = set(x.reshape(-1).abs().topk(k).indices.tolist())
    assert set(kept.nonzero().squeeze(1).tolist()) == expected
    assert torch.equal(y.reshape(-1)[kept], x.reshape(-1)[kept])  # kept values are exact
    assert torch.equal(comp.mask(payload), kept)


def test_topk_auto_index_picks_the_smaller_encoding():
    assert TopK(0.01).index_format(10_000) == "int32"  # 8 * 100 < 4 * 100 + 1250
    assert TopK(0.1).index_format(10_000) == "bitmap"  # 4 * 1000 + 1250 < 8 * 1000
    for ratio in (0.001, 0.01, 0.03, 0.1, 0.5):
        for n in (100, 4097, 100_000):
            c = TopK(ratio)
            assert c.payload_nbytes(n) == min(TopK(ratio, "int32").payload_nbytes(n),
                                              TopK(ratio, "bitmap").payload_nbytes(n))


def test_invalid_ratio_names_the_key():
    with pytest.raises(ValueError, match=r"compressor.ratio must be in \(0, 1\], got 0"):
        TopK(0.0)
    with pytest.raises(ValueError, match=r"compressor\.index"):
        TopK(0.1, "bits")


# ------------------------------------------------------------------ unbiasedness


def _assert_unbiased(comp, x: torch.Tensor, var: torch.Tensor, samples: int) -> None:
    """Mean of ``samples`` independent decodes is within 5 standard errors of x, per coordinate.

    With d coordinates the chance that a correct, unbiased compressor fails is below
    d * 6e-7 (two-sided normal tail at 5 sigma); the keys are fixed, so the test is deterministic.
    """
    total = torch.zeros_like(x, dtype=torch.float64)
    for s in range(samples):
        total += comp.roundtrip(x, None, Key(seed=3, step=s, sender=1))[0].double()
    mean = total / samples
    tol = 5.0 * (var.double() / samples).sqrt() + 1e-9
    assert bool(((mean - x.double()).abs() <= tol).all()), float(((mean - x.double()).abs() / tol).max())
    # and the test has power: a compressor that drops half the signal (mean x / 2) would fail it
    assert float(tol.mean()) < 0.5 * float(x.abs().mean())


def test_randomk_is_unbiased():
    x = _x(200, seed=5)
    comp = RandomK(0.1)
    d, k = 200, 20
    _assert_unbiased(comp, x, x**2 * (d / k - 1), samples=4000)


def test_qsgd_is_unbiased():
    x = _x(300, seed=6)
    comp = QSGD(bits=2, bucket=64)
    var = comp.variance(x)
    assert float(var.sum()) > 0
    _assert_unbiased(comp, x, var, samples=3000)


def test_qsgd_variance_bound_and_levels():
    x = _x(1000, seed=2)
    comp = QSGD(bits=3, bucket=100)
    b, s = 100, 7
    v = x.view(10, 100)
    bound = min(b / s**2, math.sqrt(b) / s) * float((v.norm(dim=1) ** 2).sum())
    assert float(comp.variance(x).sum()) <= bound
    y = comp.roundtrip(x, None, Key(step=1))[0].view(10, 100)
    levels = (y.abs() * s / v.norm(dim=1, keepdim=True)).round()
    assert torch.allclose(y.abs() * s / v.norm(dim=1, keepdim=True), levels, atol=1e-4)
    assert int(levels.max()) <= s


def test_randomk_shares_indices_across_senders_not_steps():
    comp = RandomK(0.1)
    x = _x(500)
    a = comp.roundtrip(x, None, Key(seed=1, step=4, sender=0))[0]
    b = comp.roundtrip(x, None, Key(seed=1, step=4, sender=9))[0]
    c = comp.roundtrip(x, None, Key(seed=1, step=5, sender=0))[0]
    assert torch.equal(a, b)
    assert not torch.equal(a.ne(0), c.ne(0))


def test_qsgd_draws_depend_on_sender_and_are_reproducible():
    comp = QSGD(2, 64)
    x = _x(500)
    a = comp.roundtrip(x, None, Key(seed=1, step=4, sender=0))[0]
    assert torch.equal(a, comp.roundtrip(x, None, Key(seed=1, step=4, sender=0))[0])
    assert not torch.equal(a, comp.roundtrip(x, None, Key(seed=1, step=4, sender=1))[0])


# ------------------------------------------------------------------ sign


def test_sign_decodes_to_plus_minus_one_with_zero_as_plus_one():
    x = torch.tensor([[0.5, -2.0, 0.0], [-0.0, 3.0, -1e-30]], dtype=torch.float64)
    y, payload, _ = Sign().roundtrip(x)
    # sign(x) with the documented choice for zero (and -0.0): +1; a negative subnormal stays -1
    assert torch.equal(y, torch.tensor([[1.0, -1.0, 1.0], [1.0, 1.0, -1.0]], dtype=torch.float64))
    assert payload.tensors["signs"].dtype == torch.uint8 and payload.nbytes == 1  # 6 bits in one byte


def test_scaled_sign_decodes_to_the_mean_magnitude_times_the_sign():
    x = torch.tensor([1.0, -2.0, 0.0, 5.0, -0.5, 0.5, 7.0, -8.0, 3.0])
    y, payload, _ = ScaledSign().roundtrip(x.view(3, 3))
    scale = 27.0 / 9  # ||x||_1 / d
    assert float(payload.tensors["scale"]) == scale
    assert torch.equal(y, (scale * torch.tensor([1.0, -1, 1, 1, -1, 1, 1, -1, 1])).view(3, 3))


def test_efsign_is_error_feedback_around_the_scaled_sign():
    """EF-SignSGD (specs/compressors.md 4): a = x + e; delta = (||a||_1 / d) sign(a); e <- a - delta."""
    ef = build_compressor("efsign")
    assert isinstance(ef, ErrorFeedback) and isinstance(ef.inner, ScaledSign)
    x1 = torch.tensor([1.0, -2.0, 0.0, 5.0])
    p1, s1 = ef.encode(x1, None)
    assert torch.equal(ef.decode(p1, s1), torch.tensor([2.0, -2.0, 2.0, 2.0]))  # scale 8 / 4
    assert torch.equal(s1["residual"], torch.tensor([-1.0, 0.0, -2.0, 3.0]))
    # The next message compresses x2 + e1 = [-0.5, 0.5, -1.5, -1], whose scale is 3.5 / 4.
    x2 = torch.tensor([0.5, 0.5, 0.5, -4.0])
    p2, s2 = ef.encode(x2, s1)
    assert torch.equal(ef.decode(p2, s2), torch.tensor([-0.875, 0.875, -0.875, -0.875]))
    assert torch.equal(s2["residual"], torch.tensor([0.375, -0.375, -0.625, -0.125]))


# ------------------------------------------------------------------ low rank


@pytest.mark.parametrize("shape,rank", [((40, 30), 2), ((8, 4, 3, 3), 2), ((64, 10), 1)])
def test_powersgd_is_exact_on_rank_r_input(shape, rank):
    a, b = shape[0], math.prod(shape[1:])
    g = torch.Generator().manual_seed(7)
    m = (torch.randn(a, rank, generator=g) @ torch.randn(rank, b, generator=g)).view(shape)
    comp = PowerSGD(rank)
    assert comp.compressible(shape)
    y, payload, state = comp.roundtrip(m, None, Key(seed=2))
    assert torch.allclose(y, m, atol=1e-4 * float(m.abs().max()))
    assert payload.nbytes == 4 * rank * (a + b)
    assert state["q"].numel() == b * rank


def test_powersgd_warm_start_converges_to_the_best_rank_r_approximation():
    m = _x(30, 20, seed=3)
    comp = PowerSGD(2)
    state = None
    for _ in range(60):
        y, _, state = comp.roundtrip(m, state, Key(seed=1))
    u, s, vh = torch.linalg.svd(m)
    best = (u[:, :2] * s[:2]) @ vh[:2]
    assert torch.allclose(y, best, atol=1e-3)


def test_powersgd_sends_small_or_one_dimensional_tensors_dense():
    comp = PowerSGD(4)
    for shape in [(10,), (4, 4), (3, 100)]:  # (3+100)*4*2 >= 300
        x = _x(*shape)
        y, payload, state = comp.roundtrip(x)
        assert torch.equal(y, x) and payload.meta.get("dense") and state == {}
        assert comp.state_sizes(shape) == {}


def test_powersgd_allreduce_protocol_matches_the_global_projection():
    """Two all-reduces: P_sum -> orth -> Q_i -> Q_sum; summing Q payloads == summing decodes."""
    comp = PowerSGD(2)
    ms = [comp.matrix(_x(20, 12, seed=s)) for s in range(3)]
    q0 = comp.init_state((20, 12), Key(seed=4))["q"].view(12, 2)
    p_sum = sum(comp.p_step(m, q0) for m in ms)
    steps = [comp.q_step(m, p_sum) for m in ms]
    p_hat = steps[0][0]
    assert all(torch.equal(p_hat, s[0]) for s in steps)  # identical on every rank
    q_sum = sum(s[1] for s in steps)
    approx, q_next = comp.reconstruct(p_hat, q_sum, 3)
    expected = p_hat @ p_hat.t() @ (sum(ms) / 3)
    assert torch.allclose(approx, expected, atol=1e-5)
    decoded_sum = sum(p_hat @ s[1].t() for s in steps) / 3
    assert torch.allclose(approx, decoded_sum, atol=1e-5)
    assert q_next.shape == (12, 2)


def test_acpsgd_alternates_and_is_exact_on_rank_r_input_after_a_p_and_a_q_step():
    g = torch.Generator().manual_seed(8)
    m = torch.randn(24, 2, generator=g) @ torch.randn(2, 18, generator=g)
    comp = ACPSGD(2)
    state = None
    _, p0, state = comp.roundtrip(m, state, Key(seed=1))
    assert set(p0.tensors) == {"p"} and p0.nbytes == 4 * 2 * 24
    state = comp.after_aggregate(state, p0, 1)
    y1, p1, state = comp.roundtrip(m, state, Key(seed=1))
    assert set(p1.tensors) == {"q"} and p1.nbytes == 4 * 2 * 18
    assert torch.allclose(y1, m, atol=1e-4 * float(m.abs().max()))
    assert int(comp.after_aggregate(state, p1, 1)["step"]) == 2


# ------------------------------------------------------------------ error feedback


@pytest.mark.parametrize("comp", ALL, ids=repr)
def test_error_feedback_residual_plus_decoded_equals_input(comp):
    ef = ErrorFeedback(comp)
    state = None
    x_shape = (16, 12)
    for step in range(3):
        x = _x(*x_shape, seed=step)
        old = torch.zeros(x.numel()) if state is None else state["residual"]
        payload, new_state = ef.encode(x, state, Key(seed=1, step=step))
        decoded = ef.decode(payload, new_state)
        assert torch.allclose(new_state["residual"] + decoded.reshape(-1), x.reshape(-1) + old, atol=1e-5)
        if isinstance(comp, ACPSGD):
            new_state = ef.after_aggregate(new_state, payload, 1)
        state = new_state
    assert ef.state_sizes(x_shape)["residual"] == 16 * 12


def test_ef_encode_contract():
    x = _x(100)
    payload, residual = ef_encode(TopK(0.1), x, None)
    assert torch.allclose(residual + TopK(0.1).decode(payload), x)
    payload2, residual2 = ef_encode(TopK(0.1), x, residual)
    assert torch.allclose(residual2 + TopK(0.1).decode(payload2), x + residual)
    with pytest.raises(ValueError, match="keeps state"):
        ef_encode(PowerSGD(1), _x(20, 20), None)


# ------------------------------------------------------------------ bytes


def _expected_nbytes(comp, shape) -> int:
    d = math.prod(shape)
    if isinstance(comp, Identity):
        return 4 * d
    if isinstance(comp, TopK):
        return comp.payload_nbytes(d)
    if isinstance(comp, RandomK):
        return 4 * math.ceil(comp.ratio * d)
    if isinstance(comp, QSGD):
        return 4 * math.ceil(d / comp.bucket) + math.ceil(d / 8) + math.ceil(d * comp.bits / 8)
    if isinstance(comp, ScaledSign):
        return math.ceil(d / 8) + 4
    if isinstance(comp, Sign):
        return math.ceil(d / 8)
    if isinstance(comp, ACPSGD):
        return comp.payload_nbytes(shape, phase="p")
    return comp.payload_nbytes(shape)


@pytest.mark.parametrize("comp", ALL, ids=repr)
@pytest.mark.parametrize("shape", [(1000,), (30, 20), (16, 8, 3, 3)])
def test_bytes_equal_the_real_payload_size(comp, shape):
    x = _x(*shape)
    y, payload, state = comp.roundtrip(x, None, Key(seed=1, step=2, sender=3))
    wire = payload.to_bytes()
    assert payload.nbytes == len(wire) == comp.nbytes(payload) == _expected_nbytes(comp, shape)
    received = payload.from_bytes(wire)  # what the receiver rebuilds from the bytes alone
    assert torch.equal(comp.decode(received, state), y)
    with pytest.raises(ValueError):
        payload.from_bytes(wire + b"\0")


def test_payload_dtypes_are_wire_dtypes():
    x = _x(2000)
    assert TopK(0.01, "int32").encode(x)[0].tensors["indices"].dtype == torch.int32
    assert TopK(0.2, "bitmap").encode(x)[0].tensors["bitmap"].dtype == torch.uint8
    p = QSGD(4).encode(x)[0]
    assert p.tensors["signs"].dtype == p.tensors["levels"].dtype == torch.uint8
    assert p.tensors["norms"].dtype == torch.float32


# ------------------------------------------------------------------ summability


SUMMABLE = [Identity(), RandomK(0.1), RandomK(0.1, unbiased=False), ErrorFeedback(RandomK(0.2)), ACPSGD(2)]


@pytest.mark.parametrize("comp", SUMMABLE, ids=repr)
def test_summable_sum_then_decode_equals_decode_then_sum(comp):
    assert comp.summable
    shape = (24, 18)
    xs = [_x(*shape, seed=s) for s in range(4)]
    shared = comp.init_state(shape, Key(seed=5)) if isinstance(comp, ACPSGD) else None
    for step in range(2):  # ACP-SGD: a P-step, then a Q-step
        encoded = [comp.encode(x, shared, Key(seed=5, step=step, sender=i)) for i, x in enumerate(xs)]
        state = encoded[0][1] if isinstance(comp, ACPSGD) else None
        total = comp.sum(p for p, _ in encoded)
        decoded_sum = sum(comp.decode(p, state) for p, _ in encoded)
        assert torch.allclose(comp.decode(total, state), decoded_sum, atol=1e-4)
        if isinstance(comp, ACPSGD):
            shared = comp.after_aggregate(state, total, len(xs))
            shared = {k: v.clone() for k, v in shared.items()}


@pytest.mark.parametrize("comp", [TopK(0.1), QSGD(4), Sign(), ScaledSign(), PowerSGD(1)], ids=repr)
def test_non_summable_compressors_refuse_to_add(comp):
    assert not comp.summable
    p = comp.encode(_x(24, 18))[0]
    with pytest.raises(TypeError, match="not summable"):
        comp.add(p, p)


def test_randomk_payloads_of_different_steps_do_not_add():
    comp = RandomK(0.1)
    a = comp.encode(_x(100), None, Key(step=1))[0]
    b = comp.encode(_x(100), None, Key(step=2))[0]
    with pytest.raises(ValueError, match="step keys"):
        comp.add(a, b)


# ------------------------------------------------------------------ whole vectors


def _bn_model() -> FlatModel:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Flatten(),
                              torch.nn.Linear(8 * 4 * 4, 10))
    return FlatModel(net)


def test_layerwise_layout_keeps_buffers_dense_and_matches_per_tensor_compression():
    fm = _bn_model()
    layout = Layout.from_slots(fm.slots, len(fm), "layer")
    assert [s.name for s in layout.segments if not s.compress] == ["buffers"]
    assert sum(s.numel for s in layout.segments if s.compress) == fm.num_params
    vc = VectorCompressor(TopK(0.1), layout)
    vec = _x(len(fm))
    payload, _ = vc.encode(vec, None, Key(seed=1))
    out = vc.decode(payload)
    assert torch.equal(out[fm.num_params:], vec[fm.num_params:])  # BN statistics exact
    for seg in layout.segments[:-1]:
        ref = TopK(0.1).roundtrip(vec[seg.offset:seg.end].view(seg.shape))[0]
        assert torch.equal(out[seg.offset:seg.end], ref.reshape(-1))
    assert payload.nbytes == len(payload.to_bytes()) == \
        sum(TopK(0.1).payload_nbytes(s.numel) for s in layout.segments[:-1]) + 4 * fm.num_buffers


@pytest.mark.parametrize("scope", ["global", "bucket"])
def test_global_and_bucket_scopes(scope):
    fm = _bn_model()
    layout = Layout.from_slots(fm.slots, fm.num_params, scope, bucket_size=100)
    assert layout.size == fm.num_params and all(s.compress for s in layout.segments)
    if scope == "global":
        assert len(layout.segments) == 1
    else:
        assert [s.numel for s in layout.segments[:-1]] == [100] * (len(layout.segments) - 1)
    vec = _x(fm.num_params)
    out = VectorCompressor(TopK(0.05), layout).decode(VectorCompressor(TopK(0.05), layout).encode(vec)[0])
    if scope == "global":
        assert int(out.ne(0).sum()) == math.ceil(0.05 * fm.num_params)


def test_vector_state_is_flat_per_name_and_round_trips():
    fm = _bn_model()
    layout = Layout.from_slots(fm.slots, len(fm), "layer")
    vc = VectorCompressor(ErrorFeedback(PowerSGD(1)), layout)
    sizes = vc.state_sizes()
    assert sizes["residual"] == fm.num_params
    # conv (8 x 27) and linear (10 x 128) are compressible at rank 1; biases and BN weights are not
    assert sizes["q"] == 27 + 128
    vec = _x(len(fm))
    _, s1 = vc.encode(vec, None, Key(seed=2))
    assert {k: v.numel() for k, v in s1.items()} == sizes
    p2, s2 = vc.encode(vec, s1, Key(seed=2, step=1))
    # the residual recursion holds over the whole vector
    assert torch.allclose(s2["residual"] + vc.decode(p2, s2)[: fm.num_params], vec[: fm.num_params] + s1["residual"],
                          atol=1e-5)
    with pytest.raises(ValueError, match="elements"):
        vc.encode(vec, {"residual": torch.zeros(3)})


def test_layout_rejects_a_vector_of_the_wrong_size():
    fm = _bn_model()
    with pytest.raises(ValueError, match="neither"):
        Layout.from_slots(fm.slots, 17)
    with pytest.raises(ValueError, match=r"compressor\.scope"):
        Layout.from_slots(fm.slots, len(fm), "rows")


# ------------------------------------------------------------------ registry


def test_registry_builds_from_names_and_confs():
    c = make_compressor({"name": "topk", "ratio": 0.05})
    assert isinstance(c, ErrorFeedback) and isinstance(c.inner, TopK) and c.inner.ratio == 0.05
    assert make_compressor({"name": "none"}) is None
    assert isinstance(build_compressor("qsgd", bits=8), QSGD)
    assert isinstance(build_compressor("topk", error_feedback=False, ratio=0.1), TopK)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['ratoi'\] for compressor 'topk'"):
        make_compressor({"name": "topk", "ratoi": 0.1})
    with pytest.raises(ValueError, match="valid choices"):
        make_compressor({"name": "zip"})


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_uint_fast_path_keeps_the_general_bit_layout(bits):
    v = torch.randint(0, 2**bits, (1001,), generator=torch.Generator().manual_seed(bits))
    general = pack_bits(v.to(torch.int32).unsqueeze(1).bitwise_right_shift(torch.arange(bits, dtype=torch.int32))
                        .bitwise_and(1))
    assert torch.equal(pack_uint(v, bits), general)
