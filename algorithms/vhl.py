"""VHL, Virtual Homogeneity Learning (Tang et al., ICML 2022).

Every client trains on its real batch plus a batch of a shared virtual dataset (pure noise
rendered by an untrained, seeded generator, ``vhl_data.py``) whose C_v classes get their own
logits ``C..C+C_v-1``. A supervised-contrastive term pulls the penultimate features of real class
``c`` toward the (detached) features of virtual class ``c``, so the virtual classes act as shared
anchors that calibrate the feature spaces of heterogeneous clients. Per step, with ``z`` the
penultimate feature of one forward pass over ``[x; x_v]``:

    L = CE(real) + alpha CE(virtual, y_v + C)
        + w_cls SupCon(normalize([z_real; sg(z_virt)]), [y; y_v])      (class-matched alignment)
        + w_noise SupCon(normalize(z_virt), y_v)                        (virtual-only, not detached)
        + w_dom (1/B) sum_i ||z_real_i - z_virt_i||                     (index-paired, 0 by default)

the three feature terms only during local epochs < ``align_local_epochs``. The server half is
FedAvg's (the 2C-way head is averaged like every other parameter); its ``evaluate`` reports the
plain accuracy over all 2C logits (a virtual prediction counts as wrong) and the PredShift
accuracy, which maps a predicted virtual class ``p >= C`` back to ``p - C`` (the reference maps
only ``p > C``; ``predshift_strict`` reproduces that). No per-client state; summable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fl_platform.algorithms.base import AlgorithmSpec, require
from fl_platform.algorithms.fedavg import FedAvgClient, FedAvgConf, FedAvgServer
from fl_platform.algorithms.vhl_data import (
    VIRTUAL_BATCH_KEY,
    VirtualBatches,
    VirtualDataset,
    VirtualDataSpec,
    virtual_dataset,
)
from fl_platform.core import Broadcast, ClientUpdate, RoundContext
from fl_platform.models.base import StagedModel
from fl_platform.seeding import Stream, torch_generator
from fl_platform.training.flat import FlatModel
from fl_platform.training.hooks import Batch, ComposedHooks, ProximalHook, TrainHooks
from fl_platform.training.supcon import supcon_loss


@dataclass
class VHLConf(FedAvgConf):
    name: str = "vhl"
    mu: float = 0.0  # FedProx proximal weight when stacked on FedProx (the paper uses 1.0 then)
    num_virtual_classes: int | None = None  # VHL_num; None = the number of real classes C
    alpha: float = 1.0  # VHL_alpha: weight of the virtual cross-entropy
    align_weight: float = 1.0  # w_cls: real-to-virtual class-matched SupCon
    noise_supcon_weight: float = 0.1  # w_noise: SupCon among virtual features
    domain_weight: float = 0.0  # w_dom: index-paired L2 between real and virtual features
    temperature: float = 0.07
    align_local_epochs: int = 5  # the feature terms apply in local epochs < this
    feature_detach: bool = True  # stop-gradient on the virtual features inside the alignment term
    virtual_batch_size: int = 128
    samples_per_class: int = 200
    virtual_augment: bool = True  # RandomCrop(pad 4) + horizontal flip of virtual images
    virtual_seed: int | None = None  # None: the experiment seed
    style_dim: int = 64
    n_mlp: int = 1
    generator_channels: int = 64  # the reference's StyleGAN2 has 512 at <= 32 px (see vhl_data.py)
    style_mean_std: float = 0.5  # s_mean: std of the per-class style means
    style_std: float = 0.3  # s_std: per-sample std around the class's style mean
    noise_weight: float = 0.0  # 0 = the reference's zero-initialised NoiseInjection (noise has no effect)
    predshift_strict: bool = False  # reference quirk: map only pred > C (not pred >= C) back

    def inactive_fields(self, run: Any) -> dict[str, str]:
        out = super().inactive_fields(run)
        if not (self.align_weight or self.noise_supcon_weight or self.domain_weight):
            out["align_local_epochs"] = ("it limits the feature terms, and align_weight, noise_supcon_weight and "
                                         "domain_weight are all 0")
        off = self.align_local_epochs <= 0
        if off or not (self.align_weight or self.noise_supcon_weight):
            out["temperature"] = ("the SupCon temperature, and " + ("align_local_epochs <= 0" if off else
                                  "align_weight = noise_supcon_weight = 0"))
        if off or not self.align_weight:
            out["feature_detach"] = ("it acts inside the alignment term, and " + ("align_local_epochs <= 0" if off
                                     else "align_weight=0"))
        return out


def _num_virtual(cfg: VHLConf, num_classes: int) -> int:
    return num_classes if cfg.num_virtual_classes is None else int(cfg.num_virtual_classes)


def _model_outputs(cfg: VHLConf, num_classes: int) -> int:
    return num_classes + _num_virtual(cfg, num_classes)


def _check(cfg: VHLConf) -> None:
    checks = [
        (cfg.num_virtual_classes is None or cfg.num_virtual_classes >= 1, "num_virtual_classes", ">= 1"),
        (cfg.alpha >= 0, "alpha", ">= 0"), (cfg.align_weight >= 0, "align_weight", ">= 0"),
        (cfg.noise_supcon_weight >= 0, "noise_supcon_weight", ">= 0"),
        (cfg.domain_weight >= 0, "domain_weight", ">= 0"), (cfg.temperature > 0, "temperature", "> 0"),
        (cfg.virtual_batch_size >= 1, "virtual_batch_size", ">= 1"),
        (cfg.samples_per_class >= 1, "samples_per_class", ">= 1"), (cfg.mu >= 0, "mu", ">= 0"),
        (cfg.n_mlp >= 0, "n_mlp", ">= 0"), (cfg.style_mean_std >= 0, "style_mean_std", ">= 0"),
        (cfg.style_std >= 0, "style_std", ">= 0"),
    ]
    require(cfg, *checks)


def virtual_spec(cfg: VHLConf, seed: int, num_classes: int, input_shape: tuple[int, ...]) -> VirtualDataSpec:
    return VirtualDataSpec(
        seed=seed if cfg.virtual_seed is None else int(cfg.virtual_seed),
        num_classes=_num_virtual(cfg, num_classes), samples_per_class=cfg.samples_per_class,
        image_shape=tuple(input_shape), style_dim=cfg.style_dim, n_mlp=cfg.n_mlp,
        channels=cfg.generator_channels, style_mean_std=cfg.style_mean_std, style_std=cfg.style_std,
        noise_weight=cfg.noise_weight,
    )


class VHLHook(TrainHooks):
    """VHL's loss: one forward pass over ``[x; x_v]``, cross-entropies and feature calibration."""

    def __init__(self, cfg: VHLConf, num_classes: int, batches: VirtualBatches) -> None:
        self.cfg = cfg
        self.num_classes = num_classes
        self.batches = batches
        self.sums: dict[str, torch.Tensor] = {}
        self.steps = 0

    def terms(self, model: nn.Module, batch: Batch) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Each loss term (unweighted) and the real batch's logits."""
        if not isinstance(model, StagedModel):
            raise TypeError(f"VHL needs a StagedModel (features + head), got {type(model).__name__}")
        cfg = self.cfg
        xv, yv = self.batches.next()
        b = batch.x.shape[0]
        z = model.features(torch.cat([batch.x, xv.to(batch.x.dtype)]))
        logits = model.head(z)
        terms = {
            "ce_real": F.cross_entropy(logits[:b], batch.y),
            "ce_virtual": F.cross_entropy(logits[b:], yv + self.num_classes),
        }
        if batch.epoch < cfg.align_local_epochs:
            z_real, z_virt = z[:b], z[b:]
            if cfg.align_weight:
                anchors = z_virt.detach() if cfg.feature_detach else z_virt
                terms["align"] = supcon_loss(F.normalize(torch.cat([z_real, anchors]), dim=1),
                                             torch.cat([batch.y, yv]), cfg.temperature)
            if cfg.noise_supcon_weight:
                terms["noise_supcon"] = supcon_loss(F.normalize(z_virt, dim=1), yv, cfg.temperature)
            if cfg.domain_weight:
                m = min(b, z_virt.shape[0])
                terms["domain"] = (z_real[:m] - z_virt[:m]).norm(dim=1).sum() / b
        return terms, logits[:b]

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        terms, logits = self.terms(model, batch)
        cfg = self.cfg
        weights = {"ce_real": 1.0, "ce_virtual": cfg.alpha, "align": cfg.align_weight,
                   "noise_supcon": cfg.noise_supcon_weight, "domain": cfg.domain_weight}
        loss = sum(weights[name] * value for name, value in terms.items())
        for name, value in terms.items():
            acc = self.sums.get(name)
            self.sums[name] = value.detach() if acc is None else acc + value.detach()
        self.steps += 1
        return loss, logits


