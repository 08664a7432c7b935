"""Data-free ensemble distillation through a generator: the loop DENSE and Co-Boosting share.

Per epoch e (specs/oneshot.md, methods D and E; checked against zj-jayzhang/DENSE
``helpers/synthesizers.py`` and rong-dai/Co-Boosting ``datafree/synthesis/*.py``,
``datafree_kd.py``):

1. Re-initialise the generator G (DCGAN-like, sigmoid output mapped to the teachers' input
   range), draw z ~ N(0, I) (trainable too) and random labels y.
2. ``g_steps`` of Adam (betas 0.5/0.999) on (G, z) with
   L_G = l_oh * mean((1 - p_y)^h CE(f(x), y)) + l_bn * sum_BN (||mu_b - mu_run|| + ||var_b - var_run||)
         - l_adv * mean(KL_T(f(x) || s(x)) * mask),
   where f is the (weighted) logit ensemble, s the student, mask = 1(argmax f != argmax s) for
   DENSE and 1 for Co-Boosting, h = 0 for DENSE (plain CE) and 1 for Co-Boosting (hard samples).
   The lowest-loss batch of the epoch is kept (scored before each step, as the references do).
3. Co-Boosting only, from the second epoch on: one signed-gradient pass over the labelled
   pool before the new batch joins it, w <- clip(w - mu delta^e sign(dCE(f_w(x), y)/dw), 0, 1),
   with f_w = sum_k w_k f_k / sum_k w_k.
4. The batch joins the pool P (every batch of every epoch, or the last ``pool_batches``).
5. One distillation pass over P (shuffled, augmented): loss KL_T(f || s). Co-Boosting first
   perturbs each batch x <- x + eta sign(d/dx sum r * softmax(f_w(x) / 4)), r ~ U(-1, 1).

The student is a fresh model of the clients' architecture (both papers). Every draw (generator
init, z, labels, augmentation, pool order, r) comes from (seed, epoch) through
``fl_platform.seeding``.

The loop itself (one synthetic batch per epoch, the pool, the distillation pass) is
:class:`SynthesisServer`; :class:`DataFreeServer` adds the generator (steps 1-2), the reweighting
(3) and the perturbation (5). Fed-ADI (:mod:`.adi`) is the same loop with input optimisation in
place of the generator.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fl_platform.algorithms.base import require
from fl_platform.algorithms.oneshot.distill import (
    LogitEnsemble,
    check_ensemble_weights,
    combine_logits,
    kd_loss,
)
from fl_platform.algorithms.oneshot.protocol import OneShotConf, OneShotServer, build_module, fresh_vector
from fl_platform.core import RoundContext
from fl_platform.seeding import Stream, torch_generator
from fl_platform.training.flat import model_vector
from fl_platform.training.step import to_device

log = logging.getLogger(__name__)

_DATAFREE = 0x44465245  # "DFRE": stream key of the data-free loop


@dataclass
class SynthesisConf(OneShotConf):
    """What every synthesise-then-distil method shares (DENSE, Co-Boosting, Fed-ADI): one synthetic batch
    per epoch joins the pool, then one distillation pass over the pool. DENSE's defaults (card D)."""

    epochs: int = 200
    synthesis_batch_size: int = 256
    lambda_oh: float = 1.0  # weight of the CE to the batch's target labels
    lambda_bn: float = 1.0  # weight of DeepInversion's BN-statistics term
    # Distillation into the student.
    student_init: str = "fresh"  # fresh (both papers) or fedavg
    kd_temperature: float = 20.0
    kd_lr: float = 0.005
    kd_momentum: float = 0.9
    kd_weight_decay: float = 0.0
    kd_batch_size: int = 256
    kd_cosine: bool = False  # cosine decay of the KD learning rate over the epochs
    kd_clip: float | None = None  # max gradient norm of the student
    kd_augment: bool = True  # random crop + flip of pool batches
    pool_batches: int | None = None  # keep only the last N batches (None: every batch, as the papers)
    # Input range of the teachers (normalised black and white); None: the training data's range.
    input_low: float | None = None
    input_high: float | None = None

    def inactive_fields(self, run: Any) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.epochs < 2:
            out["kd_cosine"] = "it acts from the second epoch on, and epochs=1"
        if self.input_low is None or self.input_high is None:
            both = "the input range is used only when input_low and input_high are both set"
            out.update(input_low=both, input_high=both)
        if self.pool_batches is not None and self.pool_batches >= self.epochs:
            out["pool_batches"] = f"the pool never holds more than epochs={self.epochs} batches"
        return out


