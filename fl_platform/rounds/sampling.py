"""Which clients take part in a round: a pure function of (seed, round).

``fixed`` (the default): exactly ``clients_per_round`` of the ``num_clients`` clients, drawn
uniformly without replacement. ``poisson``: each client independently with probability
q = clients_per_round / num_clients, so a round has ``clients_per_round`` clients on average (and
may have none); the sampling that DP accounting with add/remove neighbours assumes
(``privacy.sampling``, docs/privacy.md).
"""

from __future__ import annotations

import numpy as np

from fl_platform.seeding import Stream, numpy_rng

SAMPLINGS = ("fixed", "poisson")


def sample_clients(seed: int, round: int, num_clients: int, clients_per_round: int,
                   sampling: str = "fixed") -> tuple[int, ...]:
    if not 0 < clients_per_round <= num_clients:
        raise ValueError(f"clients_per_round must be in 1..num_clients={num_clients}, got {clients_per_round}")
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")
    if clients_per_round == num_clients:
        return tuple(range(num_clients))
    rng = numpy_rng(seed, Stream.SAMPLING, round)
    if sampling == "poisson":
        return tuple(int(c) for c in np.flatnonzero(rng.random(num_clients) < clients_per_round / num_clients))
    chosen = rng.choice(num_clients, size=clients_per_round, replace=False)
    return tuple(int(c) for c in np.sort(chosen))
