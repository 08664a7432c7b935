"""FedImpro (Tang et al., ICLR 2024): train the high-level part on shared feature distributions.

The model is cut after one stage into a low part ``g`` (input -> feature ``h``) and a high part
``f``. The server keeps per-class diagonal Gaussians ``(mu, sigma)`` (C x D, D = the flattened
split feature) and broadcasts them with the weights. Each local step computes ``h = g(x)``,
samples a class-balanced batch ``h_f ~ N(mu[y_f], sigma[y_f]^2)`` (``y_f`` = every class, repeated
``B // C + 1`` times; no gradient), runs ``f`` once on ``[h; h_f]`` and minimises

    w_real(r) CE(f(h), y) + w_fake(r) CE(f(h_f), y_f),   default w_real = 1, w_fake = r / T

so the low part gets gradient only from real features. The client estimates its own per-class
statistics from the detached real features and uploads them next to the FedAvg delta:

* ``aggregation=uniform`` (paper default): ``mu_k`` and ``sigma_k`` (the received global values
  for classes the client has not seen), the server averages both over the sampled clients.
* ``aggregation=label_size``: per class ``sum h``, ``sum h^2`` and the count; the server recovers
  the mean and the law-of-total-variance std of the union of the sampled clients' features
  exactly (classes nobody sampled this round keep their previous value).

Both are plain sums, so hierarchical aggregation is exact and no client state is needed.
Deliberate corrections of the reference code (each reference behaviour is a flag, see
docs/algorithms/fedimpro.md): statistics are the exact per-class mean/std of every real feature
of the round (the reference keeps a running average with weight ``a = min(1, D/5000)`` per
minibatch, D the feature dimension: ``stats_update=last_batch``; for D >= 5000 that is the last
minibatch's statistics); sampling uses the broadcast global
statistics for the whole round (the reference samples from its drifting local copy:
``sample_from=local``); ``sigma_max`` bounds the std used for sampling rather than the stored
estimates (the reference clips stored stds, which also bounds the sampled std by ``sigma_max``
but makes the aggregated statistics inexact). Optional privacy noise is clamped so that
``sigma >= 0``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fl_platform.algorithms.base import AlgorithmSpec, Setup, require
from fl_platform.algorithms.fedavg import FedAvgClient, FedAvgConf, FedAvgServer
from fl_platform.core import Aggregate, Broadcast, ClientUpdate, RoundContext
from fl_platform.models.base import StagedModel
from fl_platform.privacy.clipping import gaussian_noise
from fl_platform.seeding import Stream, torch_generator
from fl_platform.training.hooks import Batch, ComposedHooks, ProximalHook, TrainHooks

SCHEDULES = ("gradual2half", "gradual", "gradualhalfhalf", "constant")
AGGREGATIONS = ("uniform", "label_size")
STATS_UPDATES = ("exact", "last_batch")
SAMPLE_FROM = ("global", "local")

# Sub-keys of Stream.ALGORITHM (never equal to a round index in practice).
_INIT_KEY = 0x7F1B_0001
_SAMPLE_KEY = 0x7F1B_0002
_PRIVACY_KEY = 0x7F1B_0003


@dataclass
class FedImproConf(FedAvgConf):
    name: str = "fedimpro"
    mu: float = 0.0  # FedProx proximal weight when stacked on FedProx
    split_after: str = "auto"  # stage (or group) name; auto: layer2 (ResNet-18), last conv (CNN), fc1 (MLP)
    sigma_init: float = 0.1  # initial global std (fed_split_noise_std)
    sigma_max: float | None = 0.1  # upper bound on every std entry used for sampling; null = none
    weight_schedule: str = "gradual2half"  # gradual2half | gradual | gradualhalfhalf | constant
    weight_max_rounds: int = 500  # T in lambda_r = r / T (fed_split_feature_weight_max_epochs)
    constant_weight: float = 1.0  # w_fake for weight_schedule=constant
    aggregation: str = "uniform"  # uniform (paper default) | label_size (law of total variance)
    stats_update: str = "exact"  # exact | last_batch (reference quirk)
    sample_from: str = "global"  # global | local (reference quirk: the client's drifting copy)
    privacy_noise_std: float = 0.0  # std of Gaussian noise on uploaded mu/sigma (reference: 0.001 when on)

    def inactive_fields(self, run: Any) -> dict[str, str]:
        out = super().inactive_fields(run)
        if self.weight_schedule != "constant":
            out["constant_weight"] = f"w_fake of weight_schedule=constant, and weight_schedule={self.weight_schedule}"
            if run.rounds == 1:
                out["weight_max_rounds"] = "round 1's weights r / T are the same for every T, and rounds=1"
        else:
            out["weight_max_rounds"] = "T of the gradual schedules, and weight_schedule=constant"
        return out


def _check(cfg: FedImproConf) -> None:
    choices = {"weight_schedule": SCHEDULES, "aggregation": AGGREGATIONS, "stats_update": STATS_UPDATES,
               "sample_from": SAMPLE_FROM}
    for key, valid in choices.items():
        if getattr(cfg, key) not in valid:
            raise ValueError(f"algorithm.{key} must be one of {', '.join(valid)}; got {getattr(cfg, key)!r}")
    checks = [(cfg.sigma_init >= 0, "sigma_init", ">= 0"), (cfg.weight_max_rounds >= 1, "weight_max_rounds", ">= 1"),
              (cfg.sigma_max is None or cfg.sigma_max >= 0, "sigma_max", ">= 0 or null"),
              (cfg.privacy_noise_std >= 0, "privacy_noise_std", ">= 0"), (cfg.mu >= 0, "mu", ">= 0"),
              (cfg.constant_weight >= 0, "constant_weight", ">= 0")]
    require(cfg, *checks)


def loss_weights(cfg: FedImproConf, round_index: int) -> tuple[float, float]:
    """(w_real, w_fake) for global round ``round_index`` (0-based), as the reference's schedules."""
    ratio = round_index / cfg.weight_max_rounds
    if cfg.weight_schedule == "gradual2half":  # not capped: 2.0 at r = 2T, as the reference
        return 1.0, ratio
    if cfg.weight_schedule == "gradual":
        ratio = min(ratio, 1.0)
        return 1.0 - ratio, ratio
    if cfg.weight_schedule == "gradualhalfhalf":
        ratio = min(ratio, 1.0)
        return 1.0 - 0.5 * ratio, 0.5 * ratio
    return 1.0, cfg.constant_weight


