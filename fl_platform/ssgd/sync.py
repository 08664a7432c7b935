"""How the replicas of one run stay in step: DDP (+ compression hook), ACP-SGD, or local SGD.

The trainer runs the same step loop whatever the scheme and calls, per step:
``module(x)`` for the forward pass, ``before_step(step)`` after backward (the gradient in the
FlatModel's ``grad`` is then the synchronised one), the optimiser, ``after_step(step)`` (True when
the replicas are in sync after it), and at the end ``finish(last_step)``. ``stats`` counts bytes.

=================  =====================================================================
``make_sync``      what runs
=================  =====================================================================
ddp, none          DDP's built-in bucketed all-reduce (overlapped with backward)
ddp, acpsgd        :class:`~fl_platform.ssgd.acp.ACPSGDSync` (optimiser wrapper, no DDP)
ddp, other         DDP + :func:`~fl_platform.ssgd.hooks.compression_hook`
local              :class:`~fl_platform.ssgd.localsgd.LocalSGD` (no DDP)
=================  =====================================================================
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fl_platform.compression.acpsgd import ACPSGD
from fl_platform.compression.errorfeedback import ErrorFeedback
from fl_platform.compression.registry import conf_of, make_compressor
from fl_platform.ssgd.distributed import DistContext
from fl_platform.ssgd.hooks import HookState, compression_hook
from fl_platform.ssgd.stats import CommStats
from fl_platform.training.flat import FlatModel


class Sync(Protocol):
    name: str
    module: nn.Module
    stats: CommStats

    def before_step(self, step: int) -> None: ...

    def after_step(self, step: int) -> bool: ...

    def finish(self, last_step: int) -> bool: ...

    def close(self) -> None: ...


class DDPSync:
    """The model wrapped in DDP; an optional compression hook replaces DDP's bucket all-reduce.

    No buffer broadcast before each forward (``forward_sync_buffers=False``): BatchNorm running
    statistics do not change a training-mode forward pass, so instead of DDP's broadcast from rank 0
    before every forward, the trainer averages them before each evaluation (as for every scheme). ``gradient_as_bucket_view=False`` keeps
    ``param.grad`` the FlatModel's views (DDP copies the reduced bucket into them).
    """

    def __init__(self, fm: FlatModel, ctx: DistContext, compressor_conf: Any = None, seed: int = 0,
                 bucket_cap_mb: float = 25.0, start_iter: int = 2) -> None:
        self.fm = fm
        self.stats = CommStats(ctx.world_size)
        device_ids = [ctx.device] if ctx.device.type == "cuda" else None
        self.module = DistributedDataParallel(fm.model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb,
                                              gradient_as_bucket_view=False, **_no_forward_buffer_sync())
        comp = make_compressor(compressor_conf) if compressor_conf is not None else None
        self.hook_state: HookState | None = None
        self.name = "ddp"
        if comp is not None:
            conf = conf_of(compressor_conf)
            named = dict(fm.model.named_parameters())
            index = {named[s.name].data_ptr(): i for i, s in enumerate(x for x in fm.slots if x.is_param)}
            self.hook_state = HookState(comp, ctx.rank, ctx.world_size, seed=seed, start_iter=start_iter,
                                        scope=conf.scope, bucket_size=conf.bucket_size, stats=self.stats,
                                        param_index=index)
            self.module.register_comm_hook(self.hook_state, compression_hook)
            self.name = f"ddp+{self.hook_state.mode}"
        self._dense_bytes = sum(p.numel() * p.element_size() for p in fm.model.parameters() if p.requires_grad)

    def before_step(self, step: int) -> None:
        if self.hook_state is None:  # DDP's own all-reduce ran during backward: count it
            self.stats.all_reduce(self._dense_bytes)

    def after_step(self, step: int) -> bool:
        return True

    def finish(self, last_step: int) -> bool:
        return False

    def close(self) -> None:
        """Drop DDP (its reducer and hook) now, while the process group is still alive."""
        self.module = self.fm.model
        self.hook_state = None


def _no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's switch for "no buffer broadcast before each forward" (renamed in torch 2.13)."""
    import inspect

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params else {"broadcast_buffers": False}


def is_acpsgd(compressor_conf: Any) -> bool:
    comp = make_compressor(compressor_conf)
    inner = comp.inner if isinstance(comp, ErrorFeedback) else comp
    return isinstance(inner, ACPSGD)


def make_sync(sync: str, fm: FlatModel, ctx: DistContext, compressor_conf: Any, *, seed: int,
              bucket_cap_mb: float, start_iter: int, period: int, local_start_step: int,
              check_replicas: bool = False) -> Sync:
    """The scheme ``sync`` (ddp | local) with ``compressor_conf`` (a compressor group node or dict)."""
    name = conf_of(compressor_conf).name
    if sync == "local":
        if name != "none":
            raise ValueError(f"ssgd.sync=local takes no gradient compressor, got compressor={name}")
        from fl_platform.ssgd.localsgd import LocalSGD

        return LocalSGD(fm, ctx.world_size, period, local_start_step, check_replicas=check_replicas)
    if sync != "ddp":
        raise ValueError(f"ssgd.sync must be ddp or local, got {sync!r}")
    if name == "none":
        return DDPSync(fm, ctx, None, seed, bucket_cap_mb, start_iter)
    if is_acpsgd(compressor_conf):
        from fl_platform.ssgd.acp import ACPSGDSync

        return ACPSGDSync(fm, make_compressor(compressor_conf), ctx.rank, ctx.world_size, seed=seed,
                          bucket_cap_mb=bucket_cap_mb)
    return DDPSync(fm, ctx, compressor_conf, seed, bucket_cap_mb, start_iter)


def broadcast_model(fm: FlatModel, world_size: int) -> None:
    """Rank 0's parameters and buffers to every rank (what DDP does at construction; for the others)."""
    if world_size > 1:
        torch.distributed.broadcast(fm.vector, src=0)
