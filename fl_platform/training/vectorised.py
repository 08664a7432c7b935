"""Vectorised cohort training: K clients' local training as one computation, same results.

Small models leave a device idle when clients train one after another: each step is a few tiny
kernels plus Python overhead. :class:`CohortTrainer` trains a chunk of clients at once, their
flat parameter vectors stacked as the rows of one ``(K, D)`` tensor, with the step of
``LocalTrainer.fit`` in functional form (functional.py: ``functional_call`` + ``grad`` under
``vmap``). It keeps the sequential semantics exactly:

* each client's minibatches come from its own ``torch_generator(seed, SHUFFLE, round, client)``,
  one ``torch.randperm(n)`` per epoch, in the same order as the loop draws them;
* each client takes ``TrainConfig.num_steps(n)`` steps. Clients are sorted by their step count,
  so the clients still training at step ``s`` are always the first ``k_s`` rows: the others are
  masked by never being touched again. A client whose batch is shorter than the others' (the
  end of an epoch) is padded with zero-weight copies of its own samples, or, for BatchNorm models
  (whose statistics would see the padding), its step runs with the other clients of its batch size;
* the data set's augmentation (datasets/augment.py) draws each client's crops and flips from
  (seed, round, client, step, position), so a client's augmented batch is the loop's, bit for bit;
* hooks' gradient corrections, per-client gradient clipping, SGD (momentum, weight decay,
  Nesterov) and Adam are applied row-wise with the same operations;
* the same metrics (train_loss, train_accuracy, local_steps as (sum, count)) and the same
  NonFiniteError, reported per client.

:func:`auto_cohort_size` sizes chunks from the model and the device's free memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fl_platform.core import Metrics
from fl_platform.datasets.augment import Augmentation
from fl_platform.seeding import Stream, derive_seeds
from fl_platform.training.flat import FlatModel
from fl_platform.training.functional import (
    FunctionalModel,
    NotVectorisable,
    StackedOptimizer,
    clip_rows,
    gradient_terms,
    stack_terms,
)
from fl_platform.training.hooks import TrainHooks
from fl_platform.training.loop import ClientData, NonFiniteError, TrainConfig, shuffle_keys
from fl_platform.training.step import autocast, check_cohort_options, to_device

__all__ = [
    "CohortMember",
    "CohortTrainer",
    "MemberResult",
    "NotVectorisable",
    "auto_cohort_size",
    "free_memory",
    "parse_cohort_size",
]


@dataclass
class CohortMember:
    """One client of a cohort: its data, its starting vector ``[params | buffers]`` and its hooks."""

    client_id: int
    data: ClientData
    start: torch.Tensor
    hooks: TrainHooks | None = None


@dataclass
class MemberResult:
    """A client's trained vector (a row of the cohort's tensor, valid until the next ``fit``) and its
    metrics, or the NonFiniteError that ``LocalTrainer.fit`` would have raised for it."""

    client_id: int
    vector: torch.Tensor
    metrics: Metrics
    error: NonFiniteError | None = None
    row: int = -1  # its row in the cohort's tensor (``CohortTrainer.weighted_sum``)


@dataclass
class _Schedule:
    """Who trains when: clients sorted by their number of local steps (descending, stable), so the
    clients still training at step ``s`` are the first ``count_nonzero(steps > s)`` rows."""

    order: np.ndarray  # position in ``members`` of each row
    sizes: np.ndarray  # samples per row
    steps: np.ndarray  # TrainConfig.num_steps per row (0 for a client without samples)
    per_epoch: np.ndarray  # steps per epoch per row
    first_own: np.ndarray  # where each row's indices start in the concatenation of all rows' indices
    epoch_starts: dict[int, list[int]]  # step -> rows that start an epoch (draw a new order) there

    @staticmethod
    def of(members: Sequence[CohortMember], cfg: TrainConfig) -> _Schedule:
        bs = cfg.batch_size
        sizes = np.array([m.data.num_samples for m in members], dtype=np.int64)
        steps = np.array([cfg.num_steps(int(n)) if n > 0 else 0 for n in sizes], dtype=np.int64)
        per_epoch = sizes // bs if cfg.drop_last else -(-sizes // bs)
        stuck = np.nonzero((steps > 0) & (per_epoch == 0))[0]
        if stuck.size:
            m = members[int(stuck[0])]
            raise ValueError(f"client {m.client_id} has {m.data.num_samples} samples < train.batch_size={bs} "
                             f"with train.drop_last: it can take none of its train.steps={cfg.steps} steps")
        order = np.argsort(-steps, kind="stable")
        sizes, steps, per_epoch = sizes[order], steps[order], per_epoch[order]
        epoch_starts: dict[int, list[int]] = {}
        for i in range(len(order)):
            for s in range(0, int(steps[i]), int(per_epoch[i]) or 1):
                epoch_starts.setdefault(s, []).append(i)
        first_own = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        return _Schedule(order, sizes, steps, per_epoch, first_own, epoch_starts)


class CohortTrainer:
    """Trains many clients at once with the semantics of ``LocalTrainer.fit``.

    Uses ``fm`` (the worker's FlatModel) as the template of the functional model; ``fm``'s own
    values are left as they were.
    """

    def __init__(self, fm: FlatModel, cfg: TrainConfig) -> None:
        check_cohort_options(cfg, "auto")  # (any size but 1)
        self.fm = fm
        self.cfg = cfg
        self.fn = FunctionalModel(fm)
        self.optimizer = StackedOptimizer(cfg)
        self._reason: str | None = None
        self._probed = False
        self._vectors: torch.Tensor | None = None  # the last fit's trained rows

    def unsupported_reason(self, x: torch.Tensor, y: torch.Tensor) -> str | None:
        """Why this model cannot be trained as a cohort (None: it can); probed once, on ``x``/``y``."""
        if not self._probed:
            with autocast(self.cfg, self.fm.device):  # probed at the run's precision (bf16: every op's rule)
                self._reason = self.fn.unsupported_reason(x, y)
            self._probed = True
        return self._reason

    def per_client_bytes(self, x: torch.Tensor, extra_per_client: int = 0) -> int:
        """A conservative estimate of the memory one more client in a cohort costs, in bytes.

        Per client: its stacked vector, buffers and gradient, the optimiser state, temporaries of
        the hooks/clipping/optimiser step, ``extra_per_client`` elements the caller keeps per client
        (e.g. SCAFFOLD's stacked correction), and the activations of one minibatch, forward and
        backward. Checked against measured peaks in tests/test_vectorised.py.
        """
        fm = self.fm
        p, d = fm.num_params, len(fm)
        acts = self.fn.activation_numel(x)
        elems = 3 * d + (6 + self.optimizer.num_states) * p + extra_per_client + 4 * acts * self.cfg.batch_size
        return int(elems * fm.vector.element_size() * 1.25)

    def fit(self, members: Sequence[CohortMember], *, seed: int, round: int) -> list[MemberResult]:
        """Train every member from its ``start``; results in ``members`` order.

        Raises NotVectorisable (before training anything) when the model, a hook, or the members'
        data cannot be trained as one cohort.
        """
        if not members:
            return []
        cfg, fm, fn = self.cfg.at_round(round), self.fm, self.fn
        self.optimizer.cfg = cfg  # (this round's rate: train.lr_schedule)
        x, y = members[0].data.x, members[0].data.y
        aug = members[0].data.augment
        if any(m.data.augment is not aug for m in members):
            raise NotVectorisable("the clients of one cohort do not share one augmentation")
        shared = all(m.data.x is x and m.data.y is y for m in members)
        reason = self.unsupported_reason(x, y)
        if reason is not None:
            raise NotVectorisable(reason)
        terms = stack_terms([gradient_terms(m.hooks) for m in members])
        self._vectors = None  # the previous fit's rows: not kept alive beside this fit's
        fm.train_mode()  # as LocalTrainer.fit: BatchNorm uses batch statistics and updates its buffers

        plan = _Schedule.of(members, cfg)
        ordered = [members[int(i)] for i in plan.order]
        terms = [t.select(to_device(torch.from_numpy(plan.order), fm.device)) for t in terms]
        device, k_all, bs = fm.device, len(ordered), cfg.batch_size
        starts = [m.start for m in ordered]
        if all(s is starts[0] for s in starts):
            # (an expanded copy: ~1.5x faster than ``repeat`` for the (k, D) block)
            vectors = starts[0].to(device, fm.vector.dtype).expand(k_all, -1).clone(memory_format=torch.contiguous_format)
        else:
            vectors = torch.stack([s.to(device, fm.vector.dtype) for s in starts])
        params = vectors[:, : fm.num_params]
        buffers = fn.stack_buffers(vectors)
        layout, trainable = fn.layout, fn.trainable
        self.optimizer.reset(k_all, fm.num_params, layout.subset(trainable), params)

        # Each client's current epoch order (row i: ordered[i]), refilled when its next epoch starts.
        width = max(int(plan.sizes.max()), 1)
        shuffled = torch.zeros(k_all, width, dtype=torch.long, device=device)
        if shared:
            own_rows = torch.cat([m.data.indices.to(device) for m in ordered])  # clients' rows, back to back
        else:  # clients of several row blocks (datasets/federated.py): their rows, gathered once for this fit
            x = torch.cat([m.data.x.index_select(0, m.data.indices) for m in ordered])
            y = torch.cat([m.data.y.index_select(0, m.data.indices) for m in ordered])
            own_rows = torch.arange(x.shape[0], device=device)
        generators: list[torch.Generator | None] = [None] * k_all
        shuffle_seeds = derive_seeds(seed, Stream.SHUFFLE, round, np.array([m.client_id for m in ordered]),
                                     *shuffle_keys(cfg))
        loss_sum = torch.zeros(k_all, device=device)  # float32, as the loop's accumulator
        correct = torch.zeros(k_all, dtype=torch.long, device=device)
        seen = np.zeros(k_all, dtype=np.int64)
        cols = torch.arange(bs, device=device)
        # What each step indexes with, on the device once per fit: the rows' samples and steps per
        # epoch (the step's batch offsets and sizes are computed from them there). The host keeps
        # its numpy copies for the control flow (how many rows train, the widest batch).
        sizes_dev = to_device(torch.from_numpy(plan.sizes), device)
        per_epoch_dev = to_device(torch.from_numpy(np.maximum(plan.per_epoch, 1)), device)
        aug_keys = aug.client_keys(seed, round, [m.client_id for m in ordered], device) if aug is not None else None

        for s in range(int(plan.steps.max(initial=0))):
            k = int(np.count_nonzero(plan.steps > s))  # the clients still training: a prefix
            if s in plan.epoch_starts:
                self._shuffle(shuffled, own_rows, plan, plan.epoch_starts[s], generators, shuffle_seeds)
            first = (s % plan.per_epoch[:k]) * bs
            batch = np.minimum(bs, plan.sizes[:k] - first)
            b = int(batch.max())
            first_dev = (s % per_epoch_dev[:k]) * bs
            batch_dev = torch.clamp(sizes_dev[:k] - first_dev, max=bs)
            pos = (first_dev[:, None] + cols[:b]).clamp_(max=width - 1)
            idx = shuffled[:k].gather(1, pos)
            rows = params[:k]
            live = {name: t[:k] for name, t in buffers.items()}
            augment = (aug, aug_keys[:k], s) if aug is not None else None
            with autocast(cfg, device):
                if int(batch.min()) == b:
                    g, loss, hits = fn.grads(rows, live, *self._gather(x, y, idx, augment))
                elif fn.can_pad:
                    valid = cols[:b] < batch_dev[:, None]
                    idx = torch.where(valid, idx, idx[:, :1])
                    g, loss, hits = fn.grads(rows, live, *self._gather(x, y, idx, augment), valid.to(rows.dtype))
                else:
                    g, loss, hits = self._grads_by_batch_size(rows, live, x, y, idx, batch, augment)
            slots = layout.views(params, k)
            for term in terms:
                term.apply(g, slots, layout, k)
            if cfg.clip_norm is not None:
                clip_rows(g, cfg.clip_norm)
            if fn.frozen:
                slots, g = [slots[i] for i in trainable], [g[i] for i in trainable]
            self.optimizer.step(s, slots, g)
            loss_sum[:k] += loss.detach().float() * batch_dev
            correct[:k] += hits
            seen[:k] += batch

        fn.store_buffers(buffers, vectors)
        finite = self._finite_rows(vectors)
        losses, hits_all = loss_sum.tolist(), correct.tolist()
        results: list[MemberResult | None] = [None] * k_all
        for r, m in enumerate(ordered):
            metrics = Metrics()
            error = None
            if not math.isfinite(losses[r]) or not finite[r]:
                error = NonFiniteError(
                    f"client {m.client_id} in round {round + 1}: the training loss became {losses[r]} "
                    f"(non-finite) after {int(plan.steps[r])} steps; lower train.lr, enable train.clip_norm, "
                    "or check the data")
            if seen[r]:
                metrics.add("train_loss", losses[r], int(seen[r]))
                metrics.add("train_accuracy", float(hits_all[r]), int(seen[r]))
            metrics.add("local_steps", int(plan.steps[r]), 1)
            results[int(plan.order[r])] = MemberResult(m.client_id, vectors[r], metrics, error, r)
        self._vectors = vectors
        return results  # type: ignore[return-value]

    def weighted_sum(self, results: Sequence[MemberResult], weights: Sequence[float]) -> torch.Tensor:
        """``sum_k weights[k] * results[k].vector`` in float64, for results of the last ``fit``.

        One pass over the trained rows: they are widened to float64 a block at a time (~8 MiB) and
        summed by a float64 matrix-vector product (a mixed float32/float64 add, row by row, is not
        vectorised on CPU and took twice as long). Rows not in ``results`` take no part, whatever
        they hold (a rejected client's NaNs included).
        """
        vectors = self._vectors
        k, d = vectors.shape if vectors is not None else (0, 0)
        if vectors is None or any(r.vector._base is not vectors or not 0 <= r.row < k for r in results):
            raise ValueError("weighted_sum takes results of this trainer's last fit only")
        w = torch.zeros(k, dtype=torch.float64)
        w[[r.row for r in results]] = torch.tensor([float(x) for x in weights], dtype=torch.float64)
        skip = w == 0  # on the host: no device sync per block; a zero-weight row adds nothing anyway
        w = w.to(vectors.device)
        total = torch.zeros(d, dtype=torch.float64, device=vectors.device)
        step = max(1, min(k, 2**20 // max(d, 1)))
        block = torch.empty(step, d, dtype=torch.float64, device=vectors.device)
        for lo in range(0, k, step):
            hi = min(lo + step, k)
            part = block[: hi - lo]
            part.copy_(vectors[lo:hi])
            if bool(skip[lo:hi].any()):
                part[skip[lo:hi].to(part.device)] = 0.0
            total.addmv_(part.T, w[lo:hi])
        return total

    def delta_norms(self, results: Sequence[MemberResult], starts: Sequence[torch.Tensor]) -> list[float]:
        """``||results[k].vector - starts[k]||`` (the float32 difference, its norm in float64) for results
        of the last ``fit``, a block of rows at a time: the per-client norms that client-level DP clips
        by when a chunk is summed at once (``FedAvgCohort.sum_into``)."""
        vectors = self._vectors
        if vectors is None or any(r.vector._base is not vectors for r in results):
            raise ValueError("delta_norms takes results of this trainer's last fit only")
        if len(starts) != len(results):
            raise ValueError(f"delta_norms needs one start per result, got {len(starts)} for {len(results)}")
        d = vectors.shape[1]
        step = max(1, 2**20 // max(d, 1))
        same = all(s is starts[0] for s in starts)
        out: list[float] = []
        for lo in range(0, len(results), step):
            hi = min(lo + step, len(results))
            rows = torch.tensor([r.row for r in results[lo:hi]], device=vectors.device)
            base = starts[0].to(vectors.device) if same else torch.stack([s.to(vectors.device) for s in starts[lo:hi]])
            diff = vectors.index_select(0, rows) - base
            out += torch.linalg.vector_norm(diff.to(torch.float64), dim=1).tolist()
        return out

    @staticmethod
    def _shuffle(shuffled: torch.Tensor, own_rows: torch.Tensor, plan: _Schedule, starting: list[int],
                 generators: list[torch.Generator | None], seeds: np.ndarray) -> None:
        """New epoch orders for the clients ``starting`` one: ``indices[randperm(n, generator=gen)]``
        from each client's own generator (``torch_generator(seed, SHUFFLE, round, client)``, whose
        seeds ``seeds`` holds), as the loop draws them, written in one indexed copy."""
        perms = []
        for i in starting:
            gen = generators[i]
            if gen is None:
                gen = generators[i] = torch.Generator()
                gen.manual_seed(int(seeds[i]))
            perms.append(torch.randperm(int(plan.sizes[i]), generator=gen))
        rows = np.asarray(starting)
        counts = plan.sizes[rows]
        ends = np.cumsum(counts)
        cols = np.arange(int(ends[-1])) - np.repeat(ends - counts, counts)
        device = shuffled.device
        host = torch.stack([torch.cat(perms) + torch.from_numpy(np.repeat(plan.first_own[rows], counts)),
                            torch.from_numpy(np.repeat(rows, counts)), torch.from_numpy(cols)])
        source, at_row, at_col = to_device(host, device)  # one asynchronous copy
        shuffled[at_row, at_col] = own_rows[source]

    @staticmethod
    def _gather(x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor,
                augment: tuple[Augmentation, torch.Tensor, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``idx`` (k x b) of ``x`` and ``y``; ``augment`` = (augmentation, the k rows' keys, step)."""
        k, b = idx.shape
        flat = idx.reshape(-1)
        xs = x.index_select(0, flat).view(k, b, *x.shape[1:])
        if augment is not None:
            aug, keys, step = augment
            xs = aug.apply_cohort(xs, keys, step)
        return xs, y.index_select(0, flat).view(k, b)

    @staticmethod
    def _finite_rows(vectors: torch.Tensor) -> list[bool]:
        """Which rows hold only finite values: a row's sum is finite unless the row has a NaN/inf or
        its finite values overflow; only rows with a non-finite sum are checked element by element."""
        finite = torch.isfinite(vectors.sum(dim=1))
        if not bool(finite.all()):
            suspect = (~finite).nonzero().squeeze(1)
            finite[suspect] = torch.isfinite(vectors[suspect]).all(dim=1)
        return finite.tolist()

    def _grads_by_batch_size(self, rows: torch.Tensor, buffers: dict[str, torch.Tensor], x: torch.Tensor,
                             y: torch.Tensor, idx: torch.Tensor, batch: np.ndarray,
                             augment: tuple[Augmentation, torch.Tensor, int] | None = None):
        """One vmapped call per batch size (for models whose batch statistics padding would change)."""
        k = rows.shape[0]
        g = [rows.new_empty(k, n) for _, n in self.fn.layout.spans]
        loss = rows.new_empty(k)
        hits = torch.empty(k, dtype=torch.long, device=rows.device)
        for b in np.unique(batch):
            sel = to_device(torch.from_numpy(np.nonzero(batch == b)[0]), rows.device)
            sub = {name: t.index_select(0, sel) for name, t in buffers.items()}
            part = None if augment is None else (augment[0], augment[1][sel], augment[2])
            gs, ls, hs = self.fn.grads(rows.index_select(0, sel), sub, *self._gather(x, y, idx[sel, : int(b)], part))
            for full, part in zip(g, gs):
                full[sel] = part
            loss[sel], hits[sel] = ls, hs
            for name, t in buffers.items():
                t[sel] = sub[name]
        return g, loss, hits


# ------------------------------------------------------------------ chunk size


def parse_cohort_size(value: object) -> int | str:
    """``engine.cohort_size``: a positive integer, or ``auto``; anything else is a clear error."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        size = int(str(value))
    except ValueError:
        size = 0
    if isinstance(value, bool) or size < 1 or str(value).strip() != str(size):
        raise ValueError(f"engine.cohort_size must be a positive integer or 'auto', got {value!r}")
    return size


def free_memory(device: torch.device | str) -> int:
    """Bytes the device can still allocate: CUDA's free memory, else the host's available RAM."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    import psutil

    return int(psutil.virtual_memory().available)


def auto_cohort_size(per_client_bytes: int, num_clients: int, free_bytes: int, fraction: float = 0.5) -> int:
    """The largest chunk (at most ``num_clients``, at least 1) whose estimated memory fits in
    ``fraction`` of ``free_bytes`` (the safety factor: the rest is left to everything else)."""
    if per_client_bytes <= 0:
        raise ValueError(f"per_client_bytes must be positive, got {per_client_bytes}")
    fits = int(free_bytes * fraction) // per_client_bytes
    return max(1, min(num_clients, fits))
