"""Tests of the model zoo: shapes, the staged API (split, partition, features), parameter
counts, determinism, registry errors, the start-up refusal of inputs a model cannot train on,
and survival of the flat-buffer re-pointing that the training loop applies to every parameter
and float buffer."""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from fl_platform.experiment import build
from fl_platform.models import (
    FUSEFL_RESNET18_CUTS,
    MODELS,
    CharLSTM,
    ModelInputError,
    ResNet18,
    StagedModel,
    build_model,
    check_model_input,
    count_parameters,
    model_options,
)
from fl_platform.run_config import read_config

from .conftest import CONF_DIR, compose_config

# (id, registry name, input_shape, num_classes, options): the typical inputs of each model.
CASES: list[tuple[str, str, tuple[int, ...], int, dict[str, Any]]] = [
    ("mlp-digits", "mlp", (1, 8, 8), 10, {}),
    ("mlp-mnist-2hidden", "mlp", (1, 28, 28), 10, {"hidden": (32, 16)}),
    ("mlp-logreg", "mlp", (60,), 10, {"hidden": ()}),
    ("cnn-digits", "cnn", (1, 8, 8), 10, {}),
    ("cnn-femnist", "cnn", (1, 28, 28), 62, {"channels": (8, 16), "hidden": 32}),
    ("cnn-cifar-bn", "cnn", (3, 32, 32), 10, {"channels": (8, 16, 16), "hidden": 32, "norm": "batch"}),
    ("cnn-cifar-gn", "cnn", (3, 32, 32), 10, {"channels": (8, 16), "hidden": 32, "norm": "group"}),
    ("resnet-digits-gn", "resnet18", (1, 8, 8), 10, {"width": 4, "norm": "group"}),
    ("resnet-mnist", "resnet18", (1, 28, 28), 10, {"width": 4}),
    ("resnet-cifar-bn", "resnet18", (3, 32, 32), 10, {"width": 4}),
    ("resnet-cifar-gn", "resnet18", (3, 32, 32), 20, {"width": 4, "norm": "group"}),
    ("lstm-shakespeare", "lstm", (20,), 80, {"hidden": 16}),
]
IDS = [c[0] for c in CASES]
BATCH = 3


def make(case: tuple[str, str, tuple[int, ...], int, dict[str, Any]], seed: int = 0) -> StagedModel:
    _, name, shape, classes, options = case
    torch.manual_seed(seed)
    return build_model(name, shape, classes, **options)


