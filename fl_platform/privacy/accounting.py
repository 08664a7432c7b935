"""Privacy accounting with Google's ``dp-accounting`` (RDP and PLD), from the run's real sampling.

Which event models a round (docs/privacy.md, "What is guaranteed"):

* central DP, ``sampling=poisson`` (each client takes part independently with q = K/N): a
  Poisson-subsampled Gaussian with noise multiplier z, under the add/remove-one-client relation
  (the sum of clipped updates changes by at most C when one client is added or removed);
* central DP, ``sampling=fixed`` (exactly K of N without replacement): a Gaussian subsampled
  without replacement, under the replace-one-client relation (N is public). Replacing one client's
  update by another moves the sum by up to 2C, so the event's noise multiplier is z/2.
  dp-accounting computes this event with RDP only (Wang et al. 2019); PLD is refused for it unless
  every client takes part every round (K = N: no subsampling). With K = N the event is the plain
  Gaussian under replace-one, and dp-accounting's two accountants read that relation differently:
  its PLD doubles the sensitivity itself for REPLACE_ONE (``GaussianPrivacyLoss``, adjacency
  REPLACE), its RDP ignores the relation for a ``GaussianDpEvent``; so PLD is given z, RDP z/2;
* local DP: each client's own Gaussian (std z C, sensitivity 2C: any two clipped updates), composed
  over the rounds it took part in, without amplification (the server sees who takes part): the
  epsilon reported is the worst client's, from the sampler's actual draws.

RDP: the event's RDP curve is computed once; r rounds are r times it (what dp-accounting's own
composition does), converted with ``rdp_privacy_accountant.compute_epsilon``. PLD: the accountant
composes one round at a time (about 0.1-5 s per round, the price of its tighter epsilon). Its
discretised privacy-loss distribution grows as the noise shrinks; ``check_pld_size`` refuses, before
anything is allocated, a run or a calibration whose distribution would exceed ``PLD_MAX_POINTS``.
"""

from __future__ import annotations

import contextlib
import functools
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
                sampling: str, accountant: str) -> tuple[dpa.DpEvent, Relation]:
    """The DpEvent of one round of central DP for ``accountant``, and the neighbouring relation it is
    stated under (the module docstring: K = N under replace-one differs between RDP and PLD)."""
    if mode != "central":
        raise ValueError("round_event is for central DP; local DP composes each client's own Gaussian")
    z = float(noise_multiplier)
    if sampling == "poisson":
        return dpa.PoissonSampledDpEvent(clients_per_round / num_clients, dpa.GaussianDpEvent(z)), \
            Relation.ADD_OR_REMOVE_ONE
    if clients_per_round == num_clients:  # replace-one, no subsampling: the sum moves by up to 2C
        return dpa.GaussianDpEvent(z if accountant == "pld" else z / 2), Relation.REPLACE_ONE
    gaussian = dpa.GaussianDpEvent(z / 2)  # replace-one: the sum moves by up to 2C (RDP only, check_covered)
    return dpa.SampledWithoutReplacementDpEvent(num_clients, clients_per_round, gaussian), Relation.REPLACE_ONE


#: The largest privacy-loss distribution (points of its discretised pmf) the PLD accountant may build:
#: about 1 GB of peak memory at dp-accounting's default discretisation (1e-4).
PLD_MAX_POINTS = 4_000_000
_PLD_INTERVAL = 1e-4  # dp-accounting's PLDAccountant value_discretization_interval (its default, used here)
_PLD_TAIL = 10.0  # its Gaussian PLD keeps x within about 10 standard deviations (log mass truncation -50)


def pld_points(noise_multiplier: float, rounds: int, *, replace_one: bool) -> float:
    """An upper estimate of the points of the PLD after ``rounds`` rounds of a Gaussian with multiplier z
    (sensitivity 2C under replace-one, else C): one round spans 2 x 10 x sensitivity / z in privacy
    loss; composition widens it by about sqrt(rounds) (measured: x 3.4 after 16 rounds, bound 1.5 x 4)."""
    sensitivity = 2.0 if replace_one else 1.0
    return 2 * _PLD_TAIL * sensitivity / float(noise_multiplier) / _PLD_INTERVAL * min(rounds, 1.5 * math.sqrt(rounds))


