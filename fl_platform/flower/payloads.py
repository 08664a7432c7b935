"""Compressed uplinks on the wire: a client sends its compressor's payload bytes, the server decodes.

The ClientApp runs the simulator's uplink hook (``compression/uplink.py``), which encodes each
named contribution tensor, counts the payload's bytes and leaves in the update what the server
would decode. Here the client also produces that payload's wire bytes (``Payload.to_bytes``) and
checks that the server can rebuild the decoded tensor from them alone: the server knows the
layout (its own model and the same compressor config) and the step key (seed, round, client,
tensor), so it takes the payload structure from encoding zeros with that key, fills it with the
received bytes (``Payload.from_bytes``) and decodes without any client state. Only when that
reproduces the client's decoded tensor exactly are the bytes sent instead of the tensor;
otherwise (e.g. a compressor whose decoder needs the sender's state) the tensor travels dense
and the client logs why. Either way the server aggregates exactly what the simulator would.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import numpy as np
import torch

from fl_platform.compression.base import Key
from fl_platform.compression.uplink import PREFIX, UplinkCompression
from fl_platform.compression.vector import VectorPayload
from fl_platform.core import RoundContext

log = logging.getLogger(__name__)


class PayloadCodec:
    """Pack a client's compressed tensors into payload bytes, and unpack them on the server."""

    def __init__(self, uplink: UplinkCompression) -> None:
        self.uplink = uplink
        self._warned: set[str] = set()

    def key(self, ctx: RoundContext, client_id: int, name: str) -> Key:
        """The step key the uplink hook encodes ``name`` with (shared draws such as random-k indices)."""
        return Key(ctx.seed, ctx.round, client_id, (self.uplink.names.index(name),))

    def unpack_one(self, ctx: RoundContext, client_id: int, name: str, numel: int, data: bytes,
                   scale: float = 1.0) -> torch.Tensor:
        """The flat tensor the server decodes from ``data`` times the weight ``scale`` that the
        algorithm applies to it (the hook compresses the unscaled tensor; raises ValueError on a
        size mismatch)."""
        vc = self.uplink.vector(numel)
        key = self.key(ctx, client_id, name)
        template, _ = vc.encode(torch.zeros(numel), None, key)
        parts, pos = [], 0
        for part in template.parts:
            n = part.nbytes
            if pos + n > len(data):
                raise ValueError(f"payload of {name!r} ends after {len(data)} bytes, the layout needs more")
            parts.append(part.from_bytes(data[pos:pos + n]))
            vc.compressor.check_payload(parts[-1])  # (a client is not trusted: e.g. top-k's indices in range)
            pos += n
        if pos != len(data):
            raise ValueError(f"payload of {name!r} has {len(data) - pos} bytes more than its layout")
        return self.uplink.decode(VectorPayload(parts, template.size), None, scale, torch.zeros(numel))

    def pack(self, ctx: RoundContext, client_id: int, originals: dict[str, torch.Tensor],
             own: dict[str, torch.Tensor] | None, decoded: dict[str, torch.Tensor],
             weights: Mapping[str, float]) -> dict[str, torch.Tensor]:
        """Payload bytes (uint8 tensors) for the tensors the server can rebuild exactly from them.

        ``originals``: the tensors before the uplink hook; ``own``: the hook's state before it ran
        (as the hook saw it); ``decoded``: the tensors after it (what the server must obtain);
        ``weights``: the update's weights (what scales each tensor, see ``UplinkCompression.scale``).
        """
        packed: dict[str, torch.Tensor] = {}
        for name, original in originals.items():
            prefix = f"{PREFIX}{name}."
            state = {k[len(prefix):]: v for k, v in own.items() if k.startswith(prefix)} if own else None
            scale = self.uplink.scale(name, weights)
            payload, _ = self.uplink.encode(ctx, client_id, name, original, state, scale)
            data = payload.to_bytes()
            target = decoded[name].detach().reshape(-1).cpu()
            try:
                ok = torch.equal(self.unpack_one(ctx, client_id, name, original.numel(), data, scale).to(target.dtype),
                                 target)
            except (ValueError, RuntimeError, KeyError) as err:
                ok, why = False, str(err)
            else:
                why = "the payload alone does not decode to the client's decoded tensor"
            if ok:
                packed[name] = torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
            elif name not in self._warned:
                self._warned.add(name)
                log.warning("compressor %s: tensor %r travels dense (%s)", self.uplink.conf.name, name, why)
        return packed

    def unpack(self, ctx: RoundContext, client_id: int, payloads: dict[str, torch.Tensor],
               shapes: dict[str, tuple[int, ...]], weights: Mapping[str, float]) -> dict[str, torch.Tensor]:
        """The decoded tensors of a reply's payloads, scaled by the reply's ``weights`` as the client's
        hook scaled them (ValueError names what does not fit)."""
        out: dict[str, torch.Tensor] = {}
        for name, data in payloads.items():
            if name not in self.uplink.names:
                raise ValueError(f"payload for {name!r}, but the compressor compresses {self.uplink.names}")
            shape = shapes.get(name)
            if shape is None:
                raise ValueError(f"payload for {name!r} without its shape")
            numel = int(np.prod(shape)) if shape else 1
            flat = self.unpack_one(ctx, client_id, name, numel, data.to(torch.uint8).numpy().tobytes(),
                                   self.uplink.scale(name, weights))
            out[name] = flat.view(shape)
        return out
