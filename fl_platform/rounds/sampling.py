"""Which clients take part in a round: a pure function of (seed, round)."""

from __future__ import annotations

import numpy as np

from fl_platform.seeding import Stream, numpy_rng


def sample_clients(seed: int, round: int, num_clients: int, clients_per_round: int) -> tuple[int, ...]:
    if not 0 < clients_per_round <= num_clients:
        raise ValueError(f"clients_per_round must be in 1..num_clients={num_clients}, got {clients_per_round}")
    if clients_per_round == num_clients:
        return tuple(range(num_clients))
    rng = numpy_rng(seed, Stream.SAMPLING, round)
    chosen = rng.choice(num_clients, size=clients_per_round, replace=False)
    return tuple(int(c) for c in np.sort(chosen))
