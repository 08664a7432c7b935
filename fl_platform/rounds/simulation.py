"""The server's round loop, shared by every engine.

Per round: sample clients from (seed, round), build the broadcast once, let the engine train
the clients on its workers, reduce the partial aggregates in worker-id order, apply the
algorithm's server step, evaluate every ``eval_every`` rounds, log one metrics row, and
checkpoint every ``checkpoint_every`` rounds (``fl_platform/rounds/checkpoint.py``). The same loop
drives the simulation engines and, through an ``Engine`` adapter, Flower's ServerApp.

With client-level DP (``privacy=central|local``, fl_platform/privacy/server.py) the broadcast
carries the round's clip norm, the noise is added to the reduced sum before the server step (once,
from (seed, round), whichever engine), each row carries the epsilon spent so far, and the loop does
not start a round whose epsilon would exceed ``privacy.target_epsilon`` (the summary's
``stop_reason`` says so).

When the engine reports client states lost (``StateLost``: a node died with them), the loop rolls
the whole run back to its last checkpoint, exactly as a resume would (server state, client states,
scheduler, RNG, metrics rows), and reruns the rounds after it; the result equals an uninterrupted
run's. Without a checkpoint the run stops with the engine's error.

Metrics rows mix results (identical for every engine, worker count and resume) with timing and
scheduling fields (``is_timing_key``), which naturally differ between runs.
"""

from __future__ import annotations

import logging
import numbers
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fl_platform.algorithms.base import ServerAlgorithm
from fl_platform.core import Aggregate, ClientUpdate, Metrics, RoundContext
from fl_platform.datasets.federated import FederatedDataset
from fl_platform.outputs import MetricsLog
from fl_platform.reporting import Reporter
from fl_platform.rounds.checkpoint import Checkpoint, Checkpointer, set_rng_state
from fl_platform.rounds.engine import Engine, StateLost, busy_columns
from fl_platform.rounds.sampling import sample_clients
from fl_platform.training.flat import FlatModel
from fl_platform.training.loop import NonFiniteError

log = logging.getLogger(__name__)

#: Rollbacks to the same checkpoint before the run gives up (a fault that recurs on every rerun).
MAX_ROLLBACKS = 3
#: Columns of a round's row that the round loop itself writes (test_* are its evaluation's): a deployment's
#: client may not send a metric of these names (flower/records.py).
SERVER_COLUMNS = frozenset({"round", "num_clients", "bytes_up", "bytes_down", "round_time_s", "rejected_clients",
                            "rejected_reasons", "payload_bytes_up"})
#: Where a checkpoint keeps the privacy state (adaptive clipping's C), next to the server half's.
PRIVACY_STATE = "_privacy"


def is_timing_key(key: str) -> bool:
    """Fields that measure time or scheduling rather than results (excluded when comparing runs)."""
    return key.endswith("_s") or key.startswith(("sched_", "worker_"))


@dataclass
class LoopConfig:
    seed: int
    rounds: int
    clients_per_round: int
    eval_every: int = 1
    eval_batch_size: int = 1024
    sampling: str = "fixed"  # rounds/sampling.py: fixed-size, or Poisson (privacy.sampling)
    # the cohorts' seed (None: ``seed``); a Flower deployment under DP draws a secret one, since every client
    # is sent ``seed`` (fl_platform/flower/server_app.py)
    sampling_seed: int | None = None
    nonfinite: str = "fail"  # engine.nonfinite: a non-finite test loss or accuracy stops the run ("fail") or is logged


def server_metrics(server: Any, out: Any) -> dict[str, float]:
    """The metrics a server half's ``aggregate`` returned, as the row's numbers: a mapping of names to
    numbers (a 0-d tensor is read once, as the row writes it). A forgotten ``return {}`` (None), a list or a
    nested value is refused naming the class, not met later as "'NoneType' object is not a mapping"."""
    name = type(server).__name__
    if not isinstance(out, Mapping):
        raise TypeError(f"{name}.aggregate must return a dict of metric names to numbers ({{}} for none), got "
                        f"{type(out).__name__}")
    row: dict[str, float] = {}
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            value = value.item()
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name}.aggregate returned {key!r}: {type(value).__name__}; metrics must be numbers "
                            "under string names")
        row[key] = value
    return row


