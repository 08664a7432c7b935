"""Run experiments from Python (notebooks, scripts): the same code path as the command line.

With overrides, exactly what ``python -m fl_platform.run <overrides>`` runs::

    from fl_platform import api
    result = api.run(["algorithm=fedprox", "rounds=20", "num_clients=20", "clients_per_round=5"])
    result.summary["final_test_accuracy"], result.history[-1]

With the user's objects instead of names (any of them; the rest comes from the overrides)::

    result = api.run(["rounds=20"], model=make_net,                  # an nn.Module class or factory
                     data=(train_x, train_y, test_x, test_y),         # arrays/tensors, Datasets, or a SourceData
                     partition="dirichlet",                           # a partitioner, or one index list per client
                     algorithm=my_algorithm.SPEC)                     # an AlgorithmSpec (or a name)

Objects become config entries (``model=custom model._target_=...``, ``dataset=custom ...``, the
spec registered as ``algorithm=<its name>``), so they are validated like any config and recorded
in config.yaml: an object with an import path is recorded by it; one defined in a notebook gets a
reference that only this process resolves (fl_platform/plugins.py). Everything runs on every
engine (``engine=ray`` pickles such objects to the workers by value).

The CLI (fl_platform/run.py) is this module's :func:`run_config` behind Hydra's command line.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from fl_platform.algorithms.base import AlgorithmSpec
from fl_platform.datasets.source import SourceData, check_test_classes, refuse_fractions

__all__ = ["Result", "compose", "overrides_for", "run", "run_config", "source_from"]


@dataclass
class Result:
    """What a run gives back: the summary (as summary.json), one metrics row per round (as
    metrics.jsonl), the composed config, the run directory (None when nothing was written) and the
    final global model (a fresh instance of the run's model with the server's last weights, on the CPU,
    in eval mode; as model.pt holds them)."""

    summary: dict[str, Any]
    history: list[dict[str, Any]]
    config: DictConfig
    run_dir: Path | None = None
    model: Any = None  # torch.nn.Module

    def metric(self, name: str) -> list[tuple[int, float]]:
        """(round, value) for every round whose row has ``name`` (e.g. ``test_accuracy``)."""
        return [(row["round"], row[name]) for row in self.history if name in row]


def compose(overrides: Sequence[str] = (), *, model: Any = None, data: Any = None, partition: Any = None,
            algorithm: Any = None, callbacks: Sequence[Any] = ()) -> DictConfig:
    """The config :func:`run` would run for these overrides and objects (see :func:`overrides_for`).

    An override of a key the objects set (``model=cnn`` or ``model._target_=...`` beside ``model=``,
    ``dataset=...`` beside ``data=``, ``partition=``/``num_clients=`` beside index lists,
    ``algorithm=`` beside ``algorithm=``, ``callbacks=[...]`` beside ``callbacks=``) is refused
    naming both: neither would win silently."""
    from fl_platform.config import compose as compose_config
    from fl_platform.plugins import hold_for

    overrides = _override_list(overrides)
    given = overrides_for(model=model, data=data, partition=partition, algorithm=algorithm, callbacks=callbacks)
    _refuse_conflicts(overrides, given)
    cfg = compose_config([*overrides, *given])
    hold_for(cfg, given.held)  # its object: references resolve while cfg (or the Result holding it) is kept
    return cfg


def run(overrides: Sequence[str] = (), *, model: Any = None, data: Any = None, partition: Any = None,
        algorithm: Any = None, callbacks: Sequence[Any] = (), run_dir: str | os.PathLike[str] | None = None
        ) -> Result:
    """Compose the config from ``overrides`` and the objects, run it, return a :class:`Result`.

    ``callbacks``: a list, called after each round as ``on_round_end(round, metrics, model)`` (objects
    with that method, or functions); one that returns True stops the run, None or False goes on
    (fl_platform/rounds/callbacks.py).
    ``run_dir``: where config.yaml, metrics.jsonl, summary.json, model.pt and checkpoints go (as the
    CLI's run directory); None writes nothing.
    """
    _check_run_dir(run_dir)
    cfg = compose(overrides, model=model, data=data, partition=partition, algorithm=algorithm, callbacks=callbacks)
    return run_config(cfg, run_dir)


def _override_list(overrides: Any) -> list[str]:
    """``overrides`` as a list of strings, or a TypeError naming what is wrong."""
    if isinstance(overrides, str | bytes) or not isinstance(overrides, Sequence):
        raise TypeError(f"overrides must be a list of strings such as ['rounds=20'], got a {type(overrides).__name__}"
                        + (f" ({overrides!r}: pass [{overrides!r}])" if isinstance(overrides, str) else ""))
    bad = [(i, o) for i, o in enumerate(overrides) if not isinstance(o, str)]
    if bad:
        i, o = bad[0]
        raise TypeError(f"overrides[{i}] must be a string such as 'rounds=20', got a {type(o).__name__} ({o!r})")
    return list(overrides)


def _check_run_dir(run_dir: Any) -> None:
    if run_dir is not None and not isinstance(run_dir, str | os.PathLike):
        raise TypeError(f"run_dir must be a path (a str or os.PathLike) or None, got a {type(run_dir).__name__} "
                        f"({run_dir!r})")


def _override_key(override: str) -> str:
    """The config key an override sets or deletes (``+model.width=3`` -> ``model.width``)."""
    key = override.split("=", 1)[0].strip().lstrip("~+")
    return key.split("@", 1)[0]


def _refuse_conflicts(overrides: list[str], given: list[str]) -> None:
    """Refuse an override whose key one of the objects' overrides sets (unless it is that same override)."""
    set_by = {_override_key(g): g for g in given}
    for override in overrides:
        key = _override_key(override)
        if key in set_by and override.strip().lstrip("+") != set_by[key]:
            raise ValueError(f"override {override!r} conflicts with the {_ARGUMENT[key.split('.')[0]]}= argument, "
                             f"which sets {set_by[key]!r}: drop one of them")


#: The api.run argument behind each config key its objects set.
_ARGUMENT = {"model": "model", "dataset": "data", "partition": "partition", "num_clients": "partition",
             "algorithm": "algorithm", "callbacks": "callbacks"}


def run_config(cfg: DictConfig, run_dir: str | os.PathLike[str] | None = None) -> Result:
    """Run a composed config (what the CLI calls after Hydra composed it); ``execute`` reads it at the door
    (fl_platform/run_config.py) and checks it (fl_platform/config_checks.py)."""
    from fl_platform.experiment import execute
    from fl_platform.rounds.checkpoint import rng_state, set_rng_state

    caller = rng_state()  # the run seeds torch's (and CUDA's) global RNG from its own seed: the caller's goes on after
    try:
        outcome = execute(cfg, run_dir)
    finally:
        set_rng_state(caller)
    return Result(outcome.summary, outcome.history, cfg, Path(run_dir) if run_dir is not None else None,
                  outcome.model)


# ---------------------------------------------------------------- objects -> overrides


class _Overrides(list[str]):
    """Overrides, with ``held``: what keeps their ``object:`` references resolvable (plugins.object_ref)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Any] = []


def overrides_for(model: Any = None, data: Any = None, partition: Any = None, algorithm: Any = None,
                  callbacks: Sequence[Any] = ()) -> _Overrides:
    """The Hydra overrides that make the run use these objects; the objects they name by an ``object:``
    reference stay loadable while the returned list is kept (:func:`compose` ties them to its config).

    * ``model``: an ``nn.Module`` subclass or a function returning a module, called with
      ``input_shape``/``num_classes`` when it takes them (fl_platform/models/custom.py); or a name.
    * ``data``: a ``SourceData``; ``(train_x, train_y, test_x, test_y)`` arrays or tensors; or
      ``(train, test)`` torch Datasets of ``(x, y)`` pairs (read once, into tensors); or a name.
    * ``partition``: a partitioner's name (``dirichlet``, ...), or one sequence of training-sample
      indices per client (each sample in at most one client; num_clients becomes their number).
    * ``algorithm``: an ``AlgorithmSpec`` (registered under its name in this process), or a name.
    * ``callbacks``: objects with ``on_round_end(round, metrics, model)``, or such functions (``callbacks=``).
    """
    from fl_platform.algorithms.registry import register_algorithm
    from fl_platform.plugins import object_ref

    out = _Overrides()
    held = out.held
    if isinstance(model, str):
        out.append(f"model={model}")
    elif model is not None:
        from torch import nn

        if not callable(model) or isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module class, a function returning one, or a model name; "
                            f"got a {type(model).__name__} (pass the class or a factory, not an instance: "
                            "every client and worker builds its own)")
        out += ["model=custom", f"model._target_={_quote(object_ref(model, held))}"]
    groups: list[np.ndarray] | None = None
    if isinstance(partition, str):
        out.append(f"partition={partition}")
    elif partition is not None:
        if isinstance(partition, np.ndarray | bytes) or not isinstance(partition, Sequence):
            raise TypeError("partition must be a partitioner's name or a list with one sequence of training-sample "
                            f"indices per client, got a {type(partition).__name__}")
        groups = [_indices(ix, i) for i, ix in enumerate(partition)]
        out += ["partition=natural", f"num_clients={len(groups)}"]
    if isinstance(data, str):
        if groups is not None:
            raise ValueError("partition as index lists needs data as objects (the samples they index), not a name")
        out.append(f"dataset={data}")
    elif data is not None:
        source = source_from(data)
        if groups is not None:
            source = _with_clients(source, groups)
        out += ["dataset=custom", f"dataset._target_={_quote(object_ref(_Given(source), held))}"]
    elif groups is not None:
        raise ValueError("partition as index lists needs data= (the samples they index)")
    if isinstance(algorithm, AlgorithmSpec):
        out.append(f"algorithm={register_algorithm(algorithm)}")
    elif isinstance(algorithm, str):
        out.append(f"algorithm={algorithm}")
    elif algorithm is not None:
        raise TypeError(f"algorithm must be an AlgorithmSpec or a name, got a {type(algorithm).__name__}")
    if isinstance(callbacks, str | bytes) or not isinstance(callbacks, Sequence):
        raise TypeError(f"callbacks must be a list of callbacks (functions or objects with on_round_end), got a "
                        f"{type(callbacks).__name__}" + (" (pass [fn])" if callable(callbacks) else ""))
    if callbacks:
        for cb in callbacks:
            if not callable(getattr(cb, "on_round_end", cb)):
                raise TypeError(f"callbacks: a {type(cb).__name__} has no on_round_end(round, metrics, model) and is "
                                "not callable")
        out.append("callbacks=[" + ",".join(_quote(object_ref(cb, held)) for cb in callbacks) + "]")
    return out


def _indices(ix: Any, client: int) -> np.ndarray:
    """Client ``client``'s training-sample indices as int64: integers, or floats that are whole numbers;
    a boolean mask, fractions and non-numbers are refused naming the client."""
    where = f"partition[{client}]"
    if hasattr(ix, "detach"):
        ix = ix.detach().cpu().numpy()
    try:
        a = np.asarray(ix).reshape(-1)
    except Exception as err:
        raise TypeError(f"{where} is not a sequence of sample indices ({type(ix).__name__}: {err})") from err
    if a.dtype == bool:
        raise TypeError(f"{where} is a boolean mask; partition takes index lists, not masks "
                        "(pass np.flatnonzero(mask) for each client)")
    if a.size == 0 or a.dtype.kind in "iu":
        return a.astype(np.int64)
    if a.dtype.kind != "f":
        raise TypeError(f"{where} must hold integer sample indices, got dtype {a.dtype} (e.g. {a[0]!r})")
    refuse_fractions(a, f"{where} must hold integer sample indices")
    return a.astype(np.int64)


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


@dataclass(frozen=True)
class _Given:
    """A loader (``dataset._target_``) that returns data given as an object."""

    source: SourceData

    def __call__(self) -> SourceData:
        return self.source


def _array(value: Any, what: str) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except Exception as err:  # ragged nested lists: numpy's "inhomogeneous shape"
        raise TypeError(f"data: {what} is not an array or tensor ({type(value).__name__}: {err})") from err


def source_from(data: Any, name: str = "python") -> SourceData:
    """``data`` (see :func:`overrides_for`) as the platform's source form."""
    if isinstance(data, SourceData):
        return data
    names = ("train_x", "train_y", "test_x", "test_y")
    if isinstance(data, tuple | list) and len(data) == 2 and all(_is_dataset(d) for d in data):
        (train_x, train_y), (test_x, test_y) = (_read_dataset(d, w) for d, w in zip(data, ("train", "test")))
        names = ("the train dataset's x", "the train dataset's y", "the test dataset's x", "the test dataset's y")
    elif isinstance(data, tuple | list) and len(data) == 4:
        train_x, train_y, test_x, test_y = (_array(v, w) for v, w in zip(data, ("train_x", "train_y", "test_x",
                                                                                 "test_y")))
    else:
        raise TypeError("data must be a SourceData, (train_x, train_y, test_x, test_y) arrays or tensors, or "
                        f"(train, test) torch Datasets; got {type(data).__name__}")
    for what, y in ((names[1], train_y), (names[3], test_y)):
        if y.ndim != 1 or not (np.issubdtype(y.dtype, np.integer) or y.dtype == bool):
            raise TypeError(f"data: {what} must be a 1-d array of integer class ids, got dtype {y.dtype} "
                            f"shape {y.shape}")
    if len(train_y) == 0:
        raise ValueError("data: the training set is empty")
    if train_y.min() < 0 or (len(test_y) and test_y.min() < 0):
        raise ValueError("data: class ids must be >= 0")
    num_classes = int(train_y.max()) + 1  # the classes the clients can learn
    check_test_classes("data", test_y, num_classes, "Fix the labels, or pass a SourceData with num_classes set if "
                       "the model must have those outputs")
    for what, x in ((names[0], train_x), (names[2], test_x)):
        if x.dtype.kind not in "fiub":
            raise TypeError(f"data: {what} holds {x.dtype} values; features must be numbers (floats, or integer "
                            "token ids)")
    floats = train_x.dtype.kind == "f"
    if len(test_x) and (test_x.dtype.kind == "f") != floats:  # (an empty test set has no dtype of its own)
        raise TypeError(f"data: {names[0]} is {train_x.dtype} and {names[2]} {test_x.dtype}: both must be float features or "
                        "both integer token ids (convert one explicitly)")
    features = (lambda a: a.astype(np.float32, copy=False)) if floats \
        else (lambda a: a.astype(np.int64, copy=False))  # integer features: token ids
    return SourceData(features(train_x), train_y.astype(np.int64), features(test_x), test_y.astype(np.int64),
                      num_classes=num_classes, input_shape=tuple(train_x.shape[1:]), name=name)


def _is_dataset(obj: Any) -> bool:
    return hasattr(obj, "__getitem__") and hasattr(obj, "__len__") and not isinstance(obj, np.ndarray) \
        and not hasattr(obj, "detach")


def _read_dataset(ds: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Every ``(x, y)`` pair of a map-style Dataset, stacked (x: float32 or integer tokens, y: int64)."""
    xs, ys = [], []
    for i in range(len(ds)):
        item = ds[i]
        if not isinstance(item, tuple | list) or len(item) != 2:
            kind = f"a {type(item).__name__} of {len(item)}" if isinstance(item, tuple | list) else f"a {type(item).__name__}"
            raise TypeError(f"data: {what} dataset item {i} is not an (x, y) pair: {kind}")
        xs.append(_array(item[0], f"{what}[{i}][0]"))
        ys.append(_array(item[1], f"{what}[{i}][1]"))
        for part, got, first in (("x", xs[-1], xs[0]), ("y", ys[-1], ys[0])):
            if got.shape != first.shape:
                raise ValueError(f"data: {what} dataset item {i} has {part} of shape {got.shape}, item 0 of shape "
                                 f"{first.shape}: every item's {part} must have one shape")
    if not xs:
        return np.zeros((0,), np.float32), np.zeros((0,), np.int64)
    return np.stack(xs), np.stack(ys)  # the labels are checked as given (no int(): 1.7 is refused, not cut to 1)


def _with_clients(source: SourceData, groups: list[np.ndarray]) -> SourceData:
    """``source`` keeping the training samples the clients hold, each tagged with its client (a natural
    group), in client order, so ``partition=natural`` gives exactly these clients."""
    from dataclasses import replace

    order = np.concatenate(groups) if groups else np.zeros(0, np.int64)
    if len(order) and (order.min() < 0 or order.max() >= source.num_train):
        raise ValueError(f"partition: indices must be in 0..{source.num_train - 1}")
    if len(np.unique(order)) != len(order):
        raise ValueError("partition: a training sample is in two clients (or twice in one)")
    if any(len(g) == 0 for g in groups):
        raise ValueError(f"partition: client {next(i for i, g in enumerate(groups) if len(g) == 0)} has no samples")
    owner = np.repeat(np.arange(len(groups), dtype=np.int64), [len(g) for g in groups])
    return replace(source, train_x=np.asarray(source.train_x)[order], train_y=source.train_y[order], train_groups=owner,
                   test_groups=None, group_names=[str(i) for i in range(len(groups))])