def make_input(model: StagedModel, batch: int = BATCH, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if isinstance(model, CharLSTM):
        return torch.randint(0, model.vocab_size, (batch, *model.input_shape), generator=g)
    return torch.randn((batch, *model.input_shape), generator=g)


@pytest.fixture(params=CASES, ids=IDS)
def case(request: pytest.FixtureRequest) -> tuple[str, str, tuple[int, ...], int, dict[str, Any]]:
    return request.param


# ---------------------------------------------------------------------------- shapes / API
def test_output_and_feature_shapes(case) -> None:
    model = make(case).eval()
    x = make_input(model)
    out = model(x)
    assert out.shape == (BATCH, case[3]) == (BATCH, model.num_outputs)
    assert model.features(x).shape == (BATCH, model.feature_dim)
    assert model.stage_names[-1] == "head"
    assert isinstance(model.head, nn.Linear)
    assert (model.head.in_features, model.head.out_features) == (model.feature_dim, model.num_outputs)
    shapes = model.stage_output_shapes()
    assert list(shapes) == model.stage_names
    assert shapes["head"] == (model.num_outputs,)
    assert all(n.isidentifier() for n in model.stage_names)


def test_forward_equals_forward_stages(case) -> None:
    model = make(case).eval()
    x = make_input(model)
    with torch.no_grad():
        full = model(x)
        assert torch.equal(model.forward_stages(x), full)
        assert torch.equal(model.forward_stages(x, 0, len(model.stage_names)), full)
        assert torch.equal(model.forward_stages(x, model.stage_names[0], None), full)
        for k, name in enumerate(model.stage_names):
            by_index = model.forward_stages(model.forward_stages(x, stop=k), start=k)
            by_name = model.forward_stages(model.forward_stages(x, stop=name), start=name)
            assert torch.equal(by_index, full)
            assert torch.equal(by_name, full)


def test_features_then_head_is_forward(case) -> None:
    model = make(case).eval()
    x = make_input(model)
    with torch.no_grad():
        feat = model.features(x)
        assert torch.equal(model.head(feat), model(x))
        assert torch.equal(feat, model.forward_stages(x, stop="head"))


def test_split_composes_and_shares_parameters(case) -> None:
    model = make(case).eval()
    x = make_input(model)
    all_params = {id(p) for p in model.parameters()}
    with torch.no_grad():
        full = model(x)
        for k, name in enumerate(model.stage_names):
            low, high = model.split(name)
            assert list(dict(low.named_children())) == model.stage_names[: k + 1]
            assert list(dict(high.named_children())) == model.stage_names[k + 1 :]
            assert torch.equal(high(low(x)), full)
            low_ids, high_ids = {id(p) for p in low.parameters()}, {id(p) for p in high.parameters()}
            assert not low_ids & high_ids and low_ids | high_ids == all_params
        # the pieces are views: changing the head through the upper piece changes the model
        _, high = model.split(model.stage_names[-2])
        high.head.bias.add_(1.0)
        assert torch.allclose(model(x), full + 1.0)


def test_split_prefix_and_bad_names() -> None:
    torch.manual_seed(0)
    model = ResNet18((3, 32, 32), 10, width=4)
    low, high = model.split("layer2")  # FedImpro's default cut: after the last layer2 block
    assert list(dict(low.named_children()))[-1] == "layer2_1"
    assert next(iter(dict(high.named_children()))) == "layer3_0"
    assert model.stage_output_shapes()["layer2_1"] == (8, 16, 16)
    for bad in ("layer", "layer5", "nope", "layer2_"):
        with pytest.raises(ValueError, match="layer1_0"):
            model.split(bad)
    with pytest.raises(ValueError, match="valid stage names"):
        model.forward_stages(torch.zeros(2, 3, 32, 32), start="nope")
    with pytest.raises(IndexError):
        model.forward_stages(torch.zeros(2, 3, 32, 32), stop=99)
    with pytest.raises(ValueError, match="increasing"):
        model.partition(["layer3", "layer2"])


@pytest.mark.parametrize("k", sorted(FUSEFL_RESNET18_CUTS))
def test_fusefl_partition(k: int) -> None:
    torch.manual_seed(0)
    model = ResNet18((3, 32, 32), 10, width=4).eval()
    pieces = model.partition(FUSEFL_RESNET18_CUTS[k])
    assert len(pieces) == k + 1
    assert list(dict(pieces[-1].named_children())) == ["head"]
    x = make_input(model)
    with torch.no_grad():
        y = x
        for piece in pieces:
            y = piece(y)
        assert torch.equal(y, model(x))
    if k == 8:  # the last block is the parameter-free pooling layer
        assert list(dict(pieces[7].named_children())) == ["pool"]
        assert count_parameters(pieces[7]) == 0


def test_stage_output_shapes_leaves_state_untouched() -> None:
    torch.manual_seed(0)
    model = ResNet18((3, 32, 32), 10, width=4)
    model.stages["stem"].eval()  # a mixed train/eval state must be restored exactly
    before = copy.deepcopy(model.state_dict())
    shapes = model.stage_output_shapes()
    assert shapes["pool"] == (32,)
    assert model.training and not model.stages["stem"].training and model.stages["layer1_0"].training
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_mlp_and_lstm_stage_names() -> None:
    assert build_model("mlp", (1, 8, 8), 10, hidden=(16, 8)).stage_names == ["flatten", "fc1", "fc2", "head"]
    assert build_model("mlp", (60,), 10, hidden=()).stage_names == ["flatten", "head"]
    assert build_model("cnn", (1, 28, 28), 10).stage_names == ["conv1", "conv2", "flatten", "fc", "head"]
    lstm = build_model("lstm", (80,), 80)
    assert lstm.stage_names == ["embed", "lstm", "head"]
    assert build_model("lstm", (80,), 53, vocab_size=80).vocab_size == 80


def test_cnn_skips_pool_on_small_inputs() -> None:
    model = build_model("cnn", (1, 8, 8), 10, channels=(4, 4, 4), hidden=8)
    assert [s[1:] for s in model.stage_output_shapes().values()][:3] == [(4, 4), (2, 2), (2, 2)]


# ---------------------------------------------------------------------------- sizes / norms
def test_resnet18_parameter_counts() -> None:
    assert count_parameters(ResNet18((3, 32, 32), 10)) == 11_173_962
    w20 = count_parameters(ResNet18((3, 32, 32), 10, width=20))
    assert w20 == 1_094_750 and abs(w20 - 1.095e6) < 1e3  # FuseFL card: 1.095M
    gn = ResNet18((3, 32, 32), 10, width=20, norm="group")
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in gn.modules())
    assert any(isinstance(m, nn.GroupNorm) for m in gn.modules())
    assert count_parameters(gn) == w20  # same affine parameters, no running statistics
    assert not [b for b in gn.buffers() if b.is_floating_point()]
    # VHL: 2C outputs for ResNet-18 on CIFAR-10 add 5,130 parameters
    assert count_parameters(ResNet18((3, 32, 32), 20)) - 11_173_962 == 5_130


