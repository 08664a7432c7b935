"""Every random draw derives from (seed, round, client id, stream).

Results therefore do not depend on how clients are spread over workers or in which order
workers finish: a client's shuffle is the same whichever process trains it.
"""

from __future__ import annotations

import enum

import numpy as np
import torch


class Stream(enum.IntEnum):
    """Independent purposes that must never share a random stream."""

    INIT = 0  # global model initialisation
    SAMPLING = 1  # which clients take part in a round
    SHUFFLE = 2  # a client's minibatch order
    TORCH = 3  # torch's global RNG inside a client's training (dropout, augmentation, noise)
    ALGORITHM = 4  # algorithm-specific draws (e.g. privacy noise, synthetic data)
    COMPRESSION = 5  # random-k indices, stochastic quantisation
    SYSTEM = 6  # simulated client speeds and bandwidths
    FAULT = 7


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed that is a pure function of ``seed`` and the integer ``keys``."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, *(int(k) & 0xFFFFFFFF for k in keys)])
    return int(ss.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def numpy_rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, *keys))


def torch_generator(seed: int, *keys: int, device: str | torch.device = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(seed, *keys))
    return gen


def seed_torch_global(seed: int, *keys: int) -> None:
    """Seed torch's global RNG (CPU and CUDA) for code we do not control, e.g. dropout.

    Same effect as ``torch.manual_seed`` on CPU and CUDA, without its cost where CUDA is absent:
    there ``torch.manual_seed`` records a stack trace for a lazy CUDA call (about 0.5 ms, paid
    once per client by the training loop).
    """
    s = derive_seed(seed, *keys)
    torch.default_generator.manual_seed(s)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(s)
