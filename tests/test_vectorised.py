"""Vectorised cohort training equals the sequential loop (per client and for the round's global
model), falls back with a reason where it cannot, and sizes its chunks within a memory budget."""

from __future__ import annotations

import logging
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from fl_platform.algorithms.base import ClientAlgorithm, Setup
from fl_platform.algorithms.registry import get_algorithm
from fl_platform.core import Aggregate, Broadcast, RoundContext
from fl_platform.engine import worker as worker_module
from fl_platform.experiment import ConfigError, build
from fl_platform.models import build_model
from fl_platform.rounds.simulation import is_timing_key
from fl_platform.training.flat import FlatModel
from fl_platform.training.functional import FunctionalModel, NotVectorisable, gradient_terms
from fl_platform.training.hooks import Batch, ComposedHooks, GradientCorrectionHook, ProximalHook, TrainHooks
from fl_platform.training.loop import ClientData, LocalTrainer, NonFiniteError, TrainConfig
from fl_platform.training.vectorised import (
    CohortMember,
    CohortTrainer,
    auto_cohort_size,
    parse_cohort_size,
)

from .conftest import compose_config

SIZES = [13, 0, 1, 27, 10, 41, 6, 19]  # unequal: empty, single-sample, partial last batches
INPUT = (1, 8, 8)
TOL = 1e-6


def _model(name: str, **options) -> nn.Module:
    torch.manual_seed(0)
    return build_model(name, INPUT, 10, **options)


def _data(sizes=SIZES, seed: int = 1) -> list[ClientData]:
    g = torch.Generator().manual_seed(seed)
    total = sum(sizes) + 5
    x = torch.randn(total, *INPUT, generator=g)
    y = torch.randint(0, 10, (total,), generator=g)
    perm = torch.randperm(total, generator=g)
    out, lo = [], 0
    for n in sizes:
        out.append(ClientData(x, y, perm[lo : lo + n]))
        lo += n
    return out


def _sequential(fm: FlatModel, cfg: TrainConfig, datas, hooks, start, seed=3, round=2):
    trainer = LocalTrainer(fm, cfg)
    out = []
    for cid, (d, h) in enumerate(zip(datas, hooks)):
        fm.load(start)
        try:
            metrics = trainer.fit(d, h, seed=seed, round=round, client=cid)
        except NonFiniteError as err:
            out.append((None, err))
            continue
        out.append((fm.vector.detach().clone(), metrics))
    return out


def _assert_metrics_close(a, b):
    assert a.values.keys() == b.values.keys()
    for k in a.values:
        assert a.values[k][1] == b.values[k][1], k
        assert a.values[k][0] == pytest.approx(b.values[k][0], rel=1e-5, abs=1e-5), k


def _compare_fit(fm, cfg, datas, hooks, tol=TOL):
    start = fm.vector.detach().clone()
    seq = _sequential(fm, cfg, datas, hooks, start)
    cohort = CohortTrainer(fm, cfg)
    res = cohort.fit([CohortMember(c, d, start, h) for c, (d, h) in enumerate(zip(datas, hooks))], seed=3, round=2)
    for (vec, metrics), r in zip(seq, res):
        if vec is None:
            assert r.error is not None and str(r.error) == str(metrics)
            continue
        assert r.error is None
        assert float((r.vector - vec).abs().max()) <= tol
        _assert_metrics_close(r.metrics, metrics)
    return cohort, res


# ------------------------------------------------------------------ the trainer alone


@pytest.mark.parametrize("cfg", [
    TrainConfig(epochs=2, batch_size=10, lr=0.05),
    TrainConfig(epochs=1, batch_size=4, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=True, clip_norm=0.5),
    TrainConfig(steps=7, batch_size=5, lr=0.05, momentum=0.5),
    TrainConfig(epochs=2, batch_size=4, lr=0.05, drop_last=True),
    TrainConfig(epochs=2, batch_size=8, optimizer="adam", lr=1e-3, weight_decay=1e-4),
], ids=["sgd", "momentum-nesterov-wd-clip", "steps", "drop-last", "adam"])
def test_optimisers_and_step_rules_match_the_loop(cfg):
    fm = FlatModel(_model("mlp"))
    _compare_fit(fm, cfg, _data(), [None] * len(SIZES))