def pld_min_noise(rounds: int, *, replace_one: bool) -> float:
    """The smallest noise multiplier whose PLD over ``rounds`` rounds stays within ``PLD_MAX_POINTS``."""
    return pld_points(1.0, rounds, replace_one=replace_one) / PLD_MAX_POINTS


def check_pld_size(mode: str, accountant: str, noise_multiplier: float, rounds: int, num_clients: int,
                   clients_per_round: int, sampling: str) -> None:
    """Refuse (naming the keys) a PLD accounting whose distribution would exceed ``PLD_MAX_POINTS``."""
    if accountant != "pld" or not noise_multiplier > 0 or rounds < 1:
        return
    replace_one = mode == "local" or sampling != "poisson"
    points = pld_points(noise_multiplier, rounds, replace_one=replace_one)
    if points > PLD_MAX_POINTS:
        raise UncoveredConfiguration(
            f"privacy.accountant=pld with privacy.noise_multiplier={noise_multiplier:g} over {rounds} rounds would "
            f"build a privacy-loss distribution of about {points:.3g} points (more than {PLD_MAX_POINTS:.0e}, "
            f"a GB of memory or more): use privacy.accountant=rdp, or a noise multiplier of at least "
            f"{pld_min_noise(rounds, replace_one=replace_one):.3g}")


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


@functools.lru_cache(maxsize=64)
def _rdp_of_one_round(mode: str, noise_multiplier: float, num_clients: int, clients_per_round: int,
                      sampling: str) -> tuple[np.ndarray, np.ndarray]:
    """(orders, RDP of one round at each order): computed once per mechanism and sampler in a process
    (~0.1 s: a sweep's seeds, a test module's runs share it); read-only, a round count multiplies it."""
    event, relation = round_event(mode, noise_multiplier, num_clients, clients_per_round, sampling, "rdp")
    acc = fresh_accountant("rdp", relation)
    if not acc.supports(event):
        raise UncoveredConfiguration(f"dp-accounting's RDP accountant does not support {event}")
    acc.compose(event)
    orders, per_round = np.array(acc.orders, dtype=float), np.array(acc.rdp, dtype=float)
    orders.flags.writeable = per_round.flags.writeable = False
    return orders, per_round


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
        event, relation = round_event(self.mode, self.z, self.num_clients, self.clients_per_round, self.sampling,
                                      self.kind)
        if self.kind == "rdp":
            if self._rdp is None:
                self._rdp = _rdp_of_one_round(self.mode, self.z, self.num_clients, self.clients_per_round,
                                              self.sampling)
            orders, per_round = self._rdp
            return float(rdp_privacy_accountant.compute_epsilon(orders, rounds * per_round, self.delta)[0])
        check_pld_size(self.mode, self.kind, self.z, rounds, self.num_clients, self.clients_per_round, self.sampling)
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
        check_pld_size(self.mode, self.kind, self.z, m, self.num_clients, self.clients_per_round, self.sampling)
        return _epsilon_of(fresh_accountant(self.kind, Relation.ADD_OR_REMOVE_ONE), local_event(self.z, m), self.delta)

    def participations(self, rounds: int) -> int:
        """Local DP: the most rounds any one client took part in among the first ``rounds``."""
        self.epsilon(rounds)
        return self._max_counts[rounds] if self.mode == "local" and self.private else 0