class VHLClient(FedAvgClient):
    def __init__(self, cfg: VHLConf, setup) -> None:
        super().__init__(cfg, setup)
        _check(cfg)
        # Built once per worker (and cached per process): every worker and Flower client derives
        # the same bits from the seed, so the set is never shipped.
        self.virtual: VirtualDataset = virtual_dataset(
            virtual_spec(cfg, setup.seed, setup.num_classes, tuple(setup.input_shape)))
        if cfg.virtual_batch_size > len(self.virtual):
            raise ValueError(f"algorithm.virtual_batch_size={cfg.virtual_batch_size} exceeds the virtual set's "
                             f"{len(self.virtual)} images (num_virtual_classes x samples_per_class)")
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def _images(self, device: torch.device) -> torch.Tensor:
        images = self._on_device.get(device)
        if images is None:
            images = self._on_device[device] = self.virtual.images.to(device)
        return images

    def make_hook(self, ctx: RoundContext, client_id: int, device: torch.device) -> VHLHook:
        gen = torch_generator(ctx.seed, Stream.ALGORITHM, ctx.round, client_id, VIRTUAL_BATCH_KEY, device=device)
        batches = VirtualBatches(self.virtual, self._images(device), self.cfg.virtual_batch_size, gen,
                                 self.cfg.virtual_augment)
        return VHLHook(self.cfg, self.setup.num_classes, batches)

    def train(self, ctx: RoundContext, client_id: int, broadcast: Broadcast, state, data, trainer) -> ClientUpdate:
        fm = trainer.fm
        hook = self.make_hook(ctx, client_id, fm.device)
        hooks: TrainHooks = hook
        if self.cfg.mu:
            hooks = ComposedHooks(hook, ProximalHook(self.cfg.mu, broadcast.tensors["weights"][: fm.num_params]))
        weights = broadcast.tensors["weights"]
        fm.load(weights)
        metrics = trainer.fit(data, hooks, seed=ctx.seed, round=ctx.round, client=client_id)
        for name, total in hook.sums.items():
            metrics.add(f"vhl_{name}", float(total), hook.steps)
        n = data.num_samples
        delta = fm.vector - weights
        return ClientUpdate(client_id, {"delta": delta.mul_(n)}, {"n": float(n)}, n, metrics)


