"""Model zoo: every model is a :class:`StagedModel` (named stages, a linear ``head``).

Use :func:`build_model` with a registry name, or ``custom`` with ``_target_=<module>:<class>`` for
the user's own ``nn.Module`` (fl_platform/models/custom.py); split algorithms use ``split``,
``partition``, ``forward_stages`` and ``features`` on the result.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from fl_platform.models.base import StagedModel
from fl_platform.models.cnn import CNN
from fl_platform.models.custom import (
    CUSTOM,
    build_custom,
    dry_run_problem,
    one_sample_problem,
    split_options,
    target_name,
)
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
    under ``torch.manual_seed``. Unknown options raise TypeError naming them; a model that
    cannot train on samples of ``input_shape`` raises :class:`ModelInputError` here, before
    any training (see :func:`check_model_input`). ``custom``: ``options`` hold ``_target_`` and the
    user's arguments (checked by :func:`check_model_input`, which knows the data's dtype).
    """
    if name == CUSTOM:
        ref, own = split_options(options)
        return build_custom(ref, input_shape, num_classes, own)  # type: ignore[return-value]
    cls, shape = _checked_static(name, input_shape, num_classes, None, None, options)
    model = _construct(cls, shape, num_classes, options)
    _check_dry_run(name, model, num_classes, options, None, None)
    return model


class ModelInputError(ValueError):
    """A model cannot train on the dataset's samples (their shape or dtype), found before training."""


def check_model_input(name: str, input_shape: Sequence[int], num_classes: int,
                      input_dtype: torch.dtype | None = None, *, dataset: str | None = None,
                      stages_for: str | None = None, **options: Any) -> str | None:
    """Refuse, at start-up, a model that cannot train on samples of ``input_shape`` and ``input_dtype``;
    return why a training batch of one sample fails, or None (custom models only: they are checked on two
    samples, so a BatchNorm MLP is valid, and the data decide whether a client ever makes such a batch).

    Without this, such a pair fails deep inside torch, sometimes only mid-training (ResNet-18 on
    8x8 digits reaches a BatchNorm on 1x1 maps, which fails on the first one-sample batch). The
    check is the sample's rank and kind (float features vs integer token ids) and one dry
    training-mode forward pass of a one-sample batch; the message names the model, the shape,
    what the model takes, and the registered models that would take these samples.
    ``dataset`` only names the data in the message. ``stages_for`` names an algorithm that cuts the
    model into stages: the model must then be a :class:`StagedModel`. Runs once per process for each
    model config; draws nothing from any RNG stream the run uses.
    """
    if name == CUSTOM:
        return _check_custom(input_shape, num_classes, input_dtype, dataset, stages_for, options)
    cls, shape = _checked_static(name, input_shape, num_classes, input_dtype, dataset, options)
    if _key(name, shape, num_classes, options) in _CHECKED:
        return None
    with torch.random.fork_rng(devices=[]):
        model = _construct(cls, shape, num_classes, options)
    _check_dry_run(name, model, num_classes, options, input_dtype, dataset)
    return None


# Model configs (name, shape, classes, options) that passed the dry run in this process.
_CHECKED: set[tuple[Any, ...]] = set()
# Custom model configs that passed it -> why a training batch of one sample fails (None: it does not).
_CHECKED_CUSTOM: dict[tuple[Any, ...], str | None] = {}


def _key(name: str, shape: tuple[int, ...], num_classes: int, options: dict[str, Any]) -> tuple[Any, ...]:
    return name, shape, num_classes, repr(sorted(options.items()))


def _checked_static(name: str, input_shape: Sequence[int], num_classes: int, dtype: torch.dtype | None,
                    dataset: str | None, options: dict[str, Any]) -> tuple[type[StagedModel], tuple[int, ...]]:
    """The model class and the sample shape as a tuple, after the checks that need no model."""
    cls = _lookup(name)
    valid = model_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown} for model {name!r}; valid options: {valid}")
    shape = tuple(int(s) for s in input_shape)
    reason = _static_problem(cls, shape, dtype)
    if reason is not None:
        raise _input_error(name, shape, num_classes, dtype, dataset, reason)
    return cls, shape


def _construct(cls: type[StagedModel], shape: tuple[int, ...], num_classes: int,
               options: dict[str, Any]) -> StagedModel:
    if cls is CharLSTM:
        options = dict(options)
        vocab_size = options.pop("vocab_size", num_classes)
        return CharLSTM(vocab_size, num_classes, seq_len=shape[0], **options)
    return cls(shape, num_classes, **options)


def _is_tokens(dtype: torch.dtype | None) -> bool:
    return dtype is not None and not dtype.is_floating_point and dtype != torch.bool


def _static_problem(cls: type[StagedModel], shape: tuple[int, ...], dtype: torch.dtype | None) -> str | None:
    """Why ``cls`` cannot take samples of this shape and dtype (None: dtype unknown), or None."""
    wants_tokens = _is_tokens(cls.input_dtype)
    if dtype is not None and _is_tokens(dtype) and not wants_tokens:
        return "it computes on float features, and integer token ids are not features"
    if dtype is not None and not _is_tokens(dtype) and wants_tokens:
        return "it embeds integer token ids, and these samples are float features"
    if cls.input_rank is not None and len(shape) != cls.input_rank:
        return (f"it needs {cls.input_rank}-axis samples ({_layout(cls)}), "
                f"these have {len(shape)} ax{'is' if len(shape) == 1 else 'es'}")
    return None


