"""Personalised FL: local test splits, per-client evaluation, FedBN, FedPer, FedRep, Ditto, fine-tuning.

Each mechanism test compares an algorithm's client or server half against the rule it implements,
written out here step by step, so that breaking the rule (a personal part averaged, a phase
skipped, the proximal pull dropped) turns it red.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from fl_platform.algorithms.base import Setup
from fl_platform.algorithms.ditto import DittoClient, DittoConf
from fl_platform.algorithms.fedbn import FedBNClient, FedBNConf, FedBNServer
from fl_platform.algorithms.fedper import FedPerClient, FedPerConf, FedRepClient, FedRepConf
from fl_platform.algorithms.personal import PERSONAL
from fl_platform.core import Aggregate, Broadcast, RoundContext
from fl_platform.datasets.federated import build_federated_dataset, split_local_test
from fl_platform.experiment import build
from fl_platform.rounds.client_eval import CLIENT_METRICS, evaluate_client, summarise, to_host
from fl_platform.rounds.setup import ModelFactory
from fl_platform.rounds.simulation import is_timing_key
from fl_platform.seeding import Stream
from fl_platform.training.flat import FlatModel
from fl_platform.training.loop import ClientData, LocalTrainer, TrainConfig

from .conftest import compose_config, slot_mask
from .interrupt import StopAfter

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL = ("dataset=digits", "num_clients=6", "clients_per_round=3", "rounds=2", "train.epochs=1",
         "train.batch_size=16", "save_model=false", "seed=3", "partition.alpha=0.1", "engine.threads_per_worker=1")
BN_CNN = ("model=cnn", "model.channels=[4,4]", "model.hidden=8", "model.norm=batch")


# ---------------------------------------------------------------- the local test split


def test_local_test_split_is_stratified_disjoint_complete_and_seeded():
    data = build_federated_dataset("digits", num_clients=20, partition_name="dirichlet", seed=1,
                                   partition_options={"alpha": 0.3})
    labels = data.train_y.numpy()
    train, test = split_local_test(data.partition, labels, 0.25, seed=7)
    for c in range(data.num_clients):
        rows, tr, te = data.partition.client(c), train.client(c), test.client(c)
        assert np.array_equal(np.sort(np.concatenate([tr, te])), np.sort(rows))  # complete
        assert not set(tr.tolist()) & set(te.tolist())  # disjoint
        n = len(rows)
        assert len(te) == (min(max(math.floor(0.25 * n + 0.5), 1), n - 1) if n >= 2 else 0)
        classes, counts = np.unique(labels[rows], return_counts=True)
        taken = np.array([int((labels[te] == cls).sum()) for cls in classes])
        quota = 0.25 * counts
        assert np.all(np.abs(taken - quota) < 1.0)  # stratified: each class within one sample of its share
        extra = taken > np.floor(quota)  # ...and the rounding goes to the largest remainders
        if extra.any() and (~extra).any():
            assert (quota - np.floor(quota))[extra].min() >= (quota - np.floor(quota))[~extra].max() - 1e-12
    again = split_local_test(data.partition, labels, 0.25, seed=7)[1]
    other = split_local_test(data.partition, labels, 0.25, seed=8)[1]
    assert np.array_equal(again.indices, test.indices)
    assert not np.array_equal(other.indices, test.indices)


def test_clients_train_on_their_local_train_rows_only():
    with_split = build(compose_config(*SMALL, "eval.clients=all"))
    plain = build(compose_config(*SMALL))
    try:
        ds, full = with_split.data, plain.data
        for c in range(ds.num_clients):
            assert ds.client_sizes()[c] + len(ds.local_test.client(c)) == full.client_sizes()[c]
            _, _, rows = ds.client_test_view(c)
            assert set(ds.local_test.client(c).tolist()) == set(rows.tolist())
    finally:
        with_split.engine.close()
        plain.engine.close()


# ---------------------------------------------------------------- rows and the side file


def test_summary_is_the_mean_p10_and_worst_tenth_of_client_accuracies():
    accs = [0.05 * i for i in range(20)]
    per = {c: {"n_test": 4, "test_accuracy": a, "test_loss": 1.0} for c, a in enumerate(accs)}
    per[20] = {"n_test": 0}  # no local test rows: left out
    row = summarise(per)
    assert row["eval_clients"] == 20
    assert row["client_accuracy_mean"] == pytest.approx(np.mean(accs), abs=1e-12)
    assert row["client_accuracy_p10"] == pytest.approx(np.percentile(accs, 10), abs=1e-12)
    assert row["client_accuracy_worst10"] == pytest.approx((0.0 + 0.05) / 2, abs=1e-12)


def test_rows_carry_client_accuracy_columns_and_the_side_file_the_values(tmp_path):
    exp = build(compose_config(*SMALL, "algorithm=fedper", "eval.clients=all", "eval.finetune_steps=2"), tmp_path)
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    lines = [json.loads(line) for line in (tmp_path / CLIENT_METRICS).read_text().splitlines()]
    assert [(d["round"], d["client"]) for d in lines] == [(r, c) for r in (1, 2) for c in range(6)]
    for r, row in enumerate(exp.simulation.history, start=1):
        mine = {d["client"]: d for d in lines if d["round"] == r}
        for model, key in (("client", "test_accuracy"), ("personal", "personal_test_accuracy"),
                           ("finetuned", "finetuned_test_accuracy")):
            accs = [mine[c][key] for c in sorted(mine)]
            assert row[f"{model}_accuracy_mean"] == pytest.approx(np.mean(accs), abs=1e-12)
            assert row[f"{model}_accuracy_p10"] == pytest.approx(np.percentile(accs, 10), abs=1e-12)


def test_sample_evaluates_the_rounds_clients_only(tmp_path):
    exp = build(compose_config(*SMALL, "eval.clients=sample"), tmp_path)
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    assert all(row["eval_clients"] == 3 for row in exp.simulation.history)
    from fl_platform.rounds.sampling import sample_clients

    lines = [json.loads(line) for line in (tmp_path / CLIENT_METRICS).read_text().splitlines()]
    for r in (0, 1):
        assert sorted(d["client"] for d in lines if d["round"] == r + 1) == sorted(sample_clients(3, r, 6, 3, "fixed"))


def test_eval_keys_are_refused_without_per_client_evaluation():
    with pytest.raises(ValueError, match=r"eval\.finetune_steps=3 has no effect .* eval\.clients=none"):
        build(compose_config(*SMALL, "eval.finetune_steps=3"))
    with pytest.raises(ValueError, match=r"eval\.local_test_fraction must be in \(0, 1\), got 1\.5"):
        build(compose_config(*SMALL, "eval.clients=all", "eval.local_test_fraction=1.5"))
    with pytest.raises(ValueError, match=r"algorithm\.lam=0\.5 has no effect .* eval\.clients=none"):
        build(compose_config(*SMALL, "algorithm=ditto", "algorithm.lam=0.5"))
    with pytest.raises(ValueError, match=r"algorithm=fedbn keeps BatchNorm layers local, but model=mlp has none"):
        build(compose_config(*SMALL, "algorithm=fedbn"))


def _results(exp) -> list[dict]:
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    return [{k: v for k, v in row.items() if not is_timing_key(k)} for row in exp.simulation.history]


@pytest.mark.parametrize("algorithm", ["fedbn", "ditto"])
def test_client_evaluation_is_the_same_for_one_and_two_workers(algorithm):
    """Stateful personalisation with its states on the workers' homes: 1 vs 2 inline workers."""
    base = (*SMALL, f"algorithm={algorithm}", *BN_CNN, "eval.clients=all", "eval.finetune_steps=2", "rounds=3")
    one = _results(build(compose_config(*base)))
    two = _results(build(compose_config(*base, "engine.num_workers=2", "engine.state_store=distributed",
                                        "engine.state_backend=memory")))
    assert one == two
    assert "personal_accuracy_mean" in one[-1] and "finetuned_accuracy_worst10" in one[-1]


