"""Both seed derivations (scalar and vectorised) are bit-identical to numpy's SeedSequence."""

from __future__ import annotations

import numpy as np
import torch

from fl_platform.seeding import Stream, derive_seed, derive_seeds, torch_generator


def seed_sequence(seed: int, *keys: int) -> int:
    """The reference: numpy's SeedSequence of the words mod 2**32, first uint64 of its state, >> 1."""
    ss = np.random.SeedSequence([seed & 0xFFFFFFFF, *(k & 0xFFFFFFFF for k in keys)])
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


def test_derive_seeds_gives_the_shuffle_of_torch_generator():
    seeds = derive_seeds(3, Stream.SHUFFLE, 5, np.arange(4))
    for cid, s in enumerate(seeds):
        gen = torch.Generator()
        gen.manual_seed(int(s))
        assert torch.equal(torch.randperm(50, generator=gen),
                           torch.randperm(50, generator=torch_generator(3, Stream.SHUFFLE, 5, cid)))


def test_derive_seeds_broadcasts_scalars():
    assert derive_seeds(1, 2, 3).tolist() == [derive_seed(1, 2, 3)]
