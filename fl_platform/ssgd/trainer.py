"""Data-parallel training on torch.distributed: one process per worker, one shard of the data each.

Built from the platform's pieces: the data layer's sources (``load_source``), the model zoo
(``build_model``), the FlatModel with the flat optimisers, the loop's ``TrainConfig`` step count
and ``TrainHooks`` loss, ``evaluate``, and the run-directory writers (``outputs.py``). What is
its own: the shards (a seeded permutation per epoch, strided over ranks), the synchronisation
scheme (sync.py) and the metrics of communication.

Per step every rank draws its batch from its shard, runs forward through ``sync.module`` (DDP or
the plain model) and backward, lets the scheme synchronise (``before_step``), clips, steps its
optimiser, and lets the scheme average models if it does (``after_step``). One metrics row per
``log_every_steps`` steps (default: per epoch): train loss/accuracy over all ranks, test metrics
(rank 0 evaluates, after the BatchNorm statistics are averaged), bytes and time. Rank 0 alone
writes ``config.yaml``, ``metrics.jsonl``, ``summary.json`` and ``model.pt``.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fl_platform.datasets.augment import Augmentation
from fl_platform.datasets.registry import load_source
from fl_platform.models import build_model, check_model_input
from fl_platform.outputs import MetricsLog, RunDir, atomic_torch_save, atomic_write_json, atomic_write_text
from fl_platform.run_config import RunConfig
from fl_platform.seeding import Stream, seed_torch_global
from fl_platform.ssgd.distributed import DistContext, average_, replica_max_abs_diff, shard_indices
from fl_platform.ssgd.sync import Sync, broadcast_model, make_sync
from fl_platform.training.flat import FlatModel
from fl_platform.training.hooks import Batch, TrainHooks
from fl_platform.training.loop import NonFiniteError, TrainConfig, evaluate
from fl_platform.training.optim import make_optimizer

log = logging.getLogger("fl_platform.ssgd")


@dataclass
class TensorData:
    """A source's train and test tensors, on the device once (every rank holds the whole set)."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    input_shape: tuple[int, ...]
    vocab: list[str] | None = None
    augment: Augmentation | None = None  # dataset.augment, of training minibatches

    @property
    def num_train(self) -> int:
        return int(self.train_y.numel())


