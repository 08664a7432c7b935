"""FL uplink compression: what a worker does to each ClientUpdate before folding it in.

For every contribution tensor named in ``compressor.tensors`` (default ``delta``, the model
update) the worker encodes the tensor into a real payload, counts its bytes, and replaces the
tensor with what the server would decode. Tensors not named travel dense (4 bytes an element).
Decoding happens per client, before the worker sums: for summable compressors that equals
summing payloads first (tested), for the others it is the only option. ``compressor.tensors``
may name only tensors the algorithm uploads (``ClientAlgorithm.uploads``); anything else is
refused at start-up (``check_uplink``), so a compressor is never silently inert.

Layout: a tensor the size of the flat model vector (or of its parameters) is split with the
model's slots (``scope=layer``: per tensor, BatchNorm buffers dense), or compressed over all
parameters (``global``) or in buckets; any other tensor is one segment.

Weighting: an algorithm sends some tensors already multiplied by a weight, e.g. FedAvg's
n_k * delta_k with weight ``n`` (``uploads`` declares which weight scales which tensor). The hook
compresses the per-sample tensor (n_k * delta_k) / n_k and the server receives n_k * decoded, so
the sum over clients divided by sum n_k is the sample-weighted mean of what each client's message
decodes to, for every compressor. For positively homogeneous compressors (C(c x) = c C(x), c > 0,
with the same random draws: identity, top-k, random-k, QSGD, scaled sign, PowerSGD; tested) this
changes nothing; for ``sign`` (+-1 whatever the scale) it is what keeps the sample weighting: the
server's step is sum_k n_k sign(delta_k) / sum_k n_k, not sum_k sign(delta_k) / sum_k n_k. The
error-feedback residual lives in these unscaled units (e <- a - C(a) with a = delta_k + e).

State: per client, in the client-state store next to the algorithm's own, under names prefixed
``ef.`` (``ef.<tensor>.residual``, PowerSGD's ``ef.<tensor>.q``, and ``ef.round``: the round the
state was written, so the staleness of a residual applied when the client is next sampled is
logged as ``ef_age_rounds``; 1 means the client was also sampled in the previous round).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from fl_platform.algorithms.base import StateSpec
from fl_platform.compression.base import Key, State
from fl_platform.compression.errorfeedback import ErrorFeedback
from fl_platform.compression.powersgd import LowRank
from fl_platform.compression.registry import conf_of, make_compressor
from fl_platform.compression.vector import SCOPES, Layout, VectorCompressor, VectorPayload
from fl_platform.core import ClientUpdate, RoundContext
from fl_platform.training.flat import FlatModel

PREFIX = "ef."
ROUND_KEY = PREFIX + "round"


class UplinkCompression:
    def __init__(self, conf: Any, fm: FlatModel, sizes: dict[str, int],
                 uploads: Mapping[str, str | None] | None = None) -> None:
        self.conf = conf_of(conf)
        comp = make_compressor(self.conf)
        if comp is None:
            raise ValueError("compressor=none needs no uplink compression")
        self.uploads = dict(uploads) if uploads is not None else dict(DEFAULT_UPLOADS)
        check_compressor(self.conf, self.uploads)
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

    def scale(self, name: str, weights: Mapping[str, float]) -> float:
        """The weight that multiplies tensor ``name`` in an update with ``weights`` (1 when unscaled)."""
        return upload_scale(self.uploads, name, weights)

    def encode(self, ctx: RoundContext, client_id: int, name: str, t: torch.Tensor, state: State | None,
               scale: float) -> tuple[VectorPayload, State]:
        """The payload of ``t / scale`` (the per-sample tensor; a zero scale means a zero tensor)."""
        vc = self.vector(t.numel())
        key = Key(ctx.seed, ctx.round, client_id, (self.names.index(name),))
        unit = t.reshape(-1) / scale if scale > 0 else t.reshape(-1)
        return vc.encode(unit, state or None, key)

    def decode(self, payload: VectorPayload, state: State | None, scale: float, like: torch.Tensor) -> torch.Tensor:
        """What the server receives: ``scale`` times the decoded payload, shaped like ``like``."""
        decoded = self.vector(like.numel()).decode(payload, state or None).to(like.dtype).view(like.shape)
        return decoded * scale

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
            prefix = f"{PREFIX}{name}."
            state = {k[len(prefix):]: v for k, v in own.items() if k.startswith(prefix)} if own else None
            scale = self.scale(name, update.weights)
            payload, st = self.encode(ctx, client_id, name, t, state, scale)
            decoded = self.decode(payload, st, scale, t)
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


DEFAULT_UPLOADS: dict[str, str | None] = {"delta": "n"}  # ClientAlgorithm.uploads' default


def upload_scale(uploads: Mapping[str, str | None], name: str, weights: Mapping[str, float]) -> float:
    """The weight that multiplies upload ``name`` (``ClientAlgorithm.uploads``) in an update with
    ``weights`` (1 when unscaled); also what client-level DP divides by (fl_platform/privacy)."""
    weight = uploads.get(name)
    if weight is None:
        return 1.0
    if weight not in weights:
        raise ValueError(f"the algorithm declares its {name!r} upload scaled by weight {weight!r}, but the "
                         f"update carries weights {sorted(weights)}")
    value = float(weights[weight])
    if not value >= 0:
        raise ValueError(f"weight {weight!r} scaling {name!r} must be >= 0, got {value}")
    return value


def check_compressor(conf: Any, uploads: Mapping[str, str | None], algorithm: str = "this algorithm",
                     compresses_uplink: bool = False) -> None:
    """Refuse (ValueError naming the key) a compressor config that cannot act on these uploads."""
    c = conf_of(conf)
    if c.name == "none":
        return
    if compresses_uplink:
        raise ValueError(f"algorithm {algorithm} compresses its own uplink; run it with compressor=none "
                         f"(got compressor={c.name})")
    if c.name == "acpsgd":
        raise NotImplementedError(
            "compressor=acpsgd is not implemented for FL uplinks: its decoder needs a factor shared by "
            "the server and every client across rounds (kept by the S-SGD runtime per worker); "
            "use powersgd for FL")
    if c.scope not in SCOPES:
        raise ValueError(f"compressor.scope must be one of {', '.join(SCOPES)}; got {c.scope!r}")
    if c.scope == "bucket" and c.bucket_size < 1:
        raise ValueError(f"compressor.bucket_size must be >= 1 with scope=bucket, got {c.bucket_size}")
    if c.name == "powersgd" and c.scope != "layer":
        raise ValueError(f"compressor={c.name} compresses matrices: it needs compressor.scope=layer, "
                         f"got {c.scope!r}")
    if not c.tensors:
        raise ValueError(f"compressor.tensors is empty: compressor={c.name} would compress nothing "
                         "(use compressor=none)")
    unknown = [name for name in c.tensors if name not in uploads]
    if unknown:
        raise ValueError(f"compressor.tensors names {unknown}, but {algorithm} uploads only {sorted(uploads)}: "
                         f"nothing would be compressed; set compressor.tensors to some of {sorted(uploads)} "
                         "or use compressor=none")


def uploads_of(client: Any) -> dict[str, str | None]:
    """A client half's declared uploads (``ClientAlgorithm.uploads``), else the FedAvg convention."""
    declared = getattr(client, "uploads", None)
    cfg = getattr(client, "cfg", None)
    return dict(declared(cfg)) if callable(declared) else dict(DEFAULT_UPLOADS)


def contribution_sizes(client: Any, fm: FlatModel) -> dict[str, int]:
    """Sizes of the tensors a client half sends: its ``contribution_sizes()`` if it has one, else the
    convention of algorithm-api.md (``delta`` is the flat model vector)."""
    declared = getattr(client, "contribution_sizes", None)
    return dict(declared()) if callable(declared) else {"delta": len(fm)}


def declared_sizes(client: Any, fm: FlatModel) -> dict[str, int]:
    """``contribution_sizes`` of the tensors the client half declares it uploads (``uploads_of``): what an
    update is checked against (``ClientUpdate.problem``); a size of a tensor it never sends (FuseFL's default
    ``delta``) is left out."""
    uploads = uploads_of(client)
    return {k: n for k, n in contribution_sizes(client, fm).items() if k in uploads}


def make_uplink(conf: Any, fm: FlatModel, client: Any) -> UplinkCompression | None:
    """The worker's uplink hook for ``conf`` (None for no compressor)."""
    if conf is None or conf_of(conf).name == "none":
        return None
    check_compressor(conf, uploads_of(client), type(client).__name__, getattr(client, "compresses_uplink", False))
    return UplinkCompression(conf, fm, contribution_sizes(client, fm), uploads_of(client))
