"""FedDF-style ensemble distillation (card method C) on unlabelled server data.

The student starts as the one-shot FedAvg model (``student_init: fedavg``; ``fresh`` builds a
new model, as for heterogeneous architectures) and is distilled towards the averaged client
logits on the server's held-out split U, which no client trained on:
L = T^2 KL(softmax(f_E(x)/T) || softmax(s(x)/T)), T = 1, Adam (lr 1e-3) with cosine decay over
``steps``. Every ``eval_every`` steps the student is scored on a labelled validation part of
the server split; training stops after ``patience`` steps without a gain and the best student
is kept. That validation set is labelled server data, as the card flags: ``val_fraction: 0``
disables it (no early stopping, the last student is kept).

Out-of-domain distillation (FedDF distils CIFAR-10 ensembles on CIFAR-100 or ImageNet, not on the
task's own data): ``distill_set: <source>`` (e.g. ``femnist`` for Fashion-MNIST) replaces U by
``distill_size`` images of that source's training set (default: as many as U would hold), drawn
from (seed, ALGORITHM), loaded unstandardised (pixels in [0, 1]; FEMNIST with LEAF's inversion
undone, bright ink on black like (F)MNIST), resized to the model's input (bilinear, antialiased;
one channel repeated or several averaged) and mapped onto the task's per-channel input range
[low, high] as the generators of DENSE and Co-Boosting map theirs. The validation split for early
stopping stays the task's own labelled server data.

The teachers' logits on U are computed once (no augmentation), so a step costs one student
forward/backward. Card defaults: 10,000 steps, batch 128, early stop after 1,000; the results
script scales the steps down for CPU and says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from fl_platform.algorithms.base import AlgorithmSpec, require
from fl_platform.algorithms.oneshot.distill import combine_logits, kd_loss, predict_logits
from fl_platform.algorithms.oneshot.protocol import (
    OneShotClient,
    OneShotConf,
    OneShotServer,
    build_module,
    fresh_vector,
)
from fl_platform.core import RoundContext
from fl_platform.seeding import Stream, seed_torch_global, torch_generator
from fl_platform.training.flat import model_vector
from fl_platform.training.step import to_device

_FEDDF = 0x46444446  # "FDDF": stream key of the distillation batches
HELDOUT = "heldout"


@dataclass
class FedDFConf(OneShotConf):
    name: str = "oneshot_feddf"
    steps: int = 10000
    batch_size: int = 128
    lr: float = 1e-3
    temperature: float = 1.0
    eval_every: int = 100
    patience: int = 1000  # steps without a validation gain before stopping (0: never stop early)
    val_fraction: float = 0.2  # labelled share of the server split used for early stopping (0: none)
    student_init: str = "fedavg"  # fedavg or fresh
    distill_set: str = "heldout"  # heldout: the server split's unlabelled part | a data source name (out of domain)
    distill_size: int | None = None  # images of an out-of-domain distill_set (None: as many as heldout's)

    def inactive_fields(self, run: Any) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.distill_set == HELDOUT:
            out["distill_size"] = "it sizes an out-of-domain distillation set, and distill_set=heldout"
        if self.val_fraction == 0:
            out.update(dict.fromkeys(("eval_every", "patience"), "validation-based early stopping, and val_fraction=0"))
        if self.steps == 0:
            out.update(dict.fromkeys(("batch_size", "lr", "temperature", "eval_every", "patience"),
                                     "a setting of the distillation steps, and steps=0"))
        return out


def load_distill_set(name: str, count: int, shape: tuple[int, ...], low: torch.Tensor, high: torch.Tensor,
                     gen: torch.Generator) -> torch.Tensor:
    """``count`` training images of source ``name`` drawn by ``gen``, in the task's input shape and range.
    Read from the data root ($FL_DATA_ROOT, else ../shared/data), not from the task's ``dataset.root``."""
    import torch.nn.functional as F

    from fl_platform.datasets.registry import load_source, source_options

    if "normalize" not in source_options(name):
        raise ValueError(f"algorithm.distill_set={name!r}: an out-of-domain distillation set must be an image "
                         "source with a normalize option (mnist, fashion_mnist, femnist, cifar10, cifar100, digits)")
    src = load_source(name, normalize=False)
    x = torch.from_numpy(src.train_x)
    if x.dim() != 4 or len(shape) != 3:
        raise ValueError(f"algorithm.distill_set={name!r}: images {tuple(x.shape[1:])} cannot feed a model taking "
                         f"{shape} (both must be images: channels, height, width)")
    if count > x.shape[0]:
        raise ValueError(f"algorithm.distill_size={count} exceeds the {x.shape[0]} training images of {name!r}")
    x = x[torch.randperm(x.shape[0], generator=gen)[:count]]
    if x.shape[1] != shape[0]:
        x = x.expand(-1, shape[0], -1, -1) if x.shape[1] == 1 else x.mean(dim=1, keepdim=True).expand(-1, shape[0], -1, -1)
    if tuple(x.shape[2:]) != tuple(shape[1:]):
        x = F.interpolate(x, size=tuple(shape[1:]), mode="bilinear", antialias=True, align_corners=False).clamp(0, 1)
    return (low.view(1, -1, 1, 1) + (high - low).view(1, -1, 1, 1) * x).contiguous()


