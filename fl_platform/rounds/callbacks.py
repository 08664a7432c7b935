"""Between rounds: the user's callbacks and early stopping on a validation split.

A callback is ``on_round_end(round, metrics, model) -> bool | None``, called on the driver after each
round's metrics row is written (``round`` 1-based as in metrics.jsonl, ``metrics`` a copy of the row,
``model`` the global model as an ``nn.Module`` with the round's weights: read it, do not train it). A
True return stops the run after that round, False or None goes on, anything else (a string, a tensor)
is refused naming the callback; its signature is checked at start-up; the summary's ``stop_reason`` names the callback. It is
an object with an ``on_round_end`` method, or a function with that signature. From Python:
``api.run(..., callbacks=[fn, obj])``; in a config, ``callbacks`` is a list of import paths or of
``{_target_: mypkg.cb:StopAt, <argument>: <value>}`` (a class or function called with those
arguments to make the callback; they are checked against its signature and annotations at start-up).

Early stopping (``early_stop.patience > 0``) holds out ``early_stop.val_fraction`` of each client's
training rows (stratified by label, from (seed, client): the same rows whatever the engine; never the
test set), evaluates the global model on them whenever the test set is (``val_loss``,
``val_accuracy`` in the row), and stops once ``early_stop.metric`` has not improved by more than
``min_delta`` for ``patience`` evaluations. The decision is a function of the metrics rows alone, so
a resumed run decides as the uninterrupted one did (and one that had stopped stops again at once).
User callbacks keep their own state: a resumed run calls them from the checkpoint's round on.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fl_platform.datasets.federated import FederatedDataset, split_local_test
from fl_platform.seeding import Stream

if TYPE_CHECKING:
    from fl_platform.rounds.simulation import Simulation

log = logging.getLogger(__name__)

METRICS = {"val_loss": min, "val_accuracy": max}  # the metric and which way is better


@dataclass
class EarlyStopConf:
    """``early_stop``: stop when the validation metric stops improving (0 patience: off)."""

    patience: int = 0  # evaluations without improvement before the run stops; 0: no early stopping
    val_fraction: float = 0.1  # of each client's training rows, held out as the validation split
    metric: str = "val_loss"  # val_loss (lower is better) or val_accuracy
    min_delta: float = 0.0  # an improvement by this much or less does not count

    def problems(self) -> list[tuple[str, str]]:
        checks = [
            (self.patience >= 0, "patience", f"must be >= 0 (0: off), got {self.patience}"),
            (0.0 < self.val_fraction < 1.0, "val_fraction", f"must be in (0, 1), got {self.val_fraction}"),
            (self.metric in METRICS, "metric", f"must be one of {', '.join(METRICS)}; got {self.metric!r}"),
            (self.min_delta >= 0, "min_delta", f"must be >= 0, got {self.min_delta}"),
        ]
        return [(key, why) for ok, key, why in checks if not ok]

    def inactive_fields(self) -> dict[str, str]:
        if self.patience == 0:
            return dict.fromkeys(("val_fraction", "metric", "min_delta"),
                                 "early stopping is off (early_stop.patience=0)")
        return {}

    def stop_reason(self, history: Sequence[dict[str, Any]]) -> str | None:
        """Why the run stops after the last row of ``history``, or None."""
        better = METRICS[self.metric]
        best, since = None, 0
        for row in history:
            value = row.get(self.metric)
            if value is None:
                continue
            if best is None or (value < best - self.min_delta if better is min else value > best + self.min_delta):
                best, since = value, 0
            else:
                since += 1
        if best is not None and since >= self.patience:
            return (f"early stopping: {self.metric} has not improved on {best:.6g} by more than {self.min_delta} "
                    f"for {since} evaluations (early_stop.patience={self.patience})")
        return None


def validation_split(data: FederatedDataset, conf: EarlyStopConf, seed: int,
                     ) -> tuple[FederatedDataset, tuple[torch.Tensor, torch.Tensor] | None]:
    """``data`` without each client's validation rows, and those rows' (features, labels); unchanged
    and None when early stopping is off."""
    if conf.patience == 0:
        return data, None
    if len(data.train_blocks) != 1:
        raise NotImplementedError(f"early_stop: {data.name} holds its training features in "
                                  f"{len(data.train_blocks)} row blocks; a validation split of them is not "
                                  "implemented (early_stop.patience=0)")
    train, val = split_local_test(data.partition, data.train_y.numpy(), conf.val_fraction, seed, Stream.VALIDATION)
    rows = torch.from_numpy(np.sort(val.indices))  # (in row order)
    if rows.numel() == 0:
        raise ValueError(f"early_stop.val_fraction={conf.val_fraction} holds out no row (every client has fewer "
                         "than 2 samples)")
    return replace(data, partition=train), (data.train_x[rows], data.train_y[rows])


def load_callbacks(items: Sequence[Any]) -> list[Callable[..., Any]]:
    """The ``on_round_end`` callables of config ``callbacks`` (see the module docstring)."""
    from fl_platform.plugins import PluginError, check_arguments, describe, load

    out = []
    for i, item in enumerate(items):
        key = f"callbacks[{i}]"
        if isinstance(item, dict):
            args = dict(item)
            ref = args.pop("_target_", None)
            if ref is None:
                raise PluginError(f"{key} needs _target_=<module>:<class or function> (got keys {', '.join(item)})")
            target = load(str(ref), f"{key}._target_")
            check_arguments(target, args, (), key, str(ref))
            obj = target(**args)
        else:
            obj = load(str(item), key)
            if isinstance(obj, type):
                check_arguments(obj, {}, (), key, str(item))
                obj = obj()
        fn = getattr(obj, "on_round_end", obj)
        if not callable(fn):
            raise PluginError(f"{key}: {describe(type(obj))} has no on_round_end(round, metrics, model) and is "
                              "not callable")
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # no signature to read (a builtin): it is called as it is
            signature = None
        if signature is not None:
            try:
                signature.bind(1, {}, None)
            except TypeError as err:
                raise PluginError(f"{key}: {_name(fn)}{signature} cannot be called as on_round_end(round, metrics, "
                                  f"model): {err}") from None
        out.append(fn)
    return out


def _name(fn: Callable[..., Any]) -> str:
    owner = getattr(fn, "__self__", None)
    obj = owner if owner is not None else fn
    return getattr(obj, "__qualname__", None) or type(obj).__qualname__


class RoundEnd:
    """What runs after each round's row: early stopping, then the callbacks (in order)."""

    def __init__(self, callbacks: Sequence[Callable[..., Any]], early: EarlyStopConf | None,
                 validation: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.callbacks = list(callbacks)
        self.early = early if early is not None and early.patience > 0 else None
        self.validation = validation

    def evaluate(self, sim: Simulation) -> dict[str, float]:
        """Validation metrics of the global model (early stopping), or {}; the set is the evaluator's
        ``validation`` (experiment.build hands it over)."""
        if self.validation is None:
            return {}
        out = sim.evaluator.evaluate(sim.server, "validation", sim.loop.eval_batch_size)
        return {"val_loss": out["test_loss"], "val_accuracy": out["test_accuracy"]}

    def stop_reason(self, sim: Simulation) -> str | None:
        """Why the run stops after its last row: early stopping, or a callback that returned true."""
        if self.early is not None and (reason := self.early.stop_reason(sim.history)) is not None:
            return reason
        if not self.callbacks or not sim.history:
            return None
        row = sim.history[-1]
        sim.eval_model.load(sim.server.weights.to(sim.eval_model.device))
        model = sim.eval_model.model
        for fn in self.callbacks:
            answer = fn(int(row["round"]), dict(row), model)
            if answer is None or answer is False or answer is np.False_:
                continue
            if answer is True or answer is np.True_:
                return f"callback {_name(fn)} stopped the run after round {row['round']}"
            raise TypeError(f"callback {_name(fn)} returned a {type(answer).__name__} ({answer!r:.60}) after round "
                            f"{row['round']}; on_round_end must return True (stop), False or None (go on)")
        return None
