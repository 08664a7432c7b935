"""FuseFL (Tang et al., NeurIPS 2024): one-shot FL by progressive, causally motivated model fusion.

The model is cut into K blocks b_1..b_K (plus the linear head W). Round k = 1..K (specs/fusefl.md):

* client m trains ``[H_1, ..., H_{k-1}, a_k^m -> b_k^m, b_{k+1}^m, ..., b_K^m, W^m]``: the fused
  levels H_j (every client's block j, each behind its adaptor) are frozen and kept in eval mode,
  the adaptor a_k^m (a 1x1 conv over the channel-concatenation of all M branch outputs of level
  k-1, in client-id order; or their plain mean with ``adaptor: avg``) and everything above it
  train with the run's ``train`` settings (fresh SGD each round) for ``local_epochs``;
* it uploads b_k^m with a_k^m (and W^m in round K); the server (list mode) stacks them into
  H_k and broadcasts it. Each parameter is uploaded once, the one-shot budget spread over K
  rounds.

Between rounds the client keeps its unfused upper blocks, its classifier and its next adaptor
(created fresh when it finishes a round, default PyTorch init, seeded) in the client-state
manager: one flat tensor per name, packed and unpacked by :class:`FusePlan`.

Final model: all K fused levels, phi(x) = sum_m flatten(t_K^m), logits = W_bar phi(x) with
W_bar the mean of the M classifiers. Because each W^m saw one branch's features, W_bar is then
calibrated (CCVR, ``locals/ccvr.py``) in one more list-mode round: each client sends, for the
summed feature of the final model in eval mode, per-class counts n_mc, means mu_mc and unbiased
covariances S_mc (upper triangles; these bytes count as upload); the server pools them exactly,
mu_c = sum_m n_mc mu_mc / N_c and
S_c = sum_m [(n_mc - 1) S_mc + n_mc mu_mc mu_mc^T] / (N_c - 1) - N_c / (N_c - 1) mu_c mu_c^T,
samples ``sample_per_class`` features per class from N(mu_c, S_c) and trains only W_bar with
plain SGD (lr 0.01, batch 128, one pass) through the shared ``LocalTrainer``.

The reference code has two bugs here (card pitfall 2 and the client side of it): it sends the
population covariance (correction 0) but pools it with the unbiased formula, and its
``N_c / N_c - 1`` evaluates to 0, so the mean outer product is never subtracted (an uncentred,
too-wide sampling covariance). ``calibration: reference`` reproduces both, for comparison only;
``fixed`` (the default) is the exact pooled covariance. Unlike the reference (pitfalls 3 and 4)
frozen levels and the statistics pass use eval-mode BatchNorm: each client holds its own copy.

Rounds: K block rounds plus one calibration round (``calibrate: false``: K). All M clients take
part in every round. Cut points: ResNet-18 uses the reference table (K in 2, 3, 4, 8); any other
staged model is cut at stages that have parameters and output (C, H, W) or (D,) features, in
K groups as equal as possible (larger groups last), e.g. the CNN with channels [c1, c2, c3]:
K=2 -> [conv1 conv2][conv3 fc], K=4 -> [conv1][conv2][conv3][fc]; ``cuts`` names them explicitly.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from fl_platform.algorithms.base import (
    AlgorithmConf,
    AlgorithmSpec,
    ClientAlgorithm,
    ServerAlgorithm,
    Setup,
    StateSpec,
)
from fl_platform.algorithms.oneshot.protocol import HoldoutFilter, count_model, require_one_block
from fl_platform.core import Broadcast, ClientUpdate, RoundContext
from fl_platform.models import FUSEFL_RESNET18_CUTS, ResNet18, StagedModel
from fl_platform.seeding import Stream, seed_torch_global, torch_generator
from fl_platform.training.flat import FlatModel
from fl_platform.training.loop import ClientData, LocalTrainer, TrainConfig, evaluate

_FUSEFL = 0x46555345  # "FUSE": stream key of adaptor initialisation and calibration sampling
_SERVER = 0x7FFFFFFF  # the "client id" of the server's own calibration pass


@dataclass
class FuseFLConf(AlgorithmConf):
    name: str = "fusefl"
    blocks: int = 2  # K: blocks = block rounds
    cuts: list[str] | None = None  # K - 1 stage names to cut after (None: the model's default plan)
    adaptor: str = "conv1x1"  # conv1x1 (1x1 conv over the concatenated branches) or avg (their mean)
    local_epochs: int | None = None  # epochs per block round (None: train.epochs)
    calibrate: bool = True  # one more round: per-class feature statistics, then calibrate W_bar
    calibration: str = "fixed"  # fixed (exact pooled covariance) or reference (the reference code's bugs)
    sample_per_class: int = 5000
    calibration_lr: float = 0.01
    calibration_batch_size: int = 128
    # Share of the training set no client trains on (set to the one-shot methods' value to compare).
    server_fraction: float = 0.0

    def inactive_fields(self, run: Any) -> dict[str, str]:
        out: dict[str, str] = {}
        if not self.calibrate:
            out.update(dict.fromkeys(("calibration", "sample_per_class", "calibration_lr", "calibration_batch_size"),
                                     "a setting of the classifier calibration, and calibrate=false"))
        if self.blocks == 1:
            out.update(adaptor="with one block no level sits behind an adaptor", cuts="one block has no cut")
        return out


# ---------------------------------------------------------------------------- flat pieces

def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *(b for b in module.buffers() if b.is_floating_point())]


def piece_size(module: nn.Module) -> int:
    """Elements of a piece's parameters and float buffers (what it uploads)."""
    return sum(t.numel() for t in _tensors(module))