@pytest.mark.ray
def test_client_evaluation_on_ray_workers_equals_inline(ray_session):
    base = (*SMALL, "algorithm=fedbn", *BN_CNN, "eval.clients=all", "eval.finetune_steps=2", "rounds=3")
    inline = _results(build(compose_config(*base)))
    ray = _results(build(compose_config(*base, "engine=ray", "engine.num_workers=2")))
    keys = [k for k in inline[-1] if "accuracy" in k or k == "eval_clients"]
    assert len(ray) == len(inline) == 3
    for got, want in zip(ray, inline):
        assert {k: got[k] for k in keys} == pytest.approx({k: want[k] for k in keys}, abs=1e-6)


# ---------------------------------------------------------------- mechanisms


def _setup(model: str = "cnn", **train: object) -> Setup:
    options = {"channels": [4], "hidden": 8, "norm": "batch"} if model == "cnn" else {"hidden": [8]}
    factory = ModelFactory(model, (1, 8, 8), 10, options)
    fm = FlatModel(factory())
    cfg = TrainConfig(**{"epochs": 1, "batch_size": 8, "lr": 0.1, **train})
    return Setup(factory, fm.num_params, fm.num_buffers, 10, (1, 8, 8), 4, 0, cfg)


def _data(n: int = 24, seed: int = 0) -> ClientData:
    g = torch.Generator().manual_seed(seed)
    return ClientData(torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g), torch.arange(n))