class VHLServer(FedAvgServer):
    def __init__(self, cfg: VHLConf, setup, initial_weights: torch.Tensor) -> None:
        super().__init__(cfg, setup, initial_weights)
        _check(cfg)

    @torch.inference_mode()
    def evaluate(self, fm: FlatModel, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> dict[str, float]:
        """Plain accuracy over all C + C_v logits, and PredShift accuracy (virtual c+C counts as c)."""
        fm.load(self.weights.to(fm.device))
        model = fm.model
        was_training = model.training
        model.eval()
        c = self.setup.num_classes
        loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
        correct = torch.zeros((), dtype=torch.long, device=x.device)
        shifted = torch.zeros((), dtype=torch.long, device=x.device)
        for start in range(0, x.shape[0], batch_size):
            xb, yb = x[start : start + batch_size], y[start : start + batch_size]
            logits = model(xb)
            loss_sum += F.cross_entropy(logits, yb, reduction="sum").double()
            pred = logits.argmax(dim=-1)
            correct += (pred == yb).sum()
            virtual = pred > c if self.cfg.predshift_strict else pred >= c
            shifted += (torch.where(virtual, pred - c, pred) == yb).sum()
        model.train(was_training)
        n = max(x.shape[0], 1)
        return {"test_loss": float(loss_sum) / n, "test_accuracy": float(correct) / n,
                "test_accuracy_predshift": float(shifted) / n}


SPEC = AlgorithmSpec("vhl", VHLConf, VHLClient, VHLServer,
                     "VHL: shared virtual data from a seeded untrained generator + feature calibration",
                     model_outputs=_model_outputs, staged_model=True)
