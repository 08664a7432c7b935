"""Small CNN: the workhorse model for CPU experiments (digits, (Fashion-)MNIST, FEMNIST, CIFAR)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from torch import nn

from fl_platform.models._common import NORMS, check_num_classes, image_shape, make_norm
from fl_platform.models.base import StagedModel


class CNN(StagedModel):
    """``conv{i}: Conv3x3 [+ norm] + ReLU + MaxPool2`` per channel entry, then ``flatten, fc, head``.

    The pool is skipped once it would shrink the feature map below 2x2, so the same
    configuration works on 8x8 digits, 28x28 (F)MNIST/FEMNIST and 32x32 CIFAR.
    Stages: ``conv1, ..., convN, flatten, fc, head``.
    """

    input_rank = 3
    accepts = "float images (channels, height, width): digits 1x8x8, mnist 1x28x28, cifar10 3x32x32"

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        channels: Sequence[int] = (32, 64),
        hidden: int = 128,
        norm: str = "none",
        group_norm_groups: int = 2,
    ) -> None:
        num_classes = check_num_classes(num_classes)
        in_ch, h, w = image_shape(input_shape, "CNN")
        if norm not in NORMS:
            raise ValueError(f"unknown norm {norm!r}; valid: {list(NORMS)}")
        widths = [int(c) for c in channels]
        if not widths or any(c < 1 for c in widths) or int(hidden) < 1:
            raise ValueError(
                f"channels {tuple(channels)} and hidden {hidden} must be positive (and non-empty)"
            )
        stages: OrderedDict[str, nn.Module] = OrderedDict()
        for i, out_ch in enumerate(widths, start=1):
            # bias is redundant in front of a normalisation layer
            layers: list[nn.Module] = [nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=norm == "none")]
            if norm != "none":
                layers.append(make_norm(norm, out_ch, group_norm_groups))
            layers.append(nn.ReLU())
            if h // 2 >= 2 and w // 2 >= 2:
                layers.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
            stages[f"conv{i}"] = nn.Sequential(*layers)
            in_ch = out_ch
        stages["flatten"] = nn.Flatten()
        stages["fc"] = nn.Sequential(nn.Linear(in_ch * h * w, int(hidden)), nn.ReLU())
        stages["head"] = nn.Linear(int(hidden), num_classes)
        super().__init__(stages, input_shape)
        self.norm = norm
