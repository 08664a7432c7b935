"""ACP-SGD as an optimiser-level wrapper (no DDP): wait-free backprop, tensor fusion, one all-reduce a step.

ACP-SGD (compressors.md, item 6) alternates P-steps and Q-steps, so each step all-reduces one
factor, and the payloads are summable because the other factor is the same on every rank. As in
the reference code (lzhangbv/powersgd ``acpsgd.py``) it is not a DDP hook: a post-accumulate-grad
hook on every parameter compresses its gradient (with local error feedback) as soon as backward
has produced it, writes the factor into its fusion buffer, and launches that buffer's all-reduce
asynchronously once every member is in, so communication overlaps the rest of backward.
:meth:`before_step` waits, updates the shared factors (``after_aggregate``) and writes the
decoded mean gradient into ``param.grad`` (a view of the FlatModel's flat gradient) for the
optimiser. Fusion buffers hold ``bucket_cap_mb`` scaled by the compression ratio of the phase
(threshold = cap * payload bytes / model bytes), so there are as many as DDP would have buckets.

Never wrap the model in DDP as well: gradients would be all-reduced twice. Compression starts at
step 0 (no DDP bucket rebuild to wait for); all ranks start from identical factors (``init`` key).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fl_platform.compression.acpsgd import ACPSGD
from fl_platform.compression.base import Compressor, Key, Payload, State
from fl_platform.compression.errorfeedback import ErrorFeedback
from fl_platform.ssgd.stats import CommStats
from fl_platform.training.flat import FlatModel

PHASES = ("p", "q")


@dataclass
class _Entry:
    """One parameter: its compressor state and where its payload goes in each phase's fusion buffers."""

    index: int
    param: torch.Tensor
    shape: tuple[int, ...]
    state: State
    sizes: dict[str, int]  # phase -> payload elements
    slot: dict[str, tuple[int, int]] = field(default_factory=dict)  # phase -> (group, offset)
    pending: tuple[Payload, State] | None = None


