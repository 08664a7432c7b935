"""The shared training loop: flat views, optimisers equal to torch's, determinism, clear NaN errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fl_platform.training.flat import FlatModel, model_vector
from fl_platform.training.hooks import ComposedHooks, GradientCorrectionHook, ProximalHook, TrainHooks
from fl_platform.training.loop import ClientData, LocalTrainer, NonFiniteError, TrainConfig, evaluate
from fl_platform.training.optim import FlatAdam, FlatSGD

from .conftest import slot_mask


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _data(n: int = 60, seed: int = 1) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return ClientData(x, y, torch.arange(n))


@pytest.mark.parametrize("kwargs", [
    {"lr": 0.1},
    {"lr": 0.1, "momentum": 0.9},
    {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3},
    {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4},
])
def test_flat_sgd_matches_torch(kwargs):
    ref, ours = _mlp(), _mlp()
    fm = FlatModel(ours)
    opt_ref = torch.optim.SGD(ref.parameters(), **kwargs)
    opt = FlatSGD(**kwargs)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    for _ in range(4):
        opt_ref.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt_ref.step()
        fm.grad.zero_()
        nn.functional.cross_entropy(ours(x), y).backward()
        opt.step(fm.params, fm.grad)
    for p_ref, p in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(p, p_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours[1].running_mean, ref[1].running_mean)


def test_flat_adam_matches_torch():
    ref, ours = _mlp(), _mlp()
    fm = FlatModel(ours)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-2, weight_decay=1e-3)
    opt = FlatAdam(lr=1e-2, weight_decay=1e-3)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    for _ in range(5):
        opt_ref.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt_ref.step()
        fm.grad.zero_()
        nn.functional.cross_entropy(ours(x), y).backward()
        opt.step(fm.params, fm.grad)
    for p_ref, p in zip(ref.parameters(), ours.parameters()):
        torch.testing.assert_close(p, p_ref, rtol=1e-5, atol=1e-6)


def test_optimizer_state_reset_between_clients():
    fm = FlatModel(_mlp())
    trainer = LocalTrainer(fm, TrainConfig(lr=0.1, momentum=0.9, batch_size=8))
    start = fm.vector.clone()
    data = _data()
    trainer.fit(data, seed=0, round=0, client=3)
    first = fm.vector.clone()
    fm.load(start)
    trainer.fit(_data(seed=7), seed=0, round=0, client=4)  # leaves momentum behind
    fm.load(start)
    trainer.fit(data, seed=0, round=0, client=3)
    torch.testing.assert_close(fm.vector, first, rtol=0, atol=0)


def test_flat_model_state_dict_roundtrip_and_frozen_ranges():
    model = _mlp()
    fm = FlatModel(model)
    sd = fm.state_dict()
    assert set(sd) == {k for k, v in model.state_dict().items() if v.is_floating_point()}
    vec = fm.vector_from_state_dict(sd)
    torch.testing.assert_close(vec, fm.vector)
    assert fm.trainable_ranges() == [(0, fm.param_count)]  # (179: the alignment padding after it is in no range)
    for p in model[0].parameters():
        p.requires_grad_(False)
    (lo, hi), = fm.trainable_ranges()
    assert lo == 5 * 16 + 16 and hi == fm.param_count


def _odd_model(seed: int = 0) -> nn.Module:
    """Tensors of 3, 5, 7, 15 elements: a dense layout would put most of them off 16-byte boundaries."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 3), nn.BatchNorm1d(3), nn.ReLU(), nn.Linear(3, 5), nn.BatchNorm1d(5),
                         nn.ReLU(), nn.Linear(5, 3))


