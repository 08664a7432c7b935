"""The algorithm API: a client half and a server half per algorithm (DESIGN.md section 5).

Client half: given the round's broadcast, the client's persistent state, its data and the
shared trainer, return a ClientUpdate (named tensors + summable weights + new state).
Server half: build the broadcast, and turn the summed (or, when ``summable`` is False,
listed) contributions into the new global state. Neither half knows which runtime calls it:
the inline engine, Ray workers and the Flower apps all use these classes unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from fl_platform.core import Aggregate, Broadcast, ClientUpdate, Metrics, RoundContext
from fl_platform.privacy.clipping import BELOW, CLIPPED_METRIC, NORM_METRIC, CohortClip, clip_factor
from fl_platform.privacy.spec import PrivacyUnsupported, PrivateUploads
from fl_platform.training.flat import FlatModel
from fl_platform.training.hooks import TrainHooks
from fl_platform.training.loop import ClientData, LocalTrainer, NonFiniteError, TrainConfig, evaluate
from fl_platform.training.vectorised import CohortMember, CohortTrainer, MemberResult, NotVectorisable


def require(conf: Any, *rules: tuple[bool, str, str]) -> None:
    """Refuse a field outside its range at start-up, naming the key: ``(holds, field, rule)`` such as
    ``(cfg.mu >= 0, "mu", ">= 0")``. A conf's ``__post_init__`` calls it (the conf is made when the run
    is checked, before any round), so a negative weight or rate never runs as a silent sign flip."""
    for ok, key, rule in rules:
        if not ok:
            raise ValueError(f"algorithm.{key} must be {rule}, got {getattr(conf, key)!r}")


@dataclass
class AlgorithmConf:
    """Fields common to every algorithm; each algorithm's schema extends it."""

    name: str = "fedavg"

    def inactive_fields(self, run: Any) -> dict[str, str]:
        """Fields of this schema that have no effect in this run, each with the reason.

        ``run`` is the whole run config, typed (``fl_platform.run_config.RunConfig``: ``run.train``,
        ``run.rounds``, ``run.get("system")``; a section the run lacks is None).
        ``config_checks.check_effective`` refuses any of these set to a value other than the schema's
        default, so that no accepted key is silently ignored (e.g. a weight used only under
        another schedule). The default: every field always acts.
        """
        return {}


@dataclass
class ServerStepConf(AlgorithmConf):
    """Algorithms whose server moves the global model by ``server_lr`` times the aggregated update."""

    server_lr: float = 1.0

    def __post_init__(self) -> None:
        require(self, (self.server_lr > 0, "server_lr", "> 0"))

    def inactive_fields(self, run: Any) -> dict[str, str]:
        """``server_lr`` is the server step's own rate: an adaptive ``server_opt`` steps by ``server_opt.lr``."""
        opt = run.get("server_opt")
        if opt is not None and opt.name != "none":
            return {"server_lr": f"server_opt={opt.name} replaces the server step (its rate is server_opt.lr)"}
        return {}


@dataclass(frozen=True)
class StateSpec:
    """One piece of per-client state: a flat tensor of ``size`` elements, zeros when first used."""

    size: int
    dtype: torch.dtype = torch.float32


@dataclass
class Setup:
    """What both halves may need to know about the experiment (never per-round data)."""

    model_fn: Callable[[], nn.Module]
    num_params: int
    num_buffers: int
    num_classes: int
    input_shape: tuple[int, ...]
    num_clients: int
    seed: int
    train: TrainConfig
    extra: dict[str, Any] = field(default_factory=dict)
    #: The ``server_opt`` section (algorithms/server_opt.py): an adaptive step on the pseudo-gradient, or None.
    server_opt: Any = None
    #: Noise an algorithm adds to protect a client's data must come from the OS's CSPRNG
    #: (``privacy.clipping.gaussian_noise(secure=True)``), not from the run's seed, which every client is sent.
    #: A Flower ClientApp sets it; the simulator's draws stay seeded (reproducible).
    secure_noise: bool = False

    @property
    def vector_size(self) -> int:
        return self.num_params + self.num_buffers


