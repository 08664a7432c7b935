"""The vectorised seed derivation is bit-identical to the SeedSequence reference."""

from __future__ import annotations

import numpy as np
import torch

from fl_platform.seeding import Stream, derive_seed, derive_seeds, torch_generator


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
