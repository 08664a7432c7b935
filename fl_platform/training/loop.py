"""The shared local training loop: one client, E epochs or S steps, on device tensors.

Minibatches are index slices of tensors already on the device, in an order drawn from the
client's own (seed, round, client id) generator; there is no DataLoader and no per-client
copy. The simulator's workers, the Flower ClientApp and the S-SGD baseline all call this.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import torch

from fl_platform.core import Metrics
from fl_platform.datasets.augment import Augmentation
from fl_platform.seeding import Stream, seed_torch_global, torch_generator
from fl_platform.training.flat import FlatModel
from fl_platform.training.hooks import Batch, TrainHooks
from fl_platform.training.optim import FlatOptimizer, make_optimizer
from fl_platform.training.schedule import LrSchedule
from fl_platform.training.step import (
    LossScaler,
    as_channels_last,
    autocast,
    check_step_options,
    compile_model,
    enable_cudnn_benchmark,
    restored,
    to_device,
)


class NonFiniteError(FloatingPointError):
    """A client's loss or update became NaN/inf; names the client and round."""


@dataclass
class TrainConfig:
    """Local optimisation settings (the ``train`` section of the run config; treat as read-only)."""

    epochs: int | None = 1  # passes over the client's data; None (and only then) with ``steps``
    steps: int | None = None  # when set: exactly this many minibatch steps, reshuffling each pass
    batch_size: int = 10
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_norm: float | None = None
    drop_last: bool = False
    # 0: the run's own minibatch orders; k != 0: the k-th other stream of orders, with the partition,
    # initial model, client sampling and every other draw unchanged (the noise-floor control of
    # docs/results/README.md: a paired rerun that differs only in its shuffling).
    shuffle_offset: int = 0
    # The step's speed options (fl_platform/training/step.py, docs/engine.md "The step"): the forward
    # pass under autocast (fp32: none; bf16; fp16: CUDA only, with dynamic loss scaling), 4-D image
    # minibatches in channels-last layout (models with convolutions), the model's forward compiled
    # with torch.compile (once per process; plain loop only).
    precision: str = "fp32"
    channels_last: bool = False
    compile: bool = False
    # The rate of each round (fl_platform/training/schedule.py): a function of the round index only.
    lr_schedule: LrSchedule = field(default_factory=LrSchedule)

    def __post_init__(self) -> None:
        if isinstance(self.lr_schedule, Mapping):  # (from a config container)
            self.lr_schedule = LrSchedule(**self.lr_schedule)

    def at_round(self, round: int) -> TrainConfig:
        """This config with the rate of 0-based round ``round`` as ``lr`` (and a constant schedule)."""
        if self.lr_schedule.is_constant():
            return self
        return replace(self, lr=self.lr_schedule.lr_at(self.lr, round), lr_schedule=LrSchedule())

    def num_steps(self, num_samples: int) -> int:
        if self.steps is not None:
            return self.steps
        per_epoch = num_samples // self.batch_size if self.drop_last else math.ceil(num_samples / self.batch_size)
        if self.epochs is None:
            raise ValueError("train.epochs or train.steps must be set")
        return self.epochs * max(per_epoch, 0)


def shuffle_keys(cfg: TrainConfig) -> tuple[int, ...]:
    """Extra RNG keys of the minibatch-order stream: none at ``shuffle_offset = 0``, so default runs
    keep their (seed, SHUFFLE, round, client) orders bit for bit."""
    return (cfg.shuffle_offset,) if cfg.shuffle_offset else ()


@dataclass
class ClientData:
    """A client's view of the federated dataset: the shared device tensors its rows lie in (the
    training tensors, or their row block holding the client) plus its index slice into them, and the
    data set's augmentation of training minibatches (None: none)."""

    x: torch.Tensor
    y: torch.Tensor
    indices: torch.Tensor
    augment: Augmentation | None = None

    @property
    def num_samples(self) -> int:
        return int(self.indices.numel())


