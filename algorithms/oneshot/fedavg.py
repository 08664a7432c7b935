"""One-shot FedAvg (card method A): average the uploaded client weights once.

w = sum_k p_k w_k with p_k = n_k / sum n (``weighting: samples``, the card's default) or 1/K
(``weighting: uniform``, as the DENSE code does). BatchNorm running statistics are averaged
with the weights (they are float buffers of the flat vector); ``num_batches_tracked`` is an
integer buffer and is skipped, as the card allows.

With ``rounds > 1`` the same server step, repeated, is multi-round FedAvg with server learning
rate 1 (w_new = sum_k p_k w_k = w + sum_k p_k delta_k): the results script uses it as the
reference "FedAvg with the same total local epochs", on exactly the clients' data of the
one-shot methods (the server split held out too).
"""

from __future__ import annotations

from dataclasses import dataclass

from fl_platform.algorithms.base import AlgorithmSpec
from fl_platform.algorithms.oneshot.protocol import OneShotClient, OneShotConf, OneShotServer, average

from fl_platform.core import RoundContext


@dataclass
class OneShotFedAvgConf(OneShotConf):
    name: str = "oneshot_fedavg"
    weighting: str = "samples"  # samples (n_k / sum n) or uniform (1 / K)


class OneShotFedAvgServer(OneShotServer):
    multi_round = True

    def __init__(self, cfg: OneShotFedAvgConf, setup, initial_weights) -> None:
        if cfg.weighting not in ("samples", "uniform"):
            raise ValueError(f"algorithm.weighting must be 'samples' or 'uniform', got {cfg.weighting!r}")
        super().__init__(cfg, setup, initial_weights)

    def build(self, ctx: RoundContext) -> dict[str, float]:
        self.weights = average(self.teachers, self.sizes if self.cfg.weighting == "samples" else None)
        return {}


SPEC = AlgorithmSpec("oneshot_fedavg", OneShotFedAvgConf, OneShotClient, OneShotFedAvgServer,
                     "One-shot FedAvg: average the client models once (rounds > 1: plain FedAvg)")