@dataclass
class DataFreeConf(SynthesisConf):
    """DENSE's generator settings (card D); Co-Boosting overrides some of them (card E)."""

    g_steps: int = 30
    lr_g: float = 1e-3
    nz: int = 256
    ngf: int = 64
    synthesis_augment: bool = True  # random crop + flip of G(z) before the teachers see it
    lambda_adv: float = 1.0
    adv_temperature: float = 1.0
    adv_mask: bool = True  # adversarial term only where student and ensemble disagree (DENSE)
    hard_sample_power: float = 0.0  # h of the focal-style CE; 0 = plain CE (DENSE), 1 (Co-Boosting)
    generator_clip: float | None = None  # max gradient norm of G (Co-Boosting: 10)
    # Ensemble reweighting (Co-Boosting).
    reweight: bool = False
    reweight_mu: float = 0.01
    reweight_delta: float = 0.99
    reweight_steps: int = 1
    ods_eta: float = 0.0  # diverse-sample perturbation size in input units (Co-Boosting: 8/255)
    ods_temperature: float = 4.0

    def inactive_fields(self, run: Any) -> dict[str, str]:
        out = super().inactive_fields(run)
        if self.epochs < 2:
            out["reweight"] = "it acts from the second epoch on, and epochs=1"
        if not self.reweight or self.epochs < 2:
            out.update(dict.fromkeys(("reweight_mu", "reweight_delta", "reweight_steps"),
                                     "a setting of ensemble reweighting, which is off (reweight=false or epochs=1)"))
        if not self.lambda_adv:
            out.update(dict.fromkeys(("adv_temperature", "adv_mask"), "a setting of the adversarial term, and lambda_adv=0"))
        if not self.ods_eta:
            out["ods_temperature"] = "a setting of the diverse-sample perturbation, and ods_eta=0"
        return out