def split_server_data(num: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(unlabelled positions, validation positions) within the server split, seeded."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"algorithm.val_fraction must be in [0, 1), got {val_fraction}")
    order = torch.randperm(num, generator=torch_generator(seed, Stream.ALGORITHM, _FEDDF, 1))
    n_val = round(val_fraction * num)
    return order[n_val:].sort().values, order[:n_val].sort().values


class FedDFServer(OneShotServer):
    def __init__(self, cfg: FedDFConf, setup, initial_weights) -> None:
        if cfg.distill_set != HELDOUT:
            from fl_platform.datasets.registry import SOURCES

            if cfg.distill_set not in SOURCES:
                raise ValueError(f"algorithm.distill_set={cfg.distill_set!r}: use {HELDOUT!r} or a data source "
                                 f"({', '.join(sorted(SOURCES))})")
        require(cfg, (cfg.steps >= 0, "steps", ">= 0"), (cfg.batch_size >= 1, "batch_size", ">= 1"),
                (cfg.lr > 0, "lr", "> 0"), (cfg.temperature > 0, "temperature", "> 0"),
                (cfg.eval_every >= 1, "eval_every", ">= 1"), (cfg.patience >= 0, "patience", ">= 0"),
                (cfg.student_init in ("fedavg", "fresh"), "student_init", "'fedavg' or 'fresh'"),
                (cfg.server_fraction > 0, "server_fraction", "> 0 (FedDF distils on held-out server data)"),
                (cfg.distill_size is None or cfg.distill_size >= 1, "distill_size", "null or >= 1"))
        super().__init__(cfg, setup, initial_weights)
        self.history: list[tuple[int, float]] = []
        self.distill_x: torch.Tensor | None = None  # an out-of-domain distillation set (distill_set)

    def attach_data(self, data: Any) -> None:
        super().attach_data(data)
        if self.cfg.distill_set != HELDOUT:
            if self.server_x is None or self.input_low is None or self.input_high is None:
                raise ValueError(f"algorithm.distill_set={self.cfg.distill_set!r}: an out-of-domain distillation set "
                                 "needs an image task (its images are mapped onto the task's input range)")
            unl, _ = split_server_data(self.server_x.shape[0], self.cfg.val_fraction, self.setup.seed)
            count = self.cfg.distill_size or unl.numel()
            gen = torch_generator(self.setup.seed, Stream.ALGORITHM, _FEDDF, 4)
            self.distill_x = load_distill_set(self.cfg.distill_set, count, tuple(self.server_x.shape[1:]),
                                              self.input_low, self.input_high, gen)

    def build(self, ctx: RoundContext) -> dict[str, float]:
        cfg = self.cfg
        if self.server_x is None or self.server_x.shape[0] == 0:
            raise RuntimeError("oneshot_feddf has no server data: the runtime must call attach_data and "
                               "algorithm.server_fraction must be > 0")
        dev = self.device
        unl, val = split_server_data(self.server_x.shape[0], cfg.val_fraction, self.setup.seed)
        x_u = (self.server_x[unl] if self.distill_x is None else self.distill_x).to(dev)
        x_v, y_v = self.server_x[val].to(dev), self.server_y[val].to(dev)
        teachers = self.teacher_modules(dev)
        t_u = combine_logits(torch.stack([predict_logits(m, x_u) for m in teachers]))
        if cfg.student_init == "fedavg":
            student = build_module(self.setup, self.fedavg_vector(), dev)
        else:
            student = build_module(self.setup, fresh_vector(self.setup, _FEDDF, 2), dev)
        params = [p for p in student.parameters()]
        opt = torch.optim.Adam(params, lr=cfg.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: 0.5 * (1.0 + math.cos(math.pi * min(step, cfg.steps) / max(cfg.steps, 1))))
        gen = torch_generator(self.setup.seed, Stream.ALGORITHM, _FEDDF, 0)
        seed_torch_global(self.setup.seed, Stream.ALGORITHM, _FEDDF, 3)
        use_val = x_v.shape[0] > 0

        def val_accuracy() -> float:
            return float((predict_logits(student, x_v).argmax(1) == y_v).float().mean())

        def snapshot() -> list[torch.Tensor]:
            return [t.detach().clone() for t in (*student.parameters(), *student.buffers())]

        best_acc = val_accuracy() if use_val else float("nan")
        best_state, best_step = snapshot(), 0
        self.history = [(0, best_acc)]
        # Each pass's order is drawn on the CPU (the same on every device) and copied once, non-blocking.
        order = to_device(torch.randperm(x_u.shape[0], generator=gen), dev)
        pos = 0
        step = 0
        student.train()
        while step < cfg.steps:
            if pos + cfg.batch_size > order.numel():  # reshuffle each pass over U (drop the ragged tail)
                order, pos = to_device(torch.randperm(x_u.shape[0], generator=gen), dev), 0
            idx = order[pos : pos + cfg.batch_size]
            pos += cfg.batch_size
            loss = kd_loss(student(x_u[idx]), t_u[idx], cfg.temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if use_val and (step % cfg.eval_every == 0 or step == cfg.steps):
                acc = val_accuracy()
                self.history.append((step, acc))
                if acc > best_acc:
                    best_acc, best_state, best_step = acc, snapshot(), step
                elif cfg.patience and step - best_step >= cfg.patience:
                    break
        if use_val:
            with torch.no_grad():
                for t, saved in zip((*student.parameters(), *student.buffers()), best_state):
                    t.copy_(saved)
        self.weights = model_vector(student).to(torch.float32)
        return {"distill_steps": float(step), "best_step": float(best_step if use_val else step),
                "server_val_accuracy": best_acc, "distill_set_size": float(x_u.shape[0])}


SPEC = AlgorithmSpec("oneshot_feddf", FedDFConf, OneShotClient, FedDFServer,
                     "FedDF: distil the client ensemble into one model on unlabelled server data")
