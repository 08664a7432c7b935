"""Adaptive server optimisers (Reddi et al. 2021, "Adaptive Federated Optimization"): the ``server_opt`` group.

FedAdam, FedYogi and FedAdagrad keep FedAvg's clients and replace the server step. With the round's
pseudo-gradient ``Delta`` (the mean client update over the model's trainable parameters):

    m <- b1 m + (1 - b1) Delta
    v <- v + Delta^2                                  (adagrad)
    v <- v - (1 - b2) Delta^2 sign(v - Delta^2)       (yogi)
    v <- b2 v + (1 - b2) Delta^2                      (adam)
    x <- x + lr * m / (sqrt(v) + tau)

``v`` starts at ``tau^2`` (the paper's Algorithm 2: ``v_{-1} >= tau^2``; zeros would make Yogi's first
step Adam's), ``m`` at zero; no bias correction (the paper has none). The optimiser sees parameters
only: a server half hands it ``delta[:num_params]`` and moves the float buffers (BatchNorm's running
statistics) by the clients' mean itself (``ServerAlgorithm.apply_update``), so an adaptive step can
never scale a running variance below zero. It applies to every algorithm whose server half declares
``pseudo_gradient = True`` (FedAvg, FedProx, SCAFFOLD's model part, MOON, ...); the others (one-shot,
FuseFL, FedDyn) refuse it at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SERVER_OPTS = ("none", "adam", "yogi", "adagrad")


@dataclass
class ServerOptConf:
    """The ``server_opt`` section; ``none`` keeps the algorithm's own step (``algorithm.server_lr``)."""

    name: str = "none"  # none | adam | yogi | adagrad
    lr: float = 0.01  # eta, the server learning rate (the paper tunes it per task on a log10 grid)
    beta1: float = 0.9  # momentum of the pseudo-gradient
    beta2: float = 0.99  # second-moment decay (adam, yogi)
    tau: float = 1e-3  # adaptivity: bounds the step where v is small; v starts at tau^2

    def inactive_fields(self) -> dict[str, str]:
        """Fields that have no effect with this option (field -> why)."""
        if self.name == "none":
            return dict.fromkeys(("lr", "beta1", "beta2", "tau"),
                                 "server_opt=none: the algorithm's own server step (algorithm.server_lr)")
        if self.name == "adagrad":
            return {"beta2": "FedAdagrad sums Delta^2 into v (no decay)"}
        return {}


def server_opt_schemas() -> dict[str, type]:
    return dict.fromkeys(SERVER_OPTS, ServerOptConf)


def active(conf: ServerOptConf | None) -> bool:
    return conf is not None and conf.name != "none"


def check_server_opt(conf: ServerOptConf, server: type, algorithm: str) -> None:
    """ValueError naming ``server_opt`` when the option is unknown, a value is out of range, or the
    algorithm's server step takes no pseudo-gradient for it to act on."""
    if conf.name not in SERVER_OPTS:
        raise ValueError(f"server_opt={conf.name!r} is not an option; valid: {', '.join(SERVER_OPTS)}")
    if not active(conf):
        return
    if not getattr(server, "pseudo_gradient", False):
        raise ValueError(f"server_opt={conf.name} needs a server step on a pseudo-gradient (the mean client update), "
                         f"and algorithm={algorithm} has none ({server.__name__} builds its model otherwise); "
                         "use server_opt=none")
    checks = [(conf.lr > 0, "lr", "> 0"), (0 <= conf.beta1 < 1, "beta1", "in [0, 1)"),
              (0 <= conf.beta2 < 1, "beta2", "in [0, 1)"), (conf.tau > 0, "tau", "> 0")]
    for ok, key, valid in checks:
        if not ok:
            raise ValueError(f"server_opt.{key} must be {valid}, got {getattr(conf, key)}")


class ServerOptimizer:
    """The adaptive step on the parameter part of the pseudo-gradient; its state is checkpointed."""

    def __init__(self, conf: ServerOptConf, num_params: int) -> None:
        if not active(conf) or conf.name not in SERVER_OPTS:
            raise ValueError(f"ServerOptimizer needs server_opt=adam|yogi|adagrad, got {conf.name!r}")
        self.conf = conf
        self.m = torch.zeros(num_params, dtype=torch.float32)
        self.v = torch.full((num_params,), conf.tau ** 2, dtype=torch.float32)

    def step(self, delta: torch.Tensor) -> torch.Tensor:
        """The change of the parameters for pseudo-gradient ``delta`` (parameters only)."""
        c = self.conf
        if delta.shape != self.m.shape:
            raise ValueError(f"the server optimiser acts on the {self.m.numel()} parameters, got a pseudo-gradient "
                             f"of shape {tuple(delta.shape)}")
        self.m.mul_(c.beta1).add_(delta, alpha=1 - c.beta1)
        sq = delta * delta
        if c.name == "adagrad":
            self.v.add_(sq)
        elif c.name == "yogi":
            self.v.sub_(sq * torch.sign(self.v - sq), alpha=1 - c.beta2)
        else:
            self.v.mul_(c.beta2).add_(sq, alpha=1 - c.beta2)
        return self.m / (self.v.sqrt() + c.tau) * c.lr

    def state_dict(self) -> dict[str, Any]:
        return {"m": self.m.clone(), "v": self.v.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m, self.v = state["m"].clone(), state["v"].clone()
