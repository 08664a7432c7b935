"""Compress a whole flat vector (a model update, a gradient bucket) segment by segment.

A :class:`Layout` cuts a flat vector into segments: one per layer (``layer``, from a FlatModel's
slots, so PowerSGD sees the real matrix shapes), one over all parameters (``global`` top-k), or
fixed-size chunks (``bucket``, as DDP's gradient buckets). Segments marked dense (BatchNorm
running statistics) travel uncompressed. :class:`VectorCompressor` applies one per-tensor
compressor to every compressible segment, keyed by the segment's index, and lays the per-segment
states end to end so that each state name is one flat tensor (what the client-state store keeps).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fl_platform.compression.base import NO_KEY, Compressor, Key, Payload, State, decode_dense, dense_payload
from fl_platform.training.flat import regions

SCOPES = ("layer", "global", "bucket")


@dataclass(frozen=True)
class Segment:
    name: str
    offset: int
    shape: tuple[int, ...]
    compress: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


class Layout:
    """Contiguous segments covering ``[0, size)`` of a flat vector."""

    def __init__(self, segments: Sequence[Segment]) -> None:
        pos = 0
        for s in segments:
            if s.offset != pos:
                raise ValueError(f"segment {s.name!r} starts at {s.offset}, expected {pos} (segments must tile the vector)")
            pos = s.end
        self.segments = list(segments)
        self.size = pos

    @classmethod
    def whole(cls, size: int) -> Layout:
        return cls([Segment("all", 0, (size,), True)])

    @classmethod
    def buckets(cls, size: int, bucket_size: int, offset: int = 0, prefix: str = "bucket") -> Layout:
        if bucket_size < 1:
            raise ValueError(f"compressor.bucket_size must be >= 1 with scope=bucket, got {bucket_size}")
        return cls([Segment(f"{prefix}{i}", offset + start, (min(bucket_size, size - start),), True)
                    for i, start in enumerate(range(0, size, bucket_size))])

    @classmethod
    def from_slots(cls, slots: Sequence, size: int, scope: str = "layer", bucket_size: int = 0) -> Layout:
        """Layout of a FlatModel vector (``size`` = params + buffers) or of its parameters only.

        ``slots`` are :class:`fl_platform.training.flat.Slot` (name, offset, shape, is_param).
        Floating-point buffers (BatchNorm statistics) always form one dense segment. With
        ``layer``, the alignment padding after a parameter tensor (at most 3 elements, zero in
        every update) is a segment of its own, compressed as the tensors are, so that per-name
        states still cover all ``num_params`` elements; ``global`` and ``bucket`` cover it.
        """
        if scope not in SCOPES:
            raise ValueError(f"compressor.scope must be one of {', '.join(SCOPES)}; got {scope!r}")
        params = [s for s in slots if s.is_param]
        num_params, total = regions(list(slots))
        num_buffers = total - num_params
        if size not in (num_params, total):
            raise ValueError(f"a vector of {size} elements is neither the model's parameters ({num_params}) "
                             f"nor parameters + buffers ({total})")
        if scope == "layer":
            segs = []
            pos = 0
            for s in [*params, None]:
                start = num_params if s is None else s.offset
                if start > pos:
                    segs.append(Segment(f"{segs[-1].name}.padding", pos, (start - pos,), True))
                if s is not None:
                    segs.append(Segment(s.name, s.offset, tuple(s.shape), True))
                    pos = s.offset + math.prod(s.shape)
        elif scope == "global":
            segs = [Segment("params", 0, (num_params,), True)] if num_params else []
        else:
            segs = cls.buckets(num_params, bucket_size).segments if num_params else []
        if size > num_params and num_buffers:
            segs.append(Segment("buffers", num_params, (num_buffers,), False))
        return cls(segs)

    def __repr__(self) -> str:
        return f"Layout({len(self.segments)} segments, size={self.size})"


@dataclass
class VectorPayload:
    """The payloads of all segments of one vector, in segment order."""

    parts: list[Payload]
    size: int

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def to_bytes(self) -> bytes:
        return b"".join(p.to_bytes() for p in self.parts)


class VectorCompressor:
    """One per-tensor compressor applied to every compressible segment of a layout."""

    def __init__(self, compressor: Compressor, layout: Layout) -> None:
        self.compressor = compressor
        self.layout = layout
        # state name -> [(segment index, start, size)] in the flat per-name state tensor
        self._slices: dict[str, list[tuple[int, int, int]]] = {}
        self._sizes: dict[str, int] = {}
        for i, seg in enumerate(layout.segments):
            if not seg.compress:
                continue
            for name, n in compressor.state_sizes(seg.shape).items():
                start = self._sizes.get(name, 0)
                self._slices.setdefault(name, []).append((i, start, n))
                self._sizes[name] = start + n

    @property
    def summable(self) -> bool:
        return self.compressor.summable

    def state_sizes(self) -> dict[str, int]:
        """Flat size of each state name over the whole vector."""
        return dict(self._sizes)

    def _segment_states(self, state: State | None, device: torch.device) -> list[State | None]:
        per: list[State | None] = [None] * len(self.layout.segments)
        if not state:
            return per
        for name, entries in self._slices.items():
            flat = state.get(name)
            if flat is None:
                continue
            if flat.numel() != self._sizes[name]:
                raise ValueError(f"state {name!r} has {flat.numel()} elements, the layout needs {self._sizes[name]}")
            flat = flat.reshape(-1).to(device)
            for i, start, n in entries:
                seg_state = per[i] if per[i] is not None else {}
                seg_state[name] = flat[start : start + n]
                per[i] = seg_state
        return per

    def _join(self, states: list[State], device: torch.device) -> State:
        out: State = {}
        for name, entries in self._slices.items():
            out[name] = torch.cat([states[i][name].reshape(-1).to(device, torch.float32) for i, _, _ in entries])
        return out

    def encode(self, vec: torch.Tensor, state: State | None = None, key: Key = NO_KEY) -> tuple[VectorPayload, State]:
        if vec.numel() != self.layout.size:
            raise ValueError(f"vector has {vec.numel()} elements, the layout covers {self.layout.size}")
        flat = vec.detach().reshape(-1)
        seg_states = self._segment_states(state, flat.device)
        parts: list[Payload] = []
        new_states: list[State] = []
        for i, seg in enumerate(self.layout.segments):
            x = flat[seg.offset : seg.end].view(seg.shape)
            if seg.compress:
                payload, st = self.compressor.encode(x, seg_states[i], key.child(i))
            else:
                payload, st = dense_payload(x), {}
            parts.append(payload)
            new_states.append(st)
        return VectorPayload(parts, self.layout.size), self._join(new_states, flat.device)

    def decode(self, payload: VectorPayload, state: State | None = None) -> torch.Tensor:
        device = payload.parts[0].tensors[next(iter(payload.parts[0].tensors))].device if payload.parts else "cpu"
        seg_states = self._segment_states(state, torch.device(device))
        out = torch.empty(self.layout.size, dtype=payload.parts[0].dtype if payload.parts else torch.float32,
                          device=device)
        for i, (seg, part) in enumerate(zip(self.layout.segments, payload.parts)):
            dec = self.compressor.decode(part, seg_states[i]) if seg.compress else decode_dense(part)
            out[seg.offset : seg.end] = dec.reshape(-1).to(out.dtype)
        return out

    def add(self, a: VectorPayload, b: VectorPayload) -> VectorPayload:
        parts = []
        for seg, pa, pb in zip(self.layout.segments, a.parts, b.parts):
            if seg.compress:
                parts.append(self.compressor.add(pa, pb))
            else:
                parts.append(Payload({"values": pa.tensors["values"] + pb.tensors["values"]}, pa.shape, pa.dtype,
                                     dict(pa.meta)))
        return VectorPayload(parts, a.size)

    def after_aggregate(self, state: State, total: VectorPayload, count: int) -> State:
        if not self._slices:
            return state
        device = next(iter(state.values())).device
        seg_states = self._segment_states(state, device)
        new = [self.compressor.after_aggregate(seg_states[i] or {}, part, count) if seg.compress else {}
               for i, (seg, part) in enumerate(zip(self.layout.segments, total.parts))]
        return self._join(new, device)

    def dense_nbytes(self, value_bytes: int = 4) -> int:
        return value_bytes * self.layout.size