def get_vector(module: nn.Module) -> torch.Tensor:
    """A piece's parameters then float buffers, flat (a detached CPU copy)."""
    parts = [t.detach().reshape(-1).to("cpu", torch.float32) for t in _tensors(module)]
    return torch.cat(parts) if parts else torch.zeros(0)


@torch.no_grad()
def set_vector(module: nn.Module, vector: torch.Tensor) -> nn.Module:
    """Inverse of :func:`get_vector`."""
    if vector.numel() != piece_size(module):
        raise ValueError(f"a vector of {vector.numel()} elements cannot fill a piece of {piece_size(module)}")
    offset = 0
    for t in _tensors(module):
        t.copy_(vector[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return module


# ---------------------------------------------------------------------------- modules

class ConcatAdaptor(nn.Module):
    """a_k: 1x1 conv (Linear for vector features) over the concatenation of the M branch outputs."""

    def __init__(self, branches: int, shape: tuple[int, ...]) -> None:
        super().__init__()
        c = shape[0]
        self.proj = nn.Conv2d(branches * c, c, kernel_size=1) if len(shape) == 3 else nn.Linear(branches * c, c)

    def forward(self, outs: list[torch.Tensor]) -> torch.Tensor:
        return self.proj(torch.cat(outs, dim=1))


class AvgAdaptor(nn.Module):
    """The parameter-free option: the elementwise mean of the M branch outputs."""

    def forward(self, outs: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(outs).mean(dim=0)


class Branch(nn.Module):
    """One client's block at one level, behind its adaptor (none at level 1: it takes the input)."""

    def __init__(self, adaptor: nn.Module | None, block: nn.Module) -> None:
        super().__init__()
        self.adaptor = adaptor
        self.block = block

    def forward(self, inp: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        return self.block(self.adaptor(inp) if self.adaptor is not None else inp)


class FuseFLModel(nn.Module):
    """Fused levels (frozen, always in eval mode), then the client's own part or the summed feature.

    With ``own`` set (a client's round-k model): ``own`` takes the concatenated level k-1 outputs,
    ``upper`` blocks follow, then ``head``. Without it (the final model): the M outputs of the last
    level are flattened and summed, then ``head`` (W_bar).
    """

    def __init__(self, levels: list[nn.ModuleList], own: Branch | None = None,
                 upper: list[nn.Module] | None = None, head: nn.Module | None = None) -> None:
        super().__init__()
        self.levels = nn.ModuleList(levels)
        self.own = own
        self.upper = nn.ModuleList(upper or [])
        self.head = head
        self.levels.requires_grad_(False)
        self.levels.eval()

    def train(self, mode: bool = True) -> FuseFLModel:
        super().train(mode)
        self.levels.eval()  # frozen levels keep their running statistics (card pitfall 4)
        return self

    def features(self, x: torch.Tensor) -> torch.Tensor:
        outs: list[torch.Tensor] | None = None
        for level in self.levels:
            outs = [branch(x if outs is None else outs) for branch in level]
        if self.own is None:
            if outs is None:
                raise ValueError("a FuseFL model needs at least one fused level or its own block")
            return torch.stack([o.flatten(1) for o in outs]).sum(dim=0)
        h = self.own(x if outs is None else outs)
        for block in self.upper:
            h = block(h)
        return h.flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            raise ValueError("this FuseFL model has no classifier (it only computes features)")
        return self.head(self.features(x))


# ---------------------------------------------------------------------------- the block plan

def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def plan_cuts(model: nn.Module, blocks: int, cuts: list[str] | None = None) -> list[str]:
    """The K stage names after which each block ends (the last is the stage before the head)."""
    if not isinstance(model, StagedModel):
        raise ValueError(f"FuseFL cuts the model into blocks at stage boundaries, so it needs a staged model "
                         f"from fl_platform.models; got {type(model).__name__}")
    if blocks < 1:
        raise ValueError(f"algorithm.blocks must be >= 1, got {blocks}")
    names = model.stage_names
    body = names[:-1]
    if not body or not any(_has_params(model.stages[n]) for n in body):
        raise ValueError(f"model {type(model).__name__} has no trainable stage below its head "
                         f"(stages {names}): FuseFL cannot split it into blocks")
    shapes = model.stage_output_shapes()
    model_name = type(model).__name__
    if cuts is not None:
        cuts = list(cuts)
        if len(cuts) != blocks - 1:
            raise ValueError(f"algorithm.cuts must name blocks - 1 = {blocks - 1} stages, got {cuts}")
        resolved = [names[model.resolve_cut(c)] for c in cuts]
        if any(n not in body[:-1] for n in resolved):
            raise ValueError(f"algorithm.cuts {cuts}: a cut must lie strictly below the last stage "
                             f"{body[-1]!r} (stages {names})")
        if any(body.index(b) <= body.index(a) for a, b in itertools.pairwise(resolved)):
            raise ValueError(f"algorithm.cuts {cuts} are not in increasing stage order {names}")
    elif isinstance(model, ResNet18) and blocks > 1:
        if blocks not in FUSEFL_RESNET18_CUTS:
            raise ValueError(f"FuseFL splits ResNet18 into K in {sorted(FUSEFL_RESNET18_CUTS)} blocks (the "
                             f"reference's EXNN_Split_Configs); got algorithm.blocks={blocks}; name the cut "
                             f"stages in algorithm.cuts to split it another way")
        resolved = [names[model.resolve_cut(c)] for c in FUSEFL_RESNET18_CUTS[blocks][:-1]]
    else:
        candidates = [n for n in body[:-1] if _has_params(model.stages[n]) and len(shapes[n]) in (1, 3)]
        units = len(candidates) + 1
        if blocks > units:
            raise ValueError(f"model {model_name} can be cut into at most {units} FuseFL blocks (cut points: "
                             f"after {candidates or 'none'}); got algorithm.blocks={blocks}")
        sizes = [units // blocks] * blocks
        for i in range(units % blocks):
            sizes[blocks - 1 - i] += 1
        ends, total = [], 0
        for s in sizes[:-1]:
            total += s
            ends.append(total)
        resolved = [candidates[e - 1] for e in ends]
    for n in resolved:
        if len(shapes[n]) not in (1, 3):
            raise ValueError(f"FuseFL cannot fuse after stage {n!r} of {model_name}: its output {shapes[n]} is "
                             "neither (C, H, W) nor (D,), so branch outputs cannot be concatenated")
    return [*resolved, body[-1]]


class FusePlan:
    """Block structure, sizes and the state layout, derived once from the experiment's model."""

    def __init__(self, setup: Setup, cfg: FuseFLConf) -> None:
        if cfg.adaptor not in ("conv1x1", "avg"):
            raise ValueError(f"algorithm.adaptor must be 'conv1x1' or 'avg', got {cfg.adaptor!r}")
        with torch.random.fork_rng(devices=[]):
            template = setup.model_fn()
        self.cuts = plan_cuts(template, cfg.blocks, cfg.cuts)
        self.K = len(self.cuts)
        self.M = setup.num_clients
        self.adaptor = cfg.adaptor
        pieces = template.partition(self.cuts)
        self.blocks: list[nn.Module] = list(pieces[:-1])
        self.head: nn.Module = pieces[-1]
        shapes = template.stage_output_shapes()
        self.out_shapes = [tuple(shapes[c]) for c in self.cuts]
        self.block_sizes = [piece_size(b) for b in self.blocks]
        self.head_size = piece_size(self.head)
        self.feature_dim = math.prod(self.out_shapes[-1])
        with torch.random.fork_rng(devices=[]):
            self.adaptor_sizes = [piece_size(self.make_adaptor(j)) if j else 0 for j in range(self.K)]
        self.upper_offsets = [0] * self.K
        for j in range(2, self.K):
            self.upper_offsets[j] = self.upper_offsets[j - 1] + self.block_sizes[j - 1]

    # -- building pieces
    def make_adaptor(self, j: int) -> nn.Module:
        """A fresh adaptor in front of block j (0-based, j >= 1), default PyTorch init."""
        if self.adaptor == "avg":
            return AvgAdaptor()
        return ConcatAdaptor(self.M, self.out_shapes[j - 1])

    def make_block(self, j: int, vector: torch.Tensor | None = None) -> nn.Module:
        block = copy.deepcopy(self.blocks[j])
        return set_vector(block, vector) if vector is not None else block

    def make_head(self, vector: torch.Tensor | None = None) -> nn.Module:
        head = copy.deepcopy(self.head)
        return set_vector(head, vector) if vector is not None else head

    def level(self, j: int, blocks: torch.Tensor, adaptors: torch.Tensor | None) -> nn.ModuleList:
        """Fused level j from the stacked block vectors [M, size] (and adaptor vectors)."""
        branches = []
        for m in range(blocks.shape[0]):
            adaptor = None
            if j:
                adaptor = self.make_adaptor(j)
                if adaptors is not None and adaptors.numel():
                    set_vector(adaptor, adaptors[m])
            branches.append(Branch(adaptor, self.make_block(j, blocks[m])))
        return nn.ModuleList(branches)

    def fused_model(self, levels: list[tuple[torch.Tensor, torch.Tensor | None]], head: torch.Tensor | None
                    ) -> FuseFLModel:
        """The final model from all K levels and a classifier vector (None: features only)."""
        with torch.random.fork_rng(devices=[]):  # adaptors are built then overwritten: keep the RNG untouched
            return FuseFLModel([self.level(j, b, a) for j, (b, a) in enumerate(levels)],
                               head=self.make_head(head) if head is not None else None)

    # -- client state
    def state_spec(self) -> dict[str, StateSpec]:
        if self.K == 1:
            return {}
        specs = {"upper": StateSpec(sum(self.block_sizes[1:])), "head": StateSpec(self.head_size)}
        if max(self.adaptor_sizes) > 0:
            specs["adaptor"] = StateSpec(max(self.adaptor_sizes))
        return {k: v for k, v in specs.items() if v.size > 0}

    def pack(self, next_round: int, upper: list[nn.Module], head: nn.Module, adaptor: nn.Module
             ) -> dict[str, torch.Tensor]:
        """State after a round: blocks next_round..K-1, the head, the adaptor of next_round."""
        specs = self.state_spec()
        state = {name: torch.zeros(spec.size) for name, spec in specs.items()}
        for j, block in zip(range(next_round, self.K), upper):
            off = self.upper_offsets[j]
            state["upper"][off : off + self.block_sizes[j]] = get_vector(block)
        state["head"] = get_vector(head)
        if "adaptor" in state:
            vec = get_vector(adaptor)
            state["adaptor"][: vec.numel()] = vec
        return state

    def unpack(self, r: int, state: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(vectors of blocks r..K-1, head vector, adaptor vector of round r)."""
        upper = state.get("upper", torch.zeros(0)).to("cpu")
        blocks = [upper[self.upper_offsets[j] : self.upper_offsets[j] + self.block_sizes[j]] for j in range(r, self.K)]
        adaptor = state.get("adaptor", torch.zeros(0)).to("cpu")[: self.adaptor_sizes[r]]
        return blocks, state["head"].to("cpu"), adaptor


def levels_from_broadcast(broadcast: Broadcast, count: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    return [(broadcast.tensors[f"level{j}.blocks"].to("cpu"), broadcast.tensors.get(f"level{j}.adaptors"))
            for j in range(count)]


# ---------------------------------------------------------------------------- calibration statistics

def _triu(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.triu_indices(d, d))  # type: ignore[return-value]


def class_statistics(features: torch.Tensor, labels: torch.Tensor, num_classes: int, correction: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-class (counts [C], means [C, D], covariances [C, D, D]) of ``features`` in float64.

    ``correction`` 1: unbiased covariance (what ``fixed`` calibration sends); 0: population (the
    reference's). A class with fewer than correction + 1 samples gets a zero covariance.
    """
    f = features.to(torch.float64)
    d = f.shape[1]
    counts = torch.zeros(num_classes, dtype=torch.float64)
    means = torch.zeros(num_classes, d, dtype=torch.float64)
    covs = torch.zeros(num_classes, d, d, dtype=torch.float64)
    for c in range(num_classes):
        fc = f[labels == c]
        n = fc.shape[0]
        counts[c] = n
        if n == 0:
            continue
        means[c] = fc.mean(dim=0)
        if n > correction:
            centred = fc - means[c]
            covs[c] = centred.T @ centred / (n - correction)
    return counts, means, covs


def pool_statistics(counts: torch.Tensor, means: torch.Tensor, covs: torch.Tensor, reference: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pool per-client class statistics [M, C, ...] into (N_c, mu_c, S_c) (CCVR's formula).

    Exact for unbiased client covariances: the pooled unbiased covariance of the union. With
    ``reference`` the mean outer product is not subtracted (``N_c / N_c - 1 == 0`` in the code).
    """
    n = counts.to(torch.float64)
    total = n.sum(dim=0)  # [C]
    safe = total.clamp(min=1.0)
    mu = (n[..., None] * means).sum(dim=0) / safe[:, None]
    denom = (total - 1.0).clamp(min=1.0)[:, None, None]
    outer = means[..., :, None] * means[..., None, :]  # [M, C, D, D]
    cov = (((n - 1.0).clamp(min=0.0)[..., None, None] * covs + n[..., None, None] * outer).sum(dim=0)) / denom
    if not reference:
        cov = cov - (total / (total - 1.0).clamp(min=1.0))[:, None, None] * (mu[:, :, None] * mu[:, None, :])
    cov[total <= 1] = 0.0
    return total, mu, cov


def sample_features(mu: torch.Tensor, cov: torch.Tensor, counts: torch.Tensor, per_class: int,
                    gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_class`` draws from N(mu_c, S_c) for every class with data (S_c made PSD by eigh)."""
    xs, ys = [], []
    for c in range(mu.shape[0]):
        if counts[c] <= 0:
            continue
        evals, evecs = torch.linalg.eigh((cov[c] + cov[c].T) / 2)
        scale = evecs * evals.clamp(min=0.0).sqrt()
        z = torch.randn(per_class, mu.shape[1], generator=gen, dtype=torch.float64)
        xs.append(mu[c] + z @ scale.T)
        ys.append(torch.full((per_class,), c, dtype=torch.long))
    return torch.cat(xs).to(torch.float32), torch.cat(ys)


def pack_statistics(features: torch.Tensor, labels: torch.Tensor, num_classes: int, correction: int
                    ) -> dict[str, torch.Tensor]:
    """What a client uploads for the calibration: per-class counts, means and covariances (upper triangles)."""
    counts, means, covs = class_statistics(features, labels, num_classes, correction)
    rows, cols = _triu(features.shape[1])
    return {"counts": counts.float(), "means": means.float(), "covs": covs[:, rows, cols].float()}


def calibrate_head(head: nn.Module, result: list[ClientUpdate], cfg: Any, gen: torch.Generator, seed: int,
                   round: int) -> dict[str, float]:
    """Train the linear ``head`` in place on features drawn from the clients' pooled class statistics
    (``pack_statistics`` uploads): ``cfg.sample_per_class`` per class, plain SGD at ``cfg.calibration_lr``,
    batch ``cfg.calibration_batch_size``, one pass; ``cfg.calibration == "reference"`` pools with the
    reference code's bug. Also FuseFL's calibration offered to the one-shot methods (oneshot/calibration.py)."""
    counts = torch.stack([u.tensors["counts"].double() for u in result])
    means = torch.stack([u.tensors["means"].double() for u in result])
    dim = means.shape[-1]
    rows, cols = _triu(dim)
    covs = torch.zeros(*counts.shape, dim, dim, dtype=torch.float64)
    for m, u in enumerate(result):
        packed = u.tensors["covs"].double()
        covs[m][:, rows, cols] = packed
        covs[m][:, cols, rows] = packed
    reference = getattr(cfg, "calibration", "fixed") == "reference"
    total, mu, cov = pool_statistics(counts, means, covs, reference=reference)
    x, y = sample_features(mu, cov, total, cfg.sample_per_class, gen)
    fm = FlatModel(head, "cpu")
    train = TrainConfig(epochs=1, batch_size=cfg.calibration_batch_size, lr=cfg.calibration_lr)
    metrics = LocalTrainer(fm, train).fit(ClientData(x, y, torch.arange(x.shape[0])), seed=seed, round=round,
                                          client=_SERVER)
    return {"calibration_samples": float(x.shape[0]), "calibration_loss": metrics.mean("train_loss"),
            "calibrated_classes": float((total > 0).sum())}


# ---------------------------------------------------------------------------- the two halves

class FuseFLClient(ClientAlgorithm):
    def __init__(self, cfg: FuseFLConf, setup: Setup) -> None:
        super().__init__(cfg, setup)
        self.plan = FusePlan(setup, cfg)
        self.holdout = HoldoutFilter(cfg.server_fraction, setup.seed)

    @classmethod
    def uploads(cls, cfg: FuseFLConf) -> dict[str, str | None]:
        """Block rounds: block (+ adaptor from round 2 with conv1x1, + head in round K); calibration:
        per-class statistics. Their sizes change from round to round."""
        names = ["block", "head"]
        if cfg.adaptor == "conv1x1" and cfg.blocks > 1:
            names.append("adaptor")
        if cfg.calibrate:
            names += ["counts", "means", "covs"]
        return dict.fromkeys(names)

    def state_spec(self) -> dict[str, StateSpec]:
        return self.plan.state_spec()

    def train(self, ctx: RoundContext, client_id: int, broadcast: Broadcast,
              state: dict[str, torch.Tensor] | None, data: ClientData, trainer: LocalTrainer) -> ClientUpdate:
        data = self.holdout(data)
        if ctx.round < self.plan.K:
            return self.train_block(ctx, client_id, broadcast, state, data, trainer)
        return self.statistics(ctx, client_id, broadcast, data, trainer)

    def train_block(self, ctx: RoundContext, client_id: int, broadcast: Broadcast,
                    state: dict[str, torch.Tensor] | None, data: ClientData, trainer: LocalTrainer) -> ClientUpdate:
        plan, r, device = self.plan, ctx.round, trainer.fm.device
        if r == 0:
            trainer.fm.load(broadcast.tensors["weights"])
            pieces = trainer.fm.model.partition(plan.cuts)
            own_vectors = [get_vector(p) for p in pieces[:-1]]
            head_vec, adaptor_vec = get_vector(pieces[-1]), None
        else:
            if state is None:
                raise RuntimeError(f"FuseFL client {client_id} has no state in round {r + 1}: every client must "
                                   "take part in every round (clients_per_round = num_clients)")
            own_vectors, head_vec, adaptor_vec = plan.unpack(r, state)
        adaptor = None
        if r:
            adaptor = plan.make_adaptor(r)
            if adaptor_vec is not None and adaptor_vec.numel():
                set_vector(adaptor, adaptor_vec)
        own = Branch(adaptor, plan.make_block(r, own_vectors[0]))
        upper = [plan.make_block(j, v) for j, v in zip(range(r + 1, plan.K), own_vectors[1:])]
        head = plan.make_head(head_vec)
        levels = [plan.level(j, b, a) for j, (b, a) in enumerate(levels_from_broadcast(broadcast, r))]
        fm = FlatModel(FuseFLModel(levels, own, upper, head), device)
        cfg = trainer.cfg if self.cfg.local_epochs is None else replace(trainer.cfg, epochs=self.cfg.local_epochs)
        metrics = LocalTrainer(fm, cfg).fit(data, self.hooks(ctx, broadcast, state, trainer), seed=ctx.seed,
                                            round=r, client=client_id)
        tensors = {"block": get_vector(own.block)}
        if adaptor is not None and plan.adaptor_sizes[r]:
            tensors["adaptor"] = get_vector(adaptor)
        new_state = None
        if r == plan.K - 1:
            tensors["head"] = get_vector(head)
        else:
            with torch.random.fork_rng(devices=[]):
                seed_torch_global(ctx.seed, Stream.ALGORITHM, _FUSEFL, r + 1, client_id)
                next_adaptor = plan.make_adaptor(r + 1)
            new_state = plan.pack(r + 1, upper, head, next_adaptor)
        n = data.num_samples
        return ClientUpdate(client_id, tensors, {"n": float(n)}, n, metrics, state=new_state)

    @torch.no_grad()
    def statistics(self, ctx: RoundContext, client_id: int, broadcast: Broadcast, data: ClientData,
                   trainer: LocalTrainer) -> ClientUpdate:
        """Per-class statistics of the final model's summed feature on this client's data (eval mode)."""
        model = self.plan.fused_model(levels_from_broadcast(broadcast, self.plan.K), None).to(trainer.fm.device)
        model.eval()
        feats = []
        idx = data.indices
        for i in range(0, idx.numel(), 1024):
            feats.append(model.features(data.x.index_select(0, idx[i : i + 1024])).cpu())
        features = torch.cat(feats) if feats else torch.zeros(0, self.plan.feature_dim)
        labels = data.y.index_select(0, idx).cpu()
        correction = 0 if self.cfg.calibration == "reference" else 1
        tensors = pack_statistics(features, labels, self.setup.num_classes, correction)
        n = data.num_samples
        return ClientUpdate(client_id, tensors, {"n": float(n)}, n)


class FuseFLServer(ServerAlgorithm):
    summable = False

    def __init__(self, cfg: FuseFLConf, setup: Setup, initial_weights: torch.Tensor) -> None:
        if cfg.calibration not in ("fixed", "reference"):
            raise ValueError(f"algorithm.calibration must be 'fixed' or 'reference', got {cfg.calibration!r}")
        if cfg.sample_per_class < 1 or cfg.calibration_lr <= 0 or cfg.calibration_batch_size < 1:
            raise ValueError("algorithm.sample_per_class, calibration_lr and calibration_batch_size must be positive")
        if cfg.local_epochs is not None and cfg.local_epochs < 1:
            raise ValueError(f"algorithm.local_epochs must be >= 1 (or null), got {cfg.local_epochs}")
        super().__init__(cfg, setup, initial_weights)
        self.plan = FusePlan(setup, cfg)
        self.levels: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.heads: list[torch.Tensor] = []
        self.head_avg: torch.Tensor | None = None
        self.head_calibrated: torch.Tensor | None = None

    @property
    def rounds_needed(self) -> int:
        return self.plan.K + (1 if self.cfg.calibrate else 0)

    def attach_data(self, data: Any) -> None:
        if self.cfg.server_fraction > 0:  # the clients hold out the server's split (HoldoutFilter)
            require_one_block(data, self.cfg.name)

    def broadcast(self, ctx: RoundContext) -> Broadcast:
        need = self.rounds_needed
        if ctx.num_rounds != need:
            extra = " + 1 calibration round" if self.cfg.calibrate else ""
            raise ValueError(f"fusefl with algorithm.blocks={self.plan.K} runs {need} rounds ({self.plan.K} block "
                             f"rounds{extra}): set rounds={need}, got rounds={ctx.num_rounds}")
        if len(ctx.clients) != ctx.num_clients:
            raise ValueError(f"fusefl fuses every client's block, so every client takes part in every round: set "
                             f"clients_per_round=num_clients={ctx.num_clients}, got {len(ctx.clients)}")
        tensors: dict[str, torch.Tensor] = {}
        if ctx.round == 0:
            tensors["weights"] = self.weights
        for j, (blocks, adaptors) in enumerate(self.levels):
            tensors[f"level{j}.blocks"] = blocks
            if adaptors is not None:
                tensors[f"level{j}.adaptors"] = adaptors
        return Broadcast(tensors)

    def aggregate(self, ctx: RoundContext, result: Any) -> dict[str, float]:
        if not isinstance(result, list):
            raise TypeError("FuseFLServer runs in list mode and needs a list of ClientUpdates")
        if [u.client_id for u in result] != list(range(self.plan.M)):
            missing = sorted(set(range(self.plan.M)) - {u.client_id for u in result})
            raise RuntimeError(f"fusefl round {ctx.round + 1}: every client's contribution is needed, missing "
                               f"clients {missing} (rejected or not sampled)")
        r = ctx.round
        if r < self.plan.K:
            blocks = torch.stack([u.tensors["block"].float().cpu() for u in result])
            adaptors = None
            if r and "adaptor" in result[0].tensors:
                adaptors = torch.stack([u.tensors["adaptor"].float().cpu() for u in result])
            self.levels.append((blocks, adaptors))
            extras: dict[str, float] = {"fused_levels": float(len(self.levels))}
            if r == self.plan.K - 1:
                self.heads = [u.tensors["head"].float().cpu() for u in result]
                self.head_avg = torch.stack(self.heads).mean(dim=0)
                params, nbytes = count_model(self.plan.fused_model(self.levels, self.head_avg))
                extras.update({"model_params": float(params), "model_bytes": float(nbytes)})
            return extras
        return self.calibrate(ctx, result)

    def calibrate(self, ctx: RoundContext, result: list[ClientUpdate]) -> dict[str, float]:
        assert self.head_avg is not None
        head = self.plan.make_head(self.head_avg)
        gen = torch_generator(self.setup.seed, Stream.ALGORITHM, _FUSEFL, ctx.round, 0)
        out = calibrate_head(head, result, self.cfg, gen, self.setup.seed, ctx.round)
        self.head_calibrated = get_vector(head)
        return out

    def final_model(self, device: torch.device | str, calibrated: bool = True) -> FuseFLModel | None:
        if len(self.levels) < self.plan.K or self.head_avg is None:
            return None
        head = self.head_calibrated if calibrated and self.head_calibrated is not None else self.head_avg
        return self.plan.fused_model(self.levels, head).to(device)

    def evaluate(self, fm: FlatModel, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> dict[str, float]:
        """Test metrics of the fused model once all levels exist (before that there is no model)."""
        model = self.final_model(fm.device)
        if model is None:
            return {}
        out = evaluate(model, x, y, batch_size)
        if self.head_calibrated is not None:
            uncal = evaluate(self.final_model(fm.device, calibrated=False), x, y, batch_size)
            out["uncalibrated_test_accuracy"] = uncal["test_accuracy"]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "levels": [(b.clone(), None if a is None else a.clone()) for b, a in self.levels],
                "heads": [h.clone() for h in self.heads],
                "head_avg": None if self.head_avg is None else self.head_avg.clone(),
                "head_calibrated": None if self.head_calibrated is None else self.head_calibrated.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.levels = [(b.clone(), None if a is None else a.clone()) for b, a in state.get("levels", [])]
        self.heads = [h.clone() for h in state.get("heads", [])]
        self.head_avg = state.get("head_avg")
        self.head_calibrated = state.get("head_calibrated")


SPEC = AlgorithmSpec("fusefl", FuseFLConf, FuseFLClient, FuseFLServer,
                     "FuseFL: K blocks trained bottom-up over K rounds, fused across clients, calibrated head",
                     staged_model=True)
