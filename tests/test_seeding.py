"""Both seed derivations (scalar and vectorised) are bit-identical to numpy's SeedSequence."""

from __future__ import annotations

import numpy as np
import torch

from fl_platform.seeding import Stream, derive_seed, derive_seeds, torch_generator


def seed_sequence(seed: int, *keys: int) -> int:
    """The reference: numpy's SeedSequence of the seed (a negative one mod 2**32; a large one, numpy splits
    into 32-bit words) and the keys mod 2**32, first uint64 of its state, >> 1."""
    ss = np.random.SeedSequence([seed if seed >= 0 else seed & 0xFFFFFFFF, *(k & 0xFFFFFFFF for k in keys)])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def test_derive_seed_equals_seed_sequence_for_every_key_count():
    rng = np.random.default_rng(1)
    for n_keys in [*range(9), 15, 16, 20]:  # around SeedSequence's pool of 4 and derive_seed's tables of 16
        for _ in range(50):
            seed = int(rng.integers(-(2**62), 2**62))
            keys = [int(k) for k in rng.integers(-(2**40), 2**40, n_keys)]
            assert derive_seed(seed, *keys) == seed_sequence(seed, *keys), (seed, keys)
    assert derive_seed(0) == seed_sequence(0)


def test_derive_seeds_equals_derive_seed_for_every_key_count():
    rng = np.random.default_rng(0)
    for n_keys in range(7):  # fewer, as many as and more words than SeedSequence's pool of 4
        for _ in range(20):
            seed = int(rng.integers(0, 2**40))
            keys = [int(k) for k in rng.integers(-(2**33), 2**33, n_keys)]
            clients = rng.integers(0, 2**31, 9)
            got = derive_seeds(seed, *keys, clients)
            assert got.tolist() == [derive_seed(seed, *keys, int(c)) for c in clients]
    secret = (0x9E3779B97F4A7C15 << 64) | 12345  # 128 bits (a deployment's secret sampling seed)
    assert derive_seeds(secret, 1, np.arange(3)).tolist() == [derive_seed(secret, 1, c) for c in range(3)]


def test_every_bit_of_a_large_seed_counts():
    """A deployment's secret sampling seed has 128 bits: seeds that agree in their low 32 bits (or 64) still
    give other streams and other cohorts (taken mod 2**32, a client that learns its own rounds could search
    the 2**32 candidates and predict every cohort)."""
    low = 0xDEADBEEF
    seeds = [low, low + 2**32, low + 2**64, low + 2**127]
    derived = {derive_seed(s, Stream.SAMPLING, 3) for s in seeds}
    assert len(derived) == len(seeds)
    assert len({int(derive_seeds(s, Stream.SAMPLING, 3)[0]) for s in seeds}) == len(seeds)
    for s in seeds[1:]:
        assert derive_seed(s, 1, 2) == seed_sequence(s, 1, 2)
    from fl_platform.rounds.sampling import sample_clients

    cohorts = {tuple(sample_clients(s, 0, 1000, 10)) for s in seeds}
    assert len(cohorts) == len(seeds)


def test_derive_seeds_gives_the_shuffle_of_torch_generator():
    seeds = derive_seeds(3, Stream.SHUFFLE, 5, np.arange(4))
    for cid, s in enumerate(seeds):
        gen = torch.Generator()
        gen.manual_seed(int(s))
        assert torch.equal(torch.randperm(50, generator=gen),
                           torch.randperm(50, generator=torch_generator(3, Stream.SHUFFLE, 5, cid)))


def test_derive_seeds_broadcasts_scalars():
    assert derive_seeds(1, 2, 3).tolist() == [derive_seed(1, 2, 3)]
