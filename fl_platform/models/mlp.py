"""Multi-layer perceptron (also multinomial logistic regression with ``hidden=()``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from fl_platform.models._common import check_num_classes, flat_size
from fl_platform.models.base import StagedModel


class MLP(StagedModel):
    """``flatten -> [Linear + ReLU] per hidden layer -> head``.

    Stages: ``flatten, fc1, ..., fcN, head``. ``hidden=()`` is the logistic-regression model of
    the FedProx Synthetic benchmarks.
    """

    accepts = ("float samples of any shape, flattened: feature vectors (synthetic: 60) or images "
               "(digits: 1x8x8, mnist: 1x28x28, cifar10: 3x32x32)")

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        hidden: Sequence[int] = (128,),
    ) -> None:
        num_classes = check_num_classes(num_classes)
        widths = [int(h) for h in hidden]
        if any(h < 1 for h in widths):
            raise ValueError(f"hidden widths must be positive, got {tuple(hidden)}")
        in_dim = flat_size(input_shape)
        if in_dim < 1:
            raise ValueError(f"input_shape {tuple(input_shape)} has no elements")
        stages: OrderedDict[str, nn.Module] = OrderedDict(flatten=nn.Flatten())
        for i, width in enumerate(widths, start=1):
            stages[f"fc{i}"] = nn.Sequential(nn.Linear(in_dim, width), nn.ReLU())
            in_dim = width
        stages["head"] = nn.Linear(in_dim, num_classes)
        super().__init__(stages, input_shape)
        self.hidden: tuple[int, ...] = tuple(widths)
