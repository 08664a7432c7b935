"""The client's side of client-level DP: clip the update (and, under local DP, noise it) before upload.

Per client, after training and the finiteness check and *before* uplink compression (so what is
clipped is what is compressed):

1. each tensor the algorithm names in ``PrivateUploads.tensors`` is divided by the weight that
   scales it (FedAvg's n_k delta_k becomes delta_k: under DP every client counts once, see
   docs/privacy.md "Weighting"); the other uploads are dropped;
2. the tensors are clipped *together* to L2 norm C (C from the round's broadcast, ``dp_clip``, so
   adaptive clipping's server-side C reaches every runtime): x <- x min(1, C / ||x||);
3. every weight in ``PrivateUploads.weights`` becomes 1 (the server replaces their sums by the
   expected number of clients);
4. with adaptive clipping the update also carries ``dp_below_clip`` = 1[||x|| <= C] - 1/2 (one number;
   the server noises its sum: Andrew et al. 2021);
5. local DP: N(0, (z C)^2) is added to each clipped tensor, drawn from (seed, PRIVACY, round, client),
   or with ``privacy.secure_rng`` (always in a Flower deployment) from the client's own OS CSPRNG
   (``gaussian_noise``); then the update keeps nothing else it could leak: no metrics, no sample count
   (the server replaces the weights by a public constant anyway).

Central DP then bounds what the server decodes (``bound``): after compression, the decoded private
tensors are clipped to C again. For compressors that never lengthen a vector (identity, top-k,
scaled sign, PowerSGD) this changes nothing; for the others (unbiased random-k and QSGD, unscaled
sign, error feedback's residual on top of the clipped update) it is what keeps the sum's sensitivity
at C. In a deployment it runs on the server, which must not trust a client's clipping.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from fl_platform.core import Broadcast, ClientUpdate, Metrics, RoundContext
from fl_platform.privacy.config import PrivacyConf
from fl_platform.privacy.spec import PrivateUploads
from fl_platform.seeding import Stream, torch_generator

CLIP_KEY = "dp_clip"  # Broadcast.scalars: this round's clip norm C
BELOW = "dp_below_clip"  # ClientUpdate tensor (adaptive clipping): 1[||x|| <= C] - 1/2
CLIPPED_METRIC = "dp_clipped_fraction"  # per client 1 if its update was clipped: the row's mean is the fraction
NORM_METRIC = "dp_update_norm"  # the update's norm before clipping (mean over clients)
LOCAL_NOISE_KEY = 1  # (seed, PRIVACY, round, LOCAL_NOISE_KEY, client, tensor index): local DP noise


def gaussian_noise(secure: bool, shape: tuple[int, ...], dtype: torch.dtype, seed: int, *keys: int) -> torch.Tensor:
    """N(0, 1) draws of ``shape`` on the CPU, for noise that protects someone's data.

    Seeded (the simulation's default): from a torch generator of (seed, *keys), reproducible and equal on
    every runtime, and so derivable by whoever knows the seed. ``secure`` (always in a Flower deployment):
    every bit from the OS's CSPRNG (``os.urandom``), by Box-Muller, fresh per call and derived from nothing
    that is sent or logged. Not a torch generator seeded from the CSPRNG: torch's CPU generator keeps 32 bits
    of its seed, and whoever sees the noised value can search them (the right seed leaves a remainder of
    norm at most the clip, a wrong one of norm about z C sqrt(d))."""
    if not secure:
        return torch.randn(shape, generator=torch_generator(seed, *keys), dtype=dtype)
    n = math.prod(shape)
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    pairs = (n + 1) // 2
    words = torch.frombuffer(bytearray(os.urandom(16 * pairs)), dtype=torch.int64)
    u = (words & (2**53 - 1)).to(torch.float64).mul_(2.0**-53)  # uniform on [0, 1): 53 secret bits each
    radius = torch.log1p(-u[:pairs]).mul_(-2.0).sqrt_()  # (1 - u > 0: the log is finite)
    angle = u[pairs:].mul_(2 * math.pi)
    return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:n].reshape(shape).to(dtype)


def joint_norm(tensors: Iterable[torch.Tensor]) -> float:
    """The L2 norm of several tensors taken together, accumulated in float64."""
    total = 0.0
    for t in tensors:
        total += float(t.detach().to(torch.float64).pow(2).sum())
    return math.sqrt(total)


def clip_factor(norm: float, clip: float) -> float:
    """min(1, C / norm): the scale that brings a vector of ``norm`` within the ball of radius C."""
    return clip / norm if norm > clip else 1.0


def clip_of(broadcast: Broadcast) -> float:
    """The round's clip norm C, set by the server's privacy step."""
    value = broadcast.scalars.get(CLIP_KEY)
    if value is None:
        raise ValueError(f"the broadcast carries no clip norm ({CLIP_KEY!r}): the server of this run does not apply "
                         "the privacy config that the client was given")
    return float(value)


@dataclass(frozen=True)
class CohortClip:
    """Per-client clipping for a vectorised chunk summed at once (``FedAvgCohort.sum_into``)."""

    clip: float
    adaptive: bool


class ClientPrivacy:
    """What one client does to its update under ``privacy=central|local`` (same code on every runtime)."""

    def __init__(self, conf: PrivacyConf, private: PrivateUploads, uploads: Mapping[str, str | None]) -> None:
        if conf.name not in ("central", "local"):
            raise ValueError(f"ClientPrivacy needs privacy=central or local, got {conf.name!r}")
        unknown = [name for name in private.tensors if name not in uploads]
        if unknown:
            raise ValueError(f"private_uploads names {unknown}, which the algorithm does not upload ({sorted(uploads)})")
        self.conf = conf
        self.private = private
        self.uploads = dict(uploads)
        self.local = conf.name == "local"
        self.adaptive = conf.name == "central" and conf.adaptive.enabled
        self.secure = bool(conf.secure_rng)

    def cohort_clip(self, broadcast: Broadcast) -> CohortClip | None:
        """How a vectorised chunk may clip while summing (None: local DP noises each client instead)."""
        return None if self.local else CohortClip(clip_of(broadcast), self.adaptive)

    def apply(self, ctx: RoundContext, broadcast: Broadcast, update: ClientUpdate) -> None:
        """Steps 1-5 of the module docstring, in place (before compression)."""
        # (imported here: the uplink module imports the algorithm API, which imports this module)
        from fl_platform.compression.uplink import upload_scale

        clip = clip_of(broadcast)
        units: dict[str, torch.Tensor] = {}
        for name in self.private.tensors:
            t = update.tensors.get(name)
            if t is None:
                raise ValueError(f"client {update.client_id}: the update lacks {name!r}, which the algorithm declares "
                                 "private (private_uploads)")
            scale = upload_scale(self.uploads, name, update.weights)
            units[name] = t / scale if scale > 0 else torch.zeros_like(t)
        norm = joint_norm(units.values())
        factor = clip_factor(norm, clip)
        if factor != 1.0:
            for u in units.values():  # (new tensors: the division made them)
                u.mul_(factor)
        if self.local:
            z = float(self.conf.noise_multiplier or 0.0)
            if z:
                for i, (name, u) in enumerate(units.items()):
                    noise = gaussian_noise(self.secure, tuple(u.shape), torch.float32, ctx.seed, Stream.PRIVACY,
                                           ctx.round, LOCAL_NOISE_KEY, update.client_id, i)
                    units[name] = u + noise.to(u.device, u.dtype).mul_(z * clip)
        if self.adaptive:
            units[BELOW] = torch.tensor([(1.0 if norm <= clip else 0.0) - 0.5], dtype=torch.float32,
                                        device=next(iter(units.values())).device)
        update.tensors = units
        update.weights = dict.fromkeys(self.private.weights, 1.0)
        if self.local:  # the noised update and nothing else: its loss, accuracy, norm, size are not noised
            update.metrics = Metrics()
            update.num_samples = 0
            return
        update.metrics.add(CLIPPED_METRIC, 1.0 if norm > clip else 0.0)
        update.metrics.add(NORM_METRIC, norm)

    def bound(self, broadcast: Broadcast, update: ClientUpdate) -> None:
        """Central DP, after compression: clip what the server decodes to C (see the module docstring)."""
        if not self.local:
            bound_decoded(update, self.private, clip_of(broadcast))


def bound_decoded(update: ClientUpdate, private: PrivateUploads, clip: float) -> None:
    """Scale the decoded private tensors of ``update`` together into the ball of radius ``clip``."""
    names = [name for name in private.tensors if name in update.tensors]
    factor = clip_factor(joint_norm(update.tensors[n] for n in names), clip)
    if factor != 1.0:
        for name in names:
            update.tensors[name] = update.tensors[name] * factor
