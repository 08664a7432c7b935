"""DDP communication hooks built from the shared compressors (fl_platform/compression).

``ddp.register_comm_hook(state, compression_hook)`` replaces DDP's all-reduce of each gradient
bucket (a flat buffer of whole parameter gradients, up to ``bucket_cap_mb``) by:

* **all-reduce** of the payloads, for summable compressors (identity, random-k with its shared
  seed, ACP-SGD): encode, one all-reduce of the concatenated payload tensors, the shared-state
  update (``after_aggregate``), decode, divide by the world size;
* the **PowerSGD protocol** (P all-reduced, orthogonalised, Q all-reduced; error feedback against
  the global approximation, as torch's hook), for PowerSGD, whose one-sender payload is not summable;
* **all-gather** for the others (Top-k, QSGD, sign, EF-sign): every rank's payload travels as raw
  bytes (its wire format), each is decoded, and the mean is returned.

A bucket is cut into segments by ``compressor.scope``: ``layer`` (one per parameter, so low-rank
compressors see real matrices), ``global`` (the bucket as one vector) or ``bucket`` (chunks of
``bucket_size``). Per-worker state (error-feedback residuals, PowerSGD's warm-start Q, ACP-SGD's
factors) is kept per bucket index. DDP rebuilds its buckets after iteration 1, so compression
starts at ``start_iter >= 2``; before that buckets are all-reduced dense. Random draws come from
``Key(seed, step=iteration, sender=rank, tensor=(bucket index, segment index))``; PowerSGD's
initial and fresh Q use ``tensor=(parameter index in the model,)`` instead (with ``param_index``),
so they do not depend on how DDP assigned parameters to buckets.
"""

# No ``from __future__ import annotations``: DDP checks the hook's annotations at run time.
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from fl_platform.compression.base import Compressor, Key, Payload, State
from fl_platform.compression.errorfeedback import ErrorFeedback
from fl_platform.compression.powersgd import PowerSGD, matrix_shape
from fl_platform.compression.vector import Layout, Segment, VectorCompressor, VectorPayload
from fl_platform.ssgd.stats import CommStats

MODES = ("allreduce", "powersgd", "allgather")


def hook_mode(compressor: Compressor) -> str:
    """How a compressor's payloads are aggregated: ``allreduce``, ``powersgd`` or ``allgather``."""
    inner = compressor.inner if isinstance(compressor, ErrorFeedback) else compressor
    if isinstance(inner, PowerSGD):
        return "powersgd"
    if compressor.summable:
        return "allreduce"
    return "allgather"


def payload_tensors(vp: VectorPayload) -> list[torch.Tensor]:
    """The payload's tensors in wire order (segment order, then name order, as ``to_bytes``)."""
    return [part.tensors[name] for part in vp.parts for name in sorted(part.tensors)]


def with_tensors(vp: VectorPayload, tensors: list[torch.Tensor]) -> VectorPayload:
    """A payload of ``vp``'s layout holding ``tensors`` (in wire order) instead of its own."""
    it = iter(tensors)
    parts = [Payload({name: next(it) for name in sorted(part.tensors)}, part.shape, part.dtype, dict(part.meta))
             for part in vp.parts]
    return VectorPayload(parts, vp.size)


def flatten_float(vp: VectorPayload) -> torch.Tensor:
    """The payload's tensors concatenated into one float32 vector (for an all-reduce)."""
    parts = payload_tensors(vp)
    bad = sorted({str(t.dtype) for t in parts if not t.is_floating_point()})
    if bad:
        raise TypeError(f"a summable payload must hold floating-point tensors to be all-reduced, got {bad}")
    return torch.cat([t.reshape(-1).to(torch.float32) for t in parts])


def unflatten_float(vp: VectorPayload, flat: torch.Tensor) -> VectorPayload:
    out, pos = [], 0
    for t in payload_tensors(vp):
        out.append(flat[pos : pos + t.numel()].view(t.shape).to(t.dtype))
        pos += t.numel()
    return with_tensors(vp, out)


