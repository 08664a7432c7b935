"""``model=custom`` start-up checks (fl_platform/models/custom.py): what the dry run accepts and refuses.

* a BatchNorm MLP (valid: it trains on batches of two or more) passes, and a run with it finishes;
* a forward that fails or mis-shapes in training mode (two samples) or eval mode (one sample), integer
  logits, tied or doubly registered parameters and integer buffers the platform cannot carry are refused
  naming why, before training (they used to pass and fail mid-run or in ``final_model``);
* a target that hands out one cached instance is refused at its second call.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

from fl_platform import api
from fl_platform.models.custom import build_custom, dry_run_problem


class Lin(nn.Module):
    def __init__(self, input_shape=(8,), num_classes=4):
        super().__init__()
        self.l = nn.Linear(int(np.prod(input_shape)), num_classes)

    def forward(self, x):
        return self.l(x.flatten(1))


class BNMLP(Lin):
    def __init__(self, input_shape=(8,), num_classes=4):
        super().__init__(input_shape, num_classes)
        self.bn = nn.BatchNorm1d(int(np.prod(input_shape)))

    def forward(self, x):
        return self.l(self.bn(x.flatten(1)))


class Squeezes(Lin):  # drops the batch axis of a one-sample batch
    def forward(self, x):
        return self.l(x.flatten(1)).squeeze(0)


class TrainOnlyFails(Lin):
    def forward(self, x):
        if self.training:
            raise RuntimeError("boom in training")
        return super().forward(x)


class IntLogits(Lin):
    def forward(self, x):
        return super().forward(x).argmax(1, keepdim=True).repeat(1, 4)


class Tied(Lin):
    def __init__(self, input_shape=(8,), num_classes=4):
        super().__init__(input_shape, num_classes)
        self.a = nn.Linear(8, 8, bias=False)
        self.c = nn.Linear(8, 8, bias=False)
        self.c.weight = self.a.weight

    def forward(self, x):
        return self.l(self.c(self.a(x)))


class CachedRef(Lin):
    def __init__(self, input_shape=(8,), num_classes=4):
        super().__init__(input_shape, num_classes)
        self.w = self.l.weight  # a Parameter as an attribute: registered a second time


class IntBuffer(Lin):
    def __init__(self, input_shape=(8,), num_classes=4):
        super().__init__(input_shape, num_classes)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))


class IntScratch(Lin):  # a non-persistent integer buffer is in no state_dict: fine
    def __init__(self, input_shape=(8,), num_classes=4):
        super().__init__(input_shape, num_classes)
        self.register_buffer("count", torch.zeros((), dtype=torch.long), persistent=False)


def _problem(cls):
    return dry_run_problem(cls(), (8,), 4, None)


@pytest.mark.parametrize("cls", [Lin, BNMLP, IntScratch])
def test_valid_models_pass_the_dry_run_and_keep_their_state(cls):
    model = cls()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert dry_run_problem(model, (8,), 4, None) is None
    assert model.training and all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(("cls", "message"), [
    (Squeezes, r"^an eval-mode forward pass of one sample of shape 8 returns shape \(4,\); the run needs \(1, 4\)"),
    (TrainOnlyFails, r"^a training-mode forward pass of two samples of shape 8 fails: boom in training"),
    (IntLogits, r"^its forward returns torch\.int64 logits; the loss needs floating-point logits"),
    (Tied, r"^parameters a\.weight and c\.weight are one tensor \(tied weights"),
    (CachedRef, r"^parameters w and l\.weight are one tensor"),
    (IntBuffer, r"^its state_dict holds count \(torch\.int64\), which the platform does not carry"),
])
def test_models_the_run_cannot_carry_are_refused_naming_why(cls, message):
    reason = _problem(cls)
    assert reason is not None and re.search(message, reason), reason


def test_a_target_returning_one_cached_instance_is_refused():
    cache: list[nn.Module] = []

    def cached(input_shape, num_classes):
        if not cache:
            cache.append(Lin(input_shape, num_classes))
        return cache[0]

    build_custom(cached, (8,), 4, {})
    with pytest.raises(ValueError, match=r"model\._target_=.*cached returned the Lin instance it had returned before; "
                                         "every call must build a new module"):
        build_custom(cached, (8,), 4, {})
    build_custom(Lin, (8,), 4, {})
    build_custom(Lin, (8,), 4, {})  # a class builds a new one each call


def test_a_batchnorm_mlp_runs_and_a_cached_factory_stops_at_start_up():
    g = np.random.default_rng(0)
    data = (g.normal(size=(64, 8)).astype(np.float32), np.arange(64) % 4,
            g.normal(size=(16, 8)).astype(np.float32), np.arange(16) % 4)
    small = ["rounds=1", "clients_per_round=2", "train.epochs=1", "train.batch_size=8",
             "logger.progress=false", "save_model=false"]
    clients = [np.arange(32), np.arange(32, 64)]  # 4 batches of 8 each (a last batch of one would fail in torch)
    result = api.run(small, model=BNMLP, data=data, partition=clients)
    assert len(result.history) == 1 and isinstance(result.model, BNMLP)
    one = BNMLP()
    with pytest.raises(ValueError, match="it had returned before"):
        api.run(small, model=lambda input_shape, num_classes: one, data=data, partition=clients)


def three_clients() -> tuple[tuple[np.ndarray, ...], list[np.ndarray]]:
    """82 training samples of 8 features (4 classes) and 16 test ones; clients of 32, 33 and 17 samples."""
    g = np.random.default_rng(0)
    data = (g.normal(size=(82, 8)).astype(np.float32), np.arange(82) % 4,
            g.normal(size=(16, 8)).astype(np.float32), np.arange(16) % 4)
    return data, [np.arange(32), np.arange(32, 65), np.arange(65, 82)]


def test_clients_that_would_make_a_one_sample_batch_are_named_at_start_up():
    """A BatchNorm MLP cannot train on a batch of one sample. Clients of 33 and 17 samples make one with
    batches of 8 (their last of each epoch): the run is refused at start-up naming them and
    train.drop_last, rather than failing in torch in the first round that samples them. drop_last runs;
    a model that takes one sample, or train.steps that stop before the last batch, are not refused."""
    small = ["rounds=1", "clients_per_round=3", "train.batch_size=8", "logger.progress=false", "save_model=false"]
    data, clients = three_clients()
    with pytest.raises(ValueError, match=r"batch of one sample \(.*2 clients' local training would make one with "
                                         r"train\.batch_size=8, e\.g\. clients 1 \(33 samples\), 2 \(17 samples\): "
                                         r"set train\.drop_last=true"):
        api.run([*small, "train.epochs=1"], model=BNMLP, data=data, partition=clients)
    assert len(api.run([*small, "train.epochs=1", "train.drop_last=true"], model=BNMLP, data=data,
                       partition=clients).history) == 1
    assert len(api.run([*small, "train.epochs=1"], model=Lin, data=data, partition=clients).history) == 1
    assert len(api.run([*small, "train.steps=2"], model=BNMLP, data=data, partition=clients).history) == 1


def test_fine_tuning_that_would_make_a_one_sample_batch_is_named_at_start_up():
    """eval.finetune_steps trains each evaluated client on its training rows in batches of
    train.batch_size too. After their local test splits (a fifth) the clients keep 26, 26 and 14 rows;
    with batches of 13, client 2's second step is a one-sample batch. Local training (1 step) stops
    before it and runs; fine-tuning of 2 steps reaches it and is refused at start-up, naming the client
    and the key, rather than failing in torch at the first evaluation. 1 step, or drop_last, runs."""
    small = ["rounds=1", "clients_per_round=3", "train.batch_size=13", "train.steps=1", "logger.progress=false",
             "save_model=false", "eval.clients=all"]
    data, clients = three_clients()
    with pytest.raises(ValueError, match=r"batch of one sample \(.*1 clients' fine-tuning \(eval\.finetune_steps=2\) "
                                         r"would make one with train\.batch_size=13, e\.g\. clients 2 \(14 samples\): "
                                         r"set train\.drop_last=true"):
        api.run([*small, "eval.finetune_steps=2"], model=BNMLP, data=data, partition=clients)
    for extra in (["eval.finetune_steps=1"], ["eval.finetune_steps=2", "train.drop_last=true"]):
        (row,) = api.run([*small, *extra], model=BNMLP, data=data, partition=clients).history
        assert row["eval_clients"] == 3 and 0 <= row["finetuned_accuracy_mean"] <= 1, sorted(row)
