"""The user's own ``nn.Module`` as the run's model (``model=custom model._target_=mypkg.nets:WideNet``).

``_target_`` is a class or a function returning an ``nn.Module``. It is called with its own
arguments from the config section (``+model.width=64``) plus ``input_shape`` (one sample's shape,
a tuple) and ``num_classes`` (the number of logits the run needs) when its signature takes them.

Any module trains with the algorithms that treat the model as a whole (FedAvg, FedProx, SCAFFOLD,
BAOW, the one-shot methods); its forward must return ``[batch, num_classes]`` logits and it must
survive having its parameters re-pointed into one flat buffer (no cached parameter references, no
weight tying; see fl_platform/models/base.py). Split algorithms (FedImpro, VHL, FuseFL) cut the
model into stages and need a :class:`StagedModel`: subclass it, or return an ``nn.Sequential``
ending in an ``nn.Linear``, which is turned into one (its layers the stages, the last the ``head``).
Both are checked at start-up with a dry forward pass in training and in eval mode, and for weights the
platform can carry (:func:`dry_run_problem`); a target that returns one cached instance is refused at
its second call.
"""

from __future__ import annotations

import contextlib
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from fl_platform.models.base import StagedModel
from fl_platform.plugins import check_arguments, describe, load, parameters

CUSTOM = "custom"
TARGET = "_target_"
#: Arguments the platform fills when the target's signature takes them.
FILLED = ("input_shape", "num_classes")


class SequentialStages(StagedModel):
    """An ``nn.Sequential`` ending in an ``nn.Linear`` as a :class:`StagedModel` (same modules, same
    forward): a stage per layer, named as in the Sequential (``stage<i>`` for numbered layers), the
    last one ``head``."""

    def __init__(self, seq: nn.Sequential, input_shape: Sequence[int]) -> None:
        items = list(seq.named_children())
        stages: OrderedDict[str, nn.Module] = OrderedDict()
        for i, (key, module) in enumerate(items):
            name = "head" if i == len(items) - 1 else (key if key.isidentifier() and key != "head" else f"stage{key}")
            stages[name] = module
        super().__init__(stages, input_shape)
        if isinstance(items[0][1], nn.Embedding):
            self.input_dtype = torch.long


def as_staged(model: nn.Module, input_shape: Sequence[int]) -> nn.Module:
    """``model``, as a :class:`StagedModel` when it is an ``nn.Sequential`` ending in ``nn.Linear``."""
    if (type(model) is nn.Sequential and len(model) > 0 and isinstance(model[-1], nn.Linear)
            and all(k.isidentifier() or k.isdigit() for k, _ in model.named_children())):
        return SequentialStages(model, input_shape)
    return model


Target = str | Callable[..., nn.Module]  # an import path, or the class/function it names (resolved)


def split_options(options: dict[str, Any]) -> tuple[Target, dict[str, Any]]:
    """(``_target_``, the user's arguments) of a ``model=custom`` section's options."""
    options = dict(options)
    ref = options.pop(TARGET, None)
    if ref is None or (isinstance(ref, str) and ref.strip() in ("", "???")):
        raise ValueError("model=custom needs model._target_=<module>:<class or function> returning an nn.Module")
    return ref, options


def target_name(target: Target) -> str:
    """``target`` as an import path, for messages."""
    if isinstance(target, str):
        return target
    return f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', type(target).__name__)}"


def builder_of(target: Target, options: dict[str, Any]) -> Callable[..., nn.Module]:
    """The callable ``target`` names (or is), with ``options`` checked against its signature."""
    fn = load(target, "model._target_") if isinstance(target, str) else target
    if not callable(fn):
        raise TypeError(f"model._target_={target} is a {type(fn).__name__}, not a class or function")
    check_arguments(fn, options, FILLED, "model", target_name(target))
    return fn


def build_custom(target: Target, input_shape: Sequence[int], num_classes: int, options: dict[str, Any]) -> nn.Module:
    """Call ``target`` with ``options`` and what it takes of ``input_shape``/``num_classes``."""
    ref = target_name(target)
    fn = builder_of(target, options)
    named, _ = parameters(fn)
    filled = {"input_shape": tuple(int(s) for s in input_shape), "num_classes": int(num_classes)}
    model = fn(**{k: v for k, v in filled.items() if k in named}, **options)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model._target_={ref}: {describe(fn)} returned a {type(model).__name__}, not an nn.Module")
    if model in _BUILT:
        raise ValueError(f"model._target_={ref} returned the {type(model).__name__} instance it had returned "
                         "before; every call must build a new module (the server, the evaluator and each client train "
                         "their own copy, so a shared one changes the results)")
    _BUILT.add(model)
    return as_staged(model, input_shape)