@pytest.mark.parametrize("norm", ["batch", "group"])
def test_normalisation_layers_keep_per_client_statistics(norm):
    fm = FlatModel(_model("cnn", channels=[8, 16], hidden=32, norm=norm))
    cohort, res = _compare_fit(fm, TrainConfig(epochs=2, batch_size=5, lr=0.05, momentum=0.9), _data(),
                               [None] * len(SIZES))
    assert cohort.fn.can_pad is (norm != "batch")  # BatchNorm statistics would see the padding
    if norm == "batch":  # running statistics are per client (they differ between clients)
        assert fm.num_buffers > 0
        assert not torch.equal(res[0].vector[fm.num_params:], res[3].vector[fm.num_params:])


class BatchCentre(nn.Module):
    """Subtracts the batch mean: samples of a batch interact without any BatchNorm."""

    def forward(self, x):
        return x - x.mean(dim=0, keepdim=True)


def test_samples_that_interact_are_never_padded():
    torch.manual_seed(0)
    fm = FlatModel(nn.Sequential(nn.Flatten(), nn.Linear(64, 16), BatchCentre(), nn.ReLU(), nn.Linear(16, 10)))
    cohort, _ = _compare_fit(fm, TrainConfig(epochs=1, batch_size=4, lr=0.05), _data(), [None] * len(SIZES))
    assert not cohort.fn.can_pad  # found by the probe: padding would change the batch mean


def test_frozen_parameters_stay_put():
    model = _model("mlp")
    model.stages["fc1"][0].weight.requires_grad_(False)
    fm = FlatModel(model)
    start = fm.vector.detach().clone()
    hooks = [GradientCorrectionHook(torch.full((fm.num_params,), 0.01))] * len(SIZES)
    cfg = TrainConfig(epochs=1, batch_size=4, lr=0.05, weight_decay=1e-2, clip_norm=1.0)
    _, res = _compare_fit(fm, cfg, _data(), hooks)
    frozen = torch.zeros(fm.num_params, dtype=torch.bool)
    for s, p in zip([s for s in fm.slots if s.is_param], model.parameters(), strict=True):
        frozen[s.offset : s.offset + s.numel] = not p.requires_grad
    assert torch.equal(res[3].vector[: fm.num_params][frozen], start[: fm.num_params][frozen])


def test_non_finite_client_gets_the_loop_s_error_and_others_are_unaffected():
    fm = FlatModel(_model("mlp"))
    datas = _data()
    datas[3].x[datas[3].indices[0]] = float("inf")  # client 3's data poison only its own training
    try:
        _compare_fit(fm, TrainConfig(epochs=1, batch_size=10, lr=0.05), datas, [None] * len(SIZES))
    finally:
        datas[3].x[datas[3].indices[0]] = 0.0


