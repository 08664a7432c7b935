"""Model zoo: every model is a :class:`StagedModel` (named stages, a linear ``head``).

Use :func:`build_model` with a registry name; split algorithms use ``split``,
``partition``, ``forward_stages`` and ``features`` on the result.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from torch import nn

from fl_platform.models.base import StagedModel
from fl_platform.models.cnn import CNN
from fl_platform.models.lstm import CharLSTM
from fl_platform.models.mlp import MLP
from fl_platform.models.resnet import FUSEFL_RESNET18_CUTS, ResNet18

MODELS: dict[str, type[StagedModel]] = {"mlp": MLP, "cnn": CNN, "resnet18": ResNet18, "lstm": CharLSTM}

# Arguments build_model fills itself; the rest of each constructor's keywords are options.
_FILLED = {"input_shape", "num_classes", "seq_len"}


def model_options(name: str) -> list[str]:
    """The option names (constructor keywords) that ``build_model(name, ...)`` accepts."""
    cls = _lookup(name)
    return [p for p in inspect.signature(cls).parameters if p not in _FILLED]


def _lookup(name: str) -> type[StagedModel]:
    try:
        return MODELS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model {name!r}; valid models: {sorted(MODELS)}") from None


def build_model(name: str, input_shape: Sequence[int], num_classes: int, **options: Any) -> StagedModel:
    """Build a registered model for one sample shape and class count.

    For ``lstm`` the input shape is ``(seq_len,)`` and ``vocab_size`` defaults to
    ``num_classes``. Construction draws only from torch's global RNG, so it is reproducible
    under ``torch.manual_seed``. Unknown options raise TypeError naming them.
    """
    cls = _lookup(name)
    valid = model_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown} for model {name!r}; valid options: {valid}")
    shape = tuple(int(s) for s in input_shape)
    if cls is CharLSTM:
        if len(shape) != 1:
            raise ValueError(f"model 'lstm' needs input_shape (seq_len,), got {shape}")
        vocab_size = options.pop("vocab_size", num_classes)
        return CharLSTM(vocab_size, num_classes, seq_len=shape[0], **options)
    return cls(shape, num_classes, **options)


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (each shared parameter counted once)."""
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "CNN",
    "FUSEFL_RESNET18_CUTS",
    "MLP",
    "MODELS",
    "CharLSTM",
    "ResNet18",
    "StagedModel",
    "build_model",
    "count_parameters",
    "model_options",
]