@pytest.mark.parametrize("channels_last", [False, True])
def test_resnet18_pool_is_a_mean_over_height_and_width_with_adaptive_pooling_bits(channels_last: bool) -> None:
    """The global pool is x.mean((2, 3)) (deterministic backward on CUDA, engine.deterministic) and on the
    CPU gives AdaptiveAvgPool2d(1)'s bits, forward and backward: pinned results stay valid."""
    torch.manual_seed(0)
    model = ResNet18((3, 32, 32), 10, width=4)
    reference = copy.deepcopy(model)
    reference.stages["pool"] = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
    assert not any(isinstance(m, nn.AdaptiveAvgPool2d) for m in model.modules())
    x = torch.randn(6, 3, 32, 32)
    if channels_last:
        model, reference = model.to(memory_format=torch.channels_last), reference.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    outs = []
    for net in (model, reference):
        out = net(x)
        out.square().sum().backward()
        outs.append((out, [p.grad for p in net.parameters()]))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))
    pooled = model.stages["pool"](torch.arange(8.0).reshape(1, 2, 2, 2))
    assert torch.equal(pooled, torch.tensor([[1.5, 5.5]]))


def test_resnet18_shortcut_is_a_strided_1x1_conv_computed_without_the_strided_1x1_kernel() -> None:
    """The downsampling shortcut computes a stride-2 1x1 conv as a subsample then a stride-1 conv: oneDNN's
    strided 1x1 weight gradient on channels-last input with fewer than 8 input channels is wrong, hangs or
    crashes on AVX2 CPUs (oneDNN issue 6035; here layer2_0's 4 -> 8 channels at 32x32, the failing shape).
    Channels-last gradients match the NCHW model's, and the shortcut is the strided conv's map."""
    torch.manual_seed(0)
    model = ResNet18((3, 32, 32), 10, width=4)
    strided_1x1 = [m for m in model.modules()
                   if isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1) and m.stride != (1, 1)]
    assert not strided_1x1
    reference = copy.deepcopy(model)
    x = torch.randn(6, 3, 32, 32)
    model = model.to(memory_format=torch.channels_last)
    model(x.contiguous(memory_format=torch.channels_last)).square().sum().backward()
    reference(x).square().sum().backward()
    # other kernels, other rounding: at most 1e-4 of a tensor's gradient norm here; the strided kernel's was 1.56
    errors = {name: float((p.grad - q.grad).norm() / q.grad.norm())
              for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True)}
    assert max(errors.values()) < 1e-3, max(errors.items(), key=lambda kv: kv[1])
    block = reference.stages["layer2_0"]
    h = torch.randn(2, 4, 9, 9)  # odd size: the subsample keeps ceil(9 / 2) = 5 rows, as the strided conv
    strided = nn.functional.conv2d(h, block.shortcut[0].weight, stride=2)
    torch.testing.assert_close(block.shortcut[0](h[:, :, ::2, ::2]), strided, rtol=0, atol=1e-6)


