"""The algorithm API: a client half and a server half per algorithm (DESIGN.md section 5).

Client half: given the round's broadcast, the client's persistent state, its data and the
shared trainer, return a ClientUpdate (named tensors + summable weights + new state).
Server half: build the broadcast, and turn the summed (or, when ``summable`` is False,
listed) contributions into the new global state. Neither half knows which runtime calls it:
the inline engine, Ray workers and the Flower apps all use these classes unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from fl_platform.core import Aggregate, Broadcast, ClientUpdate, RoundContext
from fl_platform.training.flat import FlatModel
from fl_platform.training.loop import ClientData, LocalTrainer, TrainConfig, evaluate


@dataclass
class AlgorithmConf:
    """Fields common to every algorithm; each algorithm's schema extends it."""

    name: str = "fedavg"
    server_lr: float = 1.0


@dataclass(frozen=True)
class StateSpec:
    """One piece of per-client state: a flat tensor of ``size`` elements, zeros when first used."""

    size: int
    dtype: torch.dtype = torch.float32


@dataclass
class Setup:
    """What both halves may need to know about the experiment (never per-round data)."""

    model_fn: Callable[[], nn.Module]
    num_params: int
    num_buffers: int
    num_classes: int
    input_shape: tuple[int, ...]
    num_clients: int
    seed: int
    train: TrainConfig
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def vector_size(self) -> int:
        return self.num_params + self.num_buffers


class ClientAlgorithm:
    """Client half. Subclasses override ``train`` or only ``hooks``."""

    def __init__(self, cfg: AlgorithmConf, setup: Setup) -> None:
        self.cfg = cfg
        self.setup = setup

    def state_spec(self) -> dict[str, StateSpec]:
        """Per-client state this algorithm keeps across rounds (stored by the state manager)."""
        return {}

    def hooks(self, ctx: RoundContext, broadcast: Broadcast, state: dict[str, torch.Tensor] | None,
              trainer: LocalTrainer):
        return None

    def train(self, ctx: RoundContext, client_id: int, broadcast: Broadcast,
              state: dict[str, torch.Tensor] | None, data: ClientData, trainer: LocalTrainer) -> ClientUpdate:
        """FedAvg-style local training: start from the global weights, return n * delta and n."""
        weights = broadcast.tensors["weights"]
        trainer.fm.load(weights)
        metrics = trainer.fit(data, self.hooks(ctx, broadcast, state, trainer), seed=ctx.seed,
                              round=ctx.round, client=client_id)
        n = data.num_samples
        delta = trainer.fm.vector - weights
        return ClientUpdate(client_id, {"delta": delta.mul_(n)}, {"n": float(n)}, n, metrics)


class ServerAlgorithm:
    """Server half. ``summable`` says whether contributions may be summed before the server sees them."""

    summable: ClassVar[bool] = True

    def __init__(self, cfg: AlgorithmConf, setup: Setup, initial_weights: torch.Tensor) -> None:
        self.cfg = cfg
        self.setup = setup
        self.weights = initial_weights.detach().to("cpu", torch.float32).clone()

    def broadcast(self, ctx: RoundContext) -> Broadcast:
        return Broadcast({"weights": self.weights})

    def aggregate(self, ctx: RoundContext, result: Aggregate | list[ClientUpdate]) -> dict[str, float]:
        """Update the global state; returns extra scalar metrics for the round log."""
        raise NotImplementedError

    def evaluate(self, fm: FlatModel, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> dict[str, float]:
        """Server-side test metrics of the current global model."""
        fm.load(self.weights.to(fm.device))
        return evaluate(fm.model, x, y, batch_size)

    def attach_data(self, data: Any) -> None:
        """Called once by the runtime with the run's FederatedDataset; the default ignores it.

        For server halves that use server-side data (e.g. one-shot distillation on a held-out
        split that no client trains on). Never use the test set here: evaluation owns it.
        """

    def apply_mean_delta(self, agg: Aggregate, name: str = "delta", weight: str = "n") -> None:
        total = agg.weights.get(weight, 0.0)
        if total <= 0 or name not in agg.tensors:
            return
        self.weights += (agg.tensors[name] / total).to(torch.float32) * self.cfg.server_lr

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the server half exactly."""
        return {"weights": self.weights.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.weights = state["weights"].clone()


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    conf: type[AlgorithmConf]
    client: type[ClientAlgorithm]
    server: type[ServerAlgorithm]
    summary: str
    #: Number of model outputs given (conf, num_classes); None = num_classes. VHL's 2C-way head
    #: uses it, so the model factory stays generic (``Setup.num_classes`` stays the real C).
    model_outputs: Callable[[AlgorithmConf, int], int] | None = None

    def num_model_outputs(self, conf: AlgorithmConf, num_classes: int) -> int:
        return num_classes if self.model_outputs is None else int(self.model_outputs(conf, num_classes))
