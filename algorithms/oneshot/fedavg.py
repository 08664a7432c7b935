"""One-shot FedAvg (card method A): average the uploaded client weights once.

w = sum_k p_k w_k with p_k = n_k / sum n (``weighting: samples``, the card's default) or 1/K
(``weighting: uniform``, as the DENSE code does). BatchNorm running statistics are averaged
with the weights (they are float buffers of the flat vector); ``num_batches_tracked`` is an
integer buffer and is skipped, as the card allows.

With ``rounds > 1`` the same server step, repeated, is multi-round FedAvg with server learning
rate 1 (w_new = sum_k p_k w_k = w + sum_k p_k delta_k): the results script uses it as the
reference "FedAvg with the same total local epochs", on exactly the clients' data of the
one-shot methods (the server split held out too).

``calibrate: true`` adds FuseFL's classifier calibration as one more round (calibration.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fl_platform.algorithms.base import AlgorithmSpec
from fl_platform.algorithms.oneshot.calibration import CalibratedConf, CalibratedServer, staged
from fl_platform.algorithms.oneshot.distill import predict_logits
from fl_platform.algorithms.oneshot.protocol import OneShotClient, average, build_module
from fl_platform.core import RoundContext
from fl_platform.training.flat import FlatModel, model_vector


@dataclass
class OneShotFedAvgConf(CalibratedConf):
    name: str = "oneshot_fedavg"
    weighting: str = "samples"  # samples (n_k / sum n) or uniform (1 / K)


class OneShotFedAvgServer(CalibratedServer):
    """With ``calibrate: true`` (calibration.py) the last round calibrates the averaged model's head."""

    multi_round = True

    def __init__(self, cfg: OneShotFedAvgConf, setup, initial_weights) -> None:
        if cfg.weighting not in ("samples", "uniform"):
            raise ValueError(f"algorithm.weighting must be 'samples' or 'uniform', got {cfg.weighting!r}")
        super().__init__(cfg, setup, initial_weights)

    def build(self, ctx: RoundContext) -> dict[str, float]:
        self.weights = average(self.teachers, self.sizes if self.cfg.weighting == "samples" else None)
        return {}

    # -- calibration (calibrate: true): the averaged model's own head
    def calibration_tensors(self) -> dict[str, torch.Tensor]:
        return {"weights": self.weights}

    def initial_head(self) -> nn.Linear:
        self.uncalibrated = self.weights.clone()
        self._model = staged(build_module(self.setup, self.weights, "cpu"))
        return self._model.head

    def set_head(self, head: nn.Linear) -> None:  # ``head`` is the kept model's own, trained in place
        self.weights = model_vector(self._model).to(torch.float32)

    def uncalibrated_logits(self, x: torch.Tensor, teacher_logits: list[torch.Tensor], fm: FlatModel,
                            batch_size: int) -> torch.Tensor:
        fm.load(self.uncalibrated.to(fm.device))
        return predict_logits(fm.model, x, batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "uncalibrated": getattr(self, "uncalibrated", None)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if state.get("uncalibrated") is not None:
            self.uncalibrated = state["uncalibrated"].clone()


SPEC = AlgorithmSpec("oneshot_fedavg", OneShotFedAvgConf, OneShotClient, OneShotFedAvgServer,
                     "One-shot FedAvg: average the client models once (rounds > 1: plain FedAvg)")
