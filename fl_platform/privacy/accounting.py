"""Privacy accounting with Google's ``dp-accounting`` (RDP and PLD), from the run's real sampling.

Which event models a round (docs/privacy.md, "What is guaranteed"):

* central DP, ``sampling=poisson`` (each client takes part independently with q = K/N): a
  Poisson-subsampled Gaussian with noise multiplier z, under the add/remove-one-client relation
  (the sum of clipped updates changes by at most C when one client is added or removed);
* central DP, ``sampling=fixed`` (exactly K of N without replacement, the platform's sampler): a
  Gaussian subsampled without replacement, under the replace-one-client relation (N is public).
  Replacing one client's update by another moves the sum by up to 2C, so the event's noise
  multiplier is z/2. dp-accounting computes this event with RDP only (Wang et al. 2019); PLD is
  refused for it unless every client takes part every round (K = N: no subsampling);
* local DP: each client's own Gaussian (std z C, sensitivity 2C: any two clipped updates), composed
  over the rounds it took part in, without amplification (the server sees who takes part): the
  epsilon reported is the worst client's, from the sampler's actual draws.

RDP: the event's RDP curve is computed once; r rounds are r times it (what dp-accounting's own
composition does), converted with ``rdp_privacy_accountant.compute_epsilon``. PLD: the accountant
composes one round at a time (about 0.1-1 s per round, the price of its tighter epsilon).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator

import dp_accounting as dpa
import numpy as np
from dp_accounting import mechanism_calibration, pld, rdp
from dp_accounting.rdp import rdp_privacy_accountant

from fl_platform.privacy.config import ACCOUNTANTS
from fl_platform.rounds.sampling import SAMPLINGS, sample_clients

log = logging.getLogger(__name__)

MODES = ("central", "local")
Relation = dpa.NeighboringRelation


class UncoveredConfiguration(ValueError):
    """A setting the accountant does not model (the run would report a wrong epsilon): refused."""


def check_covered(mode: str, accountant: str, sampling: str, num_clients: int, clients_per_round: int) -> None:
    """Refuse (naming the keys) what dp-accounting cannot account for."""
    if mode not in MODES:
        raise UncoveredConfiguration(f"privacy mode must be one of {', '.join(MODES)}, got {mode!r}")
    if accountant not in ACCOUNTANTS:
        raise UncoveredConfiguration(f"privacy.accountant must be one of {', '.join(ACCOUNTANTS)}, got {accountant!r}")
    if sampling not in SAMPLINGS:
        raise UncoveredConfiguration(f"privacy.sampling must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")
    if (mode == "central" and accountant == "pld" and sampling == "fixed"
            and clients_per_round < num_clients):
        raise UncoveredConfiguration(
            f"privacy.accountant=pld cannot account for privacy.sampling=fixed ({clients_per_round} of "
            f"{num_clients} clients drawn without replacement each round): dp-accounting's PLD accountant has no "
            "sampling-without-replacement event, so the amplification by subsampling would go unaccounted; use "
            "privacy.accountant=rdp, or privacy.sampling=poisson (each client takes part independently with "
            "probability clients_per_round / num_clients)")


def round_event(mode: str, noise_multiplier: float, num_clients: int, clients_per_round: int,
                sampling: str) -> tuple[dpa.DpEvent, Relation]:
    """The DpEvent of one round of central DP, and the neighbouring relation it is stated under."""
    if mode != "central":
        raise ValueError("round_event is for central DP; local DP composes each client's own Gaussian")
    z = float(noise_multiplier)
    if sampling == "poisson":
        return dpa.PoissonSampledDpEvent(clients_per_round / num_clients, dpa.GaussianDpEvent(z)), \
            Relation.ADD_OR_REMOVE_ONE
    gaussian = dpa.GaussianDpEvent(z / 2)  # replace-one: the sum moves by up to 2C
    if clients_per_round == num_clients:
        return gaussian, Relation.REPLACE_ONE
    return dpa.SampledWithoutReplacementDpEvent(num_clients, clients_per_round, gaussian), Relation.REPLACE_ONE


def local_event(noise_multiplier: float, participations: int) -> dpa.DpEvent:
    """A client's local Gaussian (std z C, sensitivity 2C) composed over its participations."""
    return dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(float(noise_multiplier) / 2), int(participations))


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """dp-accounting's RDP code logs a warning (through absl) for each fractional order whose series does
    not converge, and leaves that order out of the minimum: a looser bound, never a wrong one. Not news
    for every round of a run."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def fresh_accountant(accountant: str, relation: Relation) -> dpa.PrivacyAccountant:
    if accountant == "rdp":
        return rdp.RdpAccountant(neighboring_relation=relation)
    return pld.PLDAccountant(neighboring_relation=relation)


def _epsilon_of(acc: dpa.PrivacyAccountant, event: dpa.DpEvent, delta: float) -> float:
    if not acc.supports(event):
        raise UncoveredConfiguration(f"dp-accounting's {type(acc).__name__} does not support {event}")
    acc.compose(event)
    return float(acc.get_epsilon(delta))


class Accountant:
    """Epsilon at ``delta`` after r rounds, for the run's mechanism and sampler (memoised per r)."""

    def __init__(self, mode: str, accountant: str, noise_multiplier: float, delta: float, num_clients: int,
                 clients_per_round: int, sampling: str, seed: int) -> None:
        check_covered(mode, accountant, sampling, num_clients, clients_per_round)
        if not 0 < delta < 1:
            raise ValueError(f"privacy.delta must be in (0, 1), got {delta}")
        self.mode, self.kind, self.z, self.delta = mode, accountant, float(noise_multiplier), float(delta)
        self.num_clients, self.clients_per_round, self.sampling, self.seed = \
            num_clients, clients_per_round, sampling, seed
        self._eps: list[float] = [0.0]  # epsilon after r rounds, r = 0, 1, ...
        self._rdp: tuple[np.ndarray, np.ndarray] | None = None
        self._pld: dpa.PrivacyAccountant | None = None
        self._counts: np.ndarray | None = None  # local DP: each client's participations so far
        self._max_counts: list[int] = [0]

    @property
    def private(self) -> bool:
        return self.z > 0

    def epsilon(self, rounds: int) -> float:
        """Epsilon after ``rounds`` rounds (inf without noise)."""
        if rounds <= 0:
            return 0.0
        if not self.private:
            return math.inf
        with _quiet():
            while len(self._eps) <= rounds:
                self._eps.append(self._next(len(self._eps)))
        return self._eps[rounds]

    def _next(self, rounds: int) -> float:
        if self.mode == "local":
            return self._local(rounds)
        event, relation = round_event(self.mode, self.z, self.num_clients, self.clients_per_round, self.sampling)
        if self.kind == "rdp":
            if self._rdp is None:
                acc = fresh_accountant("rdp", relation)
                if not acc.supports(event):
                    raise UncoveredConfiguration(f"dp-accounting's RDP accountant does not support {event}")
                acc.compose(event)
                self._rdp = (acc.orders, acc.rdp)
            orders, per_round = self._rdp
            return float(rdp_privacy_accountant.compute_epsilon(orders, rounds * per_round, self.delta)[0])
        if self._pld is None:
            self._pld = fresh_accountant("pld", relation)
        return _epsilon_of(self._pld, event, self.delta)  # composes one more round

    def _local(self, rounds: int) -> float:
        """The worst client's epsilon: its Gaussian composed over its participations in rounds 0..r-1."""
        if self._counts is None:
            self._counts = np.zeros(self.num_clients, dtype=np.int64)
        while len(self._max_counts) <= rounds:
            r = len(self._max_counts) - 1
            clients = sample_clients(self.seed, r, self.num_clients, self.clients_per_round, self.sampling)
            self._counts[list(clients)] += 1
            self._max_counts.append(int(self._counts.max()))
        m = self._max_counts[rounds]
        if m == 0:
            return 0.0
        return _epsilon_of(fresh_accountant(self.kind, Relation.ADD_OR_REMOVE_ONE), local_event(self.z, m), self.delta)

    def participations(self, rounds: int) -> int:
        """Local DP: the most rounds any one client took part in among the first ``rounds``."""
        self.epsilon(rounds)
        return self._max_counts[rounds] if self.mode == "local" and self.private else 0


