"""Optimisers over the flat parameter vector.

Semantics match ``torch.optim.SGD`` and ``torch.optim.Adam`` (tested), but a step is a few
vector ops instead of a loop over tensors, and the state is reset in place for every client
(momentum must never leak from one client to the next).
"""

from __future__ import annotations

import math

import torch


class FlatOptimizer:
    def reset(self) -> None:
        raise NotImplementedError

    def step(self, params: torch.Tensor, grad: torch.Tensor) -> None:
        raise NotImplementedError


class FlatSGD(FlatOptimizer):
    def __init__(self, lr: float, momentum: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
                 dampening: float = 0.0) -> None:
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires momentum > 0 and dampening = 0")
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.nesterov, self.dampening = nesterov, dampening
        self._buf: torch.Tensor | None = None
        self._fresh = True

    def reset(self) -> None:
        self._fresh = True

    def step(self, params: torch.Tensor, grad: torch.Tensor) -> None:
        g = grad
        if self.weight_decay:
            g = g.add(params, alpha=self.weight_decay)
        if self.momentum:
            if self._buf is None or self._buf.shape != g.shape or self._buf.device != g.device:
                self._buf = torch.empty_like(g)
                self._fresh = True
            if self._fresh:
                self._buf.copy_(g)
                self._fresh = False
            else:
                self._buf.mul_(self.momentum).add_(g, alpha=1 - self.dampening)
            g = g.add(self._buf, alpha=self.momentum) if self.nesterov else self._buf
        params.add_(g, alpha=-self.lr)


class FlatAdam(FlatOptimizer):
    def __init__(self, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self._m: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._t = 0

    def reset(self) -> None:
        self._t = 0

    def step(self, params: torch.Tensor, grad: torch.Tensor) -> None:
        b1, b2 = self.betas
        g = grad.add(params, alpha=self.weight_decay) if self.weight_decay else grad
        if self._m is None or self._m.shape != g.shape or self._m.device != g.device:
            self._m, self._v = torch.zeros_like(g), torch.zeros_like(g)
        assert self._v is not None
        if self._t == 0:
            self._m.zero_()
            self._v.zero_()
        self._t += 1
        self._m.mul_(b1).add_(g, alpha=1 - b1)
        self._v.mul_(b2).addcmul_(g, g, value=1 - b2)
        bias1 = 1 - b1**self._t
        bias2 = 1 - b2**self._t
        denom = (self._v.sqrt() / math.sqrt(bias2)).add_(self.eps)
        params.addcdiv_(self._m, denom, value=-self.lr / bias1)


def make_optimizer(name: str, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                   nesterov: bool = False, betas: tuple[float, float] = (0.9, 0.999),
                   eps: float = 1e-8) -> FlatOptimizer:
    if name == "sgd":
        return FlatSGD(lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)
    if name == "adam":
        return FlatAdam(lr, betas=betas, eps=eps, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; valid choices: sgd, adam")