def test_same_inputs_same_bits_and_cohort_mates_do_not_matter():
    fm = FlatModel(_model("mlp"))
    cfg = TrainConfig(epochs=2, batch_size=10, lr=0.05, momentum=0.9)
    datas = _data()
    start = fm.vector.detach().clone()
    members = [CohortMember(c, d, start) for c, d in enumerate(datas)]
    a = [r.vector.clone() for r in CohortTrainer(fm, cfg).fit(members, seed=5, round=1)]
    b = [r.vector.clone() for r in CohortTrainer(fm, cfg).fit(members, seed=5, round=1)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    alone = CohortTrainer(fm, cfg).fit(members[3:5], seed=5, round=1)
    assert float((alone[0].vector - a[3]).abs().max()) <= TOL
    assert float((alone[1].vector - a[4]).abs().max()) <= TOL


# ------------------------------------------------------------------ algorithms


def _algorithm(name: str, fm: FlatModel, cfg: TrainConfig, **conf):
    spec = get_algorithm(name)
    setup = Setup(model_fn=lambda: None, num_params=fm.num_params, num_buffers=fm.num_buffers, num_classes=10,
                  input_shape=INPUT, num_clients=len(SIZES), seed=3, train=cfg)
    acfg = spec.conf(**conf)
    start = fm.vector.detach().clone()
    return spec, spec.client(acfg, setup), spec.server(acfg, setup, start), spec.server(acfg, setup, start)


@pytest.mark.parametrize("model", ["mlp", "cnn"])
@pytest.mark.parametrize("algorithm,conf", [("fedavg", {}), ("fedprox", {"mu": 0.1}), ("scaffold", {})])
def test_algorithms_cohort_updates_and_global_model_equal_sequential(model, algorithm, conf):
    fm = FlatModel(_model(model))
    cfg = TrainConfig(epochs=2, batch_size=10, lr=0.05)
    _, client, server_seq, server_vec = _algorithm(algorithm, fm, cfg, **conf)
    ctx = RoundContext(round=1, seed=3, clients=tuple(range(len(SIZES))), num_rounds=3, num_clients=len(SIZES))
    bc = server_seq.broadcast(ctx)
    g = torch.Generator().manual_seed(7)
    if algorithm == "scaffold":  # non-zero server and client control variates
        bc = Broadcast({**bc.tensors, "c": 0.01 * torch.randn(fm.num_params, generator=g)})
    states = [None if c % 3 == 0 or algorithm != "scaffold" else {"c": 0.01 * torch.randn(fm.num_params, generator=g)}
              for c in ctx.clients]
    datas = _data()
    trainer = LocalTrainer(fm, cfg)
    seq = [client.train(ctx, c, bc, s, d, trainer) for c, s, d in zip(ctx.clients, states, datas)]
    cohort = CohortTrainer(fm, cfg)
    vec = [u for _, u in client.train_cohort(ctx, ctx.clients, bc, states, datas, trainer, cohort)]
    agg_seq, agg_vec = Aggregate(), Aggregate()
    for a, b, n in zip(seq, vec, SIZES):
        assert a.client_id == b.client_id and a.weights == b.weights and a.num_samples == b.num_samples
        for name in a.tensors:  # per-client updates, unscaled by the sample weight
            scale = max(n, 1) if name == "delta" else 1
            assert float((a.tensors[name] - b.tensors[name]).abs().max()) / scale <= TOL, name
        if a.state is not None:
            assert float((a.state["c"] - b.state["c"]).abs().max()) <= TOL
        _assert_metrics_close(a.metrics, b.metrics)
        agg_seq.add_update(a)
        agg_vec.add_update(b)
    server_seq.aggregate(ctx, agg_seq)
    server_vec.aggregate(ctx, agg_vec)
    assert float((server_seq.weights - server_vec.weights).abs().max()) <= TOL


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_fedavg_chunk_summed_at_once_equals_the_sum_of_its_updates(model):
    """The worker's fast path (FedAvgCohort.sum_into) adds what summing the clients' updates adds,
    leaves out a rejected client, and returns each client's weight, samples and metrics."""
    fm = FlatModel(_model(model))
    cfg = TrainConfig(epochs=1, batch_size=10, lr=0.05)
    client = _algorithm("fedavg", fm, cfg)[1]
    ctx = RoundContext(round=0, seed=3, clients=tuple(range(len(SIZES))), num_rounds=1, num_clients=len(SIZES))
    datas = _data()
    datas[0].x[datas[3].indices] = float("nan")  # client 3 is rejected
    bc = Broadcast({"weights": fm.vector.clone()})
    trainer, cohort = LocalTrainer(fm, cfg), CohortTrainer(fm, cfg)
    states = [None] * len(SIZES)
    each = list(client.train_cohort(ctx, ctx.clients, bc, states, datas, trainer, cohort))
    expected = Aggregate()
    for _, u in each:
        if not isinstance(u, NonFiniteError):
            expected.add_update(u)
    got = Aggregate()
    summed = client.train_cohort(ctx, ctx.clients, bc, states, datas, trainer, cohort).sum_into(got)
    assert [c for c, _ in summed] == list(ctx.clients) and isinstance(summed[3][1], NonFiniteError)
    assert got.count == expected.count == len(SIZES) - 1 and got.weights == expected.weights
    assert float((got.tensors["delta"] - expected.tensors["delta"]).abs().max()) <= TOL
    for (_, a), (_, b) in zip(each, summed):
        if not isinstance(a, NonFiniteError):
            assert (a.weights, a.num_samples, a.metrics.values) == (b.weights, b.num_samples, b.metrics.values)
            assert b.bytes_up == fm.vector.numel() * 4 and not b.tensors
    earlier = cohort.fit([CohortMember(0, datas[0], bc.tensors["weights"])], seed=0, round=0)
    assert cohort.weighted_sum(earlier, [2.0]).equal(2 * earlier[0].vector.double())
    cohort.fit([CohortMember(0, datas[0], bc.tensors["weights"])], seed=0, round=0)
    with pytest.raises(ValueError, match="last fit"):  # an earlier fit's rows may have been reused
        cohort.weighted_sum(earlier, [1.0])


def test_hooks_without_a_functional_form_are_named():
    class ExtraLoss(TrainHooks):
        def loss(self, model, batch: Batch):
            return super().loss(model, batch)

    class Tracker(TrainHooks):
        def after_step(self, fm, batch):
            pass

    anchor = torch.zeros(3)
    assert gradient_terms(ComposedHooks(ProximalHook(0.0, anchor), GradientCorrectionHook(anchor))) != ()
    for hook, word in [(ExtraLoss(), "ExtraLoss"), (ComposedHooks(ProximalHook(0.1, anchor), Tracker()), "Tracker")]:
        with pytest.raises(NotVectorisable, match=word):
            gradient_terms(hook)


def test_algorithm_that_overrides_train_is_not_vectorised():
    class Custom(ClientAlgorithm):
        def train(self, ctx, client_id, broadcast, state, data, trainer):
            return super().train(ctx, client_id, broadcast, state, data, trainer)

    fm = FlatModel(_model("mlp"))
    client = Custom(None, None)  # type: ignore[arg-type]
    ctx = RoundContext(0, 0, (0,), 1, 1)
    with pytest.raises(NotVectorisable, match="Custom overrides train"):
        client.train_cohort(ctx, [0], Broadcast({"weights": fm.vector}), [None], _data([5]),
                            LocalTrainer(fm, TrainConfig()), CohortTrainer(fm, TrainConfig()))


def test_models_that_cannot_be_vmapped_give_a_reason():
    dropout = FlatModel(nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.Dropout(0.5), nn.Linear(16, 10)))
    data = _data([8])[0]
    assert "Dropout" in CohortTrainer(dropout, TrainConfig()).unsupported_reason(data.x, data.y)
    lstm = FlatModel(build_model("lstm", (12,), 20, hidden=8, num_layers=1))
    tokens = torch.randint(0, 20, (4, 12))
    reason = CohortTrainer(lstm, TrainConfig()).unsupported_reason(tokens, tokens[:, 0])
    assert reason is not None and "batching rule" in reason


