"""FL uplink compression: what a worker does to each ClientUpdate before folding it in.

For every contribution tensor named in ``compressor.tensors`` (default ``delta``, the model
update) the worker encodes the tensor into a real payload, counts its bytes, and replaces the
tensor with what the server would decode. Tensors not named travel dense (4 bytes an element).
Decoding happens per client, before the worker sums: for summable compressors that equals
summing payloads first (tested), for the others it is the only option.

Layout: a tensor the size of the flat model vector (or of its parameters) is split with the
model's slots (``scope=layer``: per tensor, BatchNorm buffers dense), or compressed over all
parameters (``global``) or in buckets; any other tensor is one segment.

What is compressed is the tensor the algorithm sends, e.g. FedAvg's n_k * delta_k. Every compressor
here is positively homogeneous (C(c x) = c C(x) for c > 0, with the same random draws), so this is
the same as compressing delta_k and scaling by n_k. The one place the scale could matter is the
error-feedback residual, kept in the sent units; a client's n_k does not change between rounds,
so e + n_k delta = n_k (e / n_k + delta) is exactly EF on the unscaled update.

State: per client, in the client-state store next to the algorithm's own, under names prefixed
``ef.`` (``ef.<tensor>.residual``, PowerSGD's ``ef.<tensor>.q``, and ``ef.round``: the round the
state was written, so the staleness of a residual applied when the client is next sampled is
logged as ``ef_age_rounds``; 1 means the client was also sampled in the previous round).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fl_platform.algorithms.base import StateSpec
from fl_platform.compression.acpsgd import ACPSGD
from fl_platform.compression.base import Key, State
from fl_platform.compression.errorfeedback import ErrorFeedback
from fl_platform.compression.powersgd import LowRank
from fl_platform.compression.registry import conf_of, make_compressor
from fl_platform.compression.vector import Layout, VectorCompressor
from fl_platform.core import ClientUpdate, RoundContext
from fl_platform.training.flat import FlatModel

PREFIX = "ef."
ROUND_KEY = PREFIX + "round"


class UplinkCompression:
    def __init__(self, conf: Any, fm: FlatModel, sizes: dict[str, int]) -> None:
        self.conf = conf_of(conf)
        comp = make_compressor(self.conf)
        if comp is None:
            raise ValueError("compressor=none needs no uplink compression")
        inner = comp.inner if isinstance(comp, ErrorFeedback) else comp
        if isinstance(inner, ACPSGD):
            raise NotImplementedError(
                "compressor=acpsgd is not implemented for FL uplinks: its decoder needs a factor shared by "
                "the server and every client across rounds (kept by the S-SGD runtime per worker); "
                "use powersgd for FL")
        if isinstance(inner, LowRank) and self.conf.scope != "layer":
            raise ValueError(f"compressor={self.conf.name} compresses matrices: it needs compressor.scope=layer, "
                             f"got {self.conf.scope!r}")
        self.compressor = comp
        self.fm = fm
        self.names = list(self.conf.tensors)
        self._vcs: dict[int, VectorCompressor] = {}
        self.sizes: dict[str, int] = {}
        for name in self.names:
            if name in sizes:
                self.sizes[name] = int(sizes[name])
            elif self._stateful():
                raise ValueError(f"compressor.tensors names {name!r}, but the algorithm does not declare its size "
                                 f"(known: {sorted(sizes)}); a compressor with state needs it")

    def _stateful(self) -> bool:
        return isinstance(self.compressor, ErrorFeedback | LowRank)

    def layout(self, numel: int) -> Layout:
        if numel in (self.fm.num_params, len(self.fm)):
            return Layout.from_slots(self.fm.slots, numel, self.conf.scope, self.conf.bucket_size)
        if self.conf.scope == "bucket":
            return Layout.buckets(numel, self.conf.bucket_size)
        return Layout.whole(numel)

    def vector(self, numel: int) -> VectorCompressor:
        vc = self._vcs.get(numel)
        if vc is None:
            vc = self._vcs[numel] = VectorCompressor(self.compressor, self.layout(numel))
        return vc

    def state_spec(self) -> dict[str, StateSpec]:
        """The per-client state to merge into the algorithm's (all names prefixed ``ef.``)."""
        spec = {f"{PREFIX}{name}.{key}": StateSpec(n)
                for name, size in self.sizes.items() for key, n in self.vector(size).state_sizes().items()}
        if spec:
            spec[ROUND_KEY] = StateSpec(1)
        return spec

    @staticmethod
    def split_state(state: State | None) -> tuple[State | None, State | None]:
        """(the algorithm's part, this hook's part) of a client's stored state."""
        if state is None:
            return None, None
        own = {k: v for k, v in state.items() if k.startswith(PREFIX)}
        alg = {k: v for k, v in state.items() if not k.startswith(PREFIX)}
        return (alg or None), (own or None)

    @staticmethod
    def merge_state(old_alg: State | None, new_alg: State | None, own: State | None) -> State | None:
        """What to store: the algorithm's new state (or its unchanged old one) plus this hook's."""
        if not own:
            return new_alg
        alg = new_alg if new_alg is not None else old_alg
        return {**(alg or {}), **own}

    def apply(self, ctx: RoundContext, client_id: int, update: ClientUpdate, own: State | None) -> State | None:
        """Compress ``update`` in place (decoded tensors, real ``bytes_up``); returns the new own state."""
        total = 0
        dense_total = 0
        new_own: State = {}
        err_num = err_den = 0.0
        for name, t in update.tensors.items():
            dense = t.numel() * 4
            dense_total += dense
            if name not in self.names:
                total += dense
                continue
            vc = self.vector(t.numel())
            prefix = f"{PREFIX}{name}."
            state = {k[len(prefix):]: v for k, v in own.items() if k.startswith(prefix)} if own else None
            key = Key(ctx.seed, ctx.round, client_id, (self.names.index(name),))
            payload, st = vc.encode(t, state or None, key)
            decoded = vc.decode(payload, st).to(t.dtype).view(t.shape)
            err_num += float((decoded - t).double().norm() ** 2)
            err_den += float(t.double().norm() ** 2)
            update.tensors[name] = decoded
            total += payload.nbytes
            new_own.update({prefix + k: v for k, v in st.items()})
        update.bytes_up = total
        update.metrics.add("upload_ratio", total / dense_total if dense_total else 1.0)
        if err_den > 0:
            update.metrics.add("compression_error", math.sqrt(err_num / err_den))
        if not new_own:
            return None
        if own is not None and ROUND_KEY in own and int(own[ROUND_KEY].item()) > 0:
            update.metrics.add("ef_age_rounds", ctx.round + 1 - int(own[ROUND_KEY].item()))
        new_own[ROUND_KEY] = torch.tensor([float(ctx.round + 1)])
        return new_own


def contribution_sizes(client: Any, fm: FlatModel) -> dict[str, int]:
    """Sizes of the tensors a client half sends: its ``contribution_sizes()`` if it has one, else the
    convention of algorithm-api.md (``delta`` is the flat model vector)."""
    declared = getattr(client, "contribution_sizes", None)
    return dict(declared()) if callable(declared) else {"delta": len(fm)}


def make_uplink(conf: Any, fm: FlatModel, client: Any) -> UplinkCompression | None:
    """The worker's uplink hook for ``conf`` (None for no compressor)."""
    if conf is None or conf_of(conf).name == "none":
        return None
    if getattr(client, "compresses_uplink", False):
        raise ValueError(f"algorithm {type(client).__name__} compresses its own uplink; "
                         f"run it with compressor=none (got compressor={conf_of(conf).name})")
    return UplinkCompression(conf, fm, contribution_sizes(client, fm))
