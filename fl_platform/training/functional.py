"""The local training step in functional form, over clients stacked along a leading dimension.

``LocalTrainer.fit`` (loop.py) mutates one model in place, one client at a time. The cohort
trainer (vectorised.py) runs K clients' steps as one: their flat parameter vectors are the rows
of a ``(K, P)`` tensor and ``torch.func.vmap`` maps one client's step over the rows. This module
holds the three pieces of that step, each written to do exactly what the sequential code does:

* :class:`FunctionalModel`: loss, logits and the flat gradient of one client's minibatch as a
  pure function of its flat parameters (``functional_call`` + ``grad``), vmapped over clients;
  BatchNorm running statistics are stacked per client like the parameters.
* :func:`gradient_terms`: the functional form of a hook's ``before_step`` (FedProx's proximal
  gradient, SCAFFOLD's constant correction).
* :class:`StackedOptimizer`: ``FlatSGD`` / ``FlatAdam`` (optim.py) applied row-wise.

Anything without a functional form raises :class:`NotVectorisable`, naming the reason, so the
engine can fall back to the sequential loop.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from fl_platform.training.flat import FlatModel
from fl_platform.training.hooks import ComposedHooks, GradientCorrectionHook, ProximalHook, TrainHooks
from fl_platform.training.loop import TrainConfig


class NotVectorisable(Exception):
    """This model, hook or algorithm has no functional form; the message names why."""


# ------------------------------------------------------------------ hooks


@dataclass(frozen=True)
class ProximalTerm:
    """FedProx: ``grad += mu * (params - anchor)`` (``ProximalHook.before_step``)."""

    mu: float
    anchor: torch.Tensor


@dataclass(frozen=True)
class CorrectionTerm:
    """SCAFFOLD: ``grad += correction`` (``GradientCorrectionHook.before_step``)."""

    correction: torch.Tensor


GradTerm = ProximalTerm | CorrectionTerm


def gradient_terms(hooks: TrainHooks | None) -> tuple[GradTerm, ...]:
    """The gradient corrections ``hooks`` apply in ``before_step``, in the order they apply them.

    A hook class may declare its own form with a ``functional_terms()`` method. Otherwise a hook
    is recognised when its methods are exactly the library's (a subclass that overrides
    ``before_step``, ``after_step`` or ``loss`` is not). Raises NotVectorisable otherwise.
    """
    if hooks is None:
        return ()
    declared: Callable[[], tuple[GradTerm, ...]] | None = getattr(hooks, "functional_terms", None)
    if callable(declared):
        return tuple(declared())
    cls = type(hooks)
    if cls is ComposedHooks:
        return tuple(term for h in hooks.hooks for term in gradient_terms(h))
    if cls.loss is not TrainHooks.loss:
        raise NotVectorisable(f"hook {cls.__name__} replaces the loss (no functional form)")
    if cls.after_step is not TrainHooks.after_step:
        raise NotVectorisable(f"hook {cls.__name__} has an after_step (no functional form)")
    if cls.before_step is TrainHooks.before_step:
        return ()
    if cls.before_step is ProximalHook.before_step:
        return (ProximalTerm(float(hooks.mu), hooks.global_params),) if hooks.mu else ()
    if cls.before_step is GradientCorrectionHook.before_step:
        return (CorrectionTerm(hooks.correction),)
    raise NotVectorisable(f"hook {cls.__name__} has a before_step with no functional form")


def stack_rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``(K, n)`` rows, or the one shared ``(n,)`` tensor when every client passed the same object."""
    first = tensors[0]
    if all(t is first for t in tensors):
        return first
    return torch.stack(tensors)