def test_flat_model_views_start_on_16_byte_boundaries_and_the_padding_stays_zero():
    """cuDNN's channels-last batch norm reads its per-channel tensors with 16-byte loads: a view 8 bytes
    off stopped every fp32 ResNet-18 round on an H200 ("misaligned address"). Every parameter, gradient
    and float buffer view starts 16 bytes aligned, as its own allocation would; the padding is zero
    after training, and model_vector and the state dict use the same layout."""
    model = _odd_model()
    reference = _odd_model()
    fm = FlatModel(model)
    views = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    views += [b for b in model.buffers() if b.is_floating_point()]
    assert [v.data_ptr() % 16 for v in views] == [0] * len(views)
    assert len(fm) % 4 == 0 and fm.num_params % 4 == 0
    assert fm.param_count == sum(p.numel() for p in reference.parameters()) == 3 * 5 + 3 + 3 + 3 + 5 * 3 + 5 + 5 + 5 + 3 * 5 + 3
    used = slot_mask(fm)
    assert int((~used).sum()) > 0  # the layout really pads (else this test proves nothing)
    torch.testing.assert_close(fm.vector, model_vector(reference), rtol=0, atol=0)
    LocalTrainer(fm, TrainConfig(lr=0.1, momentum=0.9, weight_decay=1e-2)).fit(_data(), seed=0, round=0, client=0)
    assert not torch.equal(fm.vector, model_vector(reference))  # it trained
    assert torch.count_nonzero(fm.vector[~used]) == 0 and torch.count_nonzero(fm.grad[~used[: fm.num_params]]) == 0
    torch.testing.assert_close(fm.vector_from_state_dict(fm.state_dict()), fm.vector, rtol=0, atol=0)
    torch.testing.assert_close(model_vector(model), fm.vector, rtol=0, atol=0)
    # no optimiser step writes the padding, whatever a loaded vector holds there (weight decay would)
    start = fm.vector.clone()
    start[~used] = 1.0
    fm.load(start)
    LocalTrainer(fm, TrainConfig(lr=0.1, momentum=0.9, weight_decay=1e-2)).fit(_data(), seed=0, round=1, client=0)
    assert torch.equal(fm.vector[~used], start[~used])


def test_frozen_parameters_do_not_move():
    model = _mlp()
    fm = FlatModel(model)
    for p in model[0].parameters():
        p.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    LocalTrainer(fm, TrainConfig(lr=0.1, momentum=0.9, weight_decay=1e-2)).fit(_data(), seed=0, round=0, client=0)
    torch.testing.assert_close(model[0].weight, frozen, rtol=0, atol=0)


def test_fit_is_deterministic_and_depends_on_client_and_round():
    def run(client: int, round: int) -> torch.Tensor:
        fm = FlatModel(_mlp())
        LocalTrainer(fm, TrainConfig(lr=0.1, batch_size=7, epochs=2)).fit(_data(), seed=5, round=round, client=client)
        return fm.vector.clone()

    a, b = run(1, 0), run(1, 0)
    assert torch.equal(a, b)
    assert not torch.equal(a, run(2, 0))
    assert not torch.equal(a, run(1, 1))


def test_fit_learns_and_reports_metrics():
    fm = FlatModel(_mlp())
    data = _data(200)
    before = evaluate(fm.model, data.x, data.y)["test_accuracy"]
    metrics = LocalTrainer(fm, TrainConfig(lr=0.1, epochs=20, batch_size=20)).fit(data, seed=0, round=0, client=0)
    after = evaluate(fm.model, data.x, data.y)["test_accuracy"]
    assert after > max(before, 0.85)
    assert metrics.values["local_steps"][0] == 20 * 10
    assert metrics.values["train_loss"][1] == 20 * 200


def test_steps_mode_runs_exactly_s_steps():
    fm = FlatModel(_mlp())
    metrics = LocalTrainer(fm, TrainConfig(lr=0.1, steps=13, batch_size=16)).fit(_data(20), seed=0, round=0, client=0)
    assert metrics.values["local_steps"][0] == 13


def test_nan_loss_raises_error_naming_client_and_round():
    fm = FlatModel(_mlp())
    data = _data()
    data.x[3, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"client 42 in round 7.*non-finite"):
        LocalTrainer(fm, TrainConfig(lr=0.1)).fit(data, seed=0, round=6, client=42)


