"""Small helpers shared by the model files."""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

NORMS = ("none", "batch", "group")


def check_num_classes(num_classes: int) -> int:
    """Reject non-positive class counts early, with a readable message."""
    if isinstance(num_classes, bool) or int(num_classes) != num_classes or num_classes < 1:
        raise ValueError(f"num_classes must be a positive integer, got {num_classes!r}")
    return int(num_classes)


def image_shape(input_shape: Sequence[int], model: str) -> tuple[int, int, int]:
    """Validate a (channels, height, width) shape for a convolutional model."""
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"{model} needs input_shape (channels, height, width), got {tuple(input_shape)}")
    return shape  # type: ignore[return-value]


def make_norm(kind: str, channels: int, groups: int) -> nn.Module:
    """The 2-d normalisation layer for ``kind`` (``none`` gives an identity).

    GroupNorm is the usual FL replacement for BatchNorm (no running statistics to average,
    no dependence on the local batch's label mix).
    """
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        if channels % groups:
            raise ValueError(f"group_norm_groups={groups} does not divide {channels} channels")
        return nn.GroupNorm(groups, channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm {kind!r}; valid: {list(NORMS)}")


def flat_size(shape: Sequence[int]) -> int:
    """Number of elements of one sample of ``shape``."""
    return math.prod(int(s) for s in shape)