#: The modules :func:`build_custom` returned in this process (while they live): a target that hands
#: out one cached instance is refused at its second call (at start-up: the check builds one, the run another).
_BUILT: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def dry_run_problem(model: nn.Module, input_shape: tuple[int, ...], num_classes: int,
                    dtype: torch.dtype | None) -> str | None:
    """Why ``model`` cannot be the run's model, or None: a training-mode forward pass of two zero samples
    and an eval-mode one of one sample must give ``[batch, num_classes]`` floating-point logits, and its
    parameters and buffers must be what the platform carries between server and clients.

    Two samples in training mode: the mode every client trains in (dropout, BatchNorm's batch
    statistics), with the fewest samples BatchNorm can normalise (one sample has no batch statistics:
    a BatchNorm MLP is valid, and a client's last batch of one fails only where the data make one,
    not here). One sample in eval mode: evaluation batches can hold one, and a forward that drops the
    batch axis (``squeeze()``) shows itself. Restores every buffer and module's mode and forks the CPU
    RNG (draws nothing from the run's)."""
    if (reason := layout_problem(model)) is not None:
        return reason
    dims = "x".join(map(str, input_shape)) or "scalar"
    with _untouched(model):
        for train, batch in ((True, 2), (False, 1)):
            what = (f"a training-mode forward pass of two samples of shape {dims}" if train
                    else f"an eval-mode forward pass of one sample of shape {dims}")
            out = _forward(model, train, batch, input_shape, dtype)
            if isinstance(out, str):  # the user's forward raised: any error is a reason to refuse the pair
                return f"{what} fails: {out}"
            if not isinstance(out, torch.Tensor):
                return f"its forward returns a {type(out).__name__}, not a tensor of logits"
            if tuple(out.shape) != (batch, num_classes):
                return (f"{what} returns shape {tuple(out.shape)}; the run needs ({batch}, {num_classes}) logits "
                        "(num_classes is passed to the constructor when it takes a num_classes argument)")
            if not out.is_floating_point():
                return (f"its forward returns {out.dtype} logits; the loss needs floating-point logits (return the "
                        "scores, not class ids)")
    return None


def one_sample_problem(model: nn.Module, input_shape: tuple[int, ...], dtype: torch.dtype | None) -> str | None:
    """Why a training-mode forward pass of one sample fails (a BatchNorm over features has no batch
    statistics for one sample), or None. Not a reason to refuse the model: only a client whose data
    make a one-sample batch cannot train (config_checks.check_setup names them)."""
    with _untouched(model):
        out = _forward(model, True, 1, input_shape, dtype)
    return out if isinstance(out, str) else None


def _forward(model: nn.Module, train: bool, batch: int, input_shape: tuple[int, ...],
             dtype: torch.dtype | None) -> Any:
    """``model``'s output for ``batch`` zero samples in training or eval mode, or the first line of the
    error its forward raised."""
    ref = next(iter(model.parameters()), None)
    dtype = dtype or getattr(model, "input_dtype", None) or (ref.dtype if ref is not None else torch.float32)
    model.train(train)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            return model(torch.zeros((batch, *input_shape), dtype=dtype))
    except Exception as err:  # the user's forward: any error
        return (str(err).strip().splitlines() or [type(err).__name__])[0]


@contextlib.contextmanager
def _untouched(model: nn.Module) -> Iterator[None]:
    """Every buffer and module's mode as before, whatever the forward passes inside did."""
    modes = [m.training for m in model.modules()]
    saved = [b.detach().clone() for b in model.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, s in zip(model.buffers(), saved):
                b.copy_(s)
        for m, mode in zip(model.modules(), modes):
            m.training = mode


def layout_problem(model: nn.Module) -> str | None:
    """Why the platform cannot carry ``model``'s weights in its flat vector (parameters, then floating
    buffers; fl_platform/training/flat.py) and load them back into a fresh instance, or None."""
    if not list(model.parameters()):
        return "it has no parameters to train"
    for kind, named in (("parameter", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        names: dict[int, list[str]] = {}
        for name, t in named:
            if t is not None:
                names.setdefault(id(t), []).append(name)
        shared = [n for n in names.values() if len(n) > 1]
        if shared:
            return (f"{kind}s {' and '.join(shared[0])} are one tensor (tied weights, or a {kind} kept under a second "
                    f"name); the platform carries each {kind} once and cannot load a model whose state_dict "
                    "repeats one: untie them, or keep the second reference out of the module (not as an attribute)")
    carried = dict(model.named_parameters())
    carried.update((n, b) for n, b in model.named_buffers() if b is not None and b.is_floating_point())
    state = model.state_dict()
    dropped = [f"{n} ({state[n].dtype})" for n in state if n not in carried and not _batchnorm_count(model, n)]
    if dropped:
        return (f"its state_dict holds {', '.join(dropped)}, which the platform does not carry (only parameters and "
                "floating-point buffers are averaged and sent): make it a float buffer, or register it with "
                "persistent=False")
    return None


def _batchnorm_count(model: nn.Module, name: str) -> bool:
    """Whether ``name`` is a BatchNorm's ``num_batches_tracked`` (BatchNorm fills it in when a state_dict lacks it)."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    return attr == "num_batches_tracked" and isinstance(module, nn.BatchNorm1d | nn.BatchNorm2d | nn.BatchNorm3d
                                                          | nn.SyncBatchNorm)