def _layout(cls: type[StagedModel]) -> str:
    return "seq_len," if _is_tokens(cls.input_dtype) else "channels, height, width"


def _dry_run_problem(model: StagedModel) -> str | None:
    """Why one training-mode forward pass of a one-sample batch fails, or None.

    One sample, because a client's last minibatch can hold one. ``model`` is fresh from its
    constructor, so in training mode. Runs without autograd, restores every buffer (BatchNorm
    statistics) and forks the CPU RNG.
    """
    saved = [b.detach().clone() for b in model.buffers()]
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(model.example_input(1))
    except (RuntimeError, ValueError, IndexError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        if "more than 1 value per channel" in first:
            return ("a BatchNorm layer would see 1x1 feature maps, so every training batch of one sample "
                    f"(e.g. a client's last batch) fails (torch: {first})")
        return f"a training forward pass of one sample fails in torch: {first}"
    finally:
        with torch.no_grad():
            for b, s in zip(model.buffers(), saved):
                b.copy_(s)
    return None


def _input_error(name: str, shape: tuple[int, ...], num_classes: int, dtype: torch.dtype | None,
                 dataset: str | None, reason: str) -> ModelInputError:
    kind = "" if dtype is None else ("token-id " if _is_tokens(dtype) else "float ")
    dims = "x".join(str(d) for d in shape) or "scalar"
    where = f"{kind}samples of shape {dims}"
    if dataset:
        where = f"dataset={dataset}, which gives {where}"
    others = [m for m in sorted(MODELS) if m != name and _fits(m, shape, num_classes, dtype)]
    hint = (f"use {' or '.join(f'model={m}' for m in others)} instead" if others
            else "no registered model trains on these samples")
    return ModelInputError(f"model={name} cannot train on {where}: {reason}. model={name} takes "
                           f"{MODELS[name].accepts}; {hint}")


def _fits(name: str, shape: tuple[int, ...], num_classes: int, dtype: torch.dtype | None) -> bool:
    """Whether ``name`` with its default options trains on these samples (for the error's hint);
    ``dtype=None`` (unknown) judges the shape only."""
    cls = MODELS[name]
    if _static_problem(cls, shape, dtype) is not None:
        return False
    try:
        with torch.random.fork_rng(devices=[]):
            model = _construct(cls, shape, num_classes, {})
    except ValueError:
        return False
    return _dry_run_problem(model) is None


def _check_dry_run(name: str, model: StagedModel, num_classes: int, options: dict[str, Any],
                   dtype: torch.dtype | None, dataset: str | None) -> None:
    """The dry run, once per process for each model config (it passed: the config is remembered)."""
    key = _key(name, model.input_shape, num_classes, options)
    if key in _CHECKED:
        return
    reason = _dry_run_problem(model)
    if reason is not None:
        raise _input_error(name, model.input_shape, num_classes, dtype, dataset, reason)
    _CHECKED.add(key)


def _check_custom(input_shape: Sequence[int], num_classes: int, dtype: torch.dtype | None, dataset: str | None,
                  stages_for: str | None, options: dict[str, Any]) -> str | None:
    """``model=custom``: its arguments, one dry forward pass, and stages when an algorithm needs them;
    returns why a training batch of one sample fails (or None)."""
    ref = target_name(split_options(options)[0])
    shape = tuple(int(s) for s in input_shape)
    key = (CUSTOM, shape, num_classes, str(dtype), stages_for, repr(sorted(options.items())))
    if key in _CHECKED_CUSTOM:
        return _CHECKED_CUSTOM[key]
    with torch.random.fork_rng(devices=[]):
        model = build_model(CUSTOM, shape, num_classes, **options)
    kind = "" if dtype is None else ("token-id " if _is_tokens(dtype) else "float ")
    where = f"{kind}samples of shape {'x'.join(map(str, shape)) or 'scalar'}"
    if dataset:
        where = f"dataset={dataset}, which gives {where}"
    reason = dry_run_problem(model, shape, num_classes, dtype)
    if reason is not None:
        raise ModelInputError(f"model._target_={ref} cannot train on {where}: {reason}")
    if stages_for is not None and not isinstance(model, StagedModel):
        raise ModelInputError(
            f"algorithm={stages_for} cuts the model into stages, but model._target_={ref} builds a "
            f"{type(model).__name__}, which has none: subclass fl_platform.models.StagedModel (named stages, "
            "the last an nn.Linear named 'head'), or return an nn.Sequential ending in an nn.Linear")
    _CHECKED_CUSTOM[key] = one_sample_problem(model, shape, dtype)
    return _CHECKED_CUSTOM[key]


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (each shared parameter counted once)."""
    return sum(p.numel() for p in model.parameters())


__all__ = [
    "CNN",
    "FUSEFL_RESNET18_CUTS",
    "MLP",
    "MODELS",
    "CharLSTM",
    "ModelInputError",
    "ResNet18",
    "StagedModel",
    "build_model",
    "check_model_input",
    "count_parameters",
    "model_options",
]