def default_split(model: StagedModel) -> str:
    """A sensible cut: after layer2 for ResNet-18, after the last conv stage for the CNN, after fc1 for the MLP."""
    names = model.stage_names
    if any(n.startswith("layer2_") for n in names):
        return "layer2"
    convs = [n for n in names if re.fullmatch(r"conv\d+", n)]
    if convs:
        return convs[-1]
    if "fc1" in names:
        return "fc1"
    raise ValueError(f"algorithm.split_after=auto has no default for {type(model).__name__}; set it to one of "
                     f"the stages {names[:-1]}")


@dataclass(frozen=True)
class SplitInfo:
    cut: int  # index of the last stage of the low part
    feature_shape: tuple[int, ...]

    @property
    def dim(self) -> int:
        d = 1
        for s in self.feature_shape:
            d *= s
        return d


def split_info(model: nn.Module, split_after: str) -> SplitInfo:
    if not isinstance(model, StagedModel):
        raise TypeError(f"FedImpro needs a StagedModel (named stages), got {type(model).__name__}")
    name = default_split(model) if split_after == "auto" else split_after
    cut = model.resolve_cut(name)
    if cut >= len(model.stage_names) - 1:
        raise ValueError(f"algorithm.split_after={name!r} leaves no high-level part; choose a stage before 'head' "
                         f"in {model.stage_names}")
    shapes = model.stage_output_shapes()
    return SplitInfo(cut, tuple(shapes[model.stage_names[cut]]))


