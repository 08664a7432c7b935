"""FedNova: the normalised aggregate against a hand computation, its refusals, inline = Ray."""

from __future__ import annotations

import pytest
import torch

from fl_platform.algorithms.base import Setup
from fl_platform.algorithms.fedavg import FedAvgClient, FedAvgConf, FedAvgServer
from fl_platform.algorithms.fednova import FedNovaClient, FedNovaConf, FedNovaServer, step_norm
from fl_platform.core import Aggregate, Broadcast, RoundContext
from fl_platform.experiment import build
from fl_platform.rounds.simulation import is_timing_key
from fl_platform.training.flat import FlatModel
from fl_platform.training.loop import ClientData, LocalTrainer, TrainConfig

from .conftest import compose_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_step_norm_matches_the_coefficients_written_out():
    # tau = 3, rho = 0.9. Heavy ball: g1 moves the model in steps 1..3 by 1, 0.9, 0.81 -> 2.71; g2 by 1.9;
    # g3 by 1: ||a||_1 = 5.61. Nesterov adds rho * buffer to each step: g1 1 + .9 + .81 + .729, g2 1 + .9
    # + .81, g3 1 + .9: 3.439 + 2.71 + 1.9 = 8.049.
    assert step_norm(3) == 3.0
    assert step_norm(3, 0.9) == pytest.approx(5.61, abs=1e-12)
    assert step_norm(3, 0.9, nesterov=True) == pytest.approx(8.049, abs=1e-12)
    assert step_norm(1, 0.9) == pytest.approx(1.0, abs=1e-12)


# Two clients: 2 and 6 samples at batch 2, so 1 and 3 local steps; p = (0.25, 0.75). The norms a_i are
# written out by hand: plain SGD (1, 3); momentum 0.9 (1, 1 + 1.9 + 2.71).
@pytest.mark.parametrize("momentum,norms", [(0.0, (1.0, 3.0)), (0.9, (1.0, 5.61))])
def test_aggregate_is_the_hand_computed_normalised_average_not_fedavgs(momentum, norms):
    torch.manual_seed(0)
    fm = FlatModel(torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5), torch.nn.ReLU(),
                                       torch.nn.Linear(5, 3)))
    train = TrainConfig(epochs=1, batch_size=2, lr=0.1, momentum=momentum)
    setup = Setup(model_fn=lambda: None, num_params=fm.num_params, num_buffers=fm.num_buffers, num_classes=3,
                  input_shape=(4,), num_clients=2, seed=0, train=train)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    datas = [ClientData(x, y, torch.arange(0, 2)), ClientData(x, y, torch.arange(2, 8))]
    x0 = fm.vector.detach().clone()
    ctx = RoundContext(round=0, seed=0, clients=(0, 1), num_rounds=1, num_clients=2)
    trainer = LocalTrainer(fm, train)

    def run(client):
        agg, moves = Aggregate(), []
        for cid, data in enumerate(datas):
            up = client.train(ctx, cid, Broadcast({"weights": x0}), None, data, trainer)
            agg.add_update(up)
            moves.append(fm.vector.detach().clone() - x0)  # x_i - x
        return agg, moves

    nova_agg, moves = run(FedNovaClient(FedNovaConf(), setup))
    avg_agg, avg_moves = run(FedAvgClient(FedAvgConf(), setup))
    for a, b in zip(moves, avg_moves):
        assert torch.equal(a, b)  # the same local training; only the contribution differs
    p, np_ = (0.25, 0.75), fm.num_params
    tau_eff = sum(pi * ai for pi, ai in zip(p, norms))
    expected = x0.double().clone()
    for pi, ai, move in zip(p, norms, moves):
        expected[:np_] += tau_eff * pi * move[:np_].double() / ai
        expected[np_:] += pi * move[np_:].double()  # BatchNorm statistics: FedAvg's mean
    nova = FedNovaServer(FedNovaConf(), setup, x0)
    out = nova.aggregate(ctx, nova_agg)
    assert out["tau_eff"] == pytest.approx(tau_eff, rel=1e-12)
    assert torch.allclose(nova.weights.double(), expected, rtol=0, atol=1e-6)
    fedavg = FedAvgServer(FedAvgConf(), setup, x0)
    fedavg.aggregate(ctx, avg_agg)
    assert float((fedavg.weights.double() - expected)[:np_].abs().max()) > 1e-3  # FedAvg is another point