def test_gradient_clipping_bounds_the_step():
    fm = FlatModel(_mlp())
    start = fm.vector.clone()
    cfg = TrainConfig(lr=1.0, steps=1, batch_size=60, clip_norm=0.01)
    LocalTrainer(fm, cfg).fit(_data(), seed=0, round=0, client=0)
    moved = (fm.params - start[: fm.num_params]).norm()
    assert moved <= 0.01 + 1e-6


def test_hooks_compose_and_correct_gradients():
    fm = FlatModel(_mlp())
    fm.grad.fill_(1.0)
    global_params = fm.params.clone() - 2.0
    hooks = ComposedHooks(ProximalHook(0.5, global_params), GradientCorrectionHook(torch.full_like(fm.grad, 3.0)))
    hooks.before_step(fm)
    torch.testing.assert_close(fm.grad, torch.full_like(fm.grad, 1.0 + 0.5 * 2.0 + 3.0))

    class LossA(TrainHooks):
        def loss(self, model, batch):
            return super().loss(model, batch)

    with pytest.raises(ValueError, match="only one hook may replace the loss"):
        ComposedHooks(LossA(), LossA())


# ------------------------------------------------------------------ the step's options (docs/engine.md "The step")


def _image_clients(channels: int = 3, n: int = 30) -> ClientData:
    g = torch.Generator().manual_seed(2)
    return ClientData(torch.randn(n, channels, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g),
                      torch.arange(n))


def _cnn(channels: int = 3, name: str = "cnn") -> FlatModel:
    from fl_platform.models import build_model

    torch.manual_seed(0)
    return FlatModel(build_model(name, (channels, 8, 8), 10))


def _trained(fm: FlatModel, cfg: TrainConfig, data: ClientData) -> torch.Tensor:
    LocalTrainer(fm, cfg).fit(data, seed=0, round=0, client=0)
    return fm.vector.detach().clone()


def test_bf16_runs_the_forward_in_bf16_and_trains_like_fp32():
    """Autocast: every Conv2d/Linear output is bf16 during the fit, parameters and the step stay fp32,
    and the trained vector is fp32's within bf16 rounding (but not equal to it)."""
    dtypes = set()
    fm = _cnn()
    for m in fm.model.modules():
        if isinstance(m, nn.Conv2d | nn.Linear):
            m.register_forward_hook(lambda _m, _i, out: dtypes.add(out.dtype))
    cfg = TrainConfig(epochs=2, batch_size=8, lr=0.05)
    bf16 = _trained(fm, TrainConfig(**{**cfg.__dict__, "precision": "bf16"}), _image_clients())
    assert dtypes == {torch.bfloat16}
    assert fm.vector.dtype == torch.float32
    fp32 = _trained(_cnn(), cfg, _image_clients())
    diff = float((bf16 - fp32).abs().max())
    assert 0 < diff < 0.02, diff


def test_fp16_is_refused_without_cuda_and_its_scaler_recomputes_an_overflow():
    with pytest.raises(ValueError, match=r"train\.precision=fp16 needs a CUDA device"):
        LocalTrainer(FlatModel(_mlp()), TrainConfig(precision="fp16"))
    with pytest.raises(ValueError, match=r"train\.precision must be one of fp32, bf16, fp16; got 'fp8'"):
        LocalTrainer(FlatModel(_mlp()), TrainConfig(precision="fp8"))
    from fl_platform.training.step import LossScaler

    scaler = LossScaler(init_scale=8.0, interval=2)
    assert float(scaler.scaled(torch.tensor(1.5))) == 12.0
    grad = torch.tensor([8.0, float("inf")])
    assert not scaler.unscale(grad) and scaler.scale == 4.0  # overflowed: again, at half the scale
    grad = torch.tensor([8.0, -4.0])
    assert scaler.unscale(grad) and grad.tolist() == [2.0, -1.0]
    assert scaler.unscale(torch.tensor([4.0])) and scaler.scale == 8.0  # 2 good steps: doubled
    last = LossScaler(init_scale=1.0)
    assert last.unscale(torch.tensor([float("nan")])) and last.scale == 1.0  # at scale 1: final (NonFiniteError)


