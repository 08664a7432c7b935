"""One model whose parameters and floating-point buffers live in one flat vector.

Loading the global weights is one ``copy_``, a client's delta one subtraction, an optimiser
step a handful of vector ops, and zeroing the gradients one ``zero_`` (DESIGN.md section 10).
The model stays an ordinary ``nn.Module``: each parameter's ``.data`` and ``.grad`` and each
float buffer is a view into the flat storage.

Every view starts on a 16-byte boundary, as a tensor of its own would (PyTorch's allocator aligns
far more): GPU kernels may read a tensor with 16-byte loads without checking. cuDNN's batch norm on
channels-last input does, and on an H200 it stopped every fp32 ResNet-18 round of the device check
with "CUDA error: misaligned address" while the running statistics sat 8 bytes off (docs/engine.md,
GPUs). The padding between tensors starts zero; no parameter sees it and no optimiser step writes
it (``trainable_ranges`` leaves it out), so every client's update is zero there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Slot:
    """Where one named tensor of the model lives in the flat vector."""

    name: str
    offset: int
    shape: tuple[int, ...]
    is_param: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


ALIGN_BYTES = 16


def align_elements(dtype: torch.dtype) -> int:
    """Elements per ``ALIGN_BYTES`` of ``dtype`` (4 for the float32 vectors every runtime uses)."""
    return max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())


def _align(n: int, step: int) -> int:
    return -(-n // step) * step


def plan_slots(params: list[tuple[str, torch.Tensor]], buffers: list[tuple[str, torch.Tensor]],
               dtype: torch.dtype) -> tuple[list[Slot], int, int]:
    """The flat layout of named parameters then float buffers: each tensor at an aligned offset.

    Returns (slots, num_params, num_buffers): the parameter region ``[0, num_params)`` and the buffer
    region after it, both padded to whole alignment steps so that a row of stacked vectors (a
    vectorised cohort's ``(K, d)``) keeps every view aligned too.
    """
    step = align_elements(dtype)
    slots: list[Slot] = []
    offset = 0
    for tensors, is_param in ((params, True), (buffers, False)):
        for name, t in tensors:
            offset = _align(offset, step)
            slots.append(Slot(name, offset, tuple(t.shape), is_param))
            offset += t.numel()
    num_params, total = regions(slots, step)
    return slots, num_params, total - num_params


def regions(slots: list[Slot], step: int = align_elements(torch.float32)) -> tuple[int, int]:
    """(num_params, num_params + num_buffers) of a layout made by :func:`plan_slots`: each region ends
    on a whole alignment ``step`` (the float32 vectors every runtime uses by default)."""
    ends = [s.offset + s.numel for s in slots if s.is_param]
    num_params = _align(max(ends, default=0), step)
    buffer_ends = [s.offset + s.numel for s in slots if not s.is_param]
    return num_params, _align(max(buffer_ends, default=num_params), step)


def _named_tensors(model: nn.Module) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    params = list(dict(model.named_parameters()).items())
    buffers = [(name, b) for name, b in model.named_buffers() if b is not None and b.is_floating_point()]
    return params, buffers


class FlatModel:
    """Wrap ``model`` so that ``vector = [parameters | float buffers]`` is one tensor.

    Integer buffers (BatchNorm's ``num_batches_tracked``) stay outside the vector: averaging
    them has no meaning and they do not affect the forward pass with the default momentum.
    """

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu") -> None:
        self.model = model.to(device)
        self.device = torch.device(device)
        params, buffers = _named_tensors(model)
        dtype = params[0][1].dtype if params else torch.float32
        self.slots, self.num_params, self.num_buffers = plan_slots(params, buffers, dtype)
        # zeros: the alignment padding between tensors starts zero (and no optimiser step writes it)
        self.vector = torch.zeros(self.num_params + self.num_buffers, dtype=dtype, device=self.device)
        self.grad = torch.zeros(self.num_params, dtype=dtype, device=self.device)
        self.param_count = sum(p.numel() for _, p in params)  # the model's parameters, padding excluded
        for slot, (_, p) in zip(self.slots[: len(params)], params, strict=True):
            view = self.vector[slot.offset : slot.offset + slot.numel].view_as(p)
            view.copy_(p.data)
            p.data = view
            p.grad = self.grad[slot.offset : slot.offset + slot.numel].view_as(p)
        self._params = [p for _, p in params]  # in slot order
        self._modules = list(model.modules())
        self._ranges: tuple[tuple[bool, ...], list[tuple[int, int]]] | None = None
        modules = dict(model.named_modules())
        for slot, (name, b) in zip(self.slots[len(params) :], buffers, strict=True):
            view = self.vector[slot.offset : slot.offset + slot.numel].view_as(b)
            view.copy_(b)
            owner, _, attr = name.rpartition(".")
            modules[owner]._buffers[attr] = view

    @property
    def params(self) -> torch.Tensor:
        return self.vector[: self.num_params]

    @property
    def buffers(self) -> torch.Tensor:
        return self.vector[self.num_params :]

    def __len__(self) -> int:
        return self.vector.numel()

    def load(self, vector: torch.Tensor) -> None:
        self.vector.copy_(vector)

    def train_mode(self) -> None:
        """``model.train()``, skipped when every module already trains (it walks the whole tree:
        15 us per client for a 3-layer MLP)."""
        if not all(m.training for m in self._modules):
            self.model.train()

    def trainable_ranges(self) -> list[tuple[int, int]]:
        """Contiguous [start, end) ranges of parameters with ``requires_grad`` (frozen ones excluded).

        Cached on the parameters' ``requires_grad`` flags (asked once per client)."""
        key = tuple(p.requires_grad for p in self._params)
        if self._ranges is None or self._ranges[0] != key:
            self._ranges = key, self._compute_ranges(key)
        return list(self._ranges[1])

    def _compute_ranges(self, trainable: tuple[bool, ...]) -> list[tuple[int, int]]:
        """Exact spans of the trainable tensors, neighbours merged: the alignment padding is in no
        range, so no optimiser step writes it (an update is zero there whatever the vector held).
        Padding only follows a tensor whose size is not a multiple of 4, so a model with nothing
        frozen is still one range or a few."""
        ranges: list[tuple[int, int]] = []
        flags = iter(trainable)
        for slot in self.slots:
            if not slot.is_param or not next(flags):
                continue
            start, end = slot.offset, slot.offset + slot.numel
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], end)
            else:
                ranges.append((start, end))
        return ranges

    def state_dict(self, vector: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Named tensors (CPU copies) of ``vector`` (default: the live model)."""
        vec = (self.vector if vector is None else vector).detach().to("cpu")
        return {s.name: vec[s.offset : s.offset + s.numel].view(s.shape).clone() for s in self.slots}

    def vector_from_state_dict(self, state: dict[str, torch.Tensor]) -> torch.Tensor:
        missing = [s.name for s in self.slots if s.name not in state]
        if missing:
            raise KeyError(f"state dict lacks {len(missing)} tensors of the model, e.g. {missing[:3]}")
        vec = torch.zeros_like(self.vector, device="cpu")
        for s in self.slots:
            t = torch.as_tensor(state[s.name])
            if tuple(t.shape) != s.shape:
                raise ValueError(f"tensor {s.name!r} has shape {tuple(t.shape)}, the model expects {s.shape}")
            vec[s.offset : s.offset + s.numel] = t.reshape(-1).to(vec.dtype)
        return vec


def model_vector(model: nn.Module) -> torch.Tensor:
    """The flat [params | float buffers] vector of a plain module (a copy, on CPU), laid out as a
    :class:`FlatModel` of the same module lays it out (aligned, zero padding)."""
    params, buffers = _named_tensors(model)
    dtype = params[0][1].dtype if params else torch.float32
    slots, num_params, num_buffers = plan_slots(params, buffers, dtype)
    vec = torch.zeros(num_params + num_buffers, dtype=dtype)
    for slot, (_, t) in zip(slots, params + buffers, strict=True):
        vec[slot.offset : slot.offset + slot.numel] = t.detach().reshape(-1).cpu()
    return vec