def _trainer(setup: Setup) -> LocalTrainer:
    torch.manual_seed(11)
    return LocalTrainer(FlatModel(setup.model_fn()), setup.train)


CTX = RoundContext(round=1, seed=5, clients=(2,), num_rounds=3, num_clients=4)


def test_fedbn_client_starts_from_its_own_batchnorm_and_never_uploads_it():
    setup = _setup()
    client = FedBNClient(FedBNConf(), setup)
    trainer = _trainer(setup)
    idx = client.index
    held = set(idx.tolist())
    names = [s.name for s in trainer.fm.slots if s.offset in held]
    assert names == ["stages.conv1.1.weight", "stages.conv1.1.bias", "stages.conv1.1.running_mean",
                     "stages.conv1.1.running_var"]  # the BatchNorm layer's affine parameters and statistics
    assert len(held) == sum(s.numel for s in trainer.fm.slots if s.name in names)
    w = trainer.fm.vector.clone()
    own = torch.randn(idx.numel())
    update = client.train(CTX, 2, Broadcast({"weights": w}), {PERSONAL: own}, _data(), trainer)
    # the reference: the global vector with the client's BatchNorm entries, trained by the shared loop
    ref = _trainer(setup)
    start = w.clone()
    start[idx] = own
    ref.fm.load(start)
    ref.fit(_data(), seed=CTX.seed, round=CTX.round, client=2)
    delta = update.tensors["delta"] / 24
    assert torch.all(delta[idx] == 0)  # BatchNorm never leaves the client
    mask = torch.ones_like(w, dtype=torch.bool)
    mask[idx] = False
    assert torch.allclose(delta[mask], (ref.fm.vector - start)[mask], atol=1e-6)
    assert torch.equal(update.state[PERSONAL], ref.fm.vector[idx])  # its state: the trained BatchNorm


def test_fedbn_server_never_moves_batchnorm_entries():
    setup = _setup()
    w = FlatModel(setup.model_fn()).vector.clone()
    server = FedBNServer(FedBNConf(), setup, w)
    idx = server.index
    agg = Aggregate()
    agg.add({"delta": torch.randn_like(w) * 8}, {"n": 8.0})  # e.g. DP noise on every entry of the sum
    server.aggregate(CTX, agg)
    assert torch.equal(server.weights[idx], w[idx])
    mask = torch.ones_like(w, dtype=torch.bool)
    mask[idx] = False
    assert not torch.equal(server.weights[mask], w[mask])


