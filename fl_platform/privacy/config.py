"""Schema of the Hydra ``privacy`` group (``privacy=none|central|local``) and its start-up checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fl_platform.rounds.sampling import SAMPLINGS

PRIVACY_OPTIONS = ("none", "central", "local")
ACCOUNTANTS = ("rdp", "pld")  # dp-accounting's RdpAccountant, PLDAccountant (accounting.py)


@dataclass
class AdaptiveClipConf:
    """Quantile-based adaptive clipping (Andrew et al. 2021), central DP only."""

    enabled: bool = False
    quantile: float = 0.5  # gamma: the fraction of clients whose update the clip norm should leave unclipped
    lr: float = 0.2  # eta_C: C <- C exp(-lr (noised unclipped fraction - quantile))
    # sigma_b: std of the noise on the count of unclipped clients; null: expected clients per round / 20
    # (the paper's choice). The update's noise multiplier shrinks so the total stays noise_multiplier.
    count_stddev: float | None = None


@dataclass
class PrivacyConf:
    name: str = "none"  # none | central (noise on the server's sum) | local (each client noises its update)
    clip: float = 1.0  # C: L2 bound of each client's update (the initial C with adaptive clipping)
    # z: noise std z C on the sum (central) or on each client's update (local); null: the smallest z whose
    # epsilon after `rounds` rounds is <= target_epsilon (dp-accounting's calibration)
    noise_multiplier: float | None = 1.0
    delta: float = 1e-5  # epsilon is reported at this delta
    target_epsilon: float | None = None  # stop before the first round that would take epsilon above it
    accountant: str = "rdp"  # rdp | pld (dp-accounting)
    # poisson: each client with probability clients_per_round / num_clients (add/remove neighbours; the
    # default: at the same noise its epsilon is about 10x smaller); fixed: exactly clients_per_round of
    # num_clients without replacement (replace-one neighbours)
    sampling: str = "poisson"
    adaptive: AdaptiveClipConf = field(default_factory=AdaptiveClipConf)
    # the noise from the OS's secure random source (a torch generator seeded from `secrets` per draw),
    # as in a Flower deployment (always there), instead of from (seed, round, client): not reproducible
    secure_rng: bool = False

    def inactive_fields(self, num_clients: int | None = None, clients_per_round: int | None = None) -> dict[str, str]:
        """Fields (dotted) that have no effect with the other settings, each with the reason (the run's
        ``num_clients`` and ``clients_per_round``, when given, tell whether the sampling can matter)."""
        adaptive = ("adaptive.enabled", "adaptive.quantile", "adaptive.lr", "adaptive.count_stddev")
        if self.name == "none":
            keys = ("clip", "noise_multiplier", "delta", "target_epsilon", "accountant", "sampling", "secure_rng",
                    *adaptive)
            return dict.fromkeys(keys, "privacy=none: no clipping, noise or accounting")
        out: dict[str, str] = {}
        if self.name == "local":
            out.update(dict.fromkeys(adaptive, "adaptive clipping needs the server's noised count of unclipped "
                                               "clients, and privacy=local has no server-side noise"))
            if num_clients is not None and num_clients == clients_per_round:
                out["sampling"] = ("every client takes part in every round either way (clients_per_round = "
                                   "num_clients), and local DP's accounting has no amplification by sampling")
        elif not self.adaptive.enabled:
            out.update(dict.fromkeys(adaptive[1:], "it tunes adaptive clipping, and privacy.adaptive.enabled=false"))
        if self.noise_multiplier == 0:
            why = "privacy.noise_multiplier=0 adds no noise: epsilon is infinite whatever it is"
            out.update(delta=why, accountant=why)
            if not (self.name == "central" and self.adaptive.enabled and self.adaptive.count_stddev):
                out["secure_rng"] = "privacy.noise_multiplier=0 draws no noise (nor does the count of unclipped clients)"
        return out


def privacy_schemas() -> dict[str, type[PrivacyConf]]:
    """Every option of the ``privacy`` group shares one schema; the YAMLs set the mode."""
    return dict.fromkeys(PRIVACY_OPTIONS, PrivacyConf)


def privacy_conf(node: Any) -> PrivacyConf:
    """A PrivacyConf from an OmegaConf node, a dict or a PrivacyConf (None: privacy=none)."""
    if node is None:
        return PrivacyConf()
    if isinstance(node, PrivacyConf):
        return node
    from omegaconf import DictConfig, OmegaConf

    data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    adaptive = AdaptiveClipConf(**dict(data.pop("adaptive", {}) or {}))
    return PrivacyConf(**data, adaptive=adaptive)


def sampling_of(conf: PrivacyConf | None) -> str:
    """The round loop's client sampling: ``privacy.sampling`` under DP, else the platform's fixed-size draw."""
    return conf.sampling if conf is not None and conf.name != "none" else "fixed"


def count_stddev(conf: PrivacyConf, clients_per_round: int) -> float:
    """sigma_b of adaptive clipping (``adaptive.count_stddev``, default expected clients / 20)."""
    if conf.adaptive.count_stddev is not None:
        return float(conf.adaptive.count_stddev)
    # (null counts as noised: it is resolved to a z > 0 before the run starts)
    return clients_per_round / 20 if conf.noise_multiplier != 0 else 0.0


def check_values(conf: PrivacyConf, num_clients: int, clients_per_round: int) -> None:
    """ValueError naming the key for a value that makes no sense (types are Hydra's)."""
    if conf.name not in PRIVACY_OPTIONS:
        raise ValueError(f"privacy.name must be one of {', '.join(PRIVACY_OPTIONS)}, got {conf.name!r}")
    if conf.name == "none":
        return
    z = conf.noise_multiplier
    checks = [
        (conf.clip > 0, "privacy.clip", f"must be > 0, got {conf.clip}"),
        (z is None or z >= 0, "privacy.noise_multiplier", f"must be >= 0 (or null with target_epsilon), got {z}"),
        (z is not None or conf.target_epsilon is not None, "privacy.noise_multiplier",
         "=null picks the noise for privacy.target_epsilon, which is not set"),
        (0 < conf.delta < 1, "privacy.delta", f"must be in (0, 1), got {conf.delta}"),
        (conf.delta < 1 / num_clients, "privacy.delta",
         f"={conf.delta} is not below 1/num_clients={1 / num_clients:.3g}: a mechanism that publishes one "
         "client's data outright would meet it; use a delta well below 1/num_clients"),
        (conf.target_epsilon is None or conf.target_epsilon > 0, "privacy.target_epsilon",
         f"must be > 0 (or null), got {conf.target_epsilon}"),
        (conf.target_epsilon is None or z != 0, "privacy.target_epsilon",
         "cannot be met with privacy.noise_multiplier=0 (no noise: epsilon is infinite from round 1)"),
        (conf.accountant in ACCOUNTANTS, "privacy.accountant",
         f"must be one of {', '.join(ACCOUNTANTS)}, got {conf.accountant!r}"),
        (conf.sampling in SAMPLINGS, "privacy.sampling", f"must be one of {', '.join(SAMPLINGS)}, got {conf.sampling!r}"),
    ]
    a = conf.adaptive
    if conf.name == "central" and a.enabled:
        sigma_b = count_stddev(conf, clients_per_round)
        checks += [
            (0 < a.quantile < 1, "privacy.adaptive.quantile", f"must be in (0, 1), got {a.quantile}"),
            (a.lr > 0, "privacy.adaptive.lr", f"must be > 0, got {a.lr}"),
            (a.count_stddev is None or a.count_stddev >= 0, "privacy.adaptive.count_stddev",
             f"must be >= 0 (or null), got {a.count_stddev}"),
            (not z or sigma_b > 0, "privacy.adaptive.count_stddev",
             "=0 would publish the exact count of unclipped clients, which is not private with noise_multiplier > 0"),
            (not z or not sigma_b or z < 2 * sigma_b, "privacy.adaptive.count_stddev",
             f"={sigma_b:g} is too small for privacy.noise_multiplier={z}: the count's noise alone already spends "
             f"the budget (needs noise_multiplier < 2 count_stddev); raise it or lower noise_multiplier"),
        ]
    for ok, key, message in checks:
        if not ok:
            raise ValueError(f"{key}{'' if message.startswith('=') else ' '}{message}")


def update_noise_multiplier(z: float, sigma_b: float) -> float:
    """z_delta = (z^-2 - (2 sigma_b)^-2)^(-1/2): the update's share when the count also takes noise
    (Andrew et al. 2021, section 3), so that the two Gaussians together are one with multiplier z."""
    if z == 0:
        return 0.0
    if sigma_b == 0:
        return z
    rest = z ** -2 - (2 * sigma_b) ** -2
    if rest <= 0:
        raise ValueError(f"privacy.adaptive.count_stddev={sigma_b:g} leaves no budget for the update's noise "
                         f"at privacy.noise_multiplier={z}")
    return rest ** -0.5
