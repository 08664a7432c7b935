"""Messages that travel between the server half and the client half of an algorithm.

The same dataclasses are used by the inline engine, the Ray workers and the Flower apps, so
an algorithm is written once against them (DESIGN.md section 9).
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class RoundContext:
    """Everything a round needs to know, frozen so no part changes it half-way."""

    round: int
    seed: int
    clients: tuple[int, ...]
    num_rounds: int
    num_clients: int


@dataclass
class Broadcast:
    """What the server sends every sampled client this round, built once, shipped once per worker.

    ``tensors`` always holds ``weights`` (the flat global model vector); ``scalars`` holds round-level
    settings; ``per_client`` holds settings that differ by client (e.g. BAOW's keep ratio).
    """

    tensors: Tensors
    scalars: dict[str, float] = field(default_factory=dict)
    per_client: dict[int, dict[str, float]] = field(default_factory=dict)

    def to(self, device: torch.device | str) -> Broadcast:
        return Broadcast({k: v.to(device) for k, v in self.tensors.items()}, dict(self.scalars),
                         {c: dict(v) for c, v in self.per_client.items()})

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass
class Metrics:
    """Metrics carry their own weight: (sum, count) pairs combine exactly across clients and workers."""

    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, total: float, count: float = 1.0) -> None:
        entry = self.values.setdefault(name, [0.0, 0.0])
        entry[0] += float(total)
        entry[1] += float(count)

    def merge(self, other: Metrics) -> Metrics:
        for name, (total, count) in other.values.items():
            self.add(name, total, count)
        return self

    def mean(self, name: str) -> float:
        total, count = self.values[name]
        return total / count if count else float("nan")

    def means(self) -> dict[str, float]:
        return {name: self.mean(name) for name in self.values}

    def sums(self) -> dict[str, float]:
        return {name: total for name, (total, _) in self.values.items()}


@dataclass
class ClientUpdate:
    """One client's result.

    ``tensors`` and ``weights`` form the contribution: in summable mode the worker adds every
    tensor and every weight into its running sums (the algorithm scales tensors itself, e.g.
    FedAvg sends ``n_k * delta`` and weight ``n = n_k``), so the server sees only sums.
    ``state`` is the client's new persistent state (saved by the worker, never sent to the server).
    """

    client_id: int
    tensors: Tensors
    weights: dict[str, float]
    num_samples: int
    metrics: Metrics = field(default_factory=Metrics)
    state: Tensors | None = None
    bytes_up: int = 0
    finite: bool | None = None  # known already (checked for a whole cohort in one reduction), or None

    def nbytes(self) -> int:
        """Bytes of its tensors (what it weighs in a message)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def problem(self, expected: Mapping[str, int], uploads: Collection[str] = ()) -> str | None:
        """Why this is not a contribution of the run, or None. ``uploads``: the names the client half may send
        (``ClientAlgorithm.uploads``): an update carrying none of them (a misnamed or dropped ``delta``)
        would move nothing. ``expected``: the sizes of those whose size is known
        (``contribution_sizes``): where present, flat, floating point and of that size. Every weight: a
        finite number >= 0. Names, shapes, dtypes and Python numbers only: nothing is read from a device."""
        if uploads and not set(uploads) & set(self.tensors):
            return f"carries none of its uploads {sorted(uploads)} (it sends {sorted(self.tensors)})"
        wrong = [f"{k!r}: shape {tuple(t.shape)} {t.dtype}, expected ({expected[k]},) floating point"
                 for k, t in sorted(self.tensors.items()) if k in expected
                 and (tuple(t.shape) != (expected[k],) or not t.is_floating_point())]
        if wrong:
            return "wrong tensors " + ", ".join(wrong)
        bad = {k: v for k, v in self.weights.items()
               if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0}
        return f"weights {bad} must be finite numbers >= 0 (they count samples or clients)" if bad else None

    def is_finite(self) -> bool:
        if self.finite is not None:
            return self.finite
        # A finite sum proves every element finite (one reduction instead of an elementwise pass);
        # only a non-finite sum, which a finite tensor can also give by overflow, needs the full check.
        return all(bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()) for t in self.tensors.values())


@dataclass
class Aggregate:
    """A running sum of contributions (float64, so the result does not depend on grouping)."""

    tensors: Tensors = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    count: int = 0

    def add(self, tensors: Mapping[str, torch.Tensor], weights: Mapping[str, float], count: int = 1) -> None:
        """Add one contribution, or the sum of ``count`` of them."""
        for name, t in tensors.items():
            acc = self.tensors.get(name)
            if acc is None:
                self.tensors[name] = t.detach().to(torch.float64, copy=True)
            else:  # in-place promotion: float32 widened exactly, the sum taken in float64
                acc.add_(t.detach())
        for name, w in weights.items():
            self.weights[name] = self.weights.get(name, 0.0) + float(w)
        self.count += count

    def nbytes(self) -> int:
        """Bytes of its tensors (what it weighs in a message)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def add_update(self, update: ClientUpdate) -> None:
        self.add(update.tensors, update.weights)

    def merge(self, other: Aggregate) -> Aggregate:
        self.add(other.tensors, other.weights, other.count)
        return self

    def to(self, device: torch.device | str) -> Aggregate:
        return Aggregate({k: v.to(device) for k, v in self.tensors.items()}, dict(self.weights), self.count)

    @staticmethod
    def reduce(parts: Iterable[Aggregate]) -> Aggregate:
        """Sum partial aggregates in the given (worker-id) order."""
        total = Aggregate()
        for part in parts:
            if part.count:
                total.merge(part.to("cpu"))
        return total


def as_config(value: Any) -> dict[str, Any]:
    """A plain dict from a dataclass / OmegaConf node / mapping (for frozen hyperparameters)."""
    from dataclasses import asdict, is_dataclass

    if value is None:
        return {}
    if is_dataclass(value):
        return asdict(value)
    omegaconf = sys.modules.get("omegaconf")  # no DictConfig exists before omegaconf is imported (and a
    if omegaconf is not None and isinstance(value, omegaconf.DictConfig):  # ClientApp need not pay 0.3 s for it)
        return omegaconf.OmegaConf.to_container(value, resolve=True)  # type: ignore[return-value]
    return dict(value)