def test_refuses_a_local_solver_without_step_coefficients_and_dp():
    base = ("algorithm=fednova", "model=mlp", "model.hidden=[8]", "num_clients=3", "clients_per_round=3",
            "rounds=1", "save_model=false")
    with pytest.raises(ValueError, match=r"train\.optimizer='adam'"):
        build(compose_config(*base, "train.optimizer=adam"))
    with pytest.raises(ValueError, match=r"fednova.*normaliser"):
        build(compose_config(*base, "privacy=central"))


def test_equal_step_counts_give_fedavgs_model():
    weights = []
    for alg in ("fedavg", "fednova"):
        exp = build(compose_config(f"algorithm={alg}", "model=mlp", "model.hidden=[8]", "num_clients=4",
                                   "clients_per_round=4", "rounds=2", "train.epochs=null", "train.steps=3",
                                   "train.momentum=0.9", "partition.alpha=0.3", "save_model=false"))
        try:
            exp.simulation.run()
        finally:
            exp.engine.close()
        weights.append(exp.simulation.server.weights)
    assert float((weights[0] - weights[1]).abs().max()) <= 1e-6


def _run(*engine: str):
    exp = build(compose_config("algorithm=fednova", "model=mlp", "model.hidden=[16]", "num_clients=6",
                               "clients_per_round=4", "rounds=2", "partition.alpha=0.3", "train.momentum=0.9",
                               "algorithm.server_momentum=0.5", "engine.threads_per_worker=1", "save_model=false",
                               *engine))
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    rows = [{k: v for k, v in row.items() if not is_timing_key(k)} for row in exp.simulation.history]
    return exp.simulation.server.weights, rows


@pytest.mark.ray
def test_fednova_is_the_same_inline_and_on_ray(ray_session):
    wa, ra = _run("engine=inline")
    wb, rb = _run("engine=ray", "engine.num_workers=2")
    assert float((wa - wb).abs().max()) <= 1e-6
    assert [r["tau_eff"] for r in ra] == pytest.approx([r["tau_eff"] for r in rb], rel=1e-12)
    assert ra[-1]["test_accuracy"] == pytest.approx(rb[-1]["test_accuracy"], abs=1e-9)
    assert ra[-1]["test_accuracy"] > 0.3


@pytest.mark.slow
def test_fednova_through_flower_equals_the_simulator(tmp_path):
    """The ServerApp/ClientApp carry FedNova's extra weight (n_i ||a_i||_1) and give the simulator's model."""
    from fl_platform.experiment import run_experiment
    from fl_platform.flower import config as fc
    from fl_platform.flower.client_app import app as client_app
    from fl_platform.flower.server_app import run_server

    from .test_flower_unit import SMALL, LocalGrid, max_diff, nodes, run_config, weights_of

    overrides = ["algorithm=fednova", "train.momentum=0.9", "partition=dirichlet", "partition.alpha=0.3"]
    cfg = fc.compose([*SMALL, *overrides])
    rc = run_config(*overrides)
    summary = run_server(LocalGrid(client_app, nodes(cfg.num_clients), rc), rc, run_id=5, run_dir=tmp_path / "flower")
    sim = run_experiment(cfg, tmp_path / "sim")
    assert max_diff(weights_of(tmp_path / "flower"), weights_of(tmp_path / "sim")) < 1e-5
    assert summary["final_test_accuracy"] == pytest.approx(sim["final_test_accuracy"])
