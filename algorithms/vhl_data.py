"""VHL's virtual dataset: images from an untrained, seeded StyleGAN2-like generator.

The reference (``wizard1203/VHL``, ``data_preprocessing/generative/generate.py``) builds a randomly
initialised StyleGAN2 generator (never trained), draws per virtual class ``i`` a style mean
``m_i ~ N(0, s_mean^2 I)`` and a unit-norm vector of per-layer noise-injection means ``nu_i``,
then samples ``z ~ N(m_i, s_std^2 I)`` and renders ``G(z; noise ~ N(nu_i[l], (0.1/L)^2))``. The
class structure comes only from those per-class means. The images are saved as 8-bit files and
loaded with RandomCrop(pad 4) + horizontal flip and Normalize(0.5, 0.25).

Here the same sampling distribution is produced by a pure-PyTorch port (no compiled ops): the
modulated/demodulated convolutions use the mathematically equal "non-fused" form (scale the input
by the style, convolve with the shared kernel, rescale the output), and the FIR up-sampling is a
depthwise convolution. Differences from the reference, all documented in docs/algorithms/vhl.md:

* Width: ``channels`` (default 64) instead of the fixed 512 of StyleGAN2 at <= 32 px, so that a
  CPU generates the set in seconds; demodulation keeps every layer's activations at unit scale
  whatever the width, so the distribution's character does not depend on it.
* Shape: the images match the real input shape ``(C, H, W)``: the generator renders
  ``C`` channels (1 for grayscale datasets, so no channel repeat is needed) at the next power
  of two >= max(H, W) and is resized (bilinear, antialiased) to ``H x W`` (the reference resizes
  its 32 px RGB images to 28 px for Fashion-MNIST and repeats the real images to 3 channels).
* Noise injection: the reference's ``StyledConv`` zero-initialises ``NoiseInjection.weight``
  and never trains it, so the injected noise (and its per-class means) has no effect on the
  images. ``noise_weight`` reproduces that with 0.0 (default); a positive value lets the
  per-class noise means shape the images too.
* The decorrelation of the noise means zeroes its gradient every step (the reference
  accumulates gradients across steps; with ``noise_weight = 0`` this cannot matter).
* No JPEG round trip: the 8-bit images are kept exactly.

Determinism: every draw comes from one CPU ``torch.Generator`` seeded from
``(seed, Stream.ALGORITHM, VIRTUAL_DATA_KEY)``, and the generator always runs on the CPU with one
thread (whatever the training device) before quantising to uint8, so every worker, process and
Flower client on the same CPU type and torch build produces the same bits (``fingerprint`` lets
a deployment compare them); the set is cached once per process (``virtual_dataset``) and never
shipped. (float64 would also absorb CPU-ISA differences but costs ~8x the time.)
"""

from __future__ import annotations

import hashlib
import math
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fl_platform.seeding import Stream, torch_generator

#: Sub-key of Stream.ALGORITHM reserved for the virtual dataset (never a round index).
VIRTUAL_DATA_KEY = 0x7F1A_0001
#: Sub-key of Stream.ALGORITHM for the per-(round, client) virtual minibatch stream.
VIRTUAL_BATCH_KEY = 0x7F1A_0002

_BLUR = (1.0, 3.0, 3.0, 1.0)


# ----------------------------------------------------------------------------- generator parts


def _blur_kernel(dtype: torch.dtype) -> torch.Tensor:
    k = torch.tensor(_BLUR, dtype=dtype)
    k = k[None, :] * k[:, None]
    return k / k.sum()


