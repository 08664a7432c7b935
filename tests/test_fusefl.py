"""FuseFL: the card's parameter counts, the fused forward pass, frozen levels, exact calibration, bad input."""

from __future__ import annotations

import pytest
import torch

from fl_platform.algorithms.base import Setup
from fl_platform.algorithms.fusefl import (
    Branch,
    FuseFLConf,
    FuseFLModel,
    FusePlan,
    class_statistics,
    get_vector,
    plan_cuts,
    pool_statistics,
    set_vector,
)
from fl_platform.algorithms.oneshot.protocol import count_model
from fl_platform.experiment import build
from fl_platform.models import build_model
from fl_platform.rounds.setup import ModelFactory
from fl_platform.training.flat import FlatModel
from fl_platform.training.loop import ClientData, LocalTrainer, TrainConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one torch thread (conftest)


def _setup(name: str, shape: tuple[int, ...], clients: int, **options) -> Setup:
    return Setup(ModelFactory(name, shape, 10, options), 0, 0, 10, shape, clients, 0, TrainConfig())


def _random_levels(plan: FusePlan, count: int, gen: torch.Generator):
    levels = []
    for j in range(count):
        # uniform in [0, 0.2): BatchNorm running variances must stay positive
        blocks = torch.rand(plan.M, plan.block_sizes[j], generator=gen) * 0.2
        adaptors = torch.rand(plan.M, plan.adaptor_sizes[j], generator=gen) * 0.2 if j else None
        levels.append((blocks, adaptors))
    return levels


@pytest.mark.parametrize(("blocks", "millions", "adaptor_per_client"), [(2, 5.51, 8_040), (4, 5.68, 42_140),
                                                                        (8, 6.98, 302_500)])
def test_fused_resnet18_has_the_parameter_count_the_card_predicts(blocks, millions, adaptor_per_client):
    # Card: CIFAR-10, ResNet-18 width 20, M = 5 clients.
    plan = FusePlan(_setup("resnet18", (3, 32, 32), 5, width=20), FuseFLConf(blocks=blocks))
    assert sum(plan.adaptor_sizes) == adaptor_per_client
    model = plan.fused_model(_random_levels(plan, blocks, torch.Generator().manual_seed(0)),
                             torch.zeros(plan.head_size))
    params, _ = count_model(model)
    single = count_model(build_model("resnet18", (3, 32, 32), 10, width=20))[0]
    head = 8 * 20 * 10 + 10
    assert params == 5 * (single - head) + 5 * adaptor_per_client + head
    assert round(params / 1e6, 2) == millions


def test_fused_forward_equals_hand_assembled_branches():
    plan = FusePlan(_setup("cnn", (1, 8, 8), 3, channels=[4, 6], hidden=12, norm="batch"), FuseFLConf(blocks=2))
    assert plan.cuts == ["conv1", "fc"]
    gen = torch.Generator().manual_seed(1)
    levels = _random_levels(plan, 2, gen)
    head = torch.randn(plan.head_size, generator=gen)
    model = plan.fused_model(levels, head).eval()
    # Hand assembly from plain copies of the model's own stages.
    base = build_model("cnn", (1, 8, 8), 10, channels=[4, 6], hidden=12, norm="batch").eval()
    low, high, top = base.partition(["conv1", "fc"])
    x = torch.randn(5, 1, 8, 8, generator=gen)
    with torch.no_grad():
        level1 = []
        for m in range(3):
            set_vector(low, levels[0][0][m])
            level1.append(low(x))
        cat = torch.cat(level1, dim=1)
        feature = 0
        for m in range(3):
            adaptor = torch.nn.Conv2d(12, 4, 1)
            set_vector(adaptor, levels[1][1][m])
            set_vector(high, levels[1][0][m])
            feature = feature + high(adaptor(cat)).flatten(1)
        set_vector(top, head)
        expected = top(feature)
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)


def test_client_model_trains_its_part_and_keeps_fused_levels_frozen():
    plan = FusePlan(_setup("cnn", (1, 8, 8), 2, channels=[4, 6], hidden=12, norm="batch"), FuseFLConf(blocks=2))
    gen = torch.Generator().manual_seed(2)
    (level,) = _random_levels(plan, 1, gen)
    fused = plan.level(0, *level)
    own = Branch(plan.make_adaptor(1), plan.make_block(1))
    model = FuseFLModel([fused], own, [], plan.make_head())
    fm = FlatModel(model)
    before_fused, before_own = get_vector(fused), get_vector(own)
    x, y = torch.randn(64, 1, 8, 8, generator=gen), torch.randint(0, 10, (64,), generator=gen)
    LocalTrainer(fm, TrainConfig(epochs=2, batch_size=16, lr=0.1, momentum=0.9)).fit(
        ClientData(x, y, torch.arange(64)), seed=0, round=1, client=0)
    assert torch.equal(get_vector(fused), before_fused)  # parameters and BN running statistics
    assert not torch.equal(get_vector(own), before_own)
    assert not fused.training and model.own.training


