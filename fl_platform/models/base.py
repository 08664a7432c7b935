"""The staged-model contract shared by every model in the zoo.

Several algorithms cut a network at a layer boundary: FedImpro trains a low part ``g`` and a
high part ``f`` split at a configurable layer, VHL needs the penultimate feature and the head,
FuseFL cuts ResNet-18 into K blocks. Rather than special-casing each architecture, every model
is an ordered sequence of named stages, so a cut is a name and the pieces are plain
``nn.Sequential`` views that share the model's parameters.

Models must survive having every parameter and float buffer re-pointed to a view of one flat
buffer (``p.data = flat[o:o + n].view_as(p)``), which the training loop does to make weight
loading and delta computation a single tensor operation. Hence: no cached parameter
references, no weight tying, no in-place tricks on parameters.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import ClassVar

import torch
from torch import nn

StageRef = str | int | None


class StagedModel(nn.Module):
    """A model made of an ordered sequence of named stages, the last one a linear ``head``.

    Subclasses build their stages and hand them to ``__init__``; everything else (forward,
    partial forward, splitting, features) is generic.

    Attributes:
        stages: the stages, in execution order.
        input_shape: the shape of one input sample (without the batch axis).
        feature_dim: the width of the penultimate (flattened) feature, the head's input.
        num_outputs: the number of logits, the head's output.
    """

    #: dtype of the model's input; token models override it with ``torch.long``.
    input_dtype: torch.dtype | None = None
    #: number of axes of one sample the model needs (None: any), checked by ``build_model``.
    input_rank: ClassVar[int | None] = None
    #: what the model takes, for the error ``build_model`` raises on inputs it cannot train on.
    accepts: ClassVar[str] = "float samples"

    def __init__(self, stages: Mapping[str, nn.Module], input_shape: Sequence[int]) -> None:
        super().__init__()
        names = list(stages)
        if not names:
            raise ValueError("a StagedModel needs at least one stage (the head)")
        for name in names:
            if not name.isidentifier():
                raise ValueError(f"stage name {name!r} is not a valid identifier")
        if names[-1] != "head" or not isinstance(stages["head"], nn.Linear):
            raise ValueError(f"the last stage must be an nn.Linear named 'head'; got stages {names}")
        self.stages = nn.ModuleDict(OrderedDict(stages))
        self.input_shape: tuple[int, ...] = tuple(int(s) for s in input_shape)
        head: nn.Linear = stages["head"]  # type: ignore[assignment]
        self.feature_dim: int = head.in_features
        self.num_outputs: int = head.out_features

    # ------------------------------------------------------------------ stage lookup
    @property
    def stage_names(self) -> list[str]:
        """Stage names in execution order."""
        return list(self.stages.keys())

    @property
    def head(self) -> nn.Linear:
        """The final linear classifier (``feature_dim -> num_outputs``)."""
        return self.stages["head"]  # type: ignore[return-value]

    def _unknown(self, ref: object) -> ValueError:
        return ValueError(
            f"unknown stage {ref!r} for {type(self).__name__}; valid stage names: {self.stage_names}"
        )

    def stage_index(self, ref: str | int) -> int:
        """Index of a stage given its name or (possibly negative) index."""
        n = len(self.stages)
        if isinstance(ref, bool) or not isinstance(ref, int | str):
            raise TypeError(f"a stage is referenced by name or index, got {ref!r}")
        if isinstance(ref, int):
            if not -n <= ref < n:
                raise IndexError(f"stage index {ref} out of range for {n} stages {self.stage_names}")
            return ref % n
        try:
            return self.stage_names.index(ref)
        except ValueError:
            raise self._unknown(ref) from None

    def resolve_cut(self, after: str) -> int:
        """Index of the last stage in the group named ``after``.

        ``after`` is either an exact stage name or a group prefix: ``"layer2"`` means the last
        stage named ``layer2_*`` (so FedImpro's "split after layer2" is one string). The prefix
        must end at an underscore, so ``"layer1"`` never matches ``layer10_0``.
        """
        names = self.stage_names
        if after in names:
            return names.index(after)
        group = [i for i, name in enumerate(names) if name.startswith(after + "_")]
        if not group:
            raise self._unknown(after)
        return group[-1]

    # ------------------------------------------------------------------ forward passes
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages.values():
            x = stage(x)
        return x

    def _bound(self, ref: StageRef, default: int) -> int:
        if ref is None:
            return default
        if isinstance(ref, int) and not isinstance(ref, bool) and ref == len(self.stages):
            return ref  # an exclusive stop may point one past the end
        return self.stage_index(ref)

    def forward_stages(self, x: torch.Tensor, start: StageRef = None, stop: StageRef = None) -> torch.Tensor:
        """Run stages ``[start, stop)``; names or indices, ``None`` = from the start / to the end.

        Lets a split algorithm feed an intermediate feature (e.g. a sampled one) into the upper
        part without building new modules.
        """
        lo = self._bound(start, 0)
        hi = self._bound(stop, len(self.stages))
        for stage in list(self.stages.values())[lo:hi]:
            x = stage(x)
        return x

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The penultimate feature ``[B, feature_dim]``: every stage except ``head``."""
        return self.forward_stages(x, stop=-1)

    # ------------------------------------------------------------------ splitting
    def _sequential(self, lo: int, hi: int) -> nn.Sequential:
        items = list(self.stages.items())[lo:hi]
        return nn.Sequential(OrderedDict(items))

    def partition(self, cuts: Iterable[str]) -> list[nn.Sequential]:
        """Cut after each name in ``cuts`` (in order): ``len(cuts) + 1`` pieces covering all stages.

        The pieces hold the model's own stage modules (no copies), so training a piece trains
        the model. This is how FuseFL's K-block split is expressed.
        """
        cuts = list(cuts)
        bounds = [self.resolve_cut(c) + 1 for c in cuts]
        if any(b <= a for a, b in itertools.pairwise(bounds)):
            raise ValueError(f"cuts {cuts} are not in increasing stage order {self.stage_names}")
        edges = [0, *bounds, len(self.stages)]
        return [self._sequential(a, b) for a, b in itertools.pairwise(edges)]

    def split(self, after: str) -> tuple[nn.Sequential, nn.Sequential]:
        """Two parameter-sharing views: stages up to and including ``after``, and the rest."""
        low, high = self.partition([after])
        return low, high

    # ------------------------------------------------------------------ introspection
    def example_input(self, batch_size: int = 2) -> torch.Tensor:
        """A zero input batch of the right shape, dtype and device (no RNG is consumed)."""
        ref = next(self.parameters())
        dtype = self.input_dtype or ref.dtype
        return torch.zeros((batch_size, *self.input_shape), dtype=dtype, device=ref.device)

    @torch.no_grad()
    def stage_output_shapes(self) -> OrderedDict[str, tuple[int, ...]]:
        """Per-sample output shape of every stage, from one dry forward pass.

        Split algorithms size their buffers from this (FedImpro's feature dimension D, FuseFL's
        adaptor channels). Runs in eval mode so BatchNorm statistics are not touched, then
        restores each module's own train/eval flag.
        """
        modes = {m: m.training for m in self.modules()}
        self.eval()
        try:
            x = self.example_input(1)
            shapes: OrderedDict[str, tuple[int, ...]] = OrderedDict()
            for name, stage in self.stages.items():
                x = stage(x)
                shapes[name] = tuple(x.shape[1:])
        finally:
            for m, mode in modes.items():
                m.training = mode
        return shapes
