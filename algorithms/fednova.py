"""FedNova (Wang et al., NeurIPS 2020): normalised averaging against objective inconsistency.

Clients that take different numbers of local steps (tau_i = epochs * ceil(n_i / B) differs with the
data size) pull FedAvg's average toward the clients that step more, so it converges to a stationary
point of a reweighted objective. FedNova normalises each client's cumulative update by the l1 norm of
its step coefficients and rescales the average by an effective step count:

    d_i = (x - x_i) / ||a_i||_1,     x <- x - tau_eff * sum_i p_i d_i,     tau_eff = sum_i p_i ||a_i||_1,

with p_i = n_i / sum n. For plain SGD ||a_i||_1 = tau_i. For heavy-ball momentum rho the k-th step
moves by lr * sum_{j<=k} rho^(k-j) g_j, so ||a_i||_1 = sum_{k=1..tau_i} (1 - rho^k) / (1 - rho), the
``local_counter``/``local_normalizing_vec`` recursion of the official code (JYWa/FedNova,
``distoptim/FedNova.py``), whose ``average`` also takes tau_eff = sum_i p_i ||a_i||_1. Nesterov
momentum adds rho times the buffer to each step: sum_k (1 + rho (1 - rho^k) / (1 - rho)). Weight
decay and gradient clipping are part of the gradient g_j and leave a_i unchanged, as in the paper.

Both sums are sums of client contributions (``delta`` = n_i * d_i with weight ``n``, and ``tau`` =
n_i ||a_i||_1), so hierarchical aggregation stays exact. BatchNorm running statistics are not
gradient steps: their part of the vector is averaged as in FedAvg (the official code leaves them
local; averaging them is our choice). The server step then follows FedAvg's (``server_lr``, and
``server_momentum``: the official code's ``gmf``). FedNova with a proximal term (the paper's
FedProx variant) is not implemented.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fl_platform.algorithms.base import AlgorithmSpec, ClientAlgorithm
from fl_platform.algorithms.fedavg import FedAvgConf, FedAvgServer
from fl_platform.core import Aggregate, Broadcast, ClientUpdate, Metrics, RoundContext
from fl_platform.privacy.spec import PrivacyUnsupported, PrivateUploads
from fl_platform.training.loop import TrainConfig


@dataclass
class FedNovaConf(FedAvgConf):
    name: str = "fednova"


def step_norm(steps: int, momentum: float = 0.0, nesterov: bool = False) -> float:
    """||a||_1 of ``steps`` local SGD steps with heavy-ball (or Nesterov) momentum ``momentum``."""
    if momentum == 0.0:
        return float(steps)
    rho = momentum
    heavy_ball = (steps - rho * (1.0 - rho**steps) / (1.0 - rho)) / (1.0 - rho)  # sum_k (1 - rho^k) / (1 - rho)
    return steps + rho * heavy_ball if nesterov else heavy_ball


def check_local_solver(train: TrainConfig) -> None:
    """FedNova's a_i is defined for (momentum) SGD; refuse another local optimiser at start-up."""
    if train.optimizer != "sgd":
        raise ValueError(f"algorithm=fednova normalises by the step coefficients of local SGD; train.optimizer="
                         f"{train.optimizer!r} has none defined (use train.optimizer=sgd, with or without momentum)")
    if not 0.0 <= train.momentum < 1.0:
        raise ValueError(f"algorithm=fednova needs train.momentum in [0, 1), got {train.momentum}")


class FedNovaClient(ClientAlgorithm):
    @classmethod
    def private_uploads(cls, cfg: FedNovaConf) -> PrivateUploads:
        raise PrivacyUnsupported(
            "fednova: the server step needs each client's step normaliser ||a_i||_1 (a function of its number "
            "of samples), which client-level DP neither clips nor noises")

    def finish(self, ctx: RoundContext, client_id: int, broadcast: Broadcast, state, data, trainer,
               plan, metrics: Metrics) -> ClientUpdate:
        train = trainer.cfg
        n = data.num_samples
        norm = step_norm(int(metrics.values["local_steps"][0]), train.momentum, train.nesterov)
        delta = trainer.fm.vector - plan.start
        if norm > 0:
            delta[: trainer.fm.num_params].div_(norm)  # buffers (BN statistics) are averaged as they are
        return ClientUpdate(client_id, {"delta": delta.mul_(n)}, {"n": float(n), "tau": n * norm}, n, metrics)


class FedNovaServer(FedAvgServer):
    def __init__(self, cfg: FedNovaConf, setup, initial_weights: torch.Tensor) -> None:
        check_local_solver(setup.train)
        super().__init__(cfg, setup, initial_weights)

    def aggregate(self, ctx: RoundContext, result: Aggregate | list[ClientUpdate]) -> dict[str, float]:
        assert isinstance(result, Aggregate)
        total = result.weights.get("n", 0.0)
        if total <= 0:
            return {}
        tau_eff = result.weights["tau"] / total
        delta = result.tensors["delta"].clone()
        delta[: self.setup.num_params].mul_(tau_eff)
        super().aggregate(ctx, Aggregate({**result.tensors, "delta": delta}, result.weights, result.count))
        return {"tau_eff": tau_eff}


SPEC = AlgorithmSpec("fednova", FedNovaConf, FedNovaClient, FedNovaServer,
                     "FedNova: updates normalised by each client's local step count, rescaled by tau_eff")