class ClassStats:
    """A client's per-class feature statistics for one round, starting from the global ones.

    ``exact`` accumulates float64 sums of ``h`` and ``h^2`` per class over every real feature of
    the round. ``last_batch`` is the reference's running average: for each class in a minibatch,
    ``mu <- (1 - a) mu + a m`` and ``sigma <- (1 - a) sigma + a s`` (``m``, ``s``: the class's mean and
    unbiased std in the minibatch; ``sigma`` kept where the class has one sample), with
    ``a = min(1, D / 5000)`` (the reference divides the feature dimension D, not a sample count, by
    5000: for D >= 5000 the last minibatch's statistics), the std clipped at ``sigma_max`` after every
    update.
    """

    def __init__(self, mode: str, global_mu: torch.Tensor, global_sigma: torch.Tensor,
                 sigma_max: float | None) -> None:
        self.mode = mode
        self.global_mu = global_mu
        self.global_sigma = global_sigma
        self.sigma_max = sigma_max
        c, d = global_mu.shape
        dev = global_mu.device
        self.count = torch.zeros(c, dtype=torch.float64, device=dev)
        self.sum = torch.zeros(c, d, dtype=torch.float64, device=dev)
        self.sumsq = torch.zeros(c, d, dtype=torch.float64, device=dev)
        if mode == "last_batch":
            self.mu = global_mu.clone()
            self.sigma = global_sigma.clone()
            self.momentum = min(1.0, d / 5000)  # the reference's ``min(1, size(0) / 5000)`` on a D-vector

    @torch.no_grad()
    def update(self, h: torch.Tensor, y: torch.Tensor) -> None:
        """Fold in the detached, flattened real features ``h`` ``[B, D]`` with labels ``y``."""
        h = h.detach().to(torch.float64)
        c = self.count.numel()
        # Counts by index_add_ of ones (exact in float64): bincount would read y's range back to the host.
        n = torch.zeros(c, dtype=torch.float64, device=h.device).index_add_(0, y, h.new_ones(y.shape[0]))
        self.count += n
        if self.mode == "exact":
            self.sum.index_add_(0, y, h)
            self.sumsq.index_add_(0, y, h * h)
        else:
            # Every class is updated with the same elementwise arithmetic and ``torch.where`` keeps the old
            # values of absent classes (and sigma of one-sample classes): no boolean-mask indexing, whose
            # output size the host would have to read back each step. Divisors are clamped so the rows
            # ``where`` discards stay finite; the kept rows are bit-identical to indexing them.
            s = torch.zeros_like(self.sum).index_add_(0, y, h)
            sq = torch.zeros_like(self.sumsq).index_add_(0, y, h * h)
            a = self.momentum
            present = (n > 0)[:, None]
            mean = s / n.clamp_min(1)[:, None]
            mu = ((1 - a) * self.mu.to(torch.float64) + a * mean).to(self.mu.dtype)
            self.mu.copy_(torch.where(present, mu, self.mu))
            multi = (n >= 2)[:, None]  # the std of one sample is NaN in the reference and skipped
            nm = n.clamp_min(2)[:, None]
            var = ((sq - nm * (s / nm) ** 2) / (nm - 1)).clamp_min(0)
            sigma = ((1 - a) * self.sigma.to(torch.float64) + a * var.sqrt()).to(self.sigma.dtype)
            self.sigma.copy_(torch.where(multi, sigma, self.sigma))
            if self.sigma_max is not None:
                self.sigma.clamp_(max=self.sigma_max)

    def mean_std(self, unbiased: bool = True, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Current local (mu, sigma) estimates (``dtype``: default the global one); unseen classes keep the global values."""
        dtype = dtype or self.global_mu.dtype
        if self.mode == "last_batch":
            return self.mu.to(dtype), self.sigma.to(dtype)
        n = self.count[:, None]
        seen = n > 0
        mean = self.sum / n.clamp_min(1)
        var = self.sumsq / n.clamp_min(1) - mean**2
        if unbiased:
            var = var * n / (n - 1).clamp_min(1)
        sigma = var.clamp_min(0).sqrt()
        mu = torch.where(seen, mean, self.global_mu.to(torch.float64))
        sigma_ok = (n >= 2) if unbiased else seen
        sigma = torch.where(sigma_ok, sigma, self.global_sigma.to(torch.float64))
        return mu.to(dtype), sigma.to(dtype)


def privatise(mu: torch.Tensor, sigma: torch.Tensor, std: float, secure: bool, seed: int, *keys: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Add N(0, std^2) to every entry of mu and sigma; clamp sigma at 0 (the reference does not). The noise
    derives from (seed, *keys) in the simulator; ``secure`` (a Flower ClientApp, ``Setup.secure_noise``): from
    the node's OS CSPRNG, since every client is sent the seed and could otherwise subtract it."""
    if not std:
        return mu, sigma
    noise = gaussian_noise(secure, (2, *mu.shape), mu.dtype, seed, *keys).to(mu.device).mul_(std)
    return mu + noise[0], (sigma + noise[1]).clamp_min(0)


def label_size_contribution(mu: torch.Tensor, sigma: torch.Tensor, count: torch.Tensor) -> dict[str, torch.Tensor]:
    """Summable parts ``n mu``, ``n (sigma^2 + mu^2)`` and ``n`` per class (sigma: population std)."""
    mu64, sigma64, n = mu.to(torch.float64), sigma.to(torch.float64), count.to(torch.float64)
    return {"fedimpro_sum": n[:, None] * mu64, "fedimpro_sumsq": n[:, None] * (sigma64**2 + mu64**2),
            "fedimpro_count": n}


def combine_label_size(agg_sum: torch.Tensor, agg_sumsq: torch.Tensor, agg_count: torch.Tensor,
                       prev_mu: torch.Tensor, prev_sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Law of total variance: mu_c = sum n mu / N, sigma_c^2 = sum n (sigma^2 + mu^2) / N - mu_c^2."""
    n = agg_count.to(torch.float64)[:, None]
    seen = n > 0
    mean = agg_sum / n.clamp_min(1e-300)
    var = (agg_sumsq / n.clamp_min(1e-300) - mean**2).clamp_min(0)
    mu = torch.where(seen, mean, prev_mu.to(torch.float64))
    sigma = torch.where(seen, var.sqrt(), prev_sigma.to(torch.float64))
    return mu.to(prev_mu.dtype), sigma.to(prev_sigma.dtype)


class FedImproHook(TrainHooks):
    """The split forward: real features through ``f`` with class-balanced sampled features."""

    def __init__(self, split: SplitInfo, mu: torch.Tensor, sigma: torch.Tensor, stats: ClassStats,
                 weights: tuple[float, float], gen: torch.Generator, sigma_max: float | None,
                 sample_from_local: bool = False) -> None:
        self.split = split
        self.mu = mu
        self.sigma = sigma
        self.stats = stats
        self.w_real, self.w_fake = weights
        self.gen = gen
        self.sigma_max = sigma_max
        self.sample_from_local = sample_from_local
        self.fake_ce = torch.zeros(())
        self.steps = 0

    def sample(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Class-balanced sampled features ``[R*C, *feature_shape]`` (constants) and their labels."""
        mu, sigma = self.stats.mean_std() if self.sample_from_local else (self.mu, self.sigma)
        if self.sigma_max is not None:
            sigma = sigma.clamp(max=self.sigma_max)
        c = mu.shape[0]
        labels = torch.arange(c, device=mu.device).repeat(batch_size // c + 1)
        eps = torch.randn((labels.numel(), mu.shape[1]), generator=self.gen, device=mu.device, dtype=mu.dtype)
        feats = (mu[labels] + sigma[labels] * eps).detach()
        return feats.view(-1, *self.split.feature_shape), labels

    def forward(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(real logits, fake logits, fake labels, real features) of one step."""
        cut = self.split.cut
        h = model.forward_stages(batch.x, stop=cut + 1)
        h_fake, y_fake = self.sample(h.shape[0])
        out = model.forward_stages(torch.cat([h, h_fake.to(h.dtype)]), start=cut + 1)
        b = h.shape[0]
        return out[:b], out[b:], y_fake, h

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        real, fake, y_fake, h = self.forward(model, batch)
        fake_ce = F.cross_entropy(fake, y_fake)
        loss = self.w_real * F.cross_entropy(real, batch.y) + self.w_fake * fake_ce
        self.stats.update(h.detach().flatten(1), batch.y)  # features from before this step's update
        self.fake_ce = self.fake_ce.to(fake_ce.device) + fake_ce.detach()
        self.steps += 1
        return loss, real


def _split_of(setup: Setup, cfg: FedImproConf) -> SplitInfo:
    with torch.random.fork_rng(devices=[]):  # building a throwaway model must not move torch's RNG
        model = setup.model_fn()
    return split_info(model, cfg.split_after)


class FedImproClient(FedAvgClient):
    def __init__(self, cfg: FedImproConf, setup: Setup) -> None:
        super().__init__(cfg, setup)
        _check(cfg)
        self.split = _split_of(setup, cfg)

    @classmethod
    def uploads(cls, cfg: FedImproConf) -> dict[str, str | None]:
        stats = ("fedimpro_mu", "fedimpro_sigma") if cfg.aggregation == "uniform" else \
            ("fedimpro_sum", "fedimpro_sumsq", "fedimpro_count")
        return {"delta": "n", **dict.fromkeys(stats)}

    def make_hook(self, ctx: RoundContext, client_id: int, broadcast: Broadcast) -> FedImproHook:
        cfg = self.cfg
        mu, sigma = broadcast.tensors["fedimpro_mu"], broadcast.tensors["fedimpro_sigma"]
        stats = ClassStats(cfg.stats_update, mu, sigma, cfg.sigma_max)
        gen = torch_generator(ctx.seed, Stream.ALGORITHM, ctx.round, client_id, _SAMPLE_KEY, device=mu.device)
        weights = (broadcast.scalars["fedimpro_w_real"], broadcast.scalars["fedimpro_w_fake"])
        return FedImproHook(self.split, mu, sigma, stats, weights, gen, cfg.sigma_max, cfg.sample_from == "local")

    def train(self, ctx: RoundContext, client_id: int, broadcast: Broadcast, state, data, trainer) -> ClientUpdate:
        cfg = self.cfg
        fm = trainer.fm
        hook = self.make_hook(ctx, client_id, broadcast)
        hooks: TrainHooks = hook
        if cfg.mu:
            hooks = ComposedHooks(hook, ProximalHook(cfg.mu, broadcast.tensors["weights"][: fm.num_params]))
        weights = broadcast.tensors["weights"]
        fm.load(weights)
        metrics = trainer.fit(data, hooks, seed=ctx.seed, round=ctx.round, client=client_id)
        if hook.steps:
            metrics.add("fedimpro_fake_ce", float(hook.fake_ce), hook.steps)
        n = data.num_samples
        delta = fm.vector - weights
        tensors = {"delta": delta.mul_(n), **self.statistics(ctx, client_id, hook.stats, data)}
        return ClientUpdate(client_id, tensors, {"n": float(n), "clients": 1.0}, n, metrics)

    def statistics(self, ctx: RoundContext, client_id: int, stats: ClassStats, data) -> dict[str, torch.Tensor]:
        """The client's summable statistics contribution (optionally privatised)."""
        cfg = self.cfg
        noise = (self.setup.secure_noise, ctx.seed, Stream.ALGORITHM, ctx.round, client_id, _PRIVACY_KEY)
        if cfg.aggregation == "uniform":
            mu, sigma = privatise(*stats.mean_std(unbiased=True), cfg.privacy_noise_std, *noise)
            return {"fedimpro_mu": mu, "fedimpro_sigma": sigma}
        if cfg.stats_update == "exact":
            count = stats.count
            mu, sigma = stats.mean_std(unbiased=False, dtype=torch.float64)
        else:  # the reference's label sizes with its last-batch estimates
            labels = data.y.index_select(0, data.indices)
            count = torch.bincount(labels, minlength=stats.count.numel()).to(torch.float64)
            mu, sigma = stats.mean_std(dtype=torch.float64)
        mu, sigma = privatise(mu, sigma, cfg.privacy_noise_std, *noise)
        return label_size_contribution(mu, sigma, count)


class FedImproServer(FedAvgServer):
    def __init__(self, cfg: FedImproConf, setup: Setup, initial_weights: torch.Tensor) -> None:
        super().__init__(cfg, setup, initial_weights)
        _check(cfg)
        self.split = _split_of(setup, cfg)
        c, d = setup.num_classes, self.split.dim
        gen = torch_generator(setup.seed, Stream.ALGORITHM, _INIT_KEY)
        self.mu = torch.rand(c, d, generator=gen)  # U[0, 1) as the reference
        self.sigma = torch.full((c, d), float(cfg.sigma_init))

    def broadcast(self, ctx: RoundContext) -> Broadcast:
        w_real, w_fake = loss_weights(self.cfg, ctx.round)
        return Broadcast({"weights": self.weights, "fedimpro_mu": self.mu, "fedimpro_sigma": self.sigma},
                         {"fedimpro_w_real": w_real, "fedimpro_w_fake": w_fake})

    def aggregate(self, ctx: RoundContext, result: Aggregate | list[ClientUpdate]) -> dict[str, float]:
        assert isinstance(result, Aggregate)
        extra = super().aggregate(ctx, result)
        k = result.weights.get("clients", 0.0)
        if k <= 0:
            return extra
        t = result.tensors
        if self.cfg.aggregation == "uniform":
            self.mu = (t["fedimpro_mu"] / k).to(torch.float32)
            self.sigma = (t["fedimpro_sigma"] / k).to(torch.float32)
        else:
            self.mu, self.sigma = combine_label_size(t["fedimpro_sum"], t["fedimpro_sumsq"], t["fedimpro_count"],
                                                     self.mu, self.sigma)
        _, w_fake = loss_weights(self.cfg, ctx.round)
        return {**extra, "fedimpro_w_fake": w_fake, "fedimpro_sigma_mean": float(self.sigma.mean())}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "fedimpro_mu": self.mu.clone(), "fedimpro_sigma": self.sigma.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.mu = state["fedimpro_mu"].clone()
        self.sigma = state["fedimpro_sigma"].clone()


SPEC = AlgorithmSpec("fedimpro", FedImproConf, FedImproClient, FedImproServer,
                     "FedImpro: high-level part trained on real + shared per-class Gaussian features",
                     staged_model=True)