def upfirdn2d(x: torch.Tensor, kernel: torch.Tensor, up: int = 1, pad: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Zero-insertion up-sampling, padding and FIR filtering (StyleGAN2's ``upfirdn2d``, down=1)."""
    b, c, h, w = x.shape
    if up > 1:
        out = x.new_zeros(b, c, h * up, w * up)
        out[:, :, ::up, ::up] = x
        x = out
    x = F.pad(x, [pad[0], pad[1], pad[0], pad[1]])
    k = torch.flip(kernel, [0, 1]).to(x.dtype).expand(c, 1, *kernel.shape)
    return F.conv2d(x, k, groups=c)


def fused_leaky_relu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    shape = (1, -1) + (1,) * (x.dim() - 2)
    return F.leaky_relu(x + bias.view(shape), 0.2) * math.sqrt(2)


class EqualLinear(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, bias_init: float = 0.0, lr_mul: float = 1.0,
                 activation: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_dim, in_dim).div_(lr_mul))
        self.bias = nn.Parameter(torch.full((out_dim,), float(bias_init)))
        self.scale = lr_mul / math.sqrt(in_dim)
        self.lr_mul = lr_mul
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation:
            return fused_leaky_relu(F.linear(x, self.weight * self.scale), self.bias * self.lr_mul)
        return F.linear(x, self.weight * self.scale, self.bias * self.lr_mul)


class ModulatedConv2d(nn.Module):
    """StyleGAN2's modulated convolution, in the (equal) non-fused form: no per-sample kernels."""

    def __init__(self, in_ch: int, out_ch: int, kernel_size: int, style_dim: int, demodulate: bool = True,
                 upsample: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_ch, in_ch, kernel_size, kernel_size))
        self.scale = 1.0 / math.sqrt(in_ch * kernel_size**2)
        self.modulation = EqualLinear(style_dim, in_ch, bias_init=1.0)
        self.demodulate = demodulate
        self.upsample = upsample
        self.padding = kernel_size // 2
        if upsample:  # the reference's Blur after a stride-2 transposed conv
            p = (len(_BLUR) - 2) - (kernel_size - 1)
            self.blur_pad = ((p + 1) // 2 + 1, p // 2 + 1)

    def forward(self, x: torch.Tensor, style: torch.Tensor) -> torch.Tensor:
        b, in_ch = x.shape[:2]
        weight = self.scale * self.weight
        s = self.modulation(style)
        x = x * s.view(b, in_ch, 1, 1)
        if self.upsample:
            out = F.conv_transpose2d(x, weight.transpose(0, 1), stride=2)
            out = upfirdn2d(out, _blur_kernel(x.dtype) * 4, pad=self.blur_pad)
        else:
            out = F.conv2d(x, weight, padding=self.padding)
        if self.demodulate:
            w = weight.unsqueeze(0) * s.view(b, 1, in_ch, 1, 1)
            out = out * (w.square().sum((2, 3, 4)) + 1e-8).rsqrt().view(b, -1, 1, 1)
        return out


class StyledConv(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, style_dim: int, upsample: bool, noise_weight: float) -> None:
        super().__init__()
        self.conv = ModulatedConv2d(in_ch, out_ch, 3, style_dim, upsample=upsample)
        self.noise_weight = nn.Parameter(torch.tensor([float(noise_weight)]))
        self.bias = nn.Parameter(torch.zeros(out_ch))

    def forward(self, x: torch.Tensor, style: torch.Tensor, noise_mean: float, noise_std: float,
                gen: torch.Generator) -> torch.Tensor:
        out = self.conv(x, style)
        if float(self.noise_weight) != 0.0:
            # As the reference: noise of the feature map's full shape ~ N(noise_mean, noise_std^2).
            noise = torch.randn(out.shape, generator=gen, dtype=out.dtype) * noise_std + noise_mean
            out = out + self.noise_weight * noise
        return fused_leaky_relu(out, self.bias)


class ToImage(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, style_dim: int) -> None:
        super().__init__()
        self.conv = ModulatedConv2d(in_ch, out_ch, 1, style_dim, demodulate=False)
        self.bias = nn.Parameter(torch.zeros(1, out_ch, 1, 1))

    def forward(self, x: torch.Tensor, style: torch.Tensor, skip: torch.Tensor | None) -> torch.Tensor:
        out = self.conv(x, style) + self.bias
        if skip is not None:
            out = out + upfirdn2d(skip, _blur_kernel(x.dtype) * 4, up=2, pad=(2, 1))
        return out


class StyleGenerator(nn.Module):
    """StyleGAN2 generator (``n_mlp`` mapping layers, constant 4x4 input, one style for all layers)."""

    def __init__(self, size: int, style_dim: int = 64, n_mlp: int = 1, channels: int = 64,
                 out_channels: int = 3, noise_weight: float = 0.0, lr_mlp: float = 0.01) -> None:
        super().__init__()
        if size < 4 or size & (size - 1):
            raise ValueError(f"generator size must be a power of two >= 4, got {size}")
        self.size = size
        self.style_dim = style_dim
        self.mapping = nn.ModuleList(
            [EqualLinear(style_dim, style_dim, lr_mul=lr_mlp, activation=True) for _ in range(n_mlp)])
        self.input = nn.Parameter(torch.randn(1, channels, 4, 4))
        self.conv1 = StyledConv(channels, channels, style_dim, False, noise_weight)
        self.to_img1 = ToImage(channels, out_channels, style_dim)
        self.convs = nn.ModuleList()
        self.to_imgs = nn.ModuleList()
        for _ in range(3, int(math.log2(size)) + 1):
            self.convs.append(StyledConv(channels, channels, style_dim, True, noise_weight))
            self.convs.append(StyledConv(channels, channels, style_dim, False, noise_weight))
            self.to_imgs.append(ToImage(channels, out_channels, style_dim))
        self.num_layers = 1 + len(self.convs)

    def forward(self, z: torch.Tensor, noise_mean: torch.Tensor, noise_std: float,
                gen: torch.Generator) -> torch.Tensor:
        w = z * torch.rsqrt(z.square().mean(dim=1, keepdim=True) + 1e-8)  # PixelNorm
        for layer in self.mapping:
            w = layer(w)
        out = self.input.repeat(z.shape[0], 1, 1, 1)
        out = self.conv1(out, w, float(noise_mean[0]), noise_std, gen)
        skip = self.to_img1(out, w, None)
        for i, to_img in enumerate(self.to_imgs):
            out = self.convs[2 * i](out, w, float(noise_mean[2 * i + 1]), noise_std, gen)
            out = self.convs[2 * i + 1](out, w, float(noise_mean[2 * i + 2]), noise_std, gen)
            skip = to_img(out, w, skip)
        return skip


def diverse_unit_means(num: int, dim: int, gen: torch.Generator, iters: int = 500) -> torch.Tensor:
    """``num`` unit vectors in R^dim whose coordinates are decorrelated (VHL's noise means)."""
    means = torch.randn(num, dim, generator=gen, dtype=torch.float64).requires_grad_(True)
    off_diag = 1 - torch.eye(dim, dtype=torch.float64)
    opt = torch.optim.SGD([means], lr=0.5, momentum=0.9)
    with torch.enable_grad():
        for _ in range(iters):
            opt.zero_grad()
            normed = means / means.norm(dim=1, keepdim=True)
            cov = (normed.T @ normed) ** 2 / max(num - 1, 1)
            (cov * off_diag).mean().backward()
            opt.step()
    return (means / means.norm(dim=1, keepdim=True)).detach()


# ----------------------------------------------------------------------------- the dataset


@dataclass(frozen=True)
class VirtualDataSpec:
    """Everything the virtual set depends on; equal specs give bit-identical sets."""

    seed: int
    num_classes: int
    samples_per_class: int
    image_shape: tuple[int, ...]  # (C, H, W) of the real inputs
    style_dim: int = 64
    n_mlp: int = 1
    channels: int = 64
    style_mean_std: float = 0.5
    style_std: float = 0.3
    noise_weight: float = 0.0

    def __post_init__(self) -> None:
        if len(self.image_shape) != 3:
            raise ValueError(f"VHL's virtual data needs image inputs (C, H, W); the dataset's input_shape is "
                             f"{tuple(self.image_shape)}")
        for key in ("num_classes", "samples_per_class", "style_dim", "channels"):
            if getattr(self, key) < 1:
                raise ValueError(f"algorithm.{key} must be >= 1, got {getattr(self, key)}")


@dataclass(frozen=True)
class VirtualDataset:
    """Virtual images as uint8 ``[C_v * S, C, H, W]`` (class-major) and labels ``0..C_v-1``."""

    images: torch.Tensor
    labels: torch.Tensor
    spec: VirtualDataSpec

    def __len__(self) -> int:
        return int(self.labels.numel())

    def fingerprint(self) -> str:
        """sha256 (16 hex digits) of the images and labels: equal sets have equal fingerprints."""
        digest = hashlib.sha256(self.images.contiguous().numpy().tobytes())
        digest.update(self.labels.numpy().tobytes())
        return digest.hexdigest()[:16]


@torch.no_grad()
def generate_virtual_dataset(spec: VirtualDataSpec) -> VirtualDataset:
    """Render the virtual set on the CPU with one thread (bit-reproducible), as uint8."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch_generator(spec.seed, Stream.ALGORITHM, VIRTUAL_DATA_KEY)
        ch, h, w = spec.image_shape
        size = max(4, 1 << (max(h, w) - 1).bit_length())
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(0, 2**62, (1,), generator=gen)))
            g = StyleGenerator(size, spec.style_dim, spec.n_mlp, spec.channels, ch, spec.noise_weight)
        g = g.eval()
        num_layers = g.num_layers
        noise_means = diverse_unit_means(spec.num_classes, num_layers, gen).float()
        noise_std = 0.1 / num_layers
        style_means = torch.randn(spec.num_classes, spec.style_dim, generator=gen)
        style_means *= spec.style_mean_std
        images = []
        chunk = 100
        for c in range(spec.num_classes):
            for start in range(0, spec.samples_per_class, chunk):
                n = min(chunk, spec.samples_per_class - start)
                z = style_means[c] + spec.style_std * torch.randn(n, spec.style_dim, generator=gen)
                img = g(z, noise_means[c], noise_std, gen)
                if img.shape[-2:] != (h, w):
                    img = F.interpolate(img, size=(h, w), mode="bilinear", align_corners=False, antialias=True)
                # torchvision.utils.save_image without normalisation: clamp to [0, 1], round to 8 bits.
                images.append(img.mul(255).add_(0.5).clamp_(0, 255).to(torch.uint8))
    finally:
        torch.set_num_threads(threads)
    labels = torch.arange(spec.num_classes).repeat_interleave(spec.samples_per_class)
    return VirtualDataset(torch.cat(images), labels, spec)


_CACHE: dict[VirtualDataSpec, VirtualDataset] = {}
_LOCK = threading.Lock()


def virtual_dataset(spec: VirtualDataSpec) -> VirtualDataset:
    """The virtual set for ``spec``, generated once per process and cached."""
    with _LOCK:
        data = _CACHE.get(spec)
        if data is None:
            data = _CACHE[spec] = generate_virtual_dataset(spec)
        return data


# ----------------------------------------------------------------------------- minibatches

VIRTUAL_MEAN = 0.5
VIRTUAL_STD = 0.25


def augment(images: torch.Tensor, gen: torch.Generator, padding: int = 4) -> torch.Tensor:
    """RandomCrop(size, padding, zero fill) + RandomHorizontalFlip on uint8/float ``[B, C, H, W]``."""
    b, _, h, w = images.shape
    padded = F.pad(images, [padding] * 4)
    dy = torch.randint(0, 2 * padding + 1, (b,), generator=gen, device=gen.device).to(images.device)
    dx = torch.randint(0, 2 * padding + 1, (b,), generator=gen, device=gen.device).to(images.device)
    flip = torch.rand(b, generator=gen, device=gen.device).to(images.device) < 0.5
    rows = (dy[:, None] + torch.arange(h, device=images.device))[:, :, None]  # [B, H, 1]
    cols = dx[:, None] + torch.arange(w, device=images.device)  # [B, W]
    cols = torch.where(flip[:, None], cols.flip(1), cols)[:, None, :]  # [B, 1, W]
    batch = torch.arange(b, device=images.device)[:, None, None]
    return padded.permute(0, 2, 3, 1)[batch, rows, cols].permute(0, 3, 1, 2)


class VirtualBatches:
    """A client's stream of virtual minibatches for one round (shuffled, drop_last, reshuffled)."""

    def __init__(self, data: VirtualDataset, images: torch.Tensor, batch_size: int, gen: torch.Generator,
                 augment_images: bool = True) -> None:
        if batch_size < 1 or batch_size > len(data):
            raise ValueError(f"algorithm.virtual_batch_size must be in 1..{len(data)} (the virtual set's size), "
                             f"got {batch_size}")
        self.images = images  # uint8 on the training device
        self.labels = data.labels.to(images.device)
        self.batch_size = batch_size
        self.gen = gen
        self.augment = augment_images
        self._order = torch.empty(0, dtype=torch.long)
        self._pos = 0

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (normalised float images, labels 0..C_v-1)."""
        if self._pos + self.batch_size > self._order.numel():
            self._order = torch.randperm(len(self.labels), generator=self.gen, device=self.gen.device)
            self._pos = 0
        idx = self._order[self._pos : self._pos + self.batch_size].to(self.images.device)
        self._pos += self.batch_size
        x = self.images.index_select(0, idx)
        if self.augment:
            x = augment(x, self.gen)
        x = (x.float() / 255.0 - VIRTUAL_MEAN) / VIRTUAL_STD
        return x, self.labels.index_select(0, idx)
