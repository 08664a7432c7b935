"""CIFAR ResNet-18 (3x3 stem, no max-pool), with one stage per residual block."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from fl_platform.models._common import check_num_classes, image_shape, make_norm
from fl_platform.models.base import StagedModel

#: FuseFL's block split of ResNet-18 (``EXNN_Split_Configs``) as cut points for
#: :meth:`StagedModel.partition`: K blocks, plus the head as the last piece.
FUSEFL_RESNET18_CUTS: dict[int, tuple[str, ...]] = {
    2: ("layer2", "pool"),
    3: ("stem", "layer2", "pool"),
    4: ("stem", "layer2", "layer3", "pool"),
    8: ("stem", "layer1_0", "layer1_1", "layer2_0", "layer3_0", "layer4_0", "layer4_1", "pool"),
}


class BasicBlock(nn.Module):
    """Two 3x3 convs with a residual connection (1x1 conv + norm shortcut when the shape changes).

    The shortcut subsamples its input, then runs a stride-1 1x1 conv: the same map as a stride-2 1x1
    conv, without the CPU kernel that computes a strided 1x1 conv's weight gradient on channels-last
    input (oneDNN's ``jit_1x1`` "reduce to unit stride" path). With fewer than 8 input channels on an
    AVX2 CPU (oneDNN issue 6035) that kernel writes past its workspace: wrong gradients, hangs or a
    crash, and CIFAR's augmentation hands the model channels-last minibatches.
    """

    def __init__(self, in_ch: int, out_ch: int, stride: int, norm: str, groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.bn1 = make_norm(norm, out_ch, groups)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, stride=1, padding=1, bias=False)
        self.bn2 = make_norm(norm, out_ch, groups)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, bias=False), make_norm(norm, out_ch, groups)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        step = self.conv1.stride[0]  # the block's stride: the shortcut subsamples as conv1 strides
        return self.relu(out + self.shortcut(x[:, :, ::step, ::step]))


class GlobalMeanPool(nn.Module):
    """Global average pooling as a mean over height and width: its backward is deterministic on CUDA
    (AdaptiveAvgPool2d's is not) and on the CPU it gives the same bits as AdaptiveAvgPool2d(1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3))


class ResNet18(StagedModel):
    """ResNet-18, CIFAR variant (as in FedImpro's ``resnet_v2``, VHL and FuseFL).

    Stem: 3x3 conv stride 1 + norm + ReLU, no max-pool; BasicBlocks [2, 2, 2, 2] with widths
    ``w, 2w, 4w, 8w`` and strides ``1, 2, 2, 2``; global average pool; linear head.
    Stages: ``stem, layer1_0, layer1_1, layer2_0, layer2_1, layer3_0, layer3_1, layer4_0,
    layer4_1, pool, head``; ``split("layer2")`` is FedImpro's default cut.
    The stem takes ``input_shape[0]`` channels, so 1x28x28 inputs need no channel repeat.
    ``norm="group"`` uses GroupNorm with ``group_norm_groups`` groups (2 by default, as in
    Hsieh et al. 2020; it divides every width in use, including FuseFL's 14 and 20).
    """

    input_rank = 3
    # Three stride-2 stages shrink H to ceil(H / 8): from 8x8 down, layer4's BatchNorm sees 1x1 maps
    # and a training batch of one sample (a client's last batch) fails.
    accepts = ("float images (channels, height, width); with norm=batch (the default) at least 9 pixels "
               "high or wide, e.g. 1x28x28 (mnist, fashion_mnist, femnist) or 3x32x32 (cifar10, cifar100); "
               "model.norm=group also takes smaller images such as digits' 1x8x8")

    def __init__(
        self,
        input_shape: Sequence[int],
        num_classes: int,
        width: int = 64,
        norm: str = "batch",
        group_norm_groups: int = 2,
    ) -> None:
        num_classes = check_num_classes(num_classes)
        in_ch = image_shape(input_shape, "ResNet18")[0]
        if norm not in ("batch", "group"):
            raise ValueError(f"ResNet18 norm must be 'batch' or 'group', got {norm!r}")
        width = int(width)
        if width < 1:
            raise ValueError(f"width must be positive, got {width}")
        stages: OrderedDict[str, nn.Module] = OrderedDict(
            stem=nn.Sequential(
                nn.Conv2d(in_ch, width, 3, stride=1, padding=1, bias=False),
                make_norm(norm, width, group_norm_groups),
                nn.ReLU(),
            )
        )
        widths = (width, 2 * width, 4 * width, 8 * width)
        prev = width
        for layer, (out_ch, stride) in enumerate(zip(widths, (1, 2, 2, 2)), start=1):
            for block in range(2):
                stages[f"layer{layer}_{block}"] = BasicBlock(
                    prev, out_ch, stride if block == 0 else 1, norm, group_norm_groups
                )
                prev = out_ch
        stages["pool"] = GlobalMeanPool()
        stages["head"] = nn.Linear(prev, num_classes)
        super().__init__(stages, input_shape)
        self.width = width
        self.widths: tuple[int, ...] = widths
        self.norm = norm