# ------------------------------------------------------------------ chunk size and memory


class PeakMemory(TorchDispatchMode):
    """Peak bytes of the tensor storages allocated inside the context (CPU or any device)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def _track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key, n = st.data_ptr(), st.nbytes()
        if n == 0 or key in self.seen:
            return
        self.seen.add(key)
        self.live += n
        self.peak = max(self.peak, self.live)

        def release(key=key, n=n):
            self.live -= n
            self.seen.discard(key)

        weakref.finalize(st, release)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        return out


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_auto_cohort_size_with_a_tiny_budget_stays_within_it(optimizer):
    fm = FlatModel(_model("cnn", channels=[8, 16], hidden=32))
    cfg = TrainConfig(epochs=1, batch_size=10, optimizer=optimizer, momentum=0.9 if optimizer == "sgd" else 0.0)
    cohort = CohortTrainer(fm, cfg)
    datas = _data([23] * 40)
    per_client = cohort.per_client_bytes(datas[0].x)
    budget = 5 * per_client  # "free memory" of a tiny device: 2.5 clients' worth at the default fraction
    size = auto_cohort_size(per_client, num_clients=40, free_bytes=budget)
    assert size == 2
    start = fm.vector.detach().clone()
    with PeakMemory() as mem:
        cohort.fit([CohortMember(c, d, start) for c, d in enumerate(datas[:size])], seed=0, round=0)
    assert 0 < mem.peak <= budget // 2  # within the safety fraction of the budget, let alone the budget
    assert auto_cohort_size(per_client, num_clients=40, free_bytes=10**12) == 40
    assert auto_cohort_size(per_client, num_clients=40, free_bytes=1) == 1


@pytest.mark.parametrize("value,expected", [(1, 1), ("8", 8), ("auto", "auto"), ("AUTO", "auto")])
def test_parse_cohort_size(value, expected):
    assert parse_cohort_size(value) == expected


@pytest.mark.parametrize("value", [0, -3, "abc", 2.5, "", True])
def test_parse_cohort_size_names_the_key(value):
    with pytest.raises(ValueError, match=r"engine\.cohort_size"):
        parse_cohort_size(value)


# ------------------------------------------------------------------ the engine

ENGINE = ("rounds=2", "train.epochs=1", "num_clients=30", "clients_per_round=12", "engine.threads_per_worker=1")


def _run(*overrides: str) -> tuple[torch.Tensor, list[dict]]:
    exp = build(compose_config(*ENGINE, *overrides))
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    rows = [{k: v for k, v in row.items() if not is_timing_key(k)} for row in exp.simulation.history]
    return exp.simulation.server.weights.clone(), rows


def _assert_same_run(a, b) -> None:
    (wa, ra), (wb, rb) = a, b
    assert float((wa - wb).abs().max()) <= TOL
    assert [r.keys() for r in ra] == [r.keys() for r in rb]
    for x, y in zip(ra, rb):
        for k in x:
            if isinstance(x[k], float):
                assert x[k] == pytest.approx(y[k], rel=1e-5, abs=1e-7), k
            else:
                assert x[k] == y[k], k


@pytest.mark.parametrize("algorithm,model", [("fedavg", "mlp"), ("fedprox", "cnn"), ("scaffold", "cnn")])
def test_engine_with_cohorts_gives_the_sequential_run(algorithm, model):
    small_cnn = ("model.channels=[8,16]", "model.hidden=32") if model == "cnn" else ()
    ref = _run(f"algorithm={algorithm}", f"model={model}", *small_cnn)
    _assert_same_run(ref, _run(f"algorithm={algorithm}", f"model={model}", *small_cnn,
                               "engine.cohort_size=5", "engine.num_workers=2"))


@pytest.mark.ray
def test_inline_vs_ray_with_cohorts(ray_session):
    ref = _run("algorithm=scaffold", "engine.cohort_size=auto")
    _assert_same_run(ref, _run("algorithm=scaffold", "engine=ray", "engine.num_workers=2", "engine.cohort_size=4"))


def test_algorithm_without_functional_form_falls_back_with_one_log_line(caplog, monkeypatch):
    monkeypatch.setattr(worker_module, "_SEQUENTIAL_REASONS", set())
    ref = _run("algorithm=baow")
    with caplog.at_level(logging.WARNING, logger="fl_platform.engine.worker"):
        got = _run("algorithm=baow", "engine.cohort_size=4", "engine.num_workers=2")
    lines = [r.getMessage() for r in caplog.records if "clients train one by one" in r.getMessage()]
    assert len(lines) == 1 and "BAOWClient overrides train()" in lines[0]
    assert torch.equal(ref[0], got[0])


def test_bad_cohort_size_is_a_config_error():
    with pytest.raises(ConfigError, match=r"engine\.cohort_size"):
        build(compose_config(*ENGINE, "engine.cohort_size=lots"))


@pytest.mark.parametrize("model,input_shape", [("mlp", (60,)), ("mlp", (1, 8, 8)), ("cnn", (1, 8, 8)),
                                               ("cnn", (3, 12, 12))])
def test_the_batched_matmul_and_grouped_conv_step_equals_the_vmapped_step(model, input_shape):
    """Plain chains skip functorch (``_dense_grads``); their gradients, losses and hits are vmap's."""
    torch.manual_seed(0)
    options = {"hidden": [32, 16]} if model == "mlp" else {"channels": [4, 8], "hidden": 16}
    fm = FlatModel(build_model(model, input_shape, 10, **options), torch.device("cpu"))
    fn = FunctionalModel(fm)
    assert fn._dense is not None
    normed = build_model("cnn", (1, 8, 8), 10, norm="group")
    assert FunctionalModel(FlatModel(normed, torch.device("cpu")))._dense is None  # GroupNorm: vmap
    k, b = 4, 6
    rows = fm.vector.detach().repeat(k, 1)[:, : fn.num_params] + 0.01 * torch.randn(k, fn.num_params)
    x, y = torch.randn(k, b, *input_shape), torch.randint(0, 10, (k, b))
    weight = torch.ones(k, b)
    weight[1:, 4:] = 0  # shorter batches, padded
    for w in (None, weight):
        grads, loss, hits = fn.grads(rows, {}, x, y, w)
        views = fn.param_views(rows)
        g, (vloss, vhits) = fn._plain(views, {}, x, y) if w is None else fn._masked(views, {}, x, y, w)
        for got, slot in zip(grads, fn.param_slots):
            torch.testing.assert_close(got, g[slot.name].reshape(k, slot.numel), rtol=0, atol=1e-6)
        torch.testing.assert_close(loss, vloss, rtol=0, atol=1e-6)
        assert torch.equal(hits, vhits)


