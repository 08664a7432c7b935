"""Every one-shot method and FuseFL give the same result under engine=inline and engine=ray (2 workers)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fl_platform.experiment import build
from fl_platform.rounds.simulation import is_timing_key

from .conftest import compose_config

COMMON = ("dataset=digits", "model=cnn", "model.channels=[6,8]", "model.hidden=16", "model.norm=batch",
          "num_clients=4", "clients_per_round=4", "partition.alpha=0.5", "train.epochs=1", "train.batch_size=32",
          "train.lr=0.05", "train.momentum=0.9", "engine.threads_per_worker=1", "save_model=false")
GENERATOR = ("algorithm.epochs=2", "algorithm.g_steps=3", "algorithm.ngf=4", "algorithm.nz=8",
             "algorithm.synthesis_batch_size=32", "algorithm.kd_batch_size=32")
METHODS: dict[str, tuple[str, ...]] = {
    "oneshot_fedavg": ("rounds=1",),
    "oneshot_ensemble": ("rounds=1",),
    "oneshot_feddf": ("rounds=1", "algorithm.steps=30", "algorithm.eval_every=10"),
    "oneshot_dense": ("rounds=1", *GENERATOR),
    "oneshot_coboost": ("rounds=1", *GENERATOR),
    "oneshot_adi": ("rounds=1", "algorithm.epochs=2", "algorithm.di_steps=3", "algorithm.synthesis_batch_size=32",
                    "algorithm.kd_batch_size=32"),
    "fusefl": ("rounds=3", "algorithm.blocks=2", "algorithm.sample_per_class=100"),
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one torch thread (conftest)


def _tensors(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a (nested) server state, by path."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(_tensors(v, f"{prefix}/{k}"))
    elif isinstance(state, list | tuple):
        for i, v in enumerate(state):
            out.update(_tensors(v, f"{prefix}/{i}"))
    return out


def _run(method: str, engine: tuple[str, ...], cache) -> tuple[dict[str, torch.Tensor], list[dict]]:
    extra = (f"algorithm.cache_dir={cache}",) if method.startswith("oneshot_") else ()
    exp = build(compose_config(f"algorithm={method}", *COMMON, *METHODS[method], *engine, *extra))
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    rows = [{k: v for k, v in row.items() if not is_timing_key(k)} for row in exp.simulation.history]
    return _tensors(exp.simulation.server.state_dict()), rows


@pytest.mark.ray
@pytest.mark.parametrize("method", list(METHODS))
def test_method_is_the_same_inline_and_on_ray(ray_session, tmp_path, method):
    # Each engine trains its own client models (separate caches, so Ray really trains them).
    sa, ra = _run(method, ("engine=inline",), tmp_path / "inline")
    sb, rb = _run(method, ("engine=ray", "engine.num_workers=2"), tmp_path / "ray")
    assert sa.keys() == sb.keys() and sa
    for key in sa:
        diff = (sa[key].double() - sb[key].double()).abs()
        assert diff.numel() == 0 or float(diff.max()) <= 1e-6, key
    assert len(ra) == len(rb)
    for x, y in zip(ra, rb):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], float):
                assert x[k] == pytest.approx(y[k], rel=1e-6, abs=1e-9), k
            else:
                assert x[k] == y[k], k
    assert ra[-1]["test_accuracy"] > 0.1