def test_state_pack_unpack_round_trip():
    plan = FusePlan(_setup("cnn", (1, 8, 8), 3, channels=[4, 6, 8], hidden=12), FuseFLConf(blocks=4))
    specs = plan.state_spec()
    assert specs["upper"].size == sum(plan.block_sizes[1:])
    gen = torch.Generator().manual_seed(3)
    upper = [plan.make_block(j, torch.randn(plan.block_sizes[j], generator=gen)) for j in range(2, 4)]
    head = plan.make_head(torch.randn(plan.head_size, generator=gen))
    adaptor = set_vector(plan.make_adaptor(2), torch.randn(plan.adaptor_sizes[2], generator=gen))
    state = plan.pack(2, upper, head, adaptor)
    assert {k: v.numel() for k, v in state.items()} == {k: s.size for k, s in specs.items()}
    blocks, head_vec, adaptor_vec = plan.unpack(2, state)
    assert all(torch.equal(b, get_vector(u)) for b, u in zip(blocks, upper))
    assert torch.equal(head_vec, get_vector(head)) and torch.equal(adaptor_vec, get_vector(adaptor))


def test_pooled_class_statistics_are_exact_and_reference_mode_keeps_the_bug():
    gen = torch.Generator().manual_seed(4)
    parts = [(torch.randn(n, 5, generator=gen) + shift, torch.randint(0, 3, (n,), generator=gen))
             for n, shift in [(40, 0.0), (25, 2.0), (1, -1.0)]]
    stats = [class_statistics(f, y, 3, correction=1) for f, y in parts]
    total, mu, cov = pool_statistics(*(torch.stack(s) for s in zip(*stats)))
    feats, labels = torch.cat([f for f, _ in parts]).double(), torch.cat([y for _, y in parts])
    for c in range(3):
        fc = feats[labels == c]
        assert total[c] == fc.shape[0]
        torch.testing.assert_close(mu[c], fc.mean(0))
        torch.testing.assert_close(cov[c], torch.cov(fc.T, correction=1))
    ref = [class_statistics(f, y, 3, correction=0) for f, y in parts]
    _, _, cov_ref = pool_statistics(*(torch.stack(s) for s in zip(*ref)), reference=True)
    # The reference never subtracts the mean outer product: an uncentred, wider matrix.
    assert torch.linalg.eigvalsh(cov_ref[0] - cov[0]).max() > 0.1


def test_bad_input_fails_with_a_clear_message(make_config):
    cnn = build_model("cnn", (1, 8, 8), 10, channels=[4, 6])
    assert plan_cuts(cnn, 3) == ["conv1", "conv2", "fc"]
    with pytest.raises(ValueError, match=r"at most 3 FuseFL blocks.*blocks=4"):
        plan_cuts(cnn, 4)
    with pytest.raises(ValueError, match=r"ResNet18 into K in \[2, 3, 4, 8\].*blocks=5"):
        plan_cuts(build_model("resnet18", (1, 8, 8), 10, width=2, norm="group"), 5)
    with pytest.raises(ValueError, match="no trainable stage below its head"):
        plan_cuts(build_model("mlp", (4,), 3, hidden=()), 1)
    with pytest.raises(ValueError, match=r"at most 1 FuseFL blocks"):
        plan_cuts(build_model("lstm", (5,), 7, hidden=4, embed_dim=3, num_layers=1), 2)
    with pytest.raises(ValueError, match=r"algorithm.cuts must name blocks - 1 = 1"):
        plan_cuts(cnn, 2, ["conv1", "conv2"])
    with pytest.raises(ValueError, match="needs a staged model"):
        plan_cuts(torch.nn.Linear(3, 3), 2)
    with pytest.raises(ValueError, match=r"algorithm.blocks=5"):
        build(make_config("algorithm=fusefl", "algorithm.blocks=5", "model=cnn", "dataset=digits", "num_clients=3",
                         "clients_per_round=3"))


def _fusefl_config(make_config, *extra: str):
    return make_config("algorithm=fusefl", "algorithm.blocks=2", "rounds=3", "dataset=digits", "model=cnn",
                          "model.channels=[6,8]", "model.hidden=16", "model.norm=batch", "num_clients=3",
                          "clients_per_round=3", "partition.alpha=1.0", "train.epochs=2", "train.batch_size=32",
                          "train.lr=0.05", "train.momentum=0.9", "algorithm.sample_per_class=300", *extra)


def test_round_count_and_participation_are_checked(make_config):
    for overrides, message in [(("rounds=2",), r"set rounds=3, got rounds=2"),
                               (("clients_per_round=2",), r"clients_per_round=num_clients=3")]:
        exp = build(_fusefl_config(make_config, *overrides))
        try:
            with pytest.raises(ValueError, match=message):
                exp.simulation.run()
        finally:
            exp.engine.close()


def test_fusefl_runs_end_to_end_and_counts_the_statistics_upload(make_config):
    exp = build(_fusefl_config(make_config))
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    rows = exp.simulation.history
    assert "test_accuracy" not in rows[0]  # no final model before every level is fused
    d, c = 16, 10
    assert rows[2]["bytes_up"] == 3 * 4 * (c + c * d + c * d * (d + 1) // 2)
    plan = exp.simulation.server.plan
    assert rows[1]["bytes_up"] == 3 * 4 * (plan.block_sizes[1] + plan.adaptor_sizes[1] + plan.head_size)
    assert rows[2]["test_accuracy"] > 0.5
    assert rows[2]["uncalibrated_test_accuracy"] == rows[1]["test_accuracy"]