class Simulation:
    system: Any = None  # fl_platform.system.SystemModel (set by experiment.build): simulated time per row
    # fl_platform.privacy.server.ServerPrivacy (set by experiment.build and the Flower ServerApp): the
    # clip norm in the broadcast, noise on the reduced sum before the server step, epsilon per row,
    # and the stop before a round that would exceed privacy.target_epsilon.
    privacy: Any = None
    # fl_platform.rounds.client_eval.ClientEvaluation (set by experiment.build for eval.clients=all|sample):
    # per-client accuracies on local test splits, evaluated by the engine after the server step.
    client_eval: Any = None
    # fl_platform.rounds.callbacks.RoundEnd (set by experiment.build, api.run): validation metrics when the
    # test set is evaluated, then early stopping and the user's on_round_end callbacks after each row.
    round_end: Any = None
    stop_reason: str | None = None

    def __init__(self, loop: LoopConfig, data: FederatedDataset, server: ServerAlgorithm, engine: Engine,
                 eval_model: FlatModel, metrics: MetricsLog | None = None, reporter: Reporter | None = None,
                 checkpointer: Checkpointer | None = None) -> None:
        self.loop = loop
        self.server = server
        self.engine = engine
        self.eval_model = eval_model  # the driver's copy (model.pt, callbacks); evaluation goes through:
        self.evaluator = engine.evaluator(eval_model)
        self.evaluator.add("test", data.test_x, data.test_y)
        self.num_clients = data.num_clients
        self.metrics = metrics
        self.reporter = reporter
        self.history: list[dict[str, Any]] = []
        self.start_round = 0
        self.checkpointer = checkpointer
        self.rollbacks: dict[int, int] = {}  # checkpoint round -> times rolled back to it

    def evaluate(self) -> dict[str, float]:
        return self.evaluator.evaluate(self.server, "test", self.loop.eval_batch_size)

    def run_round(self, r: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        clients = sample_clients(self.loop.seed if self.loop.sampling_seed is None else self.loop.sampling_seed, r,
                                 self.num_clients, self.loop.clients_per_round, self.loop.sampling)
        ctx = RoundContext(round=r, seed=self.loop.seed, clients=clients, num_rounds=self.loop.rounds,
                           num_clients=self.num_clients)
        broadcast = self.server.broadcast(ctx)
        if self.privacy is not None:
            self.privacy.annotate(broadcast)
        # (Poisson sampling may draw nobody: the round is then the server's step on noise alone)
        results = sorted(self.engine.run_round(ctx, broadcast), key=lambda res: res.worker_id) if clients else []
        metrics = Metrics()
        rejected: dict[int, str] = {}
        for res in results:
            metrics.merge(res.metrics)
            rejected.update(res.rejected)
        if self.server.summable:
            combined: Aggregate | list[ClientUpdate] = Aggregate.reduce(res.aggregate for res in results)
        else:
            combined = sorted((u for res in results for u in res.updates), key=lambda u: u.client_id)
        private: dict[str, float] = {}
        if self.privacy is not None:  # (list-mode algorithms are refused under DP at start-up)
            private = self.privacy.privatise(ctx, combined)
        extra = server_metrics(self.server, self.server.aggregate(ctx, combined))
        if self.privacy is not None:
            private.update(self.privacy.after_round(r + 1))
        round_seconds = time.perf_counter() - t0
        row: dict[str, Any] = {  # the clients' means first: a server column of the same name wins
            **{k: v for k, v in metrics.means().items() if k != "local_steps"},
            "round": r + 1,
            "num_clients": len(clients) - len(rejected),
            "bytes_up": sum(res.bytes_up for res in results),
            "bytes_down": sum(res.bytes_down for res in results),
            "round_time_s": round_seconds,
            **extra,
            **private,
            **self.engine.round_stats(),
        }
        if rejected:
            row["rejected_clients"] = sorted(rejected)
        if self.system is not None:  # the straggler's download + compute + upload of its real payload
            row.update(self.system.round_metrics(r, {c: {**s, "bytes_down": broadcast.nbytes()}
                                                     for res in results for c, s in res.client_stats.items()}))
        last = r + 1 == self.loop.rounds or (self.privacy is not None and self.privacy.exceeds_target(r + 1))
        if (r + 1) % self.loop.eval_every == 0 or last:  # (the last round the privacy budget allows, too)
            t1 = time.perf_counter()
            row.update(self.evaluate())
            if self.round_end is not None:
                row.update(self.round_end.evaluate(self))
            row["eval_time_s"] = time.perf_counter() - t1
            if self.client_eval is not None:
                t1 = time.perf_counter()
                row.update(self.client_eval.run(ctx, self.server.weights, self.engine))
                row["client_eval_time_s"] = time.perf_counter() - t1
        if any(res.timings for res in results):  # how busy the workers were, evaluation included (it keeps them waiting)
            row.update(busy_columns(results, self.engine.num_workers, round_seconds, time.perf_counter() - t0,
                                    row.get("worker_transport_s")))
        return row

    def run(self) -> dict[str, Any]:
        wall0 = time.perf_counter()
        offset = self.history[-1].get("wall_time_s", 0.0) if self.history else 0.0
        r = self.start_round
        while r < self.loop.rounds:
            if self.round_end is not None and (reason := self.round_end.stop_reason(self)) is not None:
                self.stop_reason = reason  # (after the row just written, or a resumed run that had stopped)
                log.warning("%s", reason)
                break
            if self.privacy is not None and self.privacy.should_stop(r):
                log.warning("%s", self.privacy.stop_reason)
                break
            try:
                row = self.run_round(r)
                row["wall_time_s"] = offset + time.perf_counter() - wall0
                self.check_finite(r, row)
                self.history.append(row)
                if self.metrics is not None:
                    self.metrics.append(row)
                if self.reporter is not None:
                    self.reporter.round_done(row)
                self.after_round(r)
            except StateLost as err:
                self.roll_back(err)
                r = self.start_round
                continue
            r += 1
        if self.round_end is not None and self.stop_reason is None and r >= self.loop.rounds:
            self.round_end.stop_reason(self)  # the last round's callbacks (nothing is left to stop)
        return self.summary()

    def check_finite(self, r: int, row: dict[str, Any]) -> None:
        """A non-finite test metric means the global model itself is broken (e.g. a server step that
        corrupted BatchNorm statistics): under ``engine.nonfinite=fail`` the run stops before the row is
        written, as for a non-finite training loss; otherwise (and for the mean training loss) it is logged."""
        for key in ("test_accuracy", "test_loss", "train_loss"):
            value = row.get(key)
            if value is None or torch.isfinite(torch.tensor(value)):
                continue
            if key != "train_loss" and self.loop.nonfinite == "fail":
                raise NonFiniteError(f"round {r + 1}: the global model's {key} is {value} (engine.nonfinite=fail); "
                                     "the server step left a non-finite model or running statistics: lower the "
                                     "server's step (server_lr, server_opt.lr) or the local train.lr; "
                                     "engine.nonfinite=skip logs it and carries on")
            log.warning("round %d: %s is %s", r + 1, key, value)

    def roll_back(self, err: StateLost) -> None:
        """Continue from the last checkpoint after client states were lost, or stop with ``err``."""
        ckpt = self.checkpointer.load() if self.checkpointer is not None else None
        if ckpt is None:
            raise StateLost(f"{err}; no checkpoint to roll back to (checkpoint_every > 0 with a run dir recovers "
                            f"from this)") from err
        times = self.rollbacks[ckpt.round] = self.rollbacks.get(ckpt.round, 0) + 1
        if times > MAX_ROLLBACKS:
            raise StateLost(f"{err}; rolled back to the checkpoint after round {ckpt.round} {MAX_ROLLBACKS} times "
                            f"already") from err
        log.warning("%s; rolling back to the checkpoint after round %d", err, ckpt.round)
        self.restore(ckpt)

    def after_round(self, r: int) -> None:
        """Checkpoint when due (extension point for subclasses: call super)."""
        if self.checkpointer is not None and self.checkpointer.due(r + 1, self.loop.rounds):
            state = self.server.state_dict()
            if self.privacy is not None:  # (adaptive clipping's C)
                state = {**state, PRIVACY_STATE: self.privacy.state_dict()}
            self.checkpointer.save(r + 1, state, self.engine, self.history)

    def restore(self, ckpt: Checkpoint | None) -> None:
        """Continue after ``ckpt`` (None: start from round 1 with empty client state)."""
        if ckpt is None:
            self.engine.restore_state(None, None)
            self.start_round, self.history = 0, []
            if self.metrics is not None:
                self.metrics.replace([])
            if self.client_eval is not None:
                self.client_eval.truncate_after(0)
            return
        if ckpt.round > self.loop.rounds:
            raise ValueError(f"checkpoint {ckpt.path} is after round {ckpt.round}, beyond rounds={self.loop.rounds}")
        server_state = dict(ckpt.server)
        privacy_state = server_state.pop(PRIVACY_STATE, None)
        if (privacy_state is None) != (self.privacy is None):
            raise ValueError(f"checkpoint {ckpt.path} was made {'without' if privacy_state is None else 'with'} "
                             "client-level DP, this run is configured otherwise")
        self.server.load_state_dict(server_state)
        if self.privacy is not None:
            self.privacy.load_state_dict(privacy_state)
        self.engine.load_state_dict(ckpt.engine)
        self.engine.restore_state(ckpt.path, ckpt.round)
        set_rng_state(ckpt.rng)
        self.start_round = ckpt.round
        self.history = [dict(row) for row in ckpt.history]
        if self.metrics is not None:  # rows written after the checkpoint are dropped
            self.metrics.replace(self.history)
        if self.client_eval is not None:
            self.client_eval.truncate_after(ckpt.round)
        log.info("resumed from %s after round %d", ckpt.path, ckpt.round)

    def summary(self) -> dict[str, Any]:
        evals = [row for row in self.history if "test_accuracy" in row]
        times = [row["round_time_s"] for row in self.history]
        last = evals[-1] if evals else {}
        return {
            "rounds": len(self.history),
            "final_test_accuracy": last.get("test_accuracy"),
            "final_test_loss": last.get("test_loss"),
            "best_test_accuracy": max((row["test_accuracy"] for row in evals), default=None),
            "wall_time_s": self.history[-1]["wall_time_s"] if self.history else 0.0,
            "first_round_s": times[0] if times else None,
            "median_round_s": statistics.median(times[1:] if len(times) > 1 else times) if times else None,
            "bytes_up_total": sum(row["bytes_up"] for row in self.history),
            "bytes_down_total": sum(row["bytes_down"] for row in self.history),
            **(self.privacy.summary(len(self.history)) if self.privacy is not None else {}),
            **({"stop_reason": self.stop_reason} if self.stop_reason is not None else {}),
        }