@dataclass(frozen=True)
class SlotLayout:
    """Where each parameter tensor lives in the flat parameter vector.

    Cohort tensors stay flat (``(K, P)``: one client per row, as ``FlatModel`` lays them out) but
    are processed one parameter tensor at a time, as lists of ``(k, numel)`` views handed to
    ``torch._foreach_*`` ops: the per-parameter gradients ``grad`` returns are used as they come,
    never concatenated into a flat gradient.
    """

    spans: tuple[tuple[int, int], ...]  # (offset, numel) per parameter tensor

    def views(self, t: torch.Tensor, k: int) -> list[torch.Tensor]:
        """Per-slot views of the first ``k`` rows of a ``(K, P)`` tensor, or of a shared ``(P,)`` one."""
        if t.dim() == 1:
            return [t[o : o + n] for o, n in self.spans]
        rows = t[:k]
        return [rows[:, o : o + n] for o, n in self.spans]

    def subset(self, keep: list[int]) -> SlotLayout:
        return SlotLayout(tuple(self.spans[i] for i in keep))


@dataclass
class StackedTerm:
    """One gradient term for a whole cohort: tensors are ``(K, P)`` rows or one shared ``(P,)``."""

    kind: type
    tensor: torch.Tensor
    mu: torch.Tensor | float = 0.0

    @staticmethod
    def stack(terms: list[GradTerm]) -> StackedTerm:
        kind = type(terms[0])
        if kind is ProximalTerm:
            mus = [t.mu for t in terms]  # type: ignore[union-attr]
            mu: torch.Tensor | float = mus[0] if len(set(mus)) == 1 else torch.tensor(mus)[:, None]
            return StackedTerm(kind, stack_rows([t.anchor for t in terms]), mu)  # type: ignore[union-attr]
        return StackedTerm(kind, stack_rows([t.correction for t in terms]))  # type: ignore[union-attr]

    def apply(self, grads: list[torch.Tensor], params: list[torch.Tensor], layout: SlotLayout, k: int) -> None:
        """Add the term to the first ``k`` clients' per-slot gradients in place."""
        parts = layout.views(self.tensor, k)
        if self.kind is CorrectionTerm:
            torch._foreach_add_(grads, parts)
            return
        diff = torch._foreach_sub(params, parts)
        if isinstance(self.mu, torch.Tensor):
            mu = self.mu[:k].to(grads[0])
            for d in diff:
                d.mul_(mu)
            torch._foreach_add_(grads, diff)
        else:
            torch._foreach_add_(grads, diff, alpha=self.mu)

    def select(self, order: torch.Tensor) -> StackedTerm:
        """The term with its per-client rows reordered by ``order``."""
        tensor = self.tensor[order] if self.tensor.dim() == 2 else self.tensor
        mu = self.mu[order] if isinstance(self.mu, torch.Tensor) else self.mu
        return StackedTerm(self.kind, tensor, mu)


def stack_terms(per_client: list[tuple[GradTerm, ...]]) -> list[StackedTerm]:
    """Stack each client's terms position by position; every client must have the same kinds."""
    kinds = [tuple(type(t) for t in terms) for terms in per_client]
    if any(k != kinds[0] for k in kinds):
        raise NotVectorisable("the clients of one cohort use different gradient corrections")
    return [StackedTerm.stack([terms[i] for terms in per_client]) for i in range(len(kinds[0]))]