def to_wire(vp: VectorPayload) -> torch.Tensor:
    """The payload's wire bytes as a uint8 tensor on its device (the bytes of ``vp.to_bytes()``)."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in payload_tensors(vp)])


def from_wire(vp: VectorPayload, raw: torch.Tensor) -> VectorPayload:
    """Another sender's payload of ``vp``'s layout from its wire bytes ``raw``."""
    tensors = payload_tensors(vp)
    need = sum(t.numel() * t.element_size() for t in tensors)
    if need != raw.numel():
        raise ValueError(f"wire payload has {raw.numel()} bytes, the layout needs {need}")
    out, pos = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        out.append(raw[pos : pos + n].clone().view(t.dtype).view(t.shape))
        pos += n
    return with_tensors(vp, out)


def bucket_layout(shapes: list[tuple[int, ...]], size: int, scope: str, bucket_size: int = 0) -> Layout:
    """Segments of a DDP bucket of ``size`` elements holding gradients of ``shapes`` (in bucket order)."""
    if scope == "global":
        return Layout.whole(size)
    if scope == "bucket":
        return Layout.buckets(size, bucket_size)
    if scope != "layer":
        raise ValueError(f"compressor.scope must be layer, global or bucket; got {scope!r}")
    segs, pos = [], 0
    for j, shape in enumerate(shapes):
        segs.append(Segment(f"grad{j}", pos, tuple(shape), True))
        pos += math.prod(shape)
    if pos != size:
        raise ValueError(f"the bucket's gradients cover {pos} elements but its buffer has {size}")
    return Layout(segs)


@dataclass
class BucketState:
    """What one worker keeps for one bucket between iterations."""

    layout: Layout
    codec: VectorCompressor
    state: State = field(default_factory=dict)  # allreduce / allgather: the VectorCompressor's flat state
    lowrank: dict[int, State] = field(default_factory=dict)  # powersgd: per segment residual and q
    segment_keys: list[tuple[int, ...]] = field(default_factory=list)  # powersgd: Key.tensor of each segment
    wire_bytes: int | None = None  # allgather: the payload length every rank agreed on


@dataclass
class HookState:
    """The hook's per-worker state (``register_comm_hook(state, compression_hook)``)."""

    compressor: Compressor
    rank: int
    world_size: int
    seed: int = 0
    start_iter: int = 2
    scope: str = "layer"
    bucket_size: int = 0
    group: Any = None  # process group (None: the default group)
    # data_ptr() of each parameter -> its position in the model: PowerSGD's initial Q is keyed by it,
    # so it does not depend on how DDP happens to bucket (None: keyed by (bucket, segment) instead)
    param_index: dict[int, int] | None = None
    stats: CommStats = field(default_factory=CommStats)
    iteration: int = 0
    buckets: dict[int, BucketState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.mode = hook_mode(self.compressor)
        inner = self.compressor.inner if isinstance(self.compressor, ErrorFeedback) else self.compressor
        if self.mode == "powersgd" and self.scope != "layer":
            raise ValueError(f"compressor={inner.name} compresses matrices: it needs compressor.scope=layer, "
                             f"got {self.scope!r}")
        if self.mode == "allgather":
            extra = set(self.compressor.state_sizes((4, 4))) - {"residual"}
            if extra:
                raise ValueError(f"compressor {inner.name!r} is not summable and keeps sender state {sorted(extra)} "
                                 "that its receivers would need: it cannot be all-gathered")
        if self.start_iter < 2:
            raise ValueError(f"ssgd.start_iter must be >= 2 (DDP rebuilds buckets after iteration 1), got {self.start_iter}")
        self.stats.world_size = self.world_size

    def bucket(self, bucket: dist.GradBucket) -> BucketState:
        """This bucket's state, (re)built when its layout is new (e.g. after DDP rebuilt the buckets)."""
        buf = bucket.buffer()
        shapes = [tuple(p.shape) for p in bucket.parameters()]
        st = self.buckets.get(bucket.index())
        if st is None or st.layout.size != buf.numel() or (
                self.scope == "layer" and [s.shape for s in st.layout.segments] != shapes):
            layout = bucket_layout(shapes, buf.numel(), self.scope, self.bucket_size)
            st = BucketState(layout, VectorCompressor(self.compressor, layout))
            positions = [self.param_index.get(p.data_ptr()) for p in bucket.parameters()] if self.param_index else []
            if self.scope == "layer" and positions and None not in positions:
                st.segment_keys = [(int(i),) for i in positions]  # type: ignore[arg-type]
            else:
                st.segment_keys = [(bucket.index(), j) for j in range(len(layout.segments))]
            self.buckets[bucket.index()] = st
        return st


def _dense(state: HookState, buf: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """DDP's own all-reduce (the mean), counted."""
    state.stats.all_reduce(buf.numel() * buf.element_size())
    buf.div_(state.world_size)
    work = dist.all_reduce(buf, group=state.group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def compression_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: the mean over workers of each worker's compressed gradient bucket."""
    iteration = state.iteration
    if bucket.is_last():
        state.iteration += 1
    buf = bucket.buffer()
    if iteration < state.start_iter:
        return _dense(state, buf)
    st = state.bucket(bucket)
    key = Key(state.seed, step=iteration, sender=state.rank, tensor=(bucket.index(),))
    if state.mode == "powersgd":
        return _powersgd(state, st, buf, Key(state.seed, step=iteration, sender=state.rank))
    if state.mode == "allreduce":
        return _allreduce(state, st, buf, key)
    return _allgather(state, st, buf, key)


def _allreduce(state: HookState, st: BucketState, buf: torch.Tensor, key: Key) -> torch.futures.Future[torch.Tensor]:
    vp, new_state = st.codec.encode(buf, st.state or None, key)
    flat = flatten_float(vp)
    state.stats.all_reduce(vp.nbytes)
    n = state.world_size

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        total = unflatten_float(vp, fut.value()[0])
        st.state = st.codec.after_aggregate(new_state, total, n) if new_state else new_state
        return st.codec.decode(total, st.state or None).to(buf.dtype).div_(n)

    return dist.all_reduce(flat, group=state.group, async_op=True).get_future().then(finish)


def _allgather(state: HookState, st: BucketState, buf: torch.Tensor, key: Key) -> torch.futures.Future[torch.Tensor]:
    vp, st.state = st.codec.encode(buf, st.state or None, key)
    raw = to_wire(vp)
    n = state.world_size
    if st.wire_bytes != raw.numel():  # first use of this layout: every rank must send the same length
        sizes = torch.zeros(n, dtype=torch.int64, device=raw.device)
        sizes[state.rank] = raw.numel()
        dist.all_reduce(sizes, group=state.group)
        if bool((sizes != raw.numel()).any()):
            raise RuntimeError(f"{state.compressor.name}: payload lengths differ between ranks: {sizes.tolist()}")
        st.wire_bytes = raw.numel()
    state.stats.all_gather(raw.numel())
    gathered = torch.empty(n * raw.numel(), dtype=torch.uint8, device=raw.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    work = gather(gathered, raw, group=state.group, async_op=True)
    length = raw.numel()

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        total = torch.zeros_like(buf)
        for r in range(n):
            total += st.codec.decode(from_wire(vp, gathered[r * length : (r + 1) * length])).to(buf.dtype)
        return total.div_(n)

    return work.get_future().then(finish)


def _powersgd(state: HookState, st: BucketState, buf: torch.Tensor, key: Key) -> torch.futures.Future[torch.Tensor]:
    """Rank-r PowerSGD per matrix segment, dense for the rest; EF against the global approximation.

    Both all-reduces are launched and waited for here, on the thread that runs the hook (the backward
    pass), and the bucket's result is returned as a completed future. Not from a callback of the P
    all-reduce: a callback runs on a backend worker thread, so with two buckets in flight each of
    gloo's two worker threads blocked in its bucket's Q all-reduce and no thread was left to run them
    (a deadlock), and the ranks could launch one bucket's Q and the next bucket's P in different orders
    (collectives paired across ranks by launch order)."""
    comp = state.compressor
    ef = isinstance(comp, ErrorFeedback)
    psgd: PowerSGD = comp.inner if ef else comp  # type: ignore[assignment]
    n = state.world_size
    flat = buf.detach()
    mats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # segment -> (M^ = M + E, Q)
    first: list[torch.Tensor] = []
    for j, seg in enumerate(st.layout.segments):
        x = flat[seg.offset : seg.end]
        if not psgd.compressible(seg.shape):
            first.append(x.to(torch.float32))
            continue
        seg_state = st.lowrank.setdefault(j, {})
        m = psgd.matrix(x.view(seg.shape))
        if ef and "residual" in seg_state:
            m = m + seg_state["residual"].view(m.shape)
        cols = matrix_shape(seg.shape)[1]
        if psgd.warm_start:
            if "q" not in seg_state:
                seg_state["q"] = psgd.init_state(seg.shape, key.child(*st.segment_keys[j]), m.device)["q"]
            q = seg_state["q"].view(cols, psgd.rank).to(m.dtype)
        else:
            q = psgd.random_factor(cols, key.child(*st.segment_keys[j]), m.device, scope="step").to(m.dtype)
        mats[j] = (m, q)
        first.append(psgd.p_step(m, q).reshape(-1))
    p_sum = torch.cat(first) if first else flat.new_zeros(0, dtype=torch.float32)
    state.stats.all_reduce(p_sum.numel() * 4)
    dist.all_reduce(p_sum, group=state.group)
    out = torch.empty_like(buf)
    pos, p_hats, second = 0, {}, []
    for j, seg in enumerate(st.layout.segments):
        if j not in mats:
            out[seg.offset : seg.end] = (p_sum[pos : pos + seg.numel] / n).to(buf.dtype)
            pos += seg.numel
            continue
        m, _ = mats[j]
        size = m.shape[0] * psgd.rank
        p_hat, q_local = psgd.q_step(m, p_sum[pos : pos + size].view(m.shape[0], psgd.rank))
        pos += size
        p_hats[j] = p_hat
        second.append(q_local.reshape(-1))
    if second:
        q_sum = torch.cat(second)
        state.stats.all_reduce(q_sum.numel() * 4)
        dist.all_reduce(q_sum, group=state.group)
        pos = 0
        for j, seg in enumerate(st.layout.segments):
            if j not in mats:
                continue
            m, _ = mats[j]
            size = m.shape[1] * psgd.rank
            approx, q_mean = psgd.reconstruct(p_hats[j], q_sum[pos : pos + size].view(m.shape[1], psgd.rank), n)
            pos += size
            out[seg.offset : seg.end] = approx.reshape(-1).to(buf.dtype)
            seg_state = st.lowrank[j]
            if ef:
                seg_state["residual"] = (m - approx).reshape(-1)
            if psgd.warm_start:
                seg_state["q"] = q_mean.reshape(-1).clone()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(out)
    return fut
