"""The engine never changes the result: inline, Ray with 1 and 2 workers, and every state store
give the same global model (max abs difference <= 1e-6) and the same metrics."""

from __future__ import annotations

import pytest
import torch

from fl_platform.rounds.simulation import is_timing_key
from fl_platform.experiment import build

from .conftest import compose_config

COMMON = ("rounds=3", "train.epochs=1", "clients_per_round=12", "engine.threads_per_worker=1")


def run(*overrides: str) -> tuple[torch.Tensor, list[dict]]:
    exp = build(compose_config(*COMMON, *overrides))
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    rows = [{k: v for k, v in row.items() if not is_timing_key(k)} for row in exp.simulation.history]
    return exp.simulation.server.weights.clone(), rows


def assert_same(a: tuple[torch.Tensor, list[dict]], b: tuple[torch.Tensor, list[dict]]) -> None:
    wa, ra = a
    wb, rb = b
    assert float((wa - wb).abs().max()) <= 1e-6
    assert len(ra) == len(rb)
    for x, y in zip(ra, rb):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], float):
                assert x[k] == pytest.approx(y[k], rel=1e-6, abs=1e-9), k
            else:
                assert x[k] == y[k], k


def test_inline_worker_count_does_not_change_fedavg():
    assert_same(run("engine.num_workers=1"), run("engine.num_workers=3"))


@pytest.mark.parametrize("store", ["memory", "disk", "distributed"])
def test_inline_scaffold_state_stores_agree(store):
    ref = run("algorithm=scaffold")
    assert_same(ref, run("algorithm=scaffold", "engine.num_workers=2", f"engine.state_store={store}",
                         "engine.state_cache_mb=0.05"))


@pytest.mark.ray
def test_fedavg_inline_vs_ray_1_and_2_workers(ray_session):
    ref = run("engine=inline")
    assert_same(ref, run("engine=ray", "engine.num_workers=1"))
    assert_same(ref, run("engine=ray", "engine.num_workers=2"))


@pytest.mark.ray
@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_ray_compiled_graph_rounds_equal_rpc_rounds(ray_session, algorithm):
    def ray_run(compiled: bool):
        exp = build(compose_config(*COMMON, f"algorithm={algorithm}", "engine=ray", "engine.num_workers=2",
                                   "engine.state_store=disk", f"engine.compiled_graph={str(compiled).lower()}"))
        try:
            exp.simulation.run()
            assert (exp.engine._dag is not None) is compiled  # the path under test was taken
        finally:
            exp.engine.close()
        rows = [{k: v for k, v in row.items() if not is_timing_key(k)} for row in exp.simulation.history]
        return exp.simulation.server.weights.clone(), rows

    assert_same(ray_run(True), ray_run(False))


@pytest.mark.ray
@pytest.mark.parametrize("store", ["disk", "distributed"])
def test_scaffold_inline_vs_ray_2_workers(ray_session, store):
    ref = run("algorithm=scaffold")
    assert_same(ref, run("algorithm=scaffold", "engine=ray", "engine.num_workers=2",
                         f"engine.state_store={store}"))


@pytest.mark.ray
def test_ray_one_worker_hosts_the_rounds_between_checkpoints(ray_session, tmp_path):
    """One stateless Ray worker runs the rounds itself, server step and evaluation included, one call
    per checkpoint interval; the model, the metrics and the server's momentum equal inline's."""
    common = ("algorithm=fedavg", "algorithm.server_momentum=0.9", "rounds=5", "eval_every=2", "checkpoint_every=2")
    ref = run(*common, "engine=inline")

    def ray_run(hosted: bool):
        exp = build(compose_config(*COMMON, *common, "engine=ray", "engine.num_workers=1",
                                   f"engine.server_in_worker={str(hosted).lower()}"), tmp_path / str(hosted))
        try:
            exp.simulation.run()
            assert exp.engine.hosts_rounds() is hosted
            assert exp.engine.hosted_calls == (3 if hosted else 0)  # rounds 1-2, 3-4, 5
        finally:
            exp.engine.close()
        rows = [{k: v for k, v in row.items() if not is_timing_key(k)} for row in exp.simulation.history]
        assert [("test_accuracy" in row) for row in rows] == [False, True, False, True, True]
        walls = [row["wall_time_s"] for row in exp.simulation.history]
        assert walls == sorted(walls)
        return exp.simulation.server.weights.clone(), rows, exp.simulation.server.velocity.clone()

    hosted, per_round = ray_run(True), ray_run(False)
    assert_same(ref, hosted[:2])
    assert_same(ref, per_round[:2])
    assert torch.equal(hosted[2], per_round[2])  # server state beyond the weights travels back too


@pytest.mark.ray
@pytest.mark.parametrize("algorithm", ["scaffold", "oneshot_ensemble"])
def test_ray_one_worker_keeps_stateful_and_list_mode_rounds_on_the_driver(ray_session, algorithm):
    """Client state must be committed round by round (a crash reruns one round); a list-mode server's
    heavy step keeps the driver's threads."""
    exp = build(compose_config(*COMMON, f"algorithm={algorithm}", "engine=ray", "engine.num_workers=1"))
    try:
        assert not exp.engine.hosts_rounds()
    finally:
        exp.engine.close()


@pytest.mark.ray
@pytest.mark.parametrize("workers, hosted, compiled", [(2, False, False), (1, False, True)])
def test_compiled_graph_auto_leaves_the_driver_a_core(ray_session, workers, hosted, compiled):
    """auto: the graph only when Ray has a CPU beyond the workers' (the session's Ray has 2)."""
    exp = build(compose_config(*COMMON, "engine=ray", f"engine.num_workers={workers}",
                               f"engine.server_in_worker={str(hosted).lower()}"))
    try:
        assert exp.engine.compiled is compiled
    finally:
        exp.engine.close()


def test_compiled_graph_setting_is_checked():
    with pytest.raises(ValueError, match=r"engine\.compiled_graph must be auto, true or false"):
        build(compose_config(*COMMON, "engine.compiled_graph=sometimes"))


def test_rounds_on_the_worker_evaluate_with_the_drivers_threads(monkeypatch):
    from fl_platform.engine.hosted import _WorkerSimulation
    from fl_platform.rounds.simulation import Simulation

    seen: list[int] = []
    monkeypatch.setattr(Simulation, "evaluate", lambda self: seen.append(torch.get_num_threads()) or {})
    own = torch.get_num_threads()
    sim = object.__new__(_WorkerSimulation)  # only its evaluate() is under test
    sim.eval_threads = own + 1
    sim.evaluate()
    assert seen == [own + 1] and torch.get_num_threads() == own  # the worker's training threads come back