class ACPSGDSync:
    """Synchronise gradients with ACP-SGD around a plain (un-wrapped) model."""

    name = "acpsgd"

    def __init__(self, fm: FlatModel, compressor: Compressor, rank: int, world_size: int, seed: int = 0,
                 bucket_cap_mb: float = 25.0, group: Any = None, stats: CommStats | None = None) -> None:
        inner = compressor.inner if isinstance(compressor, ErrorFeedback) else compressor
        if not isinstance(inner, ACPSGD):
            raise ValueError(f"the ACP-SGD optimiser wrapper needs compressor=acpsgd, got {inner.name!r}")
        self.fm, self.module = fm, fm.model
        self.compressor, self.acp = compressor, inner
        self.rank, self.world_size, self.seed, self.group = rank, world_size, seed, group
        self.stats = stats or CommStats(world_size)
        self.stats.world_size = world_size
        self.step = 0
        named = dict(fm.model.named_parameters())
        device = fm.device
        self.entries: list[_Entry] = []
        for i, slot in enumerate(s for s in fm.slots if s.is_param):
            p = named[slot.name]
            if not p.requires_grad:
                continue
            state = compressor.init_state(slot.shape, Key(seed, tensor=(i,)), device)
            sizes = {ph: inner.payload_nbytes(slot.shape, 4, phase=ph) // 4 for ph in PHASES}
            self.entries.append(_Entry(i, p, slot.shape, state, sizes))
        self._plan(bucket_cap_mb * 2**20)
        self._handles = [e.param.register_post_accumulate_grad_hook(self._hook_for(e)) for e in self.entries]
        self._reset_step()

    # -- fusion plan ---------------------------------------------------------------------------
    def _plan(self, cap_bytes: float) -> None:
        """Greedy fusion groups per phase, in reverse parameter order (the order backward produces)."""
        model_elems = sum(e.param.numel() for e in self.entries) or 1
        self.group_sizes: dict[str, list[int]] = {}
        for ph in PHASES:
            total = sum(e.sizes[ph] for e in self.entries)
            threshold = cap_bytes * total / model_elems / 4  # elements per buffer
            sizes: list[int] = [0]
            for e in reversed(self.entries):
                if sizes[-1] and sizes[-1] + e.sizes[ph] > threshold:
                    sizes.append(0)
                e.slot[ph] = (len(sizes) - 1, sizes[-1])
                sizes[-1] += e.sizes[ph]
            self.group_sizes[ph] = sizes
        self.group_members = {ph: [sum(1 for e in self.entries if e.slot[ph][0] == g) for g in range(len(sizes))]
                              for ph, sizes in self.group_sizes.items()}

    @property
    def phase(self) -> str:
        return PHASES[self.step % 2]

    def _reset_step(self) -> None:
        ph = self.phase
        device = self.fm.device
        self.buffers = [torch.zeros(n, dtype=torch.float32, device=device) for n in self.group_sizes[ph]]
        self.ready = [0] * len(self.buffers)
        self.works: list[Any] = [None] * len(self.buffers)
        for e in self.entries:
            e.pending = None

    # -- per-parameter compression, as soon as the gradient exists -----------------------------------
    def _hook_for(self, entry: _Entry):
        def hook(param: torch.Tensor) -> None:
            self._compress(entry, param.grad)
        return hook

    def _compress(self, e: _Entry, grad: torch.Tensor | None) -> None:
        if e.pending is not None:
            raise RuntimeError(f"parameter {e.index} got two gradients in one ACP-SGD step; call before_step "
                               "once after every backward (gradient accumulation is not supported)")
        g = torch.zeros(e.shape, device=self.fm.device) if grad is None else grad.detach()
        key = Key(self.seed, step=self.step, sender=self.rank, tensor=(e.index,))
        ph = self.phase  # from the host's step count: the state's counter is not read back
        payload, new_state = self.compressor.encode(g, e.state, key, phase=ph)
        e.pending = (payload, new_state)
        group, offset = e.slot[ph]
        flat = torch.cat([payload.tensors[k].reshape(-1).to(torch.float32) for k in sorted(payload.tensors)])
        if flat.numel() != e.sizes[ph]:
            raise RuntimeError(f"ACP-SGD payload of parameter {e.index} has {flat.numel()} elements, planned "
                               f"{e.sizes[ph]}")
        self.buffers[group][offset : offset + flat.numel()] = flat
        self.ready[group] += 1
        if self.ready[group] == self.group_members[ph][group]:
            self._launch(group)

    def _launch(self, group: int) -> None:
        buf = self.buffers[group]
        self.stats.all_reduce(buf.numel() * buf.element_size())
        self.works[group] = dist.all_reduce(buf, group=self.group, async_op=True) if self.world_size > 1 else None

    # -- the trainer's side ----------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        """Wait for the all-reduces and put the decoded mean gradient into ``param.grad``."""
        for e in self.entries:
            if e.pending is None:  # a parameter without a gradient this step: it contributes zeros
                self._compress(e, None)
        for w in self.works:
            if w is not None:
                w.wait()
        ph, n = self.phase, self.world_size
        for e in self.entries:
            payload, new_state = e.pending  # type: ignore[misc]
            group, offset = e.slot[ph]
            flat = self.buffers[group][offset : offset + e.sizes[ph]]
            tensors, pos = {}, 0
            for k in sorted(payload.tensors):
                t = payload.tensors[k]
                tensors[k] = flat[pos : pos + t.numel()].view(t.shape).to(t.dtype)
                pos += t.numel()
            total = Payload(tensors, payload.shape, payload.dtype, dict(payload.meta))
            e.state = self.compressor.after_aggregate(new_state, total, n) if new_state else new_state
            grad = self.compressor.decode(total, e.state or None).div_(n)
            if e.param.grad is None:
                raise RuntimeError("ACP-SGD writes into param.grad: wrap the model in a FlatModel first")
            e.param.grad.copy_(grad.view(e.shape))
        self.step += 1
        self._reset_step()

    def after_step(self, step: int) -> bool:
        return True

    def finish(self, last_step: int) -> bool:
        return False

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