def clip_rows(grads: list[torch.Tensor], clip_norm: float) -> None:
    """Per-client gradient clipping (as the loop's): scale each client's gradient by
    ``min(1, clip_norm / (||g|| + 1e-6))``, its norm taken over all its parameter slots."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dim=1) for g in grads]), dim=0)
    factor = torch.clamp(clip_norm / (norm + 1e-6), max=1.0)[:, None]
    for g in grads:
        g.mul_(factor)


# ------------------------------------------------------------------ optimisers


class StackedOptimizer:
    """``FlatSGD`` / ``FlatAdam`` over ``(K, P)`` rows, one client per row, same operations per element.

    Every client of a cohort starts at local step 0 together and the trainer only ever steps the
    first ``k`` rows (the clients still training), so step ``s`` is every stepped client's own
    step ``s``: SGD's momentum buffer is initialised at ``s == 0`` and Adam's bias correction
    uses ``t = s + 1``, exactly as for one client. Only the trainable slots are stepped.
    """

    def __init__(self, cfg: TrainConfig) -> None:
        if cfg.optimizer not in ("sgd", "adam"):
            raise ValueError(f"unknown optimizer {cfg.optimizer!r}; valid choices: sgd, adam")
        if cfg.optimizer == "sgd" and cfg.nesterov and cfg.momentum <= 0:
            raise ValueError("Nesterov momentum requires momentum > 0 and dampening = 0")
        self.cfg = cfg
        self._state: list[torch.Tensor] = []
        self.layout = SlotLayout(())

    @property
    def num_states(self) -> int:
        """Tensors of shape (K, P) this optimiser keeps (for the memory estimate)."""
        if self.cfg.optimizer == "adam":
            return 2
        return 1 if self.cfg.momentum else 0

    def reset(self, rows: int, num_params: int, layout: SlotLayout, like: torch.Tensor) -> None:
        """Fresh state for ``rows`` clients, whose trainable parameters sit at ``layout``."""
        self.layout = layout
        shape = (rows, num_params)
        if not self._state or self._state[0].shape != shape or self._state[0].device != like.device \
                or self._state[0].dtype != like.dtype:
            self._state = [torch.empty(shape, dtype=like.dtype, device=like.device)
                           for _ in range(self.num_states)]

    def step(self, s: int, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Step the first ``k`` clients' trainable slots (lists of ``(k, numel)``) at local step ``s``."""
        c = self.cfg
        k = params[0].shape[0] if params else 0
        if c.weight_decay:
            grads = torch._foreach_add(grads, params, alpha=c.weight_decay)
        if c.optimizer == "sgd":
            if c.momentum:
                buf = self.layout.views(self._state[0], k)
                if s == 0:
                    torch._foreach_copy_(buf, grads)
                else:
                    torch._foreach_mul_(buf, c.momentum)
                    torch._foreach_add_(buf, grads)  # dampening 0, as make_optimizer builds FlatSGD
                grads = torch._foreach_add(grads, buf, alpha=c.momentum) if c.nesterov else buf
            torch._foreach_add_(params, grads, alpha=-c.lr)
            return
        b1, b2 = c.adam_beta1, c.adam_beta2
        m, v = self.layout.views(self._state[0], k), self.layout.views(self._state[1], k)
        if s == 0:
            torch._foreach_zero_(m)
            torch._foreach_zero_(v)
        t = s + 1
        torch._foreach_mul_(m, b1)
        torch._foreach_add_(m, grads, alpha=1 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, math.sqrt(1 - b2**t))
        torch._foreach_add_(denom, c.adam_eps)
        torch._foreach_addcdiv_(params, m, denom, value=-c.lr / (1 - b1**t))


# ------------------------------------------------------------------ the model


# The probe looks for batching rules that compute something else (errors of order 1), not for
# rounding, so it compares in full fp32 (``_full_fp32``). TF32 convolutions (cuDNN's default on
# Ampere and later) round their inputs to 10 mantissa bits, and ResNet-18's gradient amplifies that:
# on the CPU, weights perturbed by 5e-4 relative moved its gradient by 1.3e-1 relative (batch 2 or
# 8); on an H200 with TF32 the probe read 6.8e-2 and refused ResNet-18 cohorts (2026-12-04).
_PROBE_TOLERANCE = 1e-2


@contextmanager
def _full_fp32() -> Iterator[None]:
    """cuDNN without TF32 for the probe's two computations, every other cuDNN flag kept; restored
    after (``torch.backends.cudnn.flags``). Matmuls are full fp32 unless the user asked otherwise."""
    b = torch.backends.cudnn
    with b.flags(enabled=b.enabled, benchmark=b.benchmark, benchmark_limit=b.benchmark_limit,
                 deterministic=b.deterministic, allow_tf32=False):
        yield


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm()) / (float(expected.norm()) + 1e-12)


