"""DENSE (Zhang et al., NeurIPS 2022): data-free distillation of the client ensemble (card method D).

A generator, re-initialised every epoch, is trained against the averaged client logits (CE to
random labels, DeepInversion BN-statistics matching over every client's BatchNorm layers, and an
adversarial KL term where the student disagrees with the ensemble); its lowest-loss batch joins
a growing pool, and a fresh student is distilled on one pass over the pool (KL at T = 20, SGD
lr 0.005, momentum 0.9). The loop is :class:`~.datafree.DataFreeServer`; the defaults below are
the card's (DENSE README / code), the results script scales epochs, steps and widths for CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from fl_platform.algorithms.base import AlgorithmSpec
from fl_platform.algorithms.oneshot.datafree import DataFreeConf, DataFreeServer
from fl_platform.algorithms.oneshot.protocol import OneShotClient


@dataclass
class DenseConf(DataFreeConf):
    name: str = "oneshot_dense"


SPEC = AlgorithmSpec("oneshot_dense", DenseConf, OneShotClient, DataFreeServer,
                     "DENSE: data-free distillation of the client ensemble through a generator")
