"""Plug-ins with mistakes a user makes, each of which start-up must refuse naming it (tests/test_cli.py's
bad-input list): annotated parameters given the wrong type, labels and features a run cannot use,
algorithm halves missing what they must define."""

from __future__ import annotations

import math

import numpy as np
from torch import nn

from fl_platform.algorithms.base import AlgorithmSpec, ClientAlgorithm, ServerAlgorithm, ServerStepConf
from fl_platform.datasets.source import SourceData

from .alg import ClipServer
from .data import blobs


class DropNet(nn.Module):
    """A model with a float parameter."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(math.prod(input_shape), num_classes))

    def forward(self, x):
        return self.net(x)


def tagged(seed: int, tag: str = "blobs", n: int = 240) -> SourceData:
    """A loader with a str parameter (``+dataset.tag=nan`` must not arrive as a float)."""
    source = blobs(seed, n=n)
    source.name = tag
    return source


def labelled(seed: int, split: str = "test", label: int = 3) -> SourceData:
    """blobs with one ``split`` label set to ``label`` (3 is outside its 3 classes)."""
    s = blobs(seed, n=240)
    train_y, test_y = s.train_y.copy(), s.test_y.copy()
    (test_y if split == "test" else train_y)[0] = label
    return SourceData(s.train_x, train_y, s.test_x, test_y, num_classes=3, input_shape=s.input_shape, name="labelled")


def holed(seed: int, row: int = 5) -> SourceData:
    """blobs with a NaN feature in training row ``row``."""
    s = blobs(seed, n=240)
    train_x = s.train_x.copy()
    train_x[row, 2] = np.nan
    return SourceData(train_x, s.train_y, s.test_x, s.test_y, num_classes=3, input_shape=s.input_shape, name="holed")


class Lazy(ServerAlgorithm):
    """A server half that forgot ``aggregate``."""


class PlainConf:
    """A conf that is not a dataclass."""

    name: str = "plainconf"


class NotAClient:
    """A client half that does not extend ClientAlgorithm."""

    def train(self, *args):
        raise AssertionError("never called: refused at start-up")


NO_AGGREGATE = AlgorithmSpec("lazy", ServerStepConf, ClientAlgorithm, Lazy, "no aggregate")
NOT_A_DATACLASS = AlgorithmSpec("plainconf", PlainConf, ClientAlgorithm, ClipServer, "conf not a dataclass")
NOT_A_CLIENT = AlgorithmSpec("notclient", ServerStepConf, NotAClient, ClipServer, "client half of the wrong kind")