# ------------------------------------------------------------------ the step's options


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_bf16_cohort_equals_the_bf16_loop(name):
    """train.precision=bf16 in the cohort step: the loop's bf16 results (autocast in both), which are
    not fp32's."""
    fm = FlatModel(_model(name))
    cfg = TrainConfig(epochs=2, batch_size=5, lr=0.05, precision="bf16")
    _, res = _compare_fit(fm, cfg, _data(), [None] * len(SIZES), tol=1e-6)
    fp32 = CohortTrainer(fm, TrainConfig(epochs=2, batch_size=5, lr=0.05))
    start = fm.vector.detach().clone()
    ref = fp32.fit([CohortMember(c, d, start) for c, d in enumerate(_data())], seed=3, round=2)
    assert max(float((a.vector - b.vector).abs().max()) for a, b in zip(res, ref)) > 1e-4


def test_bf16_batchnorm_cohort_is_not_vectorisable():
    """BatchNorm's vmap rule takes no bf16 input beside fp32 statistics: probed at the run's precision,
    so the engine trains such clients one by one (with the reason logged) instead of failing mid-round."""
    fm = FlatModel(_model("cnn", norm="batch"))
    cohort = CohortTrainer(fm, TrainConfig(epochs=1, batch_size=5, precision="bf16"))
    data = _data()[0]
    assert "cannot be vmapped" in cohort.unsupported_reason(data.x, data.y)
    assert CohortTrainer(fm, TrainConfig(epochs=1, batch_size=5)).unsupported_reason(data.x, data.y) is None