def noise_multiplier_for(target_epsilon: float, delta: float, rounds: int, *, num_clients: int,
                         clients_per_round: int, sampling: str = "fixed", accountant: str = "rdp",
                         mode: str = "central", seed: int = 0, tol: float = 1e-4) -> float:
    """The smallest noise multiplier (within ``tol``, rounded up) whose epsilon after ``rounds`` rounds
    is <= ``target_epsilon`` at ``delta``, by dp-accounting's ``calibrate_dp_mechanism``.

    Local DP counts the worst client's participations in the sampler's draws of this ``seed``."""
    if not target_epsilon > 0:
        raise ValueError(f"privacy.target_epsilon must be > 0, got {target_epsilon}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    check_covered(mode, accountant, sampling, num_clients, clients_per_round)
    if mode == "local":
        m = Accountant(mode, accountant, 1.0, delta, num_clients, clients_per_round, sampling, seed).participations(rounds)

        def make_event(z: float) -> dpa.DpEvent:
            return local_event(z, m)

        relation = Relation.ADD_OR_REMOVE_ONE
    else:
        relation = round_event(mode, 1.0, num_clients, clients_per_round, sampling)[1]

        def make_event(z: float) -> dpa.DpEvent:
            return dpa.SelfComposedDpEvent(round_event(mode, z, num_clients, clients_per_round, sampling)[0], rounds)

    make: Callable[[], dpa.PrivacyAccountant] = lambda: fresh_accountant(accountant, relation)  # noqa: E731
    with _quiet():
        z = float(mechanism_calibration.calibrate_dp_mechanism(
            make, make_event, target_epsilon, delta,
            # (from 0.01: dp-accounting's sampled-without-replacement RDP divides by the noise multiplier)
            mechanism_calibration.LowerEndpointAndGuess(0.01, 1.0), tol=tol))
        z = math.ceil(z / tol) * tol  # the privacy-safe side of the tolerance
        for _ in range(100):  # Brent's answer is within tol of the optimum, on either side: make sure
            acc = make()
            acc.compose(make_event(z))
            if acc.get_epsilon(delta) <= target_epsilon:
                return z
            z += tol
    raise RuntimeError(f"no noise multiplier near {z:g} reaches epsilon {target_epsilon} at delta {delta}")
