"""Client partitions as two integer arrays, and the partitioners that build them.

A partition is CSR-like: client ``c`` owns ``indices[offsets[c]:offsets[c + 1]]`` (positions in the
training arrays). 100,000 clients cost two int64 arrays, never 100,000 Python objects, and every
partitioner below is vectorised numpy (argsort / bincount / cumsum) plus loops over classes.

Each partitioner is a pure function of its arguments: randomness comes from
``np.random.default_rng(seed)``, never from the global RNG, so a run's partition can be rebuilt
from (name, labels, num_clients, seed, params) and is also saved with the run.
"""

from __future__ import annotations

import inspect
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(eq=False)
class Partition:
    """Client ``c`` owns ``indices[offsets[c]:offsets[c + 1]]``."""

    indices: np.ndarray
    offsets: np.ndarray

    def __post_init__(self) -> None:
        self.indices = np.ascontiguousarray(self.indices, dtype=np.int64).reshape(-1)
        self.offsets = np.ascontiguousarray(self.offsets, dtype=np.int64).reshape(-1)
        if len(self.offsets) < 1 or self.offsets[0] != 0 or self.offsets[-1] != len(self.indices):
            raise ValueError(
                f"offsets must start at 0 and end at len(indices)={len(self.indices)}, "
                f"got {self.offsets[:1].tolist()}..{self.offsets[-1:].tolist()}"
            )
        if np.any(np.diff(self.offsets) < 0):
            raise ValueError("offsets must be non-decreasing")

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def from_sizes(cls, order: np.ndarray, sizes: np.ndarray) -> Partition:
        """Cut ``order`` into consecutive runs of ``sizes``."""
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        return cls(np.asarray(order, dtype=np.int64)[: offsets[-1]], offsets)

    @classmethod
    def from_assignment(cls, owner: np.ndarray, num_clients: int) -> Partition:
        """Build from a client id per sample (``-1`` = unassigned); each client keeps ascending order."""
        owner = np.asarray(owner, dtype=np.int64)
        keep = np.flatnonzero(owner >= 0)
        order = keep[np.argsort(owner[keep], kind="stable")]
        return cls.from_sizes(order, np.bincount(owner[keep], minlength=num_clients)[:num_clients])

    # --- queries ------------------------------------------------------------------------------
    @property
    def num_clients(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_samples(self) -> int:
        """Samples assigned to some client (the data set may hold more)."""
        return len(self.indices)

    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def client(self, c: int) -> np.ndarray:
        """Indices of client ``c`` (a view, no copy)."""
        if not -self.num_clients <= c < self.num_clients:
            raise IndexError(f"client {c} out of range for {self.num_clients} clients")
        c %= self.num_clients
        return self.indices[self.offsets[c] : self.offsets[c + 1]]

    def owners(self) -> np.ndarray:
        """The client id of each entry of ``indices``."""
        return np.repeat(np.arange(self.num_clients, dtype=np.int64), self.sizes())

    def label_counts(self, labels: np.ndarray, num_classes: int | None = None) -> np.ndarray:
        """(num_clients, num_classes) sample counts, in one bincount."""
        labels = np.asarray(labels, dtype=np.int64)[self.indices]
        if num_classes is None:
            num_classes = int(labels.max()) + 1 if len(labels) else 0
        flat = self.owners() * num_classes + labels
        return np.bincount(flat, minlength=self.num_clients * num_classes).reshape(
            self.num_clients, num_classes
        )

    def validate(self, num_samples: int, complete: bool = False) -> None:
        """Raise ValueError unless indices are in range and disjoint (and, if ``complete``, cover all)."""
        if len(self.indices) and (self.indices.min() < 0 or self.indices.max() >= num_samples):
            raise ValueError(f"partition indices outside [0, {num_samples})")
        # Strictly increasing indices (natural partitions of sorted groups) are disjoint: no count
        # per sample needed (an int64 array as long as the data set).
        if len(self.indices) > 1 and not np.all(self.indices[1:] > self.indices[:-1]):
            hits = np.bincount(self.indices, minlength=num_samples)
            if hits.max() > 1:
                raise ValueError(
                    f"partition is not disjoint: {int((hits > 1).sum())} samples owned by several clients"
                )
        if complete and len(self.indices) != num_samples:
            raise ValueError(f"partition covers {len(self.indices)} of {num_samples} samples")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Partition):
            return NotImplemented
        return np.array_equal(self.offsets, other.offsets) and np.array_equal(self.indices, other.indices)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Partition(num_clients={self.num_clients}, num_samples={self.num_samples})"

    # --- persistence --------------------------------------------------------------------------
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write ``indices`` and ``offsets`` to an .npz, atomically (temp file + os.replace)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                np.savez(fh, indices=self.indices, offsets=self.offsets)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Partition:
        with np.load(path, allow_pickle=False) as data:
            return cls(data["indices"], data["offsets"])