def test_fedbn_state_persists_across_rounds_through_the_store():
    """A worker with the run's store trains every client for two rounds: each client's stored BatchNorm
    entries after round 2 are what it trains from its own round-1 entries (not the server's)."""
    from fl_platform.engine.worker import Worker

    exp = build(compose_config(*SMALL, *BN_CNN, "algorithm=fedbn", "clients_per_round=6"))
    exp.engine.close()
    worker, server = Worker(0, exp.setup), exp.simulation.server
    clients = list(range(6))
    stored = []
    for r in range(2):
        ctx = RoundContext(round=r, seed=3, clients=tuple(clients), num_rounds=2, num_clients=6)
        bc = server.broadcast(ctx)
        res = worker.run_round(ctx, bc, clients)
        stored.append({c: worker.store.get(c)[PERSONAL].clone() for c in clients})
        if r == 1:  # (before the server's step, which moves the broadcast weights in place)
            for c in (0, 4):
                trainer = LocalTrainer(FlatModel(exp.setup.model()), exp.setup.train)
                ref = worker.client.train(ctx, c, bc, {PERSONAL: stored[0][c]}, worker.client_data(c), trainer)
                assert torch.equal(stored[1][c], ref.state[PERSONAL])
        server.aggregate(ctx, res.aggregate)
    assert not torch.equal(stored[0][0], stored[0][1])
    assert not torch.equal(stored[1][0], stored[0][0])


def test_fedper_head_never_leaves_the_client():
    setup = _setup("mlp")
    client = FedPerClient(FedPerConf(), setup)
    trainer = _trainer(setup)
    idx = client.index
    fm = trainer.fm
    head = [s for s in fm.slots if s.name.endswith("head.weight") or s.name.endswith("head.bias")]
    assert sorted(idx.tolist()) == sorted(i for s in head for i in range(s.offset, s.offset + s.numel))
    w = fm.vector.clone()
    own = torch.randn(idx.numel())
    update = client.train(CTX, 2, Broadcast({"weights": w}), {PERSONAL: own}, _data(), trainer)
    assert torch.all(update.tensors["delta"][idx] == 0)
    assert not torch.equal(update.state[PERSONAL], own)  # trained locally, kept locally
    assert torch.equal(client.personal_model(CTX, 2, Broadcast({"weights": w}), update.state)[idx],
                       update.state[PERSONAL])


def test_fedrep_trains_the_head_with_the_body_frozen_then_the_body_with_the_head_frozen():
    setup = _setup("mlp")
    conf = FedRepConf(head_epochs=2)
    client = FedRepClient(conf, setup)
    trainer = _trainer(setup)
    idx = client.index
    w = trainer.fm.vector.clone()
    own = torch.randn(idx.numel())
    update = client.train(CTX, 2, Broadcast({"weights": w}), {PERSONAL: own}, _data(), trainer)
    # the reference, phase by phase
    ref = _trainer(setup)
    fm = ref.fm
    start = w.clone()
    start[idx] = own
    fm.load(start)
    head = {id(p) for p in fm.model.head.parameters()}
    for p in fm.model.parameters():
        p.requires_grad_(id(p) in head)
    ref.fit(_data(), seed=CTX.seed, round=CTX.round, client=2, stream=Stream.PERSONAL,
            cfg=dataclasses.replace(setup.train, epochs=2))
    after_head = fm.vector.clone()
    mask = torch.ones_like(w, dtype=torch.bool)
    mask[idx] = False
    assert torch.equal(after_head[mask], start[mask])  # phase 1 moved the head only
    for p in fm.model.parameters():
        p.requires_grad_(id(p) not in head)
    ref.fit(_data(), seed=CTX.seed, round=CTX.round, client=2)
    assert torch.equal(fm.vector[idx], after_head[idx])  # phase 2 moved the body only
    assert torch.equal(update.state[PERSONAL], after_head[idx])
    assert torch.allclose(update.tensors["delta"][mask] / 24, (fm.vector - start)[mask], atol=1e-6)
    assert torch.all(update.tensors["delta"][idx] == 0)


