"""The step's speed options (``train.precision``, ``train.channels_last``, ``train.compile``) and the
device rules that make a step cheap on a GPU: no host reads, asynchronous copies from pinned memory.

Everything here is shared by the plain loop (loop.py) and the cohort trainer (vectorised.py), so the
two apply one option the same way. An option that cannot act where it is asked for is refused with
an error naming the key (fp16 without CUDA, channels_last on a model without convolutions, compile
or channels_last with vectorised cohorts): docs/engine.md, section "The step".
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from fl_platform.training.flat import FlatModel
    from fl_platform.training.loop import TrainConfig

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def check_step_options(cfg: TrainConfig, device: torch.device, model: nn.Module) -> None:
    """ValueError naming the key for a step option this device or model cannot apply."""
    if cfg.precision not in PRECISIONS:
        raise ValueError(f"train.precision must be one of {', '.join(PRECISIONS)}; got {cfg.precision!r}")
    if cfg.precision == "fp16" and device.type != "cuda":
        raise ValueError(f"train.precision=fp16 needs a CUDA device (its loss scaling exists for CUDA's fp16 "
                         f"kernels), but this worker trains on {device}; use train.precision=bf16 (autocast "
                         "on the CPU too) or fp32")
    if cfg.channels_last and not any(isinstance(m, nn.Conv2d) for m in model.modules()):
        raise ValueError(f"train.channels_last=True has no effect: the model ({type(model).__name__}) has no "
                         "2-D convolution, the only layer whose memory layout it changes; leave it False")


def check_image_inputs(cfg: TrainConfig, input_shape: Sequence[int], is_float: bool) -> None:
    """``train.channels_last`` needs image samples (channels, height, width): 4-D minibatches."""
    if cfg.channels_last and (len(input_shape) != 3 or not is_float):
        kind = "float" if is_float else "integer"
        raise ValueError(f"train.channels_last=True needs image samples (channels, height, width), got {kind} "
                         f"samples of shape {tuple(input_shape)}; leave it False")


def check_cohort_options(cfg: TrainConfig, cohort_size: int | str) -> None:
    """The options the vectorised cohort step (engine.cohort_size != 1) does not apply: refused."""
    if cohort_size == 1:
        return
    for key, on, why in (
        ("train.compile", cfg.compile, "torch.compile compiles the per-client model, which the cohort step "
                                       "never calls (it runs its own vmapped or batched-matmul step)"),
        ("train.channels_last", cfg.channels_last, "the cohort step stacks clients' images as (K, B, C, H, W), "
                                                   "which has no channels-last layout"),
        ("train.precision", cfg.precision == "fp16", "fp16 needs a loss scaler, which the cohort step does not "
                                                     "have (bf16 needs none and works there)"),
    ):
        if on:
            value = cfg.precision if key == "train.precision" else True
            raise ValueError(f"{key}={value} cannot apply with engine.cohort_size={cohort_size}: {why}; "
                             f"set engine.cohort_size=1 or leave {key} at its default")


def autocast(cfg: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward pass's autocast for ``train.precision`` (a no-op context at fp32)."""
    dtype = PRECISIONS[cfg.precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def enable_cudnn_benchmark(device: torch.device) -> None:
    """cuDNN's autotuner on a CUDA device (fixed shapes per run: it pays once, then picks the fastest
    convolution kernels); left off when deterministic algorithms are requested, which it would defeat."""
    if device.type == "cuda" and not torch.are_deterministic_algorithms_enabled():
        torch.backends.cudnn.benchmark = True


def use_deterministic_algorithms() -> None:
    """``engine.deterministic=true``, for this process (a worker's; inline, the driver's too): cuBLAS
    with a fixed workspace, cuDNN's deterministic kernels and no autotuner, and torch's deterministic
    algorithms, under which an operation without a deterministic kernel raises when it runs (see
    :func:`naming_deterministic_key`). Called before the trainer (and any cuBLAS handle) exists."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


@contextlib.contextmanager
def naming_deterministic_key() -> Iterator[None]:
    """torch's error for an operation without a deterministic kernel, said in the config's terms."""
    try:
        yield
    except RuntimeError as err:
        if not (torch.are_deterministic_algorithms_enabled() and "use_deterministic_algorithms" in str(err)):
            raise
        raise RuntimeError(f"engine.deterministic=true refuses an operation without a deterministic kernel on this "
                           f"device: {err}\nReplace the operation in the model or algorithm, or set "
                           f"engine.deterministic=false (docs/engine.md, Determinism)") from err


def as_channels_last(x: torch.Tensor) -> torch.Tensor:
    """A 4-D minibatch in channels-last layout (a device-side copy; no host read)."""
    return x.contiguous(memory_format=torch.channels_last)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor) on ``device`` without blocking the host: from pinned memory with a
    non-blocking copy on CUDA (pageable memory would make the copy synchronous)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=True)


class LossScaler:
    """Dynamic loss scaling for fp16, for the flat optimisers: the loss is multiplied by ``scale``
    before backward and the gradient divided after. A gradient that overflowed is computed again at
    half the scale (rather than its step skipped, as ``torch.amp.GradScaler`` does: a client takes
    few local steps, and each must count); after ``interval`` good steps the scale doubles. One per
    fit, so a client's steps do not depend on which clients its worker trained before.

    Reading the overflow flag is one host read per step (GradScaler's ``step`` makes the same read);
    bf16 needs no scaler and so no read.
    """

    def __init__(self, init_scale: float = 2.0**16, interval: int = 2000) -> None:
        self.scale = init_scale
        self.interval = interval
        self._good = 0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale(self, grad: torch.Tensor) -> bool:
        """Divide ``grad`` by the scale in place; False when it overflowed and must be computed again
        (the scale is halved). At scale 1 a non-finite gradient is final: the loop's NonFiniteError
        reports it."""
        grad.mul_(1.0 / self.scale)
        if not bool(torch.isfinite(grad).all()) and self.scale > 1.0:
            self.scale /= 2.0
            self._good = 0
            return False
        self._good += 1
        if self._good == self.interval:
            self.scale *= 2.0
            self._good = 0
        return True


def compile_model(model: nn.Module) -> None:
    """Compile the module's forward in place (``nn.Module.compile``): every caller of ``model(x)``,
    hooks included, runs the compiled graph; parameters stay the FlatModel's views."""
    model.compile()


@contextlib.contextmanager
def restored(fm: FlatModel) -> Iterator[None]:
    """Leave a FlatModel's values, gradient and integer buffers (BatchNorm's step counts) as they
    were: a warm-up pass trains nothing."""
    saved = fm.vector.detach().clone()
    counts = [(b, b.clone()) for b in fm.model.buffers() if not b.is_floating_point()]
    try:
        yield
    finally:
        with torch.no_grad():
            fm.vector.copy_(saved)
            for b, v in counts:
                b.copy_(v)
        fm.grad.zero_()