def test_cnn_norm_options() -> None:
    kinds = {
        norm: {type(m) for m in build_model("cnn", (1, 28, 28), 10, norm=norm).modules()}
        for norm in ("none", "batch", "group")
    }
    assert nn.BatchNorm2d not in kinds["none"] and nn.GroupNorm not in kinds["none"]
    assert nn.BatchNorm2d in kinds["batch"] and nn.GroupNorm not in kinds["batch"]
    assert nn.GroupNorm in kinds["group"] and nn.BatchNorm2d not in kinds["group"]
    with pytest.raises(ValueError, match="norm"):
        build_model("cnn", (1, 28, 28), 10, norm="layer")
    with pytest.raises(ValueError, match="group_norm_groups"):
        build_model("resnet18", (3, 32, 32), 10, width=5, norm="group")


def test_default_parameter_counts() -> None:
    assert count_parameters(build_model("mlp", (1, 8, 8), 10)) == 9_610
    assert count_parameters(build_model("cnn", (1, 28, 28), 10)) == 421_642
    assert count_parameters(build_model("lstm", (80,), 80)) == 819_920


# ---------------------------------------------------------------------------- determinism / registry
def test_construction_is_deterministic(case) -> None:
    py_state, np_state = random.getstate(), np.random.get_state()
    a, b, c = make(case, seed=3), make(case, seed=3), make(case, seed=4)
    assert random.getstate() == py_state  # only torch's RNG is consumed
    assert np.array_equal(np.random.get_state()[1], np_state[1])
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa)


def test_registry_errors() -> None:
    assert set(MODELS) == {"mlp", "cnn", "resnet18", "lstm"}
    with pytest.raises(ValueError, match=r"'vgg11'.*resnet18"):
        build_model("vgg11", (3, 32, 32), 10)
    with pytest.raises(TypeError, match=r"'depth'.*width"):
        build_model("resnet18", (3, 32, 32), 10, depth=34)
    with pytest.raises(TypeError, match="dropout"):
        build_model("mlp", (1, 8, 8), 10, dropout=0.5)
    with pytest.raises(ModelInputError, match="seq_len"):
        build_model("lstm", (1, 80), 80)
    with pytest.raises(ModelInputError, match="channels, height, width"):
        build_model("cnn", (64,), 10)
    with pytest.raises(ValueError, match="num_classes"):
        build_model("mlp", (64,), 0)
    assert "vocab_size" in model_options("lstm") and "width" in model_options("resnet18")
    # Hydra hands over lists: accepted like tuples
    assert build_model("mlp", [1, 8, 8], 10, hidden=[8]).input_shape == (1, 8, 8)