def test_ditto_personal_step_is_grad_plus_lambda_times_v_minus_w():
    """One full-batch step: v' = v - lr (grad F(v) + lam (v - w)); the upload is FedAvg's from w."""
    setup = _setup("mlp", steps=1, epochs=None, batch_size=64, lr=0.1)
    lam = 0.7
    client = DittoClient(DittoConf(lam=lam), setup)
    trainer = _trainer(setup)
    fm = trainer.fm
    w = fm.vector.clone()
    v = w + 0.3 * torch.randn_like(w) * slot_mask(fm)  # (a personal model is zero in the alignment padding, as w)
    data = _data(24)
    update = client.train(CTX, 2, Broadcast({"weights": w}), {"v": v.clone()}, data, trainer)
    ref = FlatModel(setup.model_fn())
    ref.load(v)
    loss = torch.nn.functional.cross_entropy(ref.model(data.x), data.y)
    loss.backward()
    p = ref.num_params
    expected = v.clone()
    expected[:p] -= 0.1 * (ref.grad + lam * (v[:p] - w[:p]))
    assert torch.allclose(update.state["v"], expected, atol=1e-6)
    fedavg = FlatModel(setup.model_fn())
    fedavg.load(w)
    loss = torch.nn.functional.cross_entropy(fedavg.model(data.x), data.y)
    loss.backward()
    assert torch.allclose(update.tensors["delta"][:p] / 24, -0.1 * fedavg.grad, atol=1e-6)


def test_finetuning_evaluates_after_k_local_steps_from_the_personal_model():
    setup = _setup("mlp", steps=None, epochs=1)
    client = FedPerClient(FedPerConf(), setup)
    trainer = _trainer(setup)
    w = trainer.fm.vector.clone()
    own = torch.randn(client.index.numel())
    train, test = _data(24, seed=1), _data(12, seed=2)
    bc = Broadcast({"weights": w})
    scores = to_host({2: evaluate_client(client, trainer, CTX, 2, bc, {PERSONAL: own}, train, test, 3)})[2]
    ref = _trainer(setup)
    ref.fm.load(client.personal_model(CTX, 2, bc, {PERSONAL: own}))
    ref.fit(train, seed=CTX.seed, round=CTX.round, client=2, stream=Stream.FINETUNE,
            cfg=dataclasses.replace(setup.train, steps=3, epochs=None))
    ref.fm.model.eval()
    with torch.no_grad():
        acc = float((ref.fm.model(test.x).argmax(-1) == test.y).float().mean())
    assert scores["finetuned_test_accuracy"] == pytest.approx(acc, abs=1e-12)
    assert scores["n_test"] == 12 and "personal_test_accuracy" in scores


def test_interrupted_run_resumes_to_the_same_client_metrics(tmp_path):
    """Ditto's personal models (client state) and client_metrics.jsonl after an interrupted, checkpointed
    run: the lines of the round after the checkpoint are dropped and rewritten; all equal an uninterrupted run."""
    from fl_platform.experiment import run_experiment

    base = (*SMALL, "algorithm=ditto", "eval.clients=all", "rounds=4", "eval_every=1", "checkpoint_every=2")
    run_experiment(compose_config(*base), tmp_path / "ref")
    exp = build(compose_config(*base), tmp_path / "run", reporter=StopAfter(3))
    try:
        with pytest.raises(KeyboardInterrupt):
            exp.simulation.run()
    finally:
        exp.engine.close()
    assert {json.loads(line)["round"] for line in (tmp_path / "run" / CLIENT_METRICS).read_text().splitlines()} \
        == {1, 2, 3}
    run_experiment(compose_config(*base), tmp_path / "run")
    assert (tmp_path / "run" / CLIENT_METRICS).read_text() == (tmp_path / "ref" / CLIENT_METRICS).read_text()
