"""Models: a plain nn.Module (no stages) and an nn.Sequential ending in nn.Linear (stages inferred)."""

from __future__ import annotations

import math

from torch import nn


class TinyNet(nn.Module):
    """Flatten -> Linear(width) -> ReLU -> Linear(num_classes); any forward, no StagedModel."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 16) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.ReLU())
        self.out = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.out(self.body(x))


def sequential(input_shape: tuple[int, ...], num_classes: int, width: int = 8) -> nn.Sequential:
    """An nn.Sequential ending in a Linear: split algorithms get its layers as stages."""
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, num_classes))
