"""train.shuffle_offset: the noise-floor control of docs/results changes the clients' minibatch orders
and nothing else (partition, initial model, sampled clients), in the loop and in vectorised cohorts."""

from __future__ import annotations

import torch

from fl_platform.experiment import build
from fl_platform.models import build_model
from fl_platform.seeding import Stream, torch_generator
from fl_platform.training.flat import FlatModel
from fl_platform.training.hooks import TrainHooks
from fl_platform.training.loop import ClientData, LocalTrainer, TrainConfig
from fl_platform.training.vectorised import CohortMember, CohortTrainer

from .conftest import compose_config

N, BS, SEED, ROUND, CLIENT = 12, 4, 5, 3, 2


class _Record(TrainHooks):
    """Records the row ids of every minibatch (each sample's first feature is its row id)."""

    def __init__(self) -> None:
        self.rows: list[int] = []

    def loss(self, model, batch):
        self.rows += batch.x[:, 0].round().long().tolist()
        return super().loss(model, batch)


def _client() -> tuple[FlatModel, ClientData]:
    torch.manual_seed(0)
    x = torch.randn(2 * N, 8)
    x[:, 0] = torch.arange(2 * N, dtype=torch.float32)  # row ids
    y = torch.randint(0, 3, (2 * N,))
    return FlatModel(build_model("mlp", (8,), 3, hidden=[4])), ClientData(x, y, torch.arange(N, 2 * N))


def _orders(offset: int) -> list[int]:
    fm, data = _client()
    hooks = _Record()
    LocalTrainer(fm, TrainConfig(epochs=2, batch_size=BS, lr=0.01, shuffle_offset=offset)).fit(
        data, hooks, seed=SEED, round=ROUND, client=CLIENT)
    return hooks.rows


def _expected(*keys: int) -> list[int]:
    gen = torch_generator(SEED, Stream.SHUFFLE, ROUND, CLIENT, *keys)
    return [N + int(i) for _ in range(2) for i in torch.randperm(N, generator=gen)]


def test_offset_zero_keeps_the_run_s_orders_and_an_offset_draws_other_ones():
    assert _orders(0) == _expected()
    assert _orders(3) == _expected(3)
    assert _orders(3) != _orders(0) and _orders(3) != _orders(1)


def test_cohort_training_takes_the_same_offset_as_the_loop():
    cfg = TrainConfig(epochs=2, batch_size=BS, lr=0.05, shuffle_offset=1)
    results = []
    for trainer in ("loop", "cohort"):
        fm, data = _client()
        start = fm.vector.detach().clone()
        if trainer == "loop":
            LocalTrainer(fm, cfg).fit(data, None, seed=SEED, round=ROUND, client=CLIENT)
            results.append(fm.vector.detach().clone())
        else:
            res = CohortTrainer(fm, cfg).fit([CohortMember(CLIENT, data, start, None)], seed=SEED, round=ROUND)
            results.append(res[0].vector)
    fm, data = _client()
    LocalTrainer(fm, TrainConfig(epochs=2, batch_size=BS, lr=0.05)).fit(data, None, seed=SEED, round=ROUND,
                                                                          client=CLIENT)
    assert float((results[0] - results[1]).abs().max()) <= 1e-6
    assert float((results[0] - fm.vector).abs().max()) > 1e-4  # the offset acted


def test_a_run_with_an_offset_differs_only_in_its_minibatch_orders():
    base = ("dataset=digits", "model=mlp", "model.hidden=[8]", "num_clients=6", "clients_per_round=3", "rounds=1",
            "train.epochs=1", "train.batch_size=16", "seed=4", "logger.progress=false", "save_model=false")
    exps = [build(compose_config(*base, f"train.shuffle_offset={k}")) for k in (0, 1)]
    a, b = exps
    assert (a.data.partition.indices == b.data.partition.indices).all()
    assert (a.data.partition.offsets == b.data.partition.offsets).all()
    assert torch.equal(a.simulation.server.weights, b.simulation.server.weights)  # same initial model
    rows = [exp.simulation.run_round(0) for exp in exps]
    assert rows[0]["num_clients"] == rows[1]["num_clients"] and rows[0]["bytes_up"] == rows[1]["bytes_up"]
    assert rows[0]["train_loss"] != rows[1]["train_loss"]
    assert not torch.equal(a.simulation.server.weights, b.simulation.server.weights)