class LocalTrainer:
    """Owns one FlatModel and trains it for one client at a time."""

    def __init__(self, fm: FlatModel, cfg: TrainConfig) -> None:
        check_step_options(cfg, fm.device, fm.model)
        self.fm = fm
        self.cfg = cfg
        self._optimizers: dict[tuple[int, int], FlatOptimizer] = {}
        enable_cudnn_benchmark(fm.device)
        if cfg.compile:
            compile_model(fm.model)
            example = getattr(fm.model, "example_input", None)
            if callable(example):  # compiled now, before any round is timed (else: in the first fit)
                self._warm_up(example)

    def _warm_up(self, example) -> None:
        """Compile the forward and backward graphs for a full minibatch and a shorter one (the end of
        an epoch: the second shape makes the batch axis dynamic, so no later recompilation), leaving
        the model's values, gradient and buffers as they were."""
        sizes = dict.fromkeys((self.cfg.batch_size, max(2, self.cfg.batch_size // 2)))
        model = self.fm.model
        with restored(self.fm):
            for b in sizes:
                x = example(b)
                if self.cfg.channels_last:
                    x = as_channels_last(x)
                with autocast(self.cfg, self.fm.device):
                    out = model(x)
                out.float().sum().backward()

    def _optimizer_for(self, rng: tuple[int, int]) -> FlatOptimizer:
        opt = self._optimizers.get(rng)
        if opt is None:
            c = self.cfg
            opt = make_optimizer(c.optimizer, c.lr, momentum=c.momentum, weight_decay=c.weight_decay,
                                 nesterov=c.nesterov, betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps)
            self._optimizers[rng] = opt
        return opt

    def fit(self, data: ClientData, hooks: TrainHooks | None = None, *, seed: int, round: int,
            client: int, cfg: TrainConfig | None = None, stream: Stream = Stream.SHUFFLE) -> Metrics:
        """Train the live model in place; returns (sum, count) metrics: loss, accuracy, steps.

        ``round`` is the 0-based round index (the RNG key); messages show it 1-based like metrics.jsonl.
        ``stream``: the minibatch orders' random stream; a second training of the same client in the
        same round (a personal model, fine-tuning before evaluation) names its own, so that its orders
        are not the first training's.
        Raises NonFiniteError when the loss becomes NaN/inf, naming the client and round.
        """
        cfg = (cfg or self.cfg).at_round(round)
        hooks = hooks or TrainHooks()
        fm = self.fm
        model = fm.model
        fm.train_mode()
        ranges = fm.trainable_ranges()
        opts = [(r, self._optimizer_for(r)) for r in ranges]
        for _, opt in opts:
            opt.reset()
            opt.lr = cfg.lr  # (this round's: train.lr_schedule)
        n = data.num_samples
        total_steps = cfg.num_steps(n)
        bs = cfg.batch_size
        gen = torch_generator(seed, stream, round, client, *shuffle_keys(cfg))
        seed_torch_global(seed, Stream.TORCH, round, client, *(() if stream == Stream.SHUFFLE else (stream,)))
        aug = data.augment
        aug_key = aug.client_keys(seed, round, [client], data.x.device) if aug is not None else None
        loss_sum = torch.zeros((), device=fm.device)
        correct = torch.zeros((), device=fm.device, dtype=torch.long)
        seen = 0
        step = epoch = 0
        if total_steps > 0 and cfg.drop_last and 0 < n < bs:
            raise ValueError(f"client {client} has {n} samples < train.batch_size={bs} with train.drop_last: "
                             f"it can take none of its train.steps={cfg.steps} steps")
        scaler = LossScaler() if cfg.precision == "fp16" else None  # per fit: no state across clients
        while step < total_steps and n > 0:
            order = data.indices[to_device(torch.randperm(n, generator=gen), data.indices.device)]
            stop = n - n % bs if cfg.drop_last else n
            for start in range(0, stop, bs):
                if step >= total_steps:
                    break
                idx = order[start : start + bs]
                xb = data.x.index_select(0, idx)
                if aug is not None:
                    xb = aug.apply(xb, aug_key, step)
                if cfg.channels_last:
                    xb = as_channels_last(xb)
                batch = Batch(xb, data.y.index_select(0, idx), step, epoch)
                while True:  # once, unless fp16's scaled gradient overflowed: then again at half the scale
                    fm.grad.zero_()
                    with autocast(cfg, fm.device):
                        loss, logits = hooks.loss(model, batch)
                    if scaler is None:
                        loss.backward()
                        break
                    scaler.scaled(loss).backward()
                    if scaler.unscale(fm.grad):
                        break
                hooks.before_step(fm)
                if cfg.clip_norm is not None:
                    norm = fm.grad.norm()
                    fm.grad.mul_(torch.clamp(cfg.clip_norm / (norm + 1e-6), max=1.0))
                for (lo, hi), opt in opts:
                    opt.step(fm.vector[lo:hi], fm.grad[lo:hi])
                hooks.after_step(fm, batch)
                m = idx.numel()
                loss_sum += loss.detach().float() * m
                correct += (logits.detach().argmax(dim=-1) == batch.y).sum()
                seen += m
                step += 1
            epoch += 1
        metrics = Metrics()
        total_loss = float(loss_sum)
        if not math.isfinite(total_loss) or not bool(torch.isfinite(fm.vector).all()):
            raise NonFiniteError(
                f"client {client} in round {round + 1}: the training loss became {total_loss} "
                f"(non-finite) after {step} steps; lower train.lr, enable train.clip_norm, or check the data"
            )
        if seen:
            metrics.add("train_loss", total_loss, seen)
            metrics.add("train_accuracy", float(correct), seen)
        metrics.add("local_steps", step, 1)
        return metrics


@torch.inference_mode()
def eval_sums(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
              batch_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed cross-entropy, correct predictions) in large batched forward passes, left on the device
    (per-client evaluation reads many clients' sums back at once)."""
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    correct = torch.zeros((), dtype=torch.long, device=x.device)
    for start in range(0, x.shape[0], batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        logits = model(xb)
        loss_sum += torch.nn.functional.cross_entropy(logits, yb, reduction="sum").double()
        correct += (logits.argmax(dim=-1) == yb).sum()
    model.train(was_training)
    return loss_sum, correct


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> dict[str, float]:
    """Test loss and accuracy with large batched forward passes."""
    loss_sum, correct = eval_sums(model, x, y, batch_size)
    n = max(x.shape[0], 1)
    return {"test_loss": float(loss_sum) / n, "test_accuracy": float(correct) / n}