class Generator(nn.Module):
    """DENSE's generator: Linear -> [BN, Up, Conv, BN, LReLU] x 2 -> Conv -> Sigmoid (output in [0, 1])."""

    def __init__(self, nz: int, ngf: int, shape: tuple[int, ...]) -> None:
        super().__init__()
        if len(shape) != 3 or shape[1] % 4 or shape[2] % 4:
            raise ValueError(f"the DENSE/Co-Boosting generator makes (C, H, W) images with H and W divisible "
                             f"by 4; the model's input shape is {tuple(shape)}")
        c, h, w = shape
        self.init_hw = (h // 4, w // 4)
        self.l1 = nn.Linear(nz, 2 * ngf * self.init_hw[0] * self.init_hw[1])
        self.conv = nn.Sequential(
            nn.BatchNorm2d(2 * ngf),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(2 * ngf, 2 * ngf, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(2 * ngf),
            nn.LeakyReLU(0.2),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(2 * ngf, ngf, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.LeakyReLU(0.2),
            nn.Conv2d(ngf, c, 3, stride=1, padding=1),
            nn.Sigmoid(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        out = self.l1(z).view(z.shape[0], -1, *self.init_hw)
        return self.conv(out)

    @torch.no_grad()
    def reset(self, gen: torch.Generator) -> None:
        """The references' ``reset_model``: N(0, 0.02) weights, zero biases, BN weights N(1, 0.02)."""
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Conv2d):
                m.weight.copy_(torch.normal(0.0, 0.02, m.weight.shape, generator=gen))
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(torch.normal(1.0, 0.02, m.weight.shape, generator=gen))
                m.bias.zero_()
                m.reset_running_stats()


class BNStatLoss:
    """DeepInversion's BN term: sum over the teachers' BatchNorm2d of ||mu_b - mu_run|| + ||var_b - var_run||."""

    def __init__(self, models: list[nn.Module]) -> None:
        self.terms: list[torch.Tensor] = []
        self.active = False
        self.handles = [mod.register_forward_hook(self._hook) for m in models for mod in m.modules()
                        if isinstance(mod, nn.BatchNorm2d)]

    def __len__(self) -> int:
        return len(self.handles)

    def _hook(self, module: nn.BatchNorm2d, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if not self.active:
            return
        x = inputs[0]
        mean = x.mean(dim=(0, 2, 3))
        var = x.permute(1, 0, 2, 3).reshape(x.shape[1], -1).var(dim=1, unbiased=False)
        self.terms.append(torch.linalg.vector_norm(module.running_mean - mean)
                          + torch.linalg.vector_norm(module.running_var - var))

    def pop(self) -> torch.Tensor:
        total = torch.stack(self.terms).sum()
        self.terms.clear()
        return total

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def teacher_forward(ensemble: LogitEnsemble, weights: torch.Tensor | None, x: torch.Tensor,
                    bn: BNStatLoss | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The (weighted) ensemble's logits on ``x`` and the BN-statistics term of that forward pass (0 without ``bn``)."""
    if bn is None:
        return ensemble.combine(ensemble.member_logits(x), weights), torch.zeros((), device=x.device)
    bn.active = True
    try:
        t = ensemble.combine(ensemble.member_logits(x), weights)
    finally:
        bn.active = False
    return t, bn.pop()


def augment(x: torch.Tensor, gen: torch.Generator, low: torch.Tensor) -> torch.Tensor:
    """Random crop (zero-pixel padding of H // 8) and horizontal flip per sample; differentiable in x.

    The draws come from the CPU generator ``gen`` (the same on every device) and travel by
    non-blocking copies from pinned memory: this runs every generator and distillation step."""
    b, c, h, w = x.shape
    pad = max(1, h // 8)
    xp = F.pad(x - low, (pad, pad, pad, pad)) + low
    oy = to_device(torch.randint(0, 2 * pad + 1, (b,), generator=gen), x.device)
    ox = to_device(torch.randint(0, 2 * pad + 1, (b,), generator=gen), x.device)
    rows = (oy[:, None] + torch.arange(h, device=x.device))[:, None, :, None]
    cols = (ox[:, None] + torch.arange(w, device=x.device))[:, None, None, :]
    out = xp[torch.arange(b, device=x.device)[:, None, None, None],
             torch.arange(c, device=x.device)[None, :, None, None], rows, cols]
    flip = to_device(torch.rand(b, generator=gen) < 0.5, x.device).view(b, 1, 1, 1)
    return torch.where(flip, out.flip(-1), out)


class SynthesisServer(OneShotServer):
    """The loop every synthesise-then-distil method shares; a method supplies ``synthesize`` (and may
    keep ensemble weights, perturb pool batches, or hold a synthesiser such as DENSE's generator)."""

    def checks(self) -> list[tuple[bool, str, str]]:
        """(condition, key, rule) triples that must hold for the configuration to run (``base.require``)."""
        cfg = self.cfg
        return [(cfg.epochs >= 1, "epochs", ">= 1"), (cfg.synthesis_batch_size >= 1, "synthesis_batch_size", ">= 1"),
                (cfg.kd_temperature > 0, "kd_temperature", "> 0"), (cfg.kd_lr > 0, "kd_lr", "> 0"),
                (cfg.kd_batch_size >= 1, "kd_batch_size", ">= 1"),
                (cfg.student_init in ("fresh", "fedavg"), "student_init", "'fresh' or 'fedavg'"),
                (cfg.pool_batches is None or cfg.pool_batches >= 1, "pool_batches", "null or >= 1"),
                (cfg.lambda_oh >= 0, "lambda_oh", ">= 0"), (cfg.lambda_bn >= 0, "lambda_bn", ">= 0"),
                (cfg.kd_clip is None or cfg.kd_clip > 0, "kd_clip", "null or > 0")]

    def __init__(self, cfg: SynthesisConf, setup, initial_weights) -> None:
        self.cfg = cfg
        require(cfg, *self.checks())
        super().__init__(cfg, setup, initial_weights)
        with torch.random.fork_rng(devices=[]):
            self.check_inputs(setup.input_shape)
            has_bn = any(isinstance(m, nn.BatchNorm2d) for m in setup.model_fn().modules())
        default_bn = type(cfg)().lambda_bn
        if not has_bn and cfg.lambda_bn != default_bn:
            raise ValueError(f"algorithm.lambda_bn={cfg.lambda_bn} has no effect: the BN term matches the client "
                             f"models' BatchNorm2d statistics and this model has none (leave it at {default_bn}, or "
                             "use a model with BatchNorm, e.g. model=cnn model.norm=batch)")
        self.ensemble_weights: torch.Tensor | None = None

    def check_inputs(self, shape: tuple[int, ...]) -> None:
        """Fail at start-up on inputs this method cannot synthesise."""

    def input_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        channels = self.setup.input_shape[0]
        if cfg.input_low is not None and cfg.input_high is not None:
            low, high = torch.full((channels,), cfg.input_low), torch.full((channels,), cfg.input_high)
        elif self.input_low is not None and self.input_high is not None:
            low, high = self.input_low, self.input_high
        else:
            raise ValueError(f"{cfg.name} needs the teachers' input range: set algorithm.input_low and "
                             "algorithm.input_high (the normalised values of a black and a white pixel)")
        return low.view(-1, 1, 1).to(self.device), high.view(-1, 1, 1).to(self.device)

    def fresh_student(self) -> torch.Tensor:
        """The initial weights of the fresh student (seeded; the same for every method of this family)."""
        return fresh_vector(self.setup, _DATAFREE, 0)

    def synthesizer(self) -> nn.Module | None:
        """The trainable synthesiser this method keeps across epochs (None: it optimises inputs directly)."""
        return None

    def initial_ensemble_weights(self, k: int) -> torch.Tensor | None:
        """Weights of the k teachers (None: the plain logit average)."""
        return None

    def build(self, ctx: RoundContext) -> dict[str, float]:
        cfg, dev, seed = self.cfg, self.device, self.setup.seed
        low, high = self.input_range()
        teachers = self.teacher_modules(dev)
        ensemble = LogitEnsemble(teachers)
        weights = self.initial_ensemble_weights(len(teachers))
        start = self.fedavg_vector() if cfg.student_init == "fedavg" else self.fresh_student()
        student = build_module(self.setup, start, dev)
        synth = self.synthesizer()
        bn = BNStatLoss(teachers) if cfg.lambda_bn else None
        if bn is not None and len(bn) == 0:
            log.warning("%s: lambda_bn=%s but the client models have no BatchNorm2d layer; the BN term is 0",
                        cfg.name, cfg.lambda_bn)
            bn.close()
            bn = None
        opt = torch.optim.SGD(student.parameters(), lr=cfg.kd_lr, momentum=cfg.kd_momentum,
                              weight_decay=cfg.kd_weight_decay)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.epochs) if cfg.kd_cosine else None
        pool_x: list[torch.Tensor] = []
        pool_y: list[torch.Tensor] = []
        synth_loss = kd = 0.0
        try:
            for epoch in range(cfg.epochs):
                gen = torch_generator(seed, Stream.ALGORITHM, _DATAFREE, 1, epoch)
                x, y, synth_loss = self.synthesize(synth, ensemble, weights, student, bn, low, high, gen)
                weights = self.update_ensemble_weights(epoch, ensemble, weights, pool_x, pool_y, low, gen)
                pool_x.append(x)
                pool_y.append(y)
                if cfg.pool_batches is not None and len(pool_x) > cfg.pool_batches:
                    pool_x.pop(0)
                    pool_y.pop(0)
                kd = self.distill(ensemble, weights, student, opt, pool_x, low, gen)
                if sched is not None:
                    sched.step()
        finally:
            if bn is not None:
                bn.close()
        self.weights = model_vector(student).to(torch.float32)
        self.ensemble_weights = None if weights is None else weights.detach().cpu()
        extras = {"pool_samples": float(sum(p.shape[0] for p in pool_x)), "synthesis_loss": synth_loss,
                  "kd_loss": kd}
        if weights is not None:
            extras.update({f"ensemble_weight_{i}": float(v) for i, v in enumerate(self.ensemble_weights)})
        return extras

    def synthesize(self, synth: nn.Module | None, ensemble: LogitEnsemble, weights: torch.Tensor | None,
                   student: nn.Module, bn: BNStatLoss | None, low: torch.Tensor, high: torch.Tensor,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One epoch's synthesis; returns the batch that joins the pool, its labels and its loss."""
        raise NotImplementedError

    def update_ensemble_weights(self, epoch: int, ensemble: LogitEnsemble, weights: torch.Tensor | None,
                                pool_x: list[torch.Tensor], pool_y: list[torch.Tensor], low: torch.Tensor,
                                gen: torch.Generator) -> torch.Tensor | None:
        """Before the epoch's batch joins the pool (Co-Boosting reweights here); the default keeps them."""
        return weights

    def perturb(self, xb: torch.Tensor, ensemble: LogitEnsemble, weights: torch.Tensor | None,
                gen: torch.Generator) -> torch.Tensor:
        """A pool batch as the student sees it (Co-Boosting perturbs it); the default leaves it."""
        return xb

    def _batches(self, pool_x: list[torch.Tensor], pool_y: list[torch.Tensor] | None, low: torch.Tensor,
                 gen: torch.Generator):
        x = torch.cat(pool_x)
        y = torch.cat(pool_y) if pool_y is not None else None
        order = to_device(torch.randperm(x.shape[0], generator=gen), x.device)
        bs = self.cfg.kd_batch_size
        for i in range(0, x.shape[0], bs):
            idx = order[i : i + bs]
            xb = x[idx]
            if self.cfg.kd_augment:
                xb = augment(xb, gen, low)
            yield xb, (y[idx] if y is not None else None)

    def distill(self, ensemble: LogitEnsemble, weights: torch.Tensor | None, student: nn.Module,
                opt: torch.optim.Optimizer, pool_x: list[torch.Tensor], low: torch.Tensor,
                gen: torch.Generator) -> float:
        """One pass over the pool; returns the mean KD loss (summed on the device in float64, read once)."""
        cfg = self.cfg
        student.train()
        total, batches = torch.zeros((), dtype=torch.float64, device=self.device), 0
        for xb, _ in self._batches(pool_x, None, low, gen):
            xb = self.perturb(xb, ensemble, weights, gen)
            with torch.no_grad():
                t = ensemble.combine(ensemble.member_logits(xb), weights)
            loss = kd_loss(student(xb), t, cfg.kd_temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.kd_clip is not None:
                nn.utils.clip_grad_norm_(student.parameters(), cfg.kd_clip)
            opt.step()
            total += loss.detach()
            batches += 1
        return float(total) / max(batches, 1)

    def extra_metrics(self, teacher_logits: list[torch.Tensor], y: torch.Tensor) -> dict[str, float]:
        if self.ensemble_weights is None:
            return {}
        weighted = combine_logits(torch.stack(teacher_logits), self.ensemble_weights)
        return {"weighted_ensemble_test_accuracy": float((weighted.argmax(1) == y).float().mean())}

    def state_dict(self):
        state = super().state_dict()
        if self.ensemble_weights is not None:
            state["ensemble_weights"] = self.ensemble_weights.clone()
        return state

    def load_state_dict(self, state) -> None:
        super().load_state_dict(state)
        w = state.get("ensemble_weights")
        self.ensemble_weights = None if w is None else w.clone()


class DataFreeServer(SynthesisServer):
    """DENSE and Co-Boosting: the shared loop with a generator; the two are this class with different settings."""

    def checks(self) -> list[tuple[bool, str, str]]:
        cfg = self.cfg
        return [*super().checks(), (cfg.g_steps >= 1, "g_steps", ">= 1"), (cfg.lr_g > 0, "lr_g", "> 0"),
                (cfg.nz >= 1, "nz", ">= 1"), (cfg.ngf >= 1, "ngf", ">= 1"),
                (cfg.adv_temperature > 0, "adv_temperature", "> 0"),
                (cfg.ods_temperature > 0, "ods_temperature", "> 0"), (cfg.reweight_steps >= 1, "reweight_steps", ">= 1"),
                (cfg.lambda_adv >= 0, "lambda_adv", ">= 0"), (cfg.hard_sample_power >= 0, "hard_sample_power", ">= 0"),
                (cfg.generator_clip is None or cfg.generator_clip > 0, "generator_clip", "null or > 0"),
                (cfg.reweight_mu > 0, "reweight_mu", "> 0"), (0 < cfg.reweight_delta <= 1, "reweight_delta", "in (0, 1]"),
                (cfg.ods_eta >= 0, "ods_eta", ">= 0")]

    def check_inputs(self, shape: tuple[int, ...]) -> None:
        Generator(self.cfg.nz, self.cfg.ngf, shape)

    def synthesizer(self) -> Generator:
        return Generator(self.cfg.nz, self.cfg.ngf, self.setup.input_shape).to(self.device)

    def initial_ensemble_weights(self, k: int) -> torch.Tensor | None:
        return torch.full((k,), 1.0 / k, device=self.device) if self.cfg.reweight else None

    def update_ensemble_weights(self, epoch: int, ensemble: LogitEnsemble, weights: torch.Tensor | None,
                                pool_x: list[torch.Tensor], pool_y: list[torch.Tensor], low: torch.Tensor,
                                gen: torch.Generator) -> torch.Tensor | None:
        if self.cfg.reweight and epoch > 0 and weights is not None:
            return self.reweight(epoch, ensemble, weights, pool_x, pool_y, low, gen)
        return weights

    def synthesize(self, generator: Generator, ensemble: LogitEnsemble, weights: torch.Tensor | None,
                   student: nn.Module, bn: BNStatLoss | None, low: torch.Tensor, high: torch.Tensor,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, float]:
        """One epoch's generator optimisation; returns the lowest-loss batch, its labels and that loss."""
        cfg, dev = self.cfg, self.device
        generator.reset(gen)
        generator.train()
        student.eval()
        student.requires_grad_(False)
        z = to_device(torch.randn(cfg.synthesis_batch_size, cfg.nz, generator=gen), dev).requires_grad_()
        y = to_device(torch.randint(0, self.setup.num_classes, (cfg.synthesis_batch_size,), generator=gen), dev)
        opt = torch.optim.Adam([{"params": generator.parameters()}, {"params": [z]}], lr=cfg.lr_g,
                               betas=(0.5, 0.999))
        best_cost: torch.Tensor | None = None  # kept on the device (as Fed-ADI does): no per-step host read
        best_x: torch.Tensor | None = None
        for _ in range(cfg.g_steps):
            x = low + (high - low) * generator(z)
            xa = augment(x, gen, low) if cfg.synthesis_augment else x
            t, loss_bn = teacher_forward(ensemble, weights, xa, bn)
            ce = F.cross_entropy(t, y, reduction="none")
            if cfg.hard_sample_power:
                p_y = F.softmax(t, dim=1).gather(1, y[:, None]).squeeze(1)
                ce = (1.0 - p_y.detach()).pow(cfg.hard_sample_power) * ce
            s = student(xa)
            kl = kd_loss(s, t, cfg.adv_temperature, reduction="none")
            if cfg.adv_mask:
                kl = kl * (s.argmax(1) != t.argmax(1)).float()
            loss = cfg.lambda_oh * ce.mean() + cfg.lambda_bn * loss_bn - cfg.lambda_adv * kl.mean()
            cost = loss.detach()
            if best_cost is None:  # the first step's batch, whatever its loss (NaN included)
                best_cost, best_x = cost, x.detach().clone()
            else:
                better = cost < best_cost
                best_cost, best_x = torch.where(better, cost, best_cost), torch.where(better, x.detach(), best_x)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.generator_clip is not None:
                nn.utils.clip_grad_norm_(generator.parameters(), cfg.generator_clip)
            opt.step()
        student.requires_grad_(True)
        assert best_x is not None and best_cost is not None
        return best_x, y, float(best_cost)

    def reweight(self, epoch: int, ensemble: LogitEnsemble, weights: torch.Tensor, pool_x: list[torch.Tensor],
                 pool_y: list[torch.Tensor], low: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """Co-Boosting's ensemble boosting: signed-gradient steps on CE(f_w(x), y) over the labelled pool."""
        cfg = self.cfg
        step = cfg.reweight_mu * cfg.reweight_delta**epoch
        w = weights.detach().clone()
        for _ in range(cfg.reweight_steps):
            for xb, yb in self._batches(pool_x, pool_y, low, gen):
                with torch.no_grad():
                    member = ensemble.member_logits(xb)
                wv = w.clone().requires_grad_()
                loss = F.cross_entropy(combine_logits(member, wv), yb)
                (grad,) = torch.autograd.grad(loss, wv)
                w = (w - step * grad.sign()).clamp_(0.0, 1.0)
        return check_ensemble_weights(w)  # once per reweighting, not per step (combine_logits divides by the sum)

    def perturb(self, xb: torch.Tensor, ensemble: LogitEnsemble, weights: torch.Tensor | None,
                gen: torch.Generator) -> torch.Tensor:
        cfg = self.cfg
        if not cfg.ods_eta:
            return xb
        xb = xb.detach().requires_grad_()
        out = ensemble.combine(ensemble.member_logits(xb), weights)
        r = to_device(torch.rand(out.shape, generator=gen) * 2.0 - 1.0, out.device)
        (grad,) = torch.autograd.grad((r * F.softmax(out / cfg.ods_temperature, dim=1)).sum(), xb)
        return (xb + cfg.ods_eta * grad.sign()).detach()