@dataclass(frozen=True)
class DenseLayer:
    """One layer of a plain chain (see ``_dense_chain``): its kind, parameter names and settings."""

    kind: str  # linear | conv | relu | maxpool | flatten
    weight: str | None = None
    bias: str | None = None
    options: tuple = ()  # conv: (stride, padding); maxpool: (kernel_size, stride, padding)


def _dense_chain(model: nn.Module) -> list[DenseLayer] | None:
    """The model as a list of ``DenseLayer`` when its forward is a plain chain of Linear, Conv2d
    (ungrouped, zero padding), ReLU, MaxPool2d and (per-sample) Flatten layers, e.g. our MLP and
    our CNN without normalisation; None otherwise (then vmap is used)."""
    from fl_platform.models.base import StagedModel

    if not isinstance(model, StagedModel) or type(model).forward is not StagedModel.forward:
        return None
    names = {id(m): n for n, m in model.named_modules()}
    chain: list[DenseLayer] = []

    def params(m: nn.Module) -> tuple[str, str | None]:
        return f"{names[id(m)]}.weight", f"{names[id(m)]}.bias" if m.bias is not None else None

    def walk(m: nn.Module) -> bool:
        if type(m) is nn.Sequential:
            return all(walk(c) for c in m)
        if type(m) is nn.Linear:
            chain.append(DenseLayer("linear", *params(m)))
        elif type(m) is nn.Conv2d:
            if m.groups != 1 or m.padding_mode != "zeros" or isinstance(m.padding, str) or m.dilation != (1, 1):
                return False
            chain.append(DenseLayer("conv", *params(m), options=(m.stride, m.padding)))
        elif type(m) is nn.MaxPool2d:
            if m.dilation not in (1, (1, 1)) or m.ceil_mode or m.return_indices:
                return False
            chain.append(DenseLayer("maxpool", options=(m.kernel_size, m.stride, m.padding)))
        elif type(m) is nn.ReLU:
            chain.append(DenseLayer("relu"))
        elif type(m) is nn.Flatten and m.start_dim == 1 and m.end_dim == -1:
            chain.append(DenseLayer("flatten"))
        elif type(m) is not nn.Identity:
            return False
        return True

    if not all(walk(s) for s in model.stages.values()):
        return None
    convs = [i for i, layer in enumerate(chain) if layer.kind in ("conv", "maxpool")]
    flat = next((i for i, layer in enumerate(chain) if layer.kind in ("flatten", "linear")), len(chain))
    if convs and (flat == len(chain) or convs[-1] > flat or chain[flat].kind != "flatten"):
        return None  # image layers after the flatten, or a Linear on images: leave it to vmap
    return chain