# --- input checks ----------------------------------------------------------------------------
def _as_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be one-dimensional, got shape {labels.shape}")
    return labels


def _check_clients(num_clients: int, num_samples: int, per_client: int = 1, what: str = "") -> None:
    if int(num_clients) != num_clients or num_clients < 1:
        raise ValueError(f"num_clients must be a positive integer, got {num_clients!r}")
    if num_clients > num_samples:
        raise ValueError(
            f"num_clients={num_clients} is more than the {num_samples} samples: some clients would be empty"
        )
    if num_clients * per_client > num_samples:
        raise ValueError(
            f"num_clients={num_clients} x {what}={per_client} = {num_clients * per_client} "
            f"is more than the {num_samples} samples"
        )


def _allocate(num_samples: int, weights: np.ndarray, minimum: int = 1) -> np.ndarray:
    """Integer sizes >= ``minimum`` summing to ``num_samples``, proportional to ``weights`` (largest remainder)."""
    spare = num_samples - minimum * len(weights)
    share = spare * weights / weights.sum()
    sizes = np.floor(share).astype(np.int64)
    left = spare - int(sizes.sum())
    if left > 0:
        sizes[np.argsort(sizes - share, kind="stable")[:left]] += 1
    return sizes + minimum


def _class_sorted(labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Sample positions sorted by label, in random order within each label."""
    return np.lexsort((rng.random(len(labels)), labels))


# --- partitioners ----------------------------------------------------------------------------
def iid(labels: np.ndarray, num_clients: int, seed: int) -> Partition:
    """Random split into equal sizes (the first ``n % num_clients`` clients get one more)."""
    n = len(_as_labels(labels))
    _check_clients(num_clients, n)
    rng = np.random.default_rng(seed)
    sizes = np.full(num_clients, n // num_clients, dtype=np.int64)
    sizes[: n % num_clients] += 1
    return Partition.from_sizes(rng.permutation(n), sizes)


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    seed: int,
    alpha: float = 0.5,
    min_size: int = 10,
    max_retries: int = 100,
) -> Partition:
    """Label skew: each class is split over clients by proportions ~ Dir(alpha) (LDA partition).

    As in the NIID-bench/FedML reference, a client that already holds its fair share n/num_clients
    gets no more of the next classes, and the draw is repeated until every client has ``min_size``
    samples. Smaller alpha means more skew. Covers all samples.
    """
    labels = _as_labels(labels)
    n = len(labels)
    if not alpha > 0:
        raise ValueError(f"dirichlet: alpha must be > 0, got alpha={alpha}")
    if min_size < 0:
        raise ValueError(f"dirichlet: min_size must be >= 0, got {min_size}")
    _check_clients(num_clients, n, min_size, "min_size")
    rng = np.random.default_rng(seed)
    classes, class_sizes = np.unique(labels, return_counts=True)
    fair = n / num_clients
    concentration = np.full(num_clients, float(alpha))
    alloc = np.empty((len(classes), num_clients), dtype=np.int64)
    best = 0
    for _attempt in range(max(1, max_retries)):
        held = np.zeros(num_clients, dtype=np.int64)
        for k, nk in enumerate(class_sizes):
            p = rng.dirichlet(concentration)
            masked = np.where(held < fair, p, 0.0)
            total = masked.sum()
            p = masked / total if total > 0 else p / p.sum()
            cuts = np.clip((np.cumsum(p)[:-1] * nk).astype(np.int64), 0, nk)
            alloc[k] = np.diff(cuts, prepend=0, append=nk)
            held += alloc[k]
        if held.min() >= min_size:
            break
        best = max(best, int(held.min()))
    else:
        raise ValueError(
            f"dirichlet: could not give every one of {num_clients} clients >= min_size={min_size} samples "
            f"in {max_retries} draws with alpha={alpha} ({n} samples; the best draw's smallest client had "
            f"{best}); use a larger alpha, a smaller min_size or fewer clients"
        )
    order = _class_sorted(labels, rng)
    owner = np.concatenate([np.repeat(np.arange(num_clients), row) for row in alloc])
    return Partition.from_assignment(_scatter(owner, order, n), num_clients)


def _scatter(owner_in_order: np.ndarray, order: np.ndarray, n: int) -> np.ndarray:
    """Client id per sample from client ids listed along ``order``."""
    owner = np.empty(n, dtype=np.int64)
    owner[order] = owner_in_order
    return owner


def shards(labels: np.ndarray, num_clients: int, seed: int, classes_per_client: int = 2) -> Partition:
    """Pathological non-IID (McMahan et al.): sort by label, cut into num_clients x k shards, deal k each.

    Shards are dealt at random, then swapped until no client holds two shards of the same class,
    where that is feasible (k <= number of classes, balanced classes). Covers all samples.
    """
    labels = _as_labels(labels)
    n = len(labels)
    k = int(classes_per_client)
    if k < 1:
        raise ValueError(f"shards: classes_per_client must be >= 1, got {classes_per_client}")
    _check_clients(num_clients, n, k, "classes_per_client")
    rng = np.random.default_rng(seed)
    order = _class_sorted(labels, rng)
    num_shards = num_clients * k
    bounds = np.linspace(0, n, num_shards + 1).astype(np.int64)
    shard_label = labels[order][(bounds[:-1] + bounds[1:]) // 2]
    deal = rng.permutation(num_shards).reshape(num_clients, k)
    if k > 1 and len(np.unique(labels)) >= k:
        _repair_duplicates(deal, shard_label, rng)
    shard_owner = np.empty(num_shards, dtype=np.int64)
    shard_owner[deal.reshape(-1)] = np.repeat(np.arange(num_clients), k)
    owner_in_order = np.repeat(shard_owner, np.diff(bounds))
    return Partition.from_assignment(_scatter(owner_in_order, order, n), num_clients)


def _duplicated_rows(deal: np.ndarray, shard_label: np.ndarray) -> np.ndarray:
    labs = np.sort(shard_label[deal], axis=1)
    return np.flatnonzero((labs[:, 1:] == labs[:, :-1]).any(axis=1))


def _repair_duplicates(
    deal: np.ndarray, shard_label: np.ndarray, rng: np.random.Generator, passes: int = 50
) -> None:
    """Swap shards between clients (in place) until no client has a class twice, or give up."""
    num_clients, k = deal.shape
    for _ in range(passes):
        bad = _duplicated_rows(deal, shard_label)
        if len(bad) == 0:
            return
        for c in bad:
            labs = shard_label[deal[c]].tolist()
            slot = next((j for j in range(k) if labs[j] in labs[:j]), None)
            if slot is None:  # already fixed as another client's swap partner in this pass
                continue
            keep_c = set(labs[:slot] + labs[slot + 1 :])
            for pos in rng.integers(0, num_clients * k, size=64):
                d, s = divmod(int(pos), k)
                if d == c:
                    continue
                labs_d = shard_label[deal[d]].tolist()
                mine, theirs = labs[slot], labs_d[s]
                if theirs not in keep_c and mine not in set(labs_d[:s] + labs_d[s + 1 :]):
                    deal[c, slot], deal[d, s] = deal[d, s], deal[c, slot]
                    break


def power_law(labels: np.ndarray, num_clients: int, seed: int, exponent: float = 1.5) -> Partition:
    """Quantity skew: sizes proportional to Pareto(exponent) weights (>= 1 sample each), IID labels.

    Weights follow the classical Pareto law with density ~ w^-(exponent+1), w >= 1: a smaller
    exponent gives a heavier tail (a few very large clients). Covers all samples.
    """
    n = len(_as_labels(labels))
    if not exponent > 0:
        raise ValueError(f"power_law: exponent must be > 0, got exponent={exponent}")
    _check_clients(num_clients, n)
    rng = np.random.default_rng(seed)
    weights = rng.pareto(exponent, num_clients) + 1.0
    return Partition.from_sizes(rng.permutation(n), _allocate(n, weights))


def lognormal(labels: np.ndarray, num_clients: int, seed: int, sigma: float = 1.0) -> Partition:
    """Quantity skew with sizes proportional to lognormal(0, sigma) weights (>= 1 sample each), IID labels."""
    n = len(_as_labels(labels))
    if not sigma >= 0:
        raise ValueError(f"lognormal: sigma must be >= 0, got sigma={sigma}")
    _check_clients(num_clients, n)
    rng = np.random.default_rng(seed)
    weights = rng.lognormal(0.0, sigma, num_clients)
    return Partition.from_sizes(rng.permutation(n), _allocate(n, weights))


def natural(groups: np.ndarray, num_clients: int | None = None) -> Partition:
    """One client per natural group (writer, speaker, device), in sorted group-id order.

    With ``num_clients`` only the first that many groups become clients (their samples only); without
    it every group does and all samples are covered.
    """
    groups = np.asarray(groups)
    if groups.ndim != 1:
        raise ValueError(f"natural: groups must be one-dimensional, got shape {groups.shape}")
    # Groups in sorted order (each one run, as Synthetic's devices): the runs' boundaries give the
    # same partition without np.unique's sorted copy and inverse (arrays as long as the data set).
    runs = len(groups) > 1 and bool(np.all(groups[1:] >= groups[:-1]))
    if runs:
        starts = np.flatnonzero(groups[1:] != groups[:-1]) + 1
        num_groups = len(starts) + 1
    else:
        uniq, inverse = np.unique(groups, return_inverse=True)
        num_groups = len(uniq)
    if num_clients is None:
        num_clients = num_groups
    if int(num_clients) != num_clients or num_clients < 1:
        raise ValueError(f"natural: num_clients must be a positive integer, got {num_clients!r}")
    if num_clients > num_groups:
        raise ValueError(
            f"natural: num_clients={num_clients} is more than the {num_groups} groups in the data"
        )
    if runs:
        offsets = np.concatenate([[0], starts, [len(groups)]])[: int(num_clients) + 1]
        return Partition(np.arange(offsets[-1], dtype=np.int64), offsets)
    inverse = inverse.reshape(-1).astype(np.int64)
    inverse[inverse >= num_clients] = -1
    return Partition.from_assignment(inverse, int(num_clients))


def flwr(labels: np.ndarray, num_clients: int, seed: int, partitioner: str = "IidPartitioner",
         options: dict[str, object] | None = None) -> Partition:
    """flwr-datasets' ``partitioner`` class with ``options`` (optional extra; datasets/flwr_interop.py)."""
    from fl_platform.datasets.flwr_interop import flwr_partition

    return flwr_partition(labels, num_clients, seed, partitioner, options)


PARTITIONERS: dict[str, Callable[..., Partition]] = {
    "iid": iid,
    "dirichlet": dirichlet,
    "shards": shards,
    "power_law": power_law,
    "lognormal": lognormal,
    "natural": natural,
    "flwr": flwr,
}


def partition_options(name: str) -> dict[str, object]:
    """The tunable parameters of a partitioner with their defaults."""
    fn = _get(name)
    fixed = {"labels", "num_clients", "seed", "groups"}
    return {p.name: p.default for p in inspect.signature(fn).parameters.values() if p.name not in fixed}


def _get(name: str) -> Callable[..., Partition]:
    try:
        return PARTITIONERS[name]
    except KeyError:
        raise ValueError(
            f"unknown partitioner {name!r}; valid names: {', '.join(sorted(PARTITIONERS))}"
        ) from None


def make_partition(
    name: str,
    labels: np.ndarray,
    num_clients: int | None,
    seed: int,
    groups: np.ndarray | None = None,
    **params: object,
) -> Partition:
    """Dispatch to a partitioner by name; unknown names and parameters fail with the valid choices."""
    fn = _get(name)
    valid = partition_options(name)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise TypeError(
            f"unknown parameter(s) {', '.join(map(repr, unknown))} for partitioner {name!r}; "
            f"valid: {', '.join(sorted(valid)) or '(none)'}"
        )
    if name == "natural":
        if groups is None:
            raise ValueError(
                "partitioner 'natural' needs per-sample group ids (writer/speaker/device); this data has none"
            )
        return natural(groups, num_clients)
    if num_clients is None:
        raise ValueError(f"partitioner {name!r} needs num_clients")
    return fn(labels, num_clients, seed, **params)
