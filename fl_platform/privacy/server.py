"""The server's side of client-level DP: noise on the sum, the public denominator, adaptive C, epsilon.

Runs inside the round loop (``rounds/simulation.py``), between the reduction of the workers'
partial sums and the algorithm's own server step, so the inline engine, Ray and Flower's ServerApp
(which drives the same loop) pass through this one code path:

* before the round: the broadcast carries this round's clip norm C (``dp_clip``);
* after the reduction (central DP): N(0, (z_u C)^2) is added once to the sum of each private tensor,
  drawn from (seed, PRIVACY, round), whatever the number of workers, or from the server's OS CSPRNG
  with ``privacy.secure_rng`` (always in a Flower deployment); z_u = z without adaptive clipping, else
  z_u = (z^-2 - (2 sigma_b)^-2)^(-1/2);
* both modes: every private weight's sum becomes the expected number of clients per round
  (clients_per_round: exactly K under fixed sampling, qN under Poisson), a public constant, so the
  algorithm's step divides the noised sum by it (DP-FedAvg's fixed denominator, McMahan et al. 2018);
  a round without clients still takes a (pure noise) step;
* adaptive clipping: the sum of b_k - 1/2 gets N(0, sigma_b^2); b_hat = that / K + 1/2 estimates the
  fraction of unclipped clients (clamped to [0, 1]) and C <- C exp(-lr (b_hat - quantile)) for the next round;
* after the round: epsilon at delta after r rounds (``accounting.py``); with ``target_epsilon`` the
  loop does not start a round whose epsilon would exceed it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fl_platform.core import Aggregate, Broadcast, ClientUpdate, RoundContext
from fl_platform.privacy.accounting import Accountant, check_pld_size
from fl_platform.privacy.clipping import BELOW, CLIP_KEY, bound_decoded, gaussian_noise
from fl_platform.privacy.config import PrivacyConf, count_stddev, update_noise_multiplier
from fl_platform.privacy.setup import SAMPLING_SEED_KEY
from fl_platform.privacy.spec import PrivateUploads
from fl_platform.seeding import Stream

SERVER_NOISE_KEY = 0  # (seed, PRIVACY, round, SERVER_NOISE_KEY, i): the noise on private tensor i (i = len: the count)


class ServerPrivacy:
    def __init__(self, conf: PrivacyConf, private: PrivateUploads, sizes: dict[str, int], *, num_clients: int,
                 clients_per_round: int, rounds: int, seed: int, secret_seed: bool = False) -> None:
        """``seed``: the cohorts' seed, from which local DP's accountant counts participations; ``secret_seed``:
        it is a deployment's secret (``setup.secret_sampling_seed``), kept in the checkpoint for a restart."""
        if conf.name not in ("central", "local"):
            raise ValueError(f"ServerPrivacy needs privacy=central or local, got {conf.name!r}")
        missing = [name for name in private.tensors if name not in sizes]
        if missing:
            raise ValueError(f"the sizes of the private tensors {missing} are unknown (known: {sorted(sizes)})")
        self.conf = conf
        self.private = private
        self.sizes = {name: int(sizes[name]) for name in private.tensors}
        self.central = conf.name == "central"
        self.secure = bool(conf.secure_rng)
        self.adaptive = self.central and conf.adaptive.enabled
        self.seed = seed
        self.secret_seed = secret_seed
        self.expected = float(clients_per_round)
        if conf.noise_multiplier is None:
            raise ValueError("privacy.noise_multiplier=null must be resolved before the server half is built "
                             "(privacy.setup.resolved_privacy), so that every client uses the same z")
        self.noise_multiplier = float(conf.noise_multiplier)
        self.sigma_b = count_stddev(conf, clients_per_round) if self.adaptive else 0.0
        self.update_multiplier = update_noise_multiplier(self.noise_multiplier, self.sigma_b) if self.adaptive \
            else self.noise_multiplier
        self.clip = float(conf.clip)
        self.accountant = Accountant(conf.name, conf.accountant, self.noise_multiplier, conf.delta, num_clients,
                                     clients_per_round, conf.sampling, seed)
        # PLD's distribution for the run's rounds fits in memory, or refused now rather than mid-run
        check_pld_size(conf.name, conf.accountant, self.noise_multiplier,
                       rounds if self.central else self.accountant.participations(rounds), num_clients,
                       clients_per_round, conf.sampling)
        self.stop_reason: str | None = None
        if conf.target_epsilon is not None and self.accountant.epsilon(1) > conf.target_epsilon:
            raise ValueError(f"privacy.target_epsilon={conf.target_epsilon:g} is below the epsilon of a single round "
                             f"({self.accountant.epsilon(1):.3g} with privacy.noise_multiplier={self.noise_multiplier:g}):"
                             f" the run could not train one round; raise the target or the noise multiplier")

    # ------------------------------------------------------------------ one round

    def annotate(self, broadcast: Broadcast) -> None:
        """Tell the clients this round's clip norm."""
        broadcast.scalars[CLIP_KEY] = self.clip

    def bound(self, update: ClientUpdate) -> None:
        """A decoded client update as the server may add it (the Flower server's check, which must not
        trust the client): only private tensors and weights (ValueError otherwise) and, under central DP,
        its private tensors clipped to this round's C."""
        allowed = set(self.private.tensors) | ({BELOW} if self.adaptive else set())
        extra = sorted(set(update.tensors) - allowed) + sorted(set(update.weights) - set(self.private.weights))
        if extra:
            raise ValueError(f"it carries {extra}, which are not private uploads of this run")
        if self.adaptive and BELOW in update.tensors:
            below = update.tensors[BELOW]
            if below.numel() != 1 or float(below.reshape(-1)[0]) not in (-0.5, 0.5):
                raise ValueError(f"{BELOW} must be one value, -0.5 or 0.5")
        if self.central:
            bound_decoded(update, self.private, self.clip)

    def _noise(self, ctx: RoundContext, index: int, shape: tuple[int, ...], std: float) -> torch.Tensor:
        """Seeded from (seed, PRIVACY, round, index), or from the server's OS CSPRNG (``privacy.secure_rng``,
        always in a Flower deployment): ``clipping.gaussian_noise``, on the CPU, in float64."""
        return gaussian_noise(self.secure, shape, torch.float64, ctx.seed, Stream.PRIVACY, ctx.round,
                              SERVER_NOISE_KEY, index).mul_(std)

    def privatise(self, ctx: RoundContext, agg: Aggregate) -> dict[str, float]:
        """Noise the sum (central), fix the denominators, adapt C; returns the round's dp_* metrics."""
        clip = self.clip
        std = self.update_multiplier * clip if self.central else 0.0
        for i, name in enumerate(self.private.tensors):
            total = agg.tensors.get(name)
            if total is None:  # no client this round (Poisson sampling, or all rejected): noise alone
                total = torch.zeros(self.sizes[name], dtype=torch.float64)
            if std > 0:
                total = total + self._noise(ctx, i, tuple(total.shape), std).to(total.device)
            agg.tensors[name] = total
        extra = sorted(set(agg.weights) - set(self.private.weights))
        if extra:
            raise ValueError(f"round {ctx.round + 1}: the clients sent weights {extra} that are not private "
                             f"(private_uploads declares {list(self.private.weights)})")
        for name in self.private.weights:
            agg.weights[name] = self.expected
        # the std of the noise added this round: on the sum (central) or on each client's update (local)
        row = {"dp_clip": clip, "dp_noise_std": std if self.central else self.noise_multiplier * clip}
        below = agg.tensors.pop(BELOW, None)
        if self.adaptive:
            count = float(below.sum()) if below is not None else 0.0
            if self.sigma_b > 0:
                count += float(self._noise(ctx, len(self.private.tensors), (1,), self.sigma_b)[0])
            # (clamped to [0, 1], the range of the fraction it estimates; post-processing: no privacy cost)
            estimate = min(max(count / self.expected + 0.5, 0.0), 1.0)
            self.clip = clip * math.exp(-self.conf.adaptive.lr * (estimate - self.conf.adaptive.quantile))
            row["dp_unclipped_estimate"] = estimate
        return row

    def after_round(self, rounds_done: int) -> dict[str, float]:
        """The epsilon spent after ``rounds_done`` rounds (and local DP's worst participation count)."""
        row = {"dp_epsilon": self.accountant.epsilon(rounds_done)}
        if not self.central:
            row["dp_max_participations"] = float(self.accountant.participations(rounds_done))
        return row

    def exceeds_target(self, next_round: int) -> bool:
        """Whether round ``next_round`` (0-based) would take epsilon above ``target_epsilon``."""
        target = self.conf.target_epsilon
        return target is not None and self.accountant.epsilon(next_round + 1) > target

    def should_stop(self, next_round: int) -> str | None:
        """Why round ``next_round`` (0-based) must not run: its epsilon would exceed the target."""
        if not self.exceeds_target(next_round):
            return None
        target, eps = self.conf.target_epsilon, self.accountant.epsilon(next_round + 1)
        self.stop_reason = (f"target epsilon {target:g} reached: round {next_round + 1} would raise epsilon to "
                            f"{eps:.4g} at delta {self.conf.delta:g}, so the run ends after round {next_round} "
                            f"(epsilon {self.accountant.epsilon(next_round):.4g})")
        return self.stop_reason

    # ------------------------------------------------------------------ bookkeeping

    def summary(self, rounds_done: int) -> dict[str, Any]:
        out: dict[str, Any] = {"dp_mode": self.conf.name, "dp_epsilon": self.accountant.epsilon(rounds_done),
                               "dp_delta": self.conf.delta, "dp_noise_multiplier": self.noise_multiplier,
                               "dp_accountant": self.conf.accountant, "dp_sampling": self.conf.sampling,
                               "dp_final_clip": self.clip}
        if self.adaptive:
            out["dp_update_noise_multiplier"] = self.update_multiplier
        out["stop_reason"] = self.stop_reason or "rounds done"
        return out

    def state_dict(self) -> dict[str, Any]:
        """Adaptive clipping's C, and a deployment's secret cohort seed (on the server's disk only: the
        server draws the cohorts, so it knows them anyway)."""
        return {"clip": self.clip, "noise_multiplier": self.noise_multiplier,
                **({SAMPLING_SEED_KEY: self.seed} if self.secret_seed else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if abs(float(state["noise_multiplier"]) - self.noise_multiplier) > 1e-12:
            raise ValueError(f"the checkpoint's noise multiplier {state['noise_multiplier']} differs from this run's "
                             f"{self.noise_multiplier}")
        kept = state.get(SAMPLING_SEED_KEY)
        if kept is not None and (not self.secret_seed or int(kept) != self.seed):
            raise ValueError("the checkpoint's cohorts were drawn from a secret seed that this run does not use: "
                             "resume it through the Flower ServerApp, which reads the secret back "
                             "(privacy.setup.secret_sampling_seed)")
        if kept is None and self.secret_seed and not self.central:
            raise ValueError("the checkpoint keeps no secret cohort seed (it predates keeping it, or a simulation "
                             "made it): local DP's accountant recounts each client's participations from that seed, "
                             "so it cannot count the rounds already run; start the deployment afresh")
        self.clip = float(state["clip"])