def _pld_bracket(epsilon: Callable[[float], float], target: float, rounds: int, composed: int, *,
                 replace_one: bool, rdp_z: float) -> mechanism_calibration.BracketInterval:
    """An interval around PLD's noise multiplier, from RDP's (an upper bound: PLD's epsilon is the tighter),
    that never goes below the smallest z whose distribution fits ``PLD_MAX_POINTS``: each trial of the
    search builds a distribution, and one at a tiny z would take tens of GB (K = N, z = 0.005: 61 GiB)."""
    floor = pld_min_noise(composed, replace_one=replace_one)
    if rdp_z < floor:  # PLD's z is at most RDP's (its epsilon is the tighter bound): below the floor too
        lower = floor
    else:
        upper = max(rdp_z, 2 * floor)
        if epsilon(upper) > target:  # (not seen: PLD above RDP) search upwards from there
            return mechanism_calibration.LowerEndpointAndGuess(upper, 2 * upper)
        lower = upper
    while lower > floor:
        lower = max(floor, lower / 1.5)
        if epsilon(lower) > target:
            return mechanism_calibration.ExplicitBracketInterval(lower, upper)
        upper = lower
    raise UncoveredConfiguration(
        f"privacy.target_epsilon={target:g} needs a noise multiplier below {floor:.3g}, where privacy.accountant=pld "
        f"over {rounds} rounds would build a privacy-loss distribution of more than {PLD_MAX_POINTS:.0e} points "
        "(a GB of memory or more): use privacy.accountant=rdp")


def noise_multiplier_for(target_epsilon: float, delta: float, rounds: int, *, num_clients: int,
                         clients_per_round: int, sampling: str = "poisson", accountant: str = "rdp",
                         mode: str = "central", seed: int = 0, tol: float = 1e-4) -> float:
    """The smallest noise multiplier (within ``tol``, rounded up) whose epsilon after ``rounds`` rounds
    is <= ``target_epsilon`` at ``delta``, by dp-accounting's ``calibrate_dp_mechanism``.

    Local DP counts the worst client's participations in the sampler's draws of this ``seed``. PLD's
    search is bracketed by RDP's answer and never tries a z whose distribution exceeds
    ``PLD_MAX_POINTS`` (a target that needs less noise is refused with the reason)."""
    if not target_epsilon > 0:
        raise ValueError(f"privacy.target_epsilon must be > 0, got {target_epsilon}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    check_covered(mode, accountant, sampling, num_clients, clients_per_round)
    if mode == "local":
        m = Accountant(mode, accountant, 1.0, delta, num_clients, clients_per_round, sampling, seed).participations(rounds)

        def make_event(z: float) -> dpa.DpEvent:
            return local_event(z, m)

        relation, composed = Relation.ADD_OR_REMOVE_ONE, m
    else:
        relation = round_event(mode, 1.0, num_clients, clients_per_round, sampling, accountant)[1]

        def make_event(z: float) -> dpa.DpEvent:
            return dpa.SelfComposedDpEvent(
                round_event(mode, z, num_clients, clients_per_round, sampling, accountant)[0], rounds)

        composed = rounds
    make: Callable[[], dpa.PrivacyAccountant] = lambda: fresh_accountant(accountant, relation)  # noqa: E731

    def epsilon(z: float) -> float:
        acc = make()
        acc.compose(make_event(z))
        return float(acc.get_epsilon(delta))

    with _quiet():
        if accountant == "pld":
            bracket = _pld_bracket(epsilon, target_epsilon, rounds, composed,
                                   replace_one=mode == "local" or sampling != "poisson",
                                   rdp_z=noise_multiplier_for(target_epsilon, delta, rounds, num_clients=num_clients,
                                                              clients_per_round=clients_per_round, sampling=sampling,
                                                              accountant="rdp", mode=mode, seed=seed, tol=tol))
        else:  # (from 0.01: dp-accounting's sampled-without-replacement RDP divides by the noise multiplier)
            bracket = mechanism_calibration.LowerEndpointAndGuess(0.01, 1.0)
        z = float(mechanism_calibration.calibrate_dp_mechanism(make, make_event, target_epsilon, delta, bracket,
                                                               tol=tol))
        z = math.ceil(z / tol) * tol  # the privacy-safe side of the tolerance
        for _ in range(100):  # Brent's answer is within tol of the optimum, on either side: make sure
            if epsilon(z) <= target_epsilon:
                return z
            z += tol
    raise RuntimeError(f"no noise multiplier near {z:g} reaches epsilon {target_epsilon} at delta {delta}")