def test_channels_last_lays_out_the_convolutions_inputs_and_is_refused_where_it_cannot_act():
    from fl_platform.training.step import check_cohort_options, check_image_inputs

    seen = []
    fm = _cnn()
    conv = next(m for m in fm.model.modules() if isinstance(m, nn.Conv2d))
    conv.register_forward_hook(lambda _m, inputs, _o: seen.append(
        inputs[0].is_contiguous(memory_format=torch.channels_last) and not inputs[0].is_contiguous()))
    cfg = TrainConfig(epochs=1, batch_size=8, lr=0.05)
    fast = _trained(fm, TrainConfig(**{**cfg.__dict__, "channels_last": True}), _image_clients())
    assert seen and all(seen)
    torch.testing.assert_close(fast, _trained(_cnn(), cfg, _image_clients()), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"train\.channels_last=True has no effect: the model \(Sequential\)"):
        LocalTrainer(FlatModel(_mlp()), TrainConfig(channels_last=True))
    with pytest.raises(ValueError, match=r"train\.channels_last=True needs image samples .* shape \(64,\)"):
        check_image_inputs(TrainConfig(channels_last=True), (64,), True)
    for key, value in (("channels_last", True), ("compile", True), ("precision", "fp16")):
        with pytest.raises(ValueError, match=rf"train\.{key}={value} cannot apply with engine.cohort_size=auto"):
            check_cohort_options(TrainConfig(**{key: value}), "auto")
    check_cohort_options(TrainConfig(precision="bf16"), 8)  # bf16 works in cohorts


@pytest.mark.slow
def test_compile_compiles_the_forward_before_the_first_round_and_trains_as_eager():
    """``train.compile``: the model's forward is compiled (forward and backward graphs, full and short
    batches) when the trainer is made, so no fit compiles (the round timings do not include it), and
    training equals the eager loop's within float rounding."""
    import torch._dynamo.utils as dynamo_utils

    from fl_platform.models import build_model

    torch.manual_seed(0)
    fm = FlatModel(build_model("mlp", (5,), 3, hidden=[8]))
    eager = FlatModel(build_model("mlp", (5,), 3, hidden=[8]))
    eager.load(fm.vector.detach().clone())
    cfg = TrainConfig(epochs=2, batch_size=8, lr=0.1)
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    trainer = LocalTrainer(fm, TrainConfig(**{**cfg.__dict__, "compile": True}))
    compiled = dynamo_utils.counters["stats"]["unique_graphs"] - graphs
    assert compiled >= 1
    data = _data(n=30)  # 3 full batches and a short one per epoch
    trainer.fit(data, seed=0, round=0, client=0)
    assert dynamo_utils.counters["stats"]["unique_graphs"] - graphs == compiled  # nothing compiled in the fit
    LocalTrainer(eager, cfg).fit(data, seed=0, round=0, client=0)
    torch.testing.assert_close(fm.vector, eager.vector, rtol=0, atol=1e-5)


def test_cudnn_benchmark_is_on_for_cuda_workers_unless_determinism_is_asked():
    from fl_platform.training.step import enable_cudnn_benchmark

    before = (torch.backends.cudnn.benchmark, torch.are_deterministic_algorithms_enabled())
    try:
        torch.backends.cudnn.benchmark = False
        enable_cudnn_benchmark(torch.device("cpu"))
        assert torch.backends.cudnn.benchmark is False
        torch.use_deterministic_algorithms(True)
        enable_cudnn_benchmark(torch.device("cuda"))  # (sets a flag only: no device needed)
        assert torch.backends.cudnn.benchmark is False
        torch.use_deterministic_algorithms(False)
        enable_cudnn_benchmark(torch.device("cuda"))
        assert torch.backends.cudnn.benchmark is True
    finally:
        torch.backends.cudnn.benchmark = before[0]
        torch.use_deterministic_algorithms(before[1])