def test_cohort_refuses_step_options_it_cannot_apply():
    fm = FlatModel(_model("cnn"))
    with pytest.raises(ValueError, match=r"train\.compile=True cannot apply with engine.cohort_size"):
        CohortTrainer(fm, TrainConfig(compile=True))
    with pytest.raises(ConfigError, match=r"train\.channels_last=True cannot apply with engine.cohort_size=4"):
        build(compose_config("model=cnn", "engine.cohort_size=4", "train.channels_last=true", "rounds=1"))


def test_the_probe_compares_without_tf32_and_restores_the_cudnn_flags(monkeypatch):
    """TF32 rounding, amplified by ResNet-18's gradient, made the probe refuse BatchNorm cohorts on an
    H200 (6.8e-2 > 1e-2): it compares with cuDNN's TF32 off, and every cuDNN flag is as before after."""
    b = torch.backends.cudnn
    monkeypatch.setattr(b, "benchmark", True)
    before = (b.enabled, b.benchmark, b.deterministic, b.allow_tf32)
    assert b.allow_tf32  # (torch's default, which the probe must not inherit)
    fn = FunctionalModel(FlatModel(_model("cnn", norm="batch"), torch.device("cpu")))
    seen = []
    probe = fn._probe

    def spy(*args):
        seen.append((b.allow_tf32, b.enabled, b.benchmark))
        return probe(*args)

    monkeypatch.setattr(fn, "_probe", spy)
    x, y = torch.randn(4, *INPUT), torch.tensor([0, 1, 2, 3])
    assert fn.unsupported_reason(x, y) is None
    assert seen == [(False, before[0], True)]
    assert (b.enabled, b.benchmark, b.deterministic, b.allow_tf32) == before
