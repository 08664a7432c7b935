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
    TORCH = 3  # torch's global RNG inside a client's training (dropout, an algorithm's noise)
    ALGORITHM = 4  # algorithm-specific draws (e.g. privacy noise, synthetic data)
    COMPRESSION = 5  # random-k indices, stochastic quantisation
    SYSTEM = 6  # simulated client speeds and bandwidths
    FAULT = 7
    AUGMENT = 8  # crops and flips of a client's training minibatches (datasets/augment.py)
    PRIVACY = 9  # differential privacy noise: the server's on the sum, a client's own (fl_platform/privacy)
    LOCAL_TEST = 10  # which of a client's rows form its local test split (eval.local_test_fraction)
    PERSONAL = 11  # minibatch orders of a client's personal model (Ditto's v, FedRep's head phase)
    FINETUNE = 12  # minibatch orders of eval.finetune_steps before a client's evaluation
    VALIDATION = 13  # which of a client's rows form the early-stopping validation split (early_stop.val_fraction)


# numpy's SeedSequence hash constants (numpy/random/bit_generator.pyx).
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R, _MASK = 0xCA01F9DD, 0x4973F715, 0xFFFFFFFF
_POOL = 4


def _hash_constants(count: int, init: int, mult: int) -> list[tuple[int, int]]:
    """(xor, multiply) constants of successive hash calls: SeedSequence's hash constant evolves the
    same way whatever the data, so it can be tabulated once."""
    out = []
    for _ in range(count):
        nxt = init * mult & _MASK
        out.append((init, nxt))
        init = nxt
    return out


def _mixing_constants(n_words: int) -> list[tuple[int, int]]:
    """Constants of the mixing hash calls for ``n_words`` words: one per pool entry, one per ordered
    pair of entries, then one per (further word, entry)."""
    return _hash_constants(_POOL * _POOL + _POOL * max(0, n_words - _POOL), _INIT_A, _MULT_A)


_MAX_WORDS = 16  # derive_seed's tables cover up to 16 words; longer inputs take the general path
_HASH_A = _mixing_constants(_MAX_WORDS)
_HASH_B = _hash_constants(2, _INIT_B, _MULT_B)  # the two output words


def seed_words(seed: int) -> list[int]:
    """``seed`` as SeedSequence reads an integer: its 32-bit words, least significant first, so every bit
    counts (a secret seed of 128 bits keeps 128; a negative seed is taken mod 2**32)."""
    seed = int(seed)
    if seed < 0:
        return [seed & _MASK]
    words = [seed & _MASK]
    while seed > _MASK:
        seed >>= 32
        words.append(seed & _MASK)
    return words


def derive_seed(seed: int, *keys: int) -> int:
    """A 63-bit seed that is a pure function of ``seed`` and the integer ``keys``.

    Equal to ``SeedSequence([seed, *keys mod 2**32]).generate_state(1, uint64) >> 1`` (tested; a seed of
    2**32 or more is its words, ``seed_words``), evaluated with Python integers and tabulated hash
    constants: about 7 us instead of SeedSequence's 10.5, paid twice per client by the training loop (its
    shuffle and torch's RNG).
    """
    words = [*seed_words(seed), *(int(k) & _MASK for k in keys)]
    if len(words) > _MAX_WORDS:
        return int(derive_seeds(*words)[0])
    words += [0] * (_POOL - len(words))
    pool = []
    for w, (xor, mult) in zip(words, _HASH_A):  # the first _POOL words fill the pool
        w = (w ^ xor) * mult & _MASK
        pool.append(w ^ w >> 16)
    consts = iter(_HASH_A[_POOL:])
    for src in range(_POOL):  # every pool entry mixed into every other...
        for dst in range(_POOL):
            if src != dst:
                xor, mult = next(consts)
                v = (pool[src] ^ xor) * mult & _MASK
                r = (_MIX_L * pool[dst] - _MIX_R * (v ^ v >> 16)) & _MASK
                pool[dst] = r ^ r >> 16
    for w in words[_POOL:]:  # ...then each further word into every entry
        for dst in range(_POOL):
            xor, mult = next(consts)
            v = (w ^ xor) * mult & _MASK
            r = (_MIX_L * pool[dst] - _MIX_R * (v ^ v >> 16)) & _MASK
            pool[dst] = r ^ r >> 16
    lo, hi = ((v ^ xor) * mult & _MASK for v, (xor, mult) in zip(pool, _HASH_B))
    return ((hi ^ hi >> 16) << 32 | (lo ^ lo >> 16)) >> 1


def derive_seeds(seed: int, *keys: int | np.ndarray) -> np.ndarray:
    """``derive_seed`` for many keys at once: any key may be an integer array (broadcast).

    The same hash as ``SeedSequence`` (bit-identical, tested), evaluated column-wise in numpy:
    a cohort of 100 clients needs its 100 shuffle seeds in one call instead of 100 SeedSequences
    (about 15 us each, a visible share of a vectorised round).
    """
    words = np.broadcast_arrays(*(np.atleast_1d(np.asarray(k, dtype=np.int64)).astype(np.uint64) & np.uint64(_MASK)
                                  for k in (*seed_words(seed), *keys)))
    shape = words[0].shape
    consts = iter(_mixing_constants(len(words)))

    def hashmix(value: np.ndarray) -> np.ndarray:
        xor, mult = next(consts)
        value = (value ^ np.uint64(xor)) * np.uint64(mult) & np.uint64(_MASK)
        return value ^ (value >> np.uint64(16))

    def mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        r = (np.uint64(_MIX_L) * x - np.uint64(_MIX_R) * y) & np.uint64(_MASK)
        return r ^ (r >> np.uint64(16))

    pool = [hashmix(words[i] if i < len(words) else np.zeros(shape, np.uint64)) for i in range(_POOL)]
    for src in range(_POOL):
        for dst in range(_POOL):
            if src != dst:
                pool[dst] = mix(pool[dst], hashmix(pool[src]))
    for src in range(_POOL, len(words)):
        for dst in range(_POOL):
            pool[dst] = mix(pool[dst], hashmix(words[src]))
    out = []
    for v, (xor, mult) in zip(pool, _HASH_B):  # two 32-bit words make the uint64 state
        v = (v ^ np.uint64(xor)) * np.uint64(mult) & np.uint64(_MASK)
        out.append(v ^ (v >> np.uint64(16)))
    return ((out[1] << np.uint64(32) | out[0]) >> np.uint64(1)).astype(np.int64)


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