# ---------------------------------------------------------------------------- flat-buffer views
def point_into_flat_buffer(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Re-point every parameter and float buffer to a view of one flat tensor, like the trainer."""
    tensors = list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    offset = 0
    for t in tensors:
        t.data = flat[offset : offset + t.numel()].view_as(t)
        offset += t.numel()
    return flat, tensors


def flat_of(model: nn.Module) -> torch.Tensor:
    tensors = list(model.parameters()) + [b for b in model.buffers() if b.is_floating_point()]
    return torch.cat([t.detach().reshape(-1) for t in tensors])


FLAT_CASES = [
    ("mlp", (1, 8, 8), {}),
    ("cnn", (1, 28, 28), {"channels": (4, 8), "hidden": 16, "norm": "batch"}),
    ("resnet18", (3, 32, 32), {"width": 4}),
    ("lstm", (12,), {"hidden": 16}),
]


@pytest.mark.parametrize(("name", "shape", "options"), FLAT_CASES, ids=[c[0] for c in FLAT_CASES])
def test_flat_buffer_views(name: str, shape: tuple[int, ...], options: dict[str, Any]) -> None:
    torch.manual_seed(0)
    model = build_model(name, shape, 10, **options)
    reference = copy.deepcopy(model)
    flat, tensors = point_into_flat_buffer(model)
    storage = flat.untyped_storage().data_ptr()
    x = make_input(model, batch=4)
    y = torch.arange(4) % 10
    lr = 0.1

    # one training step: the model through its flat buffer, the reference with torch's SGD
    model.train(), reference.train()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    ref_loss = nn.functional.cross_entropy(reference(x), y)
    ref_loss.backward()
    assert torch.allclose(loss, ref_loss)
    assert all(t.untyped_storage().data_ptr() == storage for t in tensors)  # BN wrote into the views
    grads = [
        t.grad if isinstance(t, nn.Parameter) and t.grad is not None else torch.zeros_like(t) for t in tensors
    ]
    flat_grad = torch.cat([g.reshape(-1) for g in grads])
    with torch.no_grad():
        flat.sub_(lr * flat_grad)
    torch.optim.SGD(reference.parameters(), lr=lr).step()
    assert torch.allclose(flat, flat_of(reference), atol=1e-6)  # params and running stats agree

    model.eval(), reference.eval()
    with torch.no_grad():
        after = model(x)
        assert torch.allclose(after, reference(x), atol=1e-5)
        # loading other weights is one copy_ into the flat buffer
        torch.manual_seed(1)
        other = build_model(name, shape, 10, **options).eval()
        flat.copy_(flat_of(other))
        assert torch.allclose(model(x), other(x), atol=1e-6)
        assert not torch.allclose(model(x), after)


# ---------------------------------------------------------------------------- inputs a model cannot train on
# Each dataset's samples (conf/dataset): shape and dtype, as its source produces them.
DATASET_SAMPLES: dict[str, tuple[tuple[int, ...], torch.dtype, int]] = {
    "digits": ((1, 8, 8), torch.float32, 10),
    "synthetic": ((60,), torch.float32, 10),
    "mnist": ((1, 28, 28), torch.float32, 10),
    "fashion_mnist": ((1, 28, 28), torch.float32, 10),
    "femnist": ((1, 28, 28), torch.float32, 62),
    "cifar10": ((3, 32, 32), torch.float32, 10),
    "cifar100": ((3, 32, 32), torch.float32, 100),
    "shakespeare": ((80,), torch.int64, 80),
}
# The (model, dataset) pairs that train with each model's default options; every other pair is refused.
TRAINABLE = {
    "mlp": {"digits", "synthetic", "mnist", "fashion_mnist", "femnist", "cifar10", "cifar100"},
    "cnn": {"digits", "mnist", "fashion_mnist", "femnist", "cifar10", "cifar100"},
    "resnet18": {"mnist", "fashion_mnist", "femnist", "cifar10", "cifar100"},  # BatchNorm: not 8x8 digits
    "lstm": {"shakespeare"},
}


def test_every_dataset_has_its_samples_listed() -> None:
    varying = {"hf", "custom"}  # their samples are those of whatever dataset.path / dataset._target_ names
    assert {p.stem for p in (CONF_DIR / "dataset").glob("*.yaml")} - varying == set(DATASET_SAMPLES)
    assert set(TRAINABLE) == set(MODELS)


@pytest.mark.parametrize("dataset", sorted(DATASET_SAMPLES))
def test_model_dataset_pairs_are_accepted_or_refused_with_a_clear_message(dataset: str) -> None:
    shape, dtype, classes = DATASET_SAMPLES[dataset]
    dims = "x".join(map(str, shape))
    for name in sorted(MODELS):
        if dataset in TRAINABLE[name]:
            check_model_input(name, shape, classes, dtype, dataset=dataset)
            continue
        with pytest.raises(ModelInputError) as err:
            check_model_input(name, shape, classes, dtype, dataset=dataset)
        message = str(err.value)
        assert message.startswith(f"model={name} cannot train on dataset={dataset}, which gives "), message
        assert f"of shape {dims}:" in message and MODELS[name].accepts in message
        others = sorted(m for m, ok in TRAINABLE.items() if dataset in ok)
        assert message.endswith(f"use {' or '.join(f'model={m}' for m in others)} instead"), message


def test_resnet18_on_digits_is_refused_when_built() -> None:
    """The BatchNorm after layer4 sees ceil(H / 8) x ceil(W / 8) maps: 1x1 from 8x8 down, where a
    one-sample training batch fails; 9 pixels in either direction give 2 values per channel."""
    with pytest.raises(ModelInputError, match=(
            r"^model=resnet18 cannot train on samples of shape 1x8x8: a BatchNorm layer would see 1x1 "
            r"feature maps.*Expected more than 1 value per channel.*use model=cnn or model=mlp instead$")):
        build_model("resnet18", (1, 8, 8), 10, width=2)
    for ok in [(1, 9, 9), (1, 8, 9), (3, 9, 8)]:
        model = build_model("resnet18", ok, 10, width=2)
        model.train()(torch.zeros(1, *ok))  # the claim the check makes: one sample trains
    build_model("resnet18", (1, 8, 8), 10, width=2, norm="group")  # GroupNorm has no such limit
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        ResNet18((1, 8, 8), 10, width=2).train()(torch.zeros(1, 1, 8, 8))  # what the check prevents


def test_the_dry_run_leaves_model_and_rng_untouched() -> None:
    """build_model's check runs the model in train mode; BatchNorm statistics, train/eval flags
    and the RNG must come out as plain construction leaves them (width=3: not checked before)."""
    torch.manual_seed(5)
    plain = ResNet18((3, 12, 12), 10, width=3)
    after_plain = torch.get_rng_state()
    torch.manual_seed(5)
    built = build_model("resnet18", (3, 12, 12), 10, width=3)
    assert torch.equal(torch.get_rng_state(), after_plain)
    assert all(m.training for m in built.modules())
    ref = plain.state_dict()
    for key, value in built.state_dict().items():
        assert torch.equal(value, ref[key]), key
    seeded = torch.manual_seed(5).get_state()
    check_model_input("resnet18", (3, 12, 12), 10, torch.float32, width=5)  # builds its own model
    assert torch.equal(torch.get_rng_state(), seeded)


def test_experiment_build_refuses_an_impossible_pair_before_any_round(tmp_path) -> None:
    cfg = compose_config("model=resnet18", "dataset=digits", "rounds=1", "num_clients=4", "clients_per_round=2")
    with pytest.raises(ModelInputError, match=(r"^model=resnet18 cannot train on dataset=digits, which gives "
                                               r"float samples of shape 1x8x8: a BatchNorm layer.*"
                                               r"use model=cnn or model=mlp instead$")):
        build(cfg, tmp_path)
    assert not (tmp_path / "config.yaml").exists() and not (tmp_path / "partition.npz").exists()
    # the dataset's dtype is checked too: a token model on float features
    cfg = compose_config("model=lstm", "dataset=synthetic", "partition=natural", "num_clients=4", "clients_per_round=2")
    with pytest.raises(ModelInputError, match=r"^model=lstm cannot train on dataset=synthetic.*integer token "
                                              r"ids.*use model=mlp instead$"):
        build(cfg)


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")))
def test_the_experiment_presets_pass_the_check(preset: str) -> None:
    cfg = compose_config(f"+experiment={preset}")
    shape, dtype, classes = DATASET_SAMPLES[cfg.dataset.name]
    check_model_input(cfg.model.name, shape, classes, dtype, dataset=cfg.dataset.name,
                      **read_config(cfg).model_options)


def test_ssgd_refuses_an_impossible_pair_before_training() -> None:
    from fl_platform.ssgd.config import compose_ssgd_config
    from fl_platform.ssgd.trainer import TensorData, build_flat_model

    cfg = compose_ssgd_config(["model=mlp", "dataset=shakespeare"])
    x, y = torch.zeros(4, 80, dtype=torch.long), torch.zeros(4, dtype=torch.long)
    data = TensorData(x, y, x, y, 80, (80,), vocab=[chr(32 + i) for i in range(80)])
    with pytest.raises(ModelInputError, match=r"^model=mlp cannot train on dataset=shakespeare, which gives "
                                              r"token-id samples of shape 80:.*use model=lstm instead$"):
        build_flat_model(cfg, data, torch.device("cpu"))