@dataclass
class LocalPlan:
    """How one client trains this round, shared by the sequential and the vectorised path: the
    vector ``[params | buffers]`` it starts from, the hooks that change its training, and what
    ``finish`` needs besides the trained model (``carry``, e.g. SCAFFOLD's control variate)."""

    start: torch.Tensor
    hooks: TrainHooks | None = None
    carry: dict[str, Any] = field(default_factory=dict)


class ClientAlgorithm:
    """Client half. Subclasses override ``hooks``, or ``prepare``/``finish`` (which keeps the
    vectorised cohort path, docs/vectorised.md), or ``train`` itself (sequential only)."""

    def __init__(self, cfg: AlgorithmConf, setup: Setup) -> None:
        self.cfg = cfg
        self.setup = setup

    @classmethod
    def uploads(cls, cfg: AlgorithmConf) -> dict[str, str | None]:
        """The ``ClientUpdate`` tensors this client half may send, each with the name of the weight
        that scales it (None: not scaled), for uplink compression (``compressor.tensors`` may name
        only these; a compressor encodes ``tensor / weight`` and the server gets ``weight * decoded``,
        so a non-linear compressor such as sign keeps sample weighting). The default is what
        ``finish`` sends: ``delta`` = n * (trained - start) with weight ``n``."""
        return {"delta": "n"}

    @classmethod
    def private_uploads(cls, cfg: AlgorithmConf) -> PrivateUploads:
        """Under client-level DP (``privacy=central|local``, docs/privacy.md): the uploads that carry
        model information (divided by their weight, clipped together to norm C, noised) and the
        weights that count clients (1 per client; the server divides by the expected number of
        clients). The default covers what ``finish`` sends (``delta`` scaled by ``n``); an algorithm
        that uploads anything else must declare its own, or raise PrivacyUnsupported saying why."""
        uploads = cls.uploads(cfg)
        if uploads != {"delta": "n"}:
            raise PrivacyUnsupported(
                f"{cls.__name__} uploads {sorted(uploads)}, not only the model delta; which of them carry model "
                "information (to clip and noise) is not declared (ClientAlgorithm.private_uploads)")
        return PrivateUploads(("delta",), ("n",))

    def state_spec(self) -> dict[str, StateSpec]:
        """Per-client state this algorithm keeps across rounds (stored by the state manager)."""
        return {}

    def hooks(self, ctx: RoundContext, broadcast: Broadcast, state: dict[str, torch.Tensor] | None,
              trainer: LocalTrainer):
        return None

    def personal_model(self, ctx: RoundContext, client_id: int, broadcast: Broadcast,
                       state: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
        """The client's personalised model ``[params | buffers]`` from the global weights and its state,
        for per-client evaluation (``eval.clients``, fl_platform/rounds/client_eval.py); None: this
        algorithm has no personal model (only the global one is evaluated). Must not change ``state``."""
        return None

    def prepare(self, ctx: RoundContext, client_id: int, broadcast: Broadcast,
                state: dict[str, torch.Tensor] | None, data: ClientData, trainer: LocalTrainer) -> LocalPlan:
        """Before local training: start from the global weights, train with ``hooks``."""
        return LocalPlan(broadcast.tensors["weights"], self.hooks(ctx, broadcast, state, trainer))

    def finish(self, ctx: RoundContext, client_id: int, broadcast: Broadcast,
               state: dict[str, torch.Tensor] | None, data: ClientData, trainer: LocalTrainer,
               plan: LocalPlan, metrics: Metrics) -> ClientUpdate:
        """After local training (the trained model is ``trainer.fm``): FedAvg's n * delta and n."""
        n = data.num_samples
        delta = trainer.fm.vector - plan.start
        return ClientUpdate(client_id, {"delta": delta.mul_(n)}, {"n": float(n)}, n, metrics)

    def train(self, ctx: RoundContext, client_id: int, broadcast: Broadcast,
              state: dict[str, torch.Tensor] | None, data: ClientData, trainer: LocalTrainer) -> ClientUpdate:
        """One client: ``prepare``, the shared training loop, ``finish``."""
        plan = self.prepare(ctx, client_id, broadcast, state, data, trainer)
        trainer.fm.load(plan.start)
        metrics = trainer.fit(data, plan.hooks, seed=ctx.seed, round=ctx.round, client=client_id)
        return self.finish(ctx, client_id, broadcast, state, data, trainer, plan, metrics)

    def train_cohort(self, ctx: RoundContext, client_ids: Sequence[int], broadcast: Broadcast,
                     states: Sequence[dict[str, torch.Tensor] | None], datas: Sequence[ClientData],
                     trainer: LocalTrainer, cohort: CohortTrainer,
                     ) -> Iterable[tuple[int, ClientUpdate | NonFiniteError]]:
        """Several clients at once (vectorised); each gets the update ``train`` would give it.

        Trains eagerly, raising NotVectorisable before training anything when this algorithm has
        no functional form; the updates are then built one by one as the caller iterates (so one
        is alive at a time). A client whose training became non-finite yields the NonFiniteError
        that ``train`` would have raised.
        """
        if type(self).train is not ClientAlgorithm.train:
            raise NotVectorisable(f"{type(self).__name__} overrides train() rather than prepare()/finish()")
        plans = [self.prepare(ctx, c, broadcast, s, d, trainer) for c, s, d in zip(client_ids, states, datas)]
        members = [CohortMember(c, d, p.start, p.hooks) for c, d, p in zip(client_ids, datas, plans)]
        results = cohort.fit(members, seed=ctx.seed, round=ctx.round)
        return self._finish_cohort(ctx, broadcast, states, datas, trainer, cohort, plans, results)

    def _finish_cohort(self, ctx: RoundContext, broadcast: Broadcast,
                       states: Sequence[dict[str, torch.Tensor] | None], datas: Sequence[ClientData],
                       trainer: LocalTrainer, cohort: CohortTrainer, plans: list[LocalPlan],
                       results: list[MemberResult],
                       ) -> Iterable[tuple[int, ClientUpdate | NonFiniteError]]:
        if type(self).finish is ClientAlgorithm.finish:
            return FedAvgCohort(datas, plans, results, cohort)
        return self._finish_each(ctx, broadcast, states, datas, trainer, plans, results)

    def _finish_each(self, ctx: RoundContext, broadcast: Broadcast,
                     states: Sequence[dict[str, torch.Tensor] | None], datas: Sequence[ClientData],
                     trainer: LocalTrainer, plans: list[LocalPlan], results: list[MemberResult],
                     ) -> Iterator[tuple[int, ClientUpdate | NonFiniteError]]:
        for state, data, plan, res in zip(states, datas, plans, results):
            if res.error is not None:
                yield res.client_id, res.error
                continue
            trainer.fm.load(res.vector)
            yield res.client_id, self.finish(ctx, res.client_id, broadcast, state, data, trainer, plan, res.metrics)


@dataclass
class FedAvgCohort:
    """The default ``finish`` (FedAvg's ``n * delta`` and ``n``) for a whole trained chunk.

    Iterating gives each client's ClientUpdate, as ``train`` would (a few tensor operations for the
    whole chunk instead of a few per client: at one local step per client that bookkeeping rivals
    the training). A worker that only sums the contributions calls ``sum_into`` instead, which adds
    the chunk in one pass over the trained rows and never materialises the deltas.
    """

    datas: Sequence[ClientData]
    plans: list[LocalPlan]
    results: list[MemberResult]
    cohort: CohortTrainer

    def __iter__(self) -> Iterator[tuple[int, ClientUpdate | NonFiniteError]]:
        datas, plans, results = self.datas, self.plans, self.results
        ok = [i for i, res in enumerate(results) if res.error is None]
        deltas, finite = None, []
        if ok:
            first = plans[ok[0]].start
            same = all(plans[i].start is first for i in ok)
            starts = first if same else torch.stack([plans[i].start for i in ok])
            n = torch.tensor([float(datas[i].num_samples) for i in ok], dtype=first.dtype, device=first.device)
            deltas = torch.stack([results[i].vector for i in ok]).sub_(starts).mul_(n[:, None])
            finite = torch.isfinite(deltas.sum(dim=1)).tolist()  # a finite row sum proves a finite row
        row = 0
        for data, res in zip(datas, results):
            if res.error is not None:
                yield res.client_id, res.error
                continue
            num = data.num_samples  # a non-finite row sum is left to ClientUpdate.is_finite's own check
            yield res.client_id, ClientUpdate(res.client_id, {"delta": deltas[row]}, {"n": float(num)}, num,
                                              res.metrics, finite=True if finite[row] else None)
            row += 1

    def sum_into(self, agg: Aggregate, clip: CohortClip | None = None) -> list[tuple[int, ClientUpdate | NonFiniteError]]:
        """Add every accepted client's contribution to ``agg``; returns, per client in order, its
        NonFiniteError or its ClientUpdate without tensors (weights, samples, metrics, and the bytes
        its dense delta would have taken).

        The sum is ``sum_k n_k * v_k - sum_k n_k * start_k`` taken in float64 (``v_k``: client k's
        trained vector), so it equals the sum of the float32 deltas that ``__iter__`` gives up to
        their own float32 rounding (~1e-7 relative). Training already rejected every client whose
        vector is not finite; with finite vectors and starts, this float64 sum is finite.

        ``clip`` (client-level DP, fl_platform/privacy/clipping.py): each client's delta is clipped to
        norm C within the chunk instead, the weight n_k becomes min(1, C / ||delta_k||), and each client
        counts once (``n`` = 1 per client), as ``ClientPrivacy.apply`` does to a single update.
        """
        out: list[tuple[int, ClientUpdate | NonFiniteError]] = []
        ok = [i for i, res in enumerate(self.results) if res.error is None]
        norms: dict[int, float] = {}
        if ok:
            if clip is None:
                n = [float(self.datas[i].num_samples) for i in ok]
            else:
                norms = dict(zip(ok, self.cohort.delta_norms([self.results[i] for i in ok],
                                                             [self.plans[i].start for i in ok])))
                n = [clip_factor(norms[i], clip.clip) for i in ok]
            total = self.cohort.weighted_sum([self.results[i] for i in ok], n)
            first = self.plans[ok[0]].start
            if all(self.plans[i].start is first for i in ok):  # the broadcast weights, as a rule
                total.sub_(first.to(torch.float64), alpha=sum(n))
            else:
                for i, weight in zip(ok, n):
                    total.sub_(self.plans[i].start.to(torch.float64), alpha=weight)
            tensors = {"delta": total}
            if clip is not None and clip.adaptive:
                below = sum((1.0 if norms[i] <= clip.clip else 0.0) - 0.5 for i in ok)
                tensors[BELOW] = torch.tensor([below], dtype=torch.float64, device=total.device)
            agg.add(tensors, {"n": sum(n) if clip is None else float(len(ok))}, count=len(ok))
        extra = 4 if clip is not None and clip.adaptive else 0  # dp_below_clip travels as one float32
        for i, (data, res) in enumerate(zip(self.datas, self.results)):
            if res.error is not None:
                out.append((res.client_id, res.error))
                continue
            if clip is not None:
                res.metrics.add(CLIPPED_METRIC, 1.0 if norms[i] > clip.clip else 0.0)
                res.metrics.add(NORM_METRIC, norms[i])
            weight = float(data.num_samples) if clip is None else 1.0
            out.append((res.client_id, ClientUpdate(res.client_id, {}, {"n": weight}, data.num_samples, res.metrics,
                                                    bytes_up=res.vector.numel() * 4 + extra, finite=True)))
        return out


class ServerAlgorithm:
    """Server half. ``summable`` says whether contributions may be summed before the server sees them.

    ``weights`` is the flat ``[parameters | float buffers]`` vector. A server half that moves the model
    by a mean client update calls ``apply_update``: the buffers (BatchNorm's running statistics) take
    the clients' mean, and only the parameters take the server step (``server_step``, or the run's
    adaptive ``server_opt``), so no server step can scale a running variance below zero. Such a half
    declares ``pseudo_gradient = True``, which is what lets ``server_opt`` apply to it.
    """

    summable: ClassVar[bool] = True
    #: Whether ``aggregate`` moves the model by ``apply_update(mean update)`` (a server optimiser may act).
    pseudo_gradient: ClassVar[bool] = False

    def __init__(self, cfg: AlgorithmConf, setup: Setup, initial_weights: torch.Tensor) -> None:
        from fl_platform.algorithms.server_opt import ServerOptimizer, active

        self.cfg = cfg
        self.setup = setup
        self.weights = initial_weights.detach().to("cpu", torch.float32).clone()
        self.server_opt: ServerOptimizer | None = None
        if active(setup.server_opt):
            if not self.pseudo_gradient:
                raise ValueError(f"server_opt={setup.server_opt.name}: {type(self).__name__} takes no pseudo-gradient "
                                 "(pseudo_gradient = False); use server_opt=none")
            self.server_opt = ServerOptimizer(setup.server_opt, setup.num_params)

    def broadcast(self, ctx: RoundContext) -> Broadcast:
        return Broadcast({"weights": self.weights})

    def aggregate(self, ctx: RoundContext, result: Aggregate | list[ClientUpdate]) -> dict[str, float]:
        """Update the global state; returns extra scalar metrics for the round log."""
        raise NotImplementedError

    def evaluate(self, fm: FlatModel, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> dict[str, float]:
        """Server-side test metrics of the current global model."""
        fm.load(self.weights.to(fm.device))
        return evaluate(fm.model, x, y, batch_size)

    def attach_data(self, data: Any) -> None:
        """Called once by the runtime with the run's FederatedDataset; the default ignores it.

        For server halves that use server-side data (e.g. one-shot distillation on a held-out
        split that no client trains on). Never use the test set here: evaluation owns it.
        """

    def apply_mean_delta(self, agg: Aggregate, name: str = "delta", weight: str = "n") -> None:
        total = agg.weights.get(weight, 0.0)
        if total <= 0 or name not in agg.tensors:
            return
        self.apply_update((agg.tensors[name] / total).to(torch.float32))

    def apply_update(self, delta: torch.Tensor) -> None:
        """Move the model by the mean client update ``delta`` (over ``[parameters | buffers]``): the
        buffers by ``delta`` itself (the clients' mean statistics), the parameters by the server step
        (``server_opt`` when the run sets one, else ``server_step``)."""
        p = self.setup.num_params
        self.weights[p:] += delta[p:]
        grad = delta[:p]
        self.weights[:p] += self.server_opt.step(grad) if self.server_opt is not None else self.server_step(grad)

    def server_step(self, grad: torch.Tensor) -> torch.Tensor:
        """The parameters' change for the pseudo-gradient ``grad`` (the mean update of the parameters)."""
        return grad * self.cfg.server_lr

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume the server half exactly."""
        state: dict[str, Any] = {"weights": self.weights.clone()}
        if self.server_opt is not None:
            state["server_opt"] = self.server_opt.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved, here = state["weights"].numel(), self.weights.numel()
        if saved != here:
            raise ValueError(f"the checkpoint's model vector has {saved} elements, this run's model {here}: it was "
                             "written for another model, or before the flat vector's tensors were 16-byte aligned "
                             "(fl_platform after 2026-12-04 pads between them); resume it with the version that wrote it")
        self.weights = state["weights"].clone()
        if self.server_opt is not None:
            if "server_opt" not in state:
                raise ValueError("the checkpoint was made without server_opt; this run sets one")
            self.server_opt.load_state_dict(state["server_opt"])


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    conf: type[AlgorithmConf]
    client: type[ClientAlgorithm]
    server: type[ServerAlgorithm]
    summary: str
    #: Number of model outputs given (conf, num_classes); None = num_classes. VHL's 2C-way head
    #: uses it, so the model factory stays generic (``Setup.num_classes`` stays the real C).
    model_outputs: Callable[[AlgorithmConf, int], int] | None = None
    #: Whether the algorithm cuts the model into stages (``StagedModel``: named stages, a linear ``head``),
    #: as FedImpro, VHL and FuseFL do; a user's model (``model=custom``) is checked for them at start-up.
    staged_model: bool = False

    def num_model_outputs(self, conf: AlgorithmConf, num_classes: int) -> int:
        return num_classes if self.model_outputs is None else int(self.model_outputs(conf, num_classes))
