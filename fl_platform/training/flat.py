"""One model whose parameters and floating-point buffers live in one flat vector.

Loading the global weights is one ``copy_``, a client's delta one subtraction, an optimiser
step a handful of vector ops, and zeroing the gradients one ``zero_`` (DESIGN.md section 10).
The model stays an ordinary ``nn.Module``: each parameter's ``.data`` and ``.grad`` and each
float buffer is a view into the flat storage.
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


class FlatModel:
    """Wrap ``model`` so that ``vector = [parameters | float buffers]`` is one tensor.

    Integer buffers (BatchNorm's ``num_batches_tracked``) stay outside the vector: averaging
    them has no meaning and they do not affect the forward pass with the default momentum.
    """

    def __init__(self, model: nn.Module, device: torch.device | str = "cpu") -> None:
        self.model = model.to(device)
        self.device = torch.device(device)
        params = list(dict(model.named_parameters()).items())
        buffers = [
            (name, b) for name, b in model.named_buffers() if b is not None and b.is_floating_point()
        ]
        self.num_params = sum(p.numel() for _, p in params)
        self.num_buffers = sum(b.numel() for _, b in buffers)
        dtype = params[0][1].dtype if params else torch.float32
        self.vector = torch.empty(self.num_params + self.num_buffers, dtype=dtype, device=self.device)
        self.grad = torch.zeros(self.num_params, dtype=dtype, device=self.device)
        self.slots: list[Slot] = []
        offset = 0
        for name, p in params:
            n = p.numel()
            view = self.vector[offset : offset + n].view_as(p)
            view.copy_(p.data)
            p.data = view
            p.grad = self.grad[offset : offset + n].view_as(p)
            self.slots.append(Slot(name, offset, tuple(p.shape), True))
            offset += n
        self._params = [p for _, p in params]  # in slot order
        self._modules = list(model.modules())
        self._ranges: tuple[tuple[bool, ...], list[tuple[int, int]]] | None = None
        modules = dict(model.named_modules())
        for name, b in buffers:
            n = b.numel()
            view = self.vector[offset : offset + n].view_as(b)
            view.copy_(b)
            owner, _, attr = name.rpartition(".")
            modules[owner]._buffers[attr] = view
            self.slots.append(Slot(name, offset, tuple(b.shape), False))
            offset += n

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
        vec = torch.empty_like(self.vector, device="cpu")
        for s in self.slots:
            t = torch.as_tensor(state[s.name])
            if tuple(t.shape) != s.shape:
                raise ValueError(f"tensor {s.name!r} has shape {tuple(t.shape)}, the model expects {s.shape}")
            vec[s.offset : s.offset + s.numel] = t.reshape(-1).to(vec.dtype)
        return vec


def model_vector(model: nn.Module) -> torch.Tensor:
    """The flat [params | float buffers] vector of a plain module (a copy, on CPU)."""
    parts = [p.detach().reshape(-1) for p in dict(model.named_parameters()).values()]
    parts += [b.detach().reshape(-1) for _, b in model.named_buffers() if b.is_floating_point()]
    return torch.cat(parts).cpu() if parts else torch.zeros(0)