class FunctionalModel:
    """A FlatModel's forward/backward as a pure function of stacked flat parameter rows.

    ``grads(params, buffers, x, y, weight)`` returns every client's flat gradient of its
    minibatch's mean cross-entropy (the default ``TrainHooks.loss``), its loss and its number of
    correct predictions. ``buffers`` maps each buffer name to a ``(K, ...)`` tensor; BatchNorm
    updates its rows in place, so each client keeps its own running statistics. With ``weight``
    (``(K, B)`` in {0, 1}) the loss is the mean over the weighted samples: clients whose batch is
    shorter than the others' are padded with copies of their own first sample at weight 0.
    """

    def __init__(self, fm: FlatModel) -> None:
        self.fm = fm
        self.model = fm.model
        self.num_params = fm.num_params
        self.param_slots = [s for s in fm.slots if s.is_param]
        self.buffer_slots = [s for s in fm.slots if not s.is_param]
        self.int_buffers = [(n, b) for n, b in self.model.named_buffers() if not b.is_floating_point()]
        self.batchnorms = [m for m in self.model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self.layout = SlotLayout(tuple((s.offset, s.numel) for s in self.param_slots))
        named = dict(self.model.named_parameters())
        # Frozen parameters (requires_grad False) get a zero gradient and no optimiser step, as in
        # the loop (whose optimisers cover FlatModel.trainable_ranges only).
        self.frozen = [i for i, s in enumerate(self.param_slots) if not named[s.name].requires_grad]
        self.trainable = [i for i in range(len(self.param_slots)) if i not in self.frozen]
        self._plain = vmap(grad(self._client_loss, has_aux=True))
        self._masked = vmap(grad(self._client_masked_loss, has_aux=True))
        self._dense = _dense_chain(self.model) if not self.buffer_slots else None
        self._conv_params = {layer.weight for layer in self._dense or () if layer.kind == "conv"}
        # Padding is exact unless samples of one batch interact (BatchNorm); checked by probe().
        self.can_pad = not self.batchnorms

    # -- one client (vmapped) ------------------------------------------------------------
    # Parameters enter as one tensor per parameter (views of the client's flat row) rather than
    # the flat row itself: slicing a flat vector inside ``grad`` would make every slice's backward
    # write a zero-filled full-size gradient and sum them.
    def _client_loss(self, p, buffers, x, y):
        logits = functional_call(self.model, {**p, **buffers}, (x,))
        loss = F.cross_entropy(logits, y)
        correct = (logits.argmax(dim=-1) == y).sum()
        return loss, (loss.detach(), correct)

    def _client_masked_loss(self, p, buffers, x, y, w):
        logits = functional_call(self.model, {**p, **buffers}, (x,))
        loss = (F.cross_entropy(logits, y, reduction="none") * w).sum() / w.sum()
        correct = ((logits.argmax(dim=-1) == y) & (w > 0)).sum()
        return loss, (loss.detach(), correct)

    # -- cohort ---------------------------------------------------------------------------
    def param_views(self, params: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each parameter of k clients as a ``(k, *shape)`` view of the ``(k, P)`` rows."""
        k = params.shape[0]
        return {s.name: params[:, s.offset : s.offset + s.numel].view(k, *s.shape) for s in self.param_slots}

    def grads(self, params: torch.Tensor, buffers: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
              weight: torch.Tensor | None = None) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """(per-slot gradients, each ``(k, numel)``; losses (k,); correct counts (k,)) for k clients."""
        if self._dense and self._dense_applies(x):
            return self._dense_grads(params, x, y, weight)
        views = self.param_views(params)
        if weight is None:
            g, (loss, correct) = self._plain(views, buffers, x, y)
        else:
            g, (loss, correct) = self._masked(views, buffers, x, y, weight)
        k = params.shape[0]
        grads = [g[s.name].reshape(k, s.numel) for s in self.param_slots]
        for i in self.frozen:
            grads[i] = torch.zeros_like(grads[i])
        return grads, loss, correct

    def _dense_applies(self, x: torch.Tensor) -> bool:
        """Whether ``x`` ((k, B, ...)) has the shape the chain's first layer takes without vmap."""
        first = self._dense[0].kind
        if first in ("conv", "maxpool"):
            return x.dim() == 5  # (k, B, C, H, W)
        return x.dim() == 3 or first == "flatten"  # (k, B, features), or images flattened first

    def _dense_grads(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor | None,
                     ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """``grads`` for a plain chain (``_dense_chain``) without vmap, the same arithmetic as the
        vmapped step without functorch's per-call dispatch (about 2 ms a step on this kind of CPU,
        as much as the step itself for small models). The k clients' Linear layers are batched
        matrix products; their convolutions one grouped convolution (group i: client i), with the
        activations laid out as (B, k * C, H, W), which ReLU and max-pooling take as they are; one
        ordinary backward of the sum of the clients' losses gives each client its own gradient
        (a client's loss depends only on its own parameters). Kept by issue 25 item 9's rule (a
        CPU-side speed-up stays only where a benchmark shows it gains more than 5 %): on the engine
        benchmark's workload with vectorised cohorts (1,000/100, inline, ``engine.cohort_size=auto``)
        a round takes 0.75 [0.68, 0.82] of its time with vmap (60 interleaved round pairs, shared
        host; docs/benchmarks.md, "CPU micro-optimisations")."""
        k = params.shape[0]
        leaves = {}
        for s in self.param_slots:
            view = params[:, s.offset : s.offset + s.numel].detach()
            # Convolution weights enter as one contiguous (k * out, in, kh, kw) tensor, the form the
            # grouped convolution takes (its gradient comes back in that form: a free reshape).
            leaves[s.name] = (view.contiguous() if s.name in self._conv_params else view).view(k, *s.shape)
            leaves[s.name].requires_grad_()
        with torch.enable_grad():
            # Layouts: "images" (B, k * C, H, W), grouped by client for the convolutions; "rows"
            # (k, B, F), the input; "columns" (k, F, B), for the Linear layers: W @ h gives the
            # weight's gradient as grad_out @ h^T, contiguous in W's own shape (no transposing copy).
            h, layout = x, "rows"
            if self._dense[0].kind in ("conv", "maxpool"):  # (k, B, C, H, W) -> (B, k * C, H, W)
                h, layout = x.transpose(0, 1).reshape(x.shape[1], k * x.shape[2], *x.shape[3:]), "images"
            for layer in self._dense:
                if layer.kind == "conv":
                    w = leaves[layer.weight]
                    bias = leaves[layer.bias].reshape(-1) if layer.bias else None
                    stride, padding = layer.options
                    h = F.conv2d(h, w.reshape(-1, *w.shape[2:]), bias, stride, padding, groups=k)
                elif layer.kind == "maxpool":
                    h = F.max_pool2d(h, *layer.options)
                elif layer.kind == "relu":
                    h = torch.relu(h)
                elif layer.kind == "flatten" and layout == "images":
                    h, layout = h.reshape(h.shape[0], k, -1).permute(1, 2, 0), "columns"
                elif layer.kind == "flatten" and layout == "rows":
                    h = h.reshape(k, h.shape[1], -1)
                elif layer.kind == "linear":
                    if layout == "rows":
                        h, layout = h.transpose(1, 2), "columns"
                    w = leaves[layer.weight]
                    h = torch.bmm(w, h) if layer.bias is None else torch.baddbmm(leaves[layer.bias].unsqueeze(2), w, h)
            if layout == "columns":
                h = h.transpose(1, 2)  # logits (k, B, classes)
            ce = F.cross_entropy(h.reshape(-1, h.shape[-1]), y.reshape(-1), reduction="none").view(k, -1)
            hit = h.detach().argmax(dim=-1) == y
            if weight is None:
                loss = ce.mean(dim=1)
            else:
                loss = (ce * weight).sum(dim=1) / weight.sum(dim=1)
                hit &= weight > 0
            g = torch.autograd.grad(loss.sum(), [leaves[s.name] for s in self.param_slots])
        grads = [gi.reshape(k, s.numel) for gi, s in zip(g, self.param_slots)]
        for i in self.frozen:
            grads[i] = torch.zeros_like(grads[i])
        return grads, loss.detach(), hit.sum(dim=1)

    def stack_buffers(self, vectors: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-client copies of every buffer: float ones from the rows of ``vectors``, integer ones
        (BatchNorm's step counter, unused with a momentum) from the live model."""
        k = vectors.shape[0]
        out = {}
        for s in self.buffer_slots:
            out[s.name] = vectors[:, s.offset : s.offset + s.numel].reshape(k, *s.shape).clone()
        for name, b in self.int_buffers:
            out[name] = b.detach().unsqueeze(0).repeat(k, *([1] * b.dim()))
        return out

    def store_buffers(self, buffers: dict[str, torch.Tensor], vectors: torch.Tensor) -> None:
        for s in self.buffer_slots:
            vectors[:, s.offset : s.offset + s.numel] = buffers[s.name].reshape(vectors.shape[0], -1)

    def activation_numel(self, x: torch.Tensor) -> int:
        """Elements of all leaf-module outputs for one input sample (for the memory estimate)."""
        total = 0

        def count(_m, _i, out):
            nonlocal total
            if isinstance(out, torch.Tensor):
                total += out.numel()

        leaves = [m for m in self.model.modules() if not list(m.children())]
        handles = [m.register_forward_hook(count) for m in leaves]
        saved = self.fm.vector.detach().clone()
        try:
            with torch.no_grad():
                self.model.eval()
                self.model(x[:1])
        finally:
            for h in handles:
                h.remove()
            self.fm.vector.copy_(saved)
            self.model.train()
        return total + x[:1].numel()

    def unsupported_reason(self, x: torch.Tensor, y: torch.Tensor) -> str | None:
        """Why this model cannot be trained functionally (None: it can), from its modules and a
        probe: two real samples through the vmapped step must give the sequential gradient, with
        no op falling back to vmap's slow per-sample loop.

        Also decides ``can_pad`` (whether a zero-weight padded sample leaves the gradient unchanged).
        """
        random = sorted({type(m).__name__ for m in self.model.modules()
                         if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0})
        if random:
            return (f"the model has random layers ({', '.join(random)}); under vmap their draws cannot "
                    "follow each client's own RNG stream")
        if any(bn.track_running_stats and bn.momentum is None for bn in self.batchnorms):
            return "the model has BatchNorm with momentum=None (a cumulative average over a shared step count)"
        if x.shape[0] < 2:
            return None  # nothing to probe with; the equivalence tests cover the zoo models
        fm = self.fm
        saved_vec = fm.vector.detach().clone()
        saved_int = [b.detach().clone() for _, b in self.int_buffers]
        try:
            with warnings.catch_warnings(record=True) as caught, _full_fp32():
                warnings.simplefilter("always")
                got, expected, padded = self._probe(x[:2], y[:2], saved_vec)
        except Exception as err:  # an op without a batching rule, randomness under vmap, ...
            return f"the model's forward/backward cannot be vmapped ({type(err).__name__}: {err})"
        finally:
            fm.vector.copy_(saved_vec)
            fm.grad.zero_()
            for (_, b), v in zip(self.int_buffers, saved_int):
                b.copy_(v)
        slow = sorted({m.group(1) for w in caught
                       if (m := re.search(r"batching rule for (\S+?)\.?\s", str(w.message)))})
        if slow:
            return (f"vmap has no batching rule for {', '.join(slow)} and would loop over the clients "
                    "one by one (slower than the sequential loop)")
        err = max(_relative_error(g, expected) for g in got)
        if err > _PROBE_TOLERANCE:
            return f"the vmapped gradient differs from the sequential one (relative error {err:.1e})"
        if padded is not None:
            self.can_pad = _relative_error(padded, expected) <= _PROBE_TOLERANCE
        return None

    def _probe(self, xb: torch.Tensor, yb: torch.Tensor, vec: torch.Tensor):
        """(vmapped gradients of 2 clients, the live model's gradient, the padded gradient or None)."""
        fm = self.fm
        fm.model.train()
        fm.grad.zero_()
        F.cross_entropy(fm.model(xb), yb).backward()
        # (the per-slot gradients, back to back as torch.cat lays the vmapped ones; frozen ones zero)
        expected = torch.cat([fm.grad[o : o + n] for o, n in self.layout.spans])
        rows = vec.unsqueeze(0).repeat(2, 1)
        got = torch.cat(self.grads(rows[:, : self.num_params], self.stack_buffers(rows),
                                   xb.unsqueeze(0).expand(2, *xb.shape), yb.unsqueeze(0).expand(2, *yb.shape))[0], 1)
        padded = None
        if self.can_pad:
            xp, yp = torch.cat([xb, xb[:1]]).unsqueeze(0), torch.cat([yb, yb[:1]]).unsqueeze(0)
            w = torch.tensor([[1.0, 1.0, 0.0]], dtype=vec.dtype, device=xb.device)
            one = vec.unsqueeze(0)
            padded = torch.cat(self.grads(one[:, : self.num_params], self.stack_buffers(one), xp, yp, w)[0], 1)[0]
        return got, expected, padded
