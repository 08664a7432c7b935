"""Training-time augmentation of image minibatches: random crop with padding and horizontal flip.

What torchvision's ``RandomCrop(size, padding=p)`` + ``RandomHorizontalFlip()`` do to a CIFAR image
(the recipe of FedImpro, VHL, FuseFL and the one-shot papers), applied to a minibatch gathered from
the device-resident training tensor, on that tensor's device, with no per-sample Python.

Determinism: a sample's crop offsets and flip are a pure function of (seed, round, client, step,
position in the batch). The client's key is ``derive_seed(seed, Stream.AUGMENT, round, client)``;
the per-sample draw is a counter-based hash of (key, step, position) evaluated with int64 tensor
ops on the device. A counter-based generator, not a stateful ``torch.Generator``, because the
vectorised path (training/vectorised.py) trains many clients in one step and must give each of them
exactly the draws the sequential loop gives it, without one generator call per client per step.
The crop itself is pure indexing, so both paths produce bit-identical batches.

Padded pixels take the feature value of a black (0) pixel, as torchvision pads the raw image before
``ToTensor``/``Normalize``: after our fixed standardisation that is ``-mean / std`` per channel
(``SourceData.pad_value``), not 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from fl_platform.seeding import Stream, derive_seeds

_MASK = 0xFFFFFFFF
# The two multipliers of Chris Wellons' "lowbias32" integer hash (a bijection of 32-bit words).
_MUL_A, _MUL_B = 0x7FEB352D, 0x846CA68B


@dataclass
class AugmentConf:
    """``dataset.augment``: training-time augmentation of image minibatches (off by default).

    ``crop_padding`` p > 0: pad every side by p black pixels, then crop back to H x W at a random
    offset in [0, 2p]^2 (torchvision RandomCrop(H, padding=p)); ``hflip``: mirror left-right with
    probability 1/2. Test data is never augmented.
    """

    crop_padding: int = 0
    hflip: bool = False

    @property
    def active(self) -> bool:
        return self.crop_padding > 0 or self.hflip


@dataclass(frozen=True)
class Augmentation:
    """An active ``AugmentConf`` bound to a data set: its padding value per channel."""

    crop_padding: int
    hflip: bool
    fill: tuple[float, ...]  # feature value of a black pixel, per channel
    _fills: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @staticmethod
    def build(conf: AugmentConf | None, input_shape: Sequence[int], dtype: np.dtype | torch.dtype,
              dataset: str, pad_value: Sequence[float] | None = None) -> Augmentation | None:
        """The augmentation of ``conf`` for a data set of samples ``input_shape``; None when off.

        Refuses (ValueError naming the key) non-image data, and a padding that is not a whole
        number of pixels >= 0.
        """
        if conf is None:
            return None
        padding, hflip = conf.crop_padding, conf.hflip
        if isinstance(padding, bool) or int(padding) != padding or padding < 0:
            raise ValueError(f"dataset.augment.crop_padding must be an integer >= 0, got {padding!r}")
        if not (padding > 0 or hflip):
            return None
        is_float = torch.is_floating_point(torch.empty(0, dtype=dtype)) if isinstance(dtype, torch.dtype) \
            else np.issubdtype(np.dtype(dtype), np.floating)
        if len(input_shape) != 3 or not is_float:
            kind = f"{'float' if is_float else 'integer'} samples of shape {tuple(input_shape)}"
            key = "crop_padding" if padding > 0 else "hflip"
            raise ValueError(
                f"dataset.augment.{key}={padding if padding > 0 else hflip!r}: crop and flip need images "
                f"(float samples C x H x W), but dataset {dataset!r} has {kind}; leave dataset.augment off")
        channels = int(input_shape[0])
        fill = tuple(float(v) for v in pad_value) if pad_value is not None else (0.0,) * channels
        if len(fill) != channels:
            raise ValueError(f"{dataset}: pad_value has {len(fill)} values for {channels} channels")
        return Augmentation(int(padding), bool(hflip), fill)

    def __getstate__(self) -> dict:
        """Pickled (to Ray workers) without the per-device fill cache: it may hold CUDA tensors."""
        return {**self.__dict__, "_fills": {}}

    # ------------------------------------------------------------------ keys

    @staticmethod
    def client_keys(seed: int, round: int, clients: Sequence[int] | np.ndarray,
                    device: torch.device | str = "cpu") -> torch.Tensor:
        """Each client's augmentation key, ``derive_seed(seed, AUGMENT, round, client)``, as int64."""
        keys = derive_seeds(seed, Stream.AUGMENT, round, np.asarray(clients, dtype=np.int64))
        return torch.from_numpy(keys).to(device)

    # ------------------------------------------------------------------ application

    def apply(self, x: torch.Tensor, key: torch.Tensor, step: int) -> torch.Tensor:
        """Augment one client's batch ``x`` (B x C x H x W) of local step ``step``; ``key`` is its
        key (a 0-d or 1-element tensor)."""
        positions = torch.arange(x.shape[0], device=x.device)
        return self._apply(x, key.reshape(-1).to(x.device).expand(x.shape[0]), step, positions)

    def apply_cohort(self, x: torch.Tensor, keys: torch.Tensor, step: int) -> torch.Tensor:
        """Augment a cohort's batches ``x`` (K x B x C x H x W) of step ``step``, row k with ``keys[k]``:
        row k equals ``apply(x[k], keys[k], step)``."""
        k, b = x.shape[:2]
        positions = torch.arange(b, device=x.device).repeat(k)
        flat_keys = keys.to(x.device).repeat_interleave(b)
        return self._apply(x.reshape(k * b, *x.shape[2:]), flat_keys, step, positions).view(x.shape)

    def draws(self, keys: torch.Tensor, step: int, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(dy, dx, flip) per sample: offsets in [0, 2p] and a flip bit (0 when hflip is off)."""
        h = sample_hash(keys, step, positions)
        n = 2 * self.crop_padding + 1
        dy = ((h & 0xFFFF) * n) >> 16  # Lemire's multiply-shift: uniform in [0, n) up to 2^-16
        dx = (((h >> 16) & 0x7FFF) * n) >> 15
        flip = (h >> 31) & 1 if self.hflip else torch.zeros_like(h)
        return dy, dx, flip.bool()

    def _apply(self, x: torch.Tensor, keys: torch.Tensor, step: int, positions: torch.Tensor) -> torch.Tensor:
        dy, dx, flip = self.draws(keys, step, positions)
        return crop_flip(x, dy, dx, flip, self.crop_padding, self._fill_on(x))

    def _fill_on(self, x: torch.Tensor) -> torch.Tensor:
        """The fill as a (C, 1, 1) tensor on ``x``'s device, made once per device and dtype."""
        key = (x.device, x.dtype)
        fill = self._fills.get(key)
        if fill is None:
            fill = self._fills[key] = torch.tensor(self.fill, dtype=x.dtype, device=x.device).view(-1, 1, 1)
        return fill


def crop_flip(x: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor, flip: torch.Tensor, padding: int,
              fill: torch.Tensor) -> torch.Tensor:
    """Per sample i: pad ``x[i]`` by ``padding`` pixels of ``fill`` (C x 1 x 1), crop H x W at
    (dy[i], dx[i]), then mirror left-right where ``flip[i]``. Indexing only (no arithmetic on values)."""
    b, _, h, w = x.shape
    dev = x.device
    rows = dy.to(dev)[:, None] - padding + torch.arange(h, device=dev)  # (B, H) source rows
    cols = torch.arange(w, device=dev).expand(b, w)
    cols = torch.where(flip.to(dev)[:, None], w - 1 - cols, cols)
    cols = dx.to(dev)[:, None] - padding + cols  # (B, W) source columns
    inside = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]
    batch = torch.arange(b, device=dev)[:, None, None]
    out = x.permute(0, 2, 3, 1)[batch, rows.clamp(0, h - 1)[:, :, None], cols.clamp(0, w - 1)[:, None, :]]
    out = out.permute(0, 3, 1, 2)  # (B, C, H, W)
    if padding == 0:
        return out.contiguous()
    return torch.where(inside[:, None], out, fill)


def _mul32(v: torch.Tensor, c: int) -> torch.Tensor:
    """``v * c mod 2^32`` for int64 ``v`` in [0, 2^32) without int64 overflow (16-bit halves)."""
    return (((v & 0xFFFF) * c) + ((((v >> 16) * c) & 0xFFFF) << 16)) & _MASK


def _mix32(v: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijection of 32-bit words with good avalanche."""
    v = v ^ (v >> 16)
    v = _mul32(v, _MUL_A)
    v = v ^ (v >> 15)
    v = _mul32(v, _MUL_B)
    return v ^ (v >> 16)


def sample_hash(keys: torch.Tensor, step: int, positions: torch.Tensor) -> torch.Tensor:
    """A 32-bit hash (in int64) of (key, step, position) per sample; injective in the position for a
    fixed key and step, so the samples of one batch never share a draw by construction."""
    keys = keys.to(torch.int64)
    h = _mix32((keys >> 32) & _MASK)
    h = _mix32(h ^ (keys & _MASK))
    h = _mix32(h ^ (int(step) & _MASK))
    return _mix32(h ^ (positions.to(torch.int64) & _MASK))