def load_data(run: RunConfig, device: torch.device) -> TensorData:
    ds = run.dataset
    src = load_source(ds.name, root=ds.root, download=ds.download, seed=run.seed, **run.source_options)
    augment = Augmentation.build(run.augment, src.input_shape, src.train_x.dtype, src.name, src.pad_value)

    def put(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    return TensorData(put(src.train_x), put(src.train_y), put(src.test_x), put(src.test_y), src.num_classes,
                      tuple(src.input_shape), src.vocab, augment)


def build_flat_model(run: RunConfig, data: TensorData, device: torch.device) -> FlatModel:
    """The run's model, initialised from (seed, INIT) as in the simulator, as a FlatModel."""
    options = run.model_options
    if data.vocab is not None and run.model.name == "lstm":
        options["vocab_size"] = len(data.vocab)
    check_model_input(run.model.name, data.input_shape, data.num_classes, data.train_x.dtype,
                      dataset=run.dataset.name, **options)
    seed_torch_global(run.seed, Stream.INIT)
    return FlatModel(build_model(run.model.name, data.input_shape, data.num_classes, **options), device)


def train_config(run: RunConfig) -> TrainConfig:
    return run.train_config


def steps_per_epoch(shard: int, cfg: TrainConfig) -> int:
    return shard // cfg.batch_size if cfg.drop_last else math.ceil(shard / cfg.batch_size)


def default_run_dir(run: RunConfig) -> Path:
    now = datetime.now()
    tag = f"{run.ssgd.sync}_{run.compressor.name}_{run.dataset.name}_s{run.seed}"
    return Path("outputs") / "ssgd" / now.strftime("%Y-%m-%d") / f"{now.strftime('%H-%M-%S-%f')}_{tag}"


def set_threads(run: RunConfig, ctx: DistContext) -> int:
    """Intra-op threads: ``ssgd.threads``, else ``OMP_NUM_THREADS`` (torchrun sets 1), else this node's
    cores shared by its processes. Oversubscribed cores make every step many times slower."""
    threads = run.ssgd.threads
    if threads is None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        threads = max(1, int(os.environ["OMP_NUM_THREADS"]))
    if threads is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = max(1, cores // max(1, ctx.local_world_size))
    torch.set_num_threads(int(threads))
    return int(threads)


class SSGDTrainer:
    def __init__(self, cfg: RunConfig, ctx: DistContext, run_dir: Path | str | None = None) -> None:
        """``cfg``: the run's typed configuration (``ssgd.config.compose_ssgd_config``)."""
        t0 = time.perf_counter()
        self.cfg, self.ctx = cfg, ctx
        self.threads = set_threads(cfg, ctx)
        self.train_cfg = train_config(cfg)
        self.data = load_data(cfg, ctx.device)
        self.fm = build_flat_model(cfg, self.data, ctx.device)
        s = cfg.ssgd
        compressor = cfg.compressor_options
        self.sync: Sync = make_sync(str(s.sync), self.fm, ctx, compressor, seed=cfg.seed,
                                    bucket_cap_mb=s.bucket_cap_mb, start_iter=s.start_iter, period=s.period,
                                    local_start_step=s.local_start_step, check_replicas=s.check_replicas)
        if not isinstance(self.sync.module, torch.nn.parallel.DistributedDataParallel):
            broadcast_model(self.fm, ctx.world_size)  # DDP broadcasts rank 0's model itself
        c = self.train_cfg
        self.optimizers = [((lo, hi), make_optimizer(c.optimizer, c.lr, momentum=c.momentum,
                                                     weight_decay=c.weight_decay, nesterov=c.nesterov,
                                                     betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps))
                           for lo, hi in self.fm.trainable_ranges()]
        self.hooks = TrainHooks()
        self.shard_size = self.data.num_train // ctx.world_size
        self.per_epoch = steps_per_epoch(self.shard_size, c)
        if self.per_epoch < 1:
            raise ValueError(f"each of {ctx.world_size} workers holds {self.shard_size} samples < train.batch_size="
                             f"{c.batch_size} with train.drop_last: no step fits in an epoch")
        self.total_steps = c.num_steps(self.shard_size)
        self.interval = cfg.log_every_steps or self.per_epoch
        self.run_dir: RunDir | None = None
        if ctx.is_main:
            self.run_dir = RunDir(run_dir if run_dir is not None else (cfg.run_dir or default_run_dir(cfg)))
            atomic_write_text(self.run_dir.config, cfg.to_yaml())
            atomic_write_text(self.run_dir.metrics, "")
        self.metrics = MetricsLog(self.run_dir.metrics) if self.run_dir is not None else None
        self.history: list[dict[str, Any]] = []
        self.setup_time_s = time.perf_counter() - t0

    # ------------------------------------------------------------------ the step loop
    def run(self) -> dict[str, Any]:
        cfg, ctx, fm, c = self.cfg, self.ctx, self.fm, self.train_cfg
        reporter = self._reporter()
        x, y = self.data.train_x, self.data.train_y
        step, epoch = 0, 0
        sums = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss * n, correct, n
        diffs: list[float] = []
        if ctx.world_size > 1:
            dist.barrier()
        wall0 = interval0 = time.perf_counter()
        train_time = 0.0
        steps_in_interval = 0
        stats0 = self.sync.stats.snapshot()
        summary: dict[str, Any] = {}
        fm.model.train()
        try:
            while step < self.total_steps:
                shard = shard_indices(self.data.num_train, ctx.world_size, ctx.rank, cfg.seed, epoch, ctx.device)
                seed_torch_global(cfg.seed, Stream.TORCH, epoch, ctx.rank)
                aug = self.data.augment  # keyed like a client: (seed, epoch, rank)
                aug_key = aug.client_keys(cfg.seed, epoch, [ctx.rank], ctx.device) if aug is not None else None
                stop = self.shard_size - self.shard_size % c.batch_size if c.drop_last else self.shard_size
                for start in range(0, stop, c.batch_size):
                    if step >= self.total_steps:
                        break
                    idx = shard[start : start + c.batch_size]
                    xb = x.index_select(0, idx)
                    if aug is not None:
                        xb = aug.apply(xb, aug_key, step)
                    batch = Batch(xb, y.index_select(0, idx), step, epoch)
                    fm.grad.zero_()
                    loss, logits = self.hooks.loss(self.sync.module, batch)
                    loss.backward()
                    self.sync.before_step(step)
                    if c.clip_norm is not None:
                        fm.grad.mul_(torch.clamp(c.clip_norm / (fm.grad.norm() + 1e-6), max=1.0))
                    for (lo, hi), opt in self.optimizers:
                        opt.step(fm.vector[lo:hi], fm.grad[lo:hi])
                    synced = self.sync.after_step(step)
                    n = idx.numel()
                    sums[0] += loss.detach().double() * n
                    sums[1] += (logits.detach().argmax(dim=-1) == batch.y).sum()
                    sums[2] += n
                    step += 1
                    steps_in_interval += 1
                    last = step == self.total_steps
                    if last and self.sync.finish(step - 1):
                        synced = True
                    if cfg.ssgd.check_replicas and synced:
                        diffs.append(replica_max_abs_diff(fm.params, ctx.world_size))
                    if step % self.interval == 0 or last:
                        average_(sums, ctx.world_size)  # the mean of per-rank sums: every rank the same
                        train_time += time.perf_counter() - interval0
                        row = self._row(step, sums, time.perf_counter() - interval0, steps_in_interval,
                                        stats0, diffs, last)
                        row["wall_time_s"] = time.perf_counter() - wall0
                        self.history.append(row)
                        if self.metrics is not None:
                            self.metrics.append(row)
                        if reporter is not None:
                            reporter.round_done(row)
                        sums.zero_()
                        diffs, steps_in_interval = [], 0
                        stats0 = self.sync.stats.snapshot()
                        interval0 = time.perf_counter()
                epoch += 1
            summary = self._summary(time.perf_counter() - wall0, train_time)
            if cfg.save_model:
                self.sync_buffers()
            if self.run_dir is not None:
                if cfg.save_model:
                    atomic_torch_save(fm.state_dict(), self.run_dir.model)
                atomic_write_json(self.run_dir.summary, summary)
        finally:
            if reporter is not None:
                reporter.close(summary if summary else None)
            self.sync.close()
        return summary

    def sync_buffers(self) -> None:
        """Average the BatchNorm running statistics over ranks (they are not synchronised by gradients)."""
        if self.fm.num_buffers:
            average_(self.fm.buffers, self.ctx.world_size)

    def _row(self, step: int, sums: torch.Tensor, seconds: float, steps: int, stats0: tuple[int, float, int],
             diffs: list[float], last: bool) -> dict[str, Any]:
        ctx = self.ctx
        seen = float(sums[2])
        train_loss = float(sums[0]) / seen if seen else float("nan")
        if not math.isfinite(train_loss):
            raise NonFiniteError(f"the training loss became {train_loss} (non-finite) by step {step}; lower "
                                 "train.lr, enable train.clip_norm, or check the data")
        payload, wire, collectives = (a - b for a, b in zip(self.sync.stats.snapshot(), stats0))
        row: dict[str, Any] = {
            "round": len(self.history) + 1,
            "epoch": step / self.per_epoch,
            "step": step,
            "train_loss": train_loss,
            "train_accuracy": float(sums[1]) / seen if seen else float("nan"),
            "bytes_up": payload * ctx.world_size,
            "bytes_per_worker": payload,
            "wire_bytes_per_worker": wire,
            "collectives": collectives,
            "train_time_s": seconds,
            "steps_per_s": steps / seconds if seconds > 0 else float("nan"),
        }
        if diffs:
            row["replica_max_abs_diff"] = max(diffs)
        before = getattr(self.sync, "divergence_before_sync", None)
        if before:
            row["replica_diff_before_sync"] = max(before)
            before.clear()
        every = self.cfg.eval_every
        if every and ((len(self.history) + 1) % every == 0 or last):
            t1 = time.perf_counter()
            self.sync_buffers()
            if ctx.is_main:
                row.update(evaluate(self.fm.model, self.data.test_x, self.data.test_y, self.cfg.eval_batch_size))
                self.fm.model.train()
            row["eval_time_s"] = time.perf_counter() - t1
        return row

    def _summary(self, wall: float, train_time: float) -> dict[str, Any]:
        cfg, ctx = self.cfg, self.ctx
        evals = [r for r in self.history if "test_accuracy" in r]
        last = evals[-1] if evals else {}
        steps = self.history[-1]["step"] if self.history else 0
        return {
            "rounds": len(self.history),
            "steps": steps,
            "epochs": steps / self.per_epoch,
            "final_test_accuracy": last.get("test_accuracy"),
            "final_test_loss": last.get("test_loss"),
            "best_test_accuracy": max((r["test_accuracy"] for r in evals), default=None),
            "final_train_loss": self.history[-1]["train_loss"] if self.history else None,
            "bytes_up_total": sum(r["bytes_up"] for r in self.history),
            "bytes_per_worker_total": sum(r["bytes_per_worker"] for r in self.history),
            "wire_bytes_per_worker_total": sum(r["wire_bytes_per_worker"] for r in self.history),
            "dense_bytes_per_step": 4 * self.fm.param_count,
            "wall_time_s": wall,
            "train_time_s": train_time,
            "steps_per_s": steps / train_time if train_time > 0 else None,
            "setup_time_s": self.setup_time_s,
            "world_size": ctx.world_size,
            "backend": ctx.backend,
            "device": str(ctx.device),
            "threads_per_process": self.threads,
            "sync": self.sync.name,
            "compressor": cfg.compressor.name,
            "dataset": cfg.dataset.name,
            "model": cfg.model.name,
            "num_params": self.fm.param_count,
            "global_batch_size": self.train_cfg.batch_size * ctx.world_size,
            "seed": cfg.seed,
        }

    def _reporter(self):
        if not self.ctx.is_main:
            return None
        from fl_platform.reporting import Reporter

        lg = self.cfg.logger
        rows = math.ceil(self.total_steps / self.interval)
        return Reporter(rows, progress=lg.progress, wandb=lg.wandb, wandb_project=lg.wandb_project,
                        wandb_mode=lg.wandb_mode, run_dir=str(self.run_dir.path) if self.run_dir else None,
                        config=self.cfg.to_container(),
                        log_every=lg.log_every)
