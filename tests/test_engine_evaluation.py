"""Where the global model is evaluated (fl_platform/rounds/evaluation.py).

``engine.eval_device=worker`` (and ``auto`` when the workers train on GPUs and the driver's node has
none) evaluates on worker 0's device: the test and validation sets travel once, the server half at
each evaluation. The rows equal the driver's evaluation (inline) to 1e-6, for FedAvg with early
stopping's validation set and for a server half with an evaluation of its own (the one-shot
ensemble's, which reads every client model it keeps); the worker reports the sets it holds, and the
driver's model is never used."""

from __future__ import annotations

import pytest

from fl_platform.config_checks import ConfigError
from fl_platform.engine.ray_placement import evaluates_on_worker
from fl_platform.experiment import build
from fl_platform.rounds.evaluation import DriverEvaluator
from fl_platform.rounds.simulation import is_timing_key

from .conftest import compose_config

COMMON = ("rounds=2", "train.epochs=1", "num_clients=6", "clients_per_round=4", "engine.threads_per_worker=1",
          "save_model=false", "model=mlp", "model.hidden=[8]")


def run(*overrides: str) -> tuple[list[dict], list[dict], object]:
    """(metric rows without timings, the workers' node_info or [], the evaluator) of a run."""
    import ray

    exp = build(compose_config(*COMMON, *overrides))
    try:
        if not isinstance(exp.simulation.evaluator, DriverEvaluator):  # (the driver's copy must stay unused)
            exp.simulation.eval_model.load = _refuse
        exp.simulation.run()
        pool = getattr(exp.engine, "pool", None)
        infos = ray.get([actor.node_info.remote() for actor in pool]) if pool is not None else []
    finally:
        exp.engine.close()
    rows = [{k: v for k, v in row.items() if not is_timing_key(k)} for row in exp.simulation.history]
    return rows, infos, exp.simulation.evaluator


def _refuse(*args, **kwargs):
    raise AssertionError("the driver's model was used although a worker evaluates")


def assert_same_rows(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) and a
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k] == (pytest.approx(y[k], rel=1e-6, abs=1e-9) if isinstance(x[k], float) else y[k]), k


@pytest.mark.ray
@pytest.mark.parametrize("overrides", [("algorithm=fedavg", "early_stop.patience=5"),
                                       ("algorithm=oneshot_ensemble", "rounds=1", "algorithm.cache_dir=null")],
                         ids=["fedavg-validation", "oneshot_ensemble"])
def test_worker_evaluation_equals_the_drivers(ray_session, overrides):
    ref, _, _ = run(*overrides)
    rows, infos, evaluator = run(*overrides, "engine=ray", "engine.num_workers=2", "engine.eval_device=worker")
    assert_same_rows(rows, ref)
    assert "test_accuracy" in rows[-1]
    assert evaluator.where == "worker 0"
    validation = ["validation"] if "early_stop.patience=5" in overrides else []
    assert [info["eval_sets"] for info in infos] == [sorted(["test", *validation]), []]


def test_where_the_global_model_is_evaluated():
    assert evaluates_on_worker("worker", gpu_workers=False, driver_gpus=0)
    assert evaluates_on_worker("auto", gpu_workers=True, driver_gpus=0)  # GPUs, none on the driver's node
    assert not evaluates_on_worker("auto", gpu_workers=True, driver_gpus=1)  # a GPU of the driver's node
    assert not evaluates_on_worker("auto", gpu_workers=False, driver_gpus=0)  # CPU workers: the driver's CPU
    assert not evaluates_on_worker("cpu", gpu_workers=True, driver_gpus=0)


def test_worker_evaluation_needs_ray():
    with pytest.raises(ConfigError, match=r"engine\.eval_device.*needs engine=ray"):
        build(compose_config(*COMMON, "engine.eval_device=worker"))
