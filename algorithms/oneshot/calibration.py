"""FuseFL's classifier calibration (specs/fusefl.md, step 8) offered to one-shot FedAvg and the ensemble.

Why: FuseFL calibrates its averaged classifier on class-balanced features drawn from the clients'
per-class feature statistics, in one more round. A comparison with one-shot baselines that do not
get the same step mixes the fusion with the calibration, so ``calibrate: true`` gives one-shot
FedAvg and the logit ensemble exactly that step (docs/results/oneshot.md reports both with and
without it).

With ``calibrate: true`` the last round is the calibration round, counted like FuseFL's: every
client downloads the final model (one-shot FedAvg: the averaged model; the ensemble: all K client
models), computes per-class counts, means and unbiased covariances of the model's penultimate
feature on its own data (eval mode; the server's held-out split excluded) and uploads them
(``fusefl.pack_statistics``; these bytes count as upload). The server pools them exactly, draws
``sample_per_class`` features per class from N(mu_c, S_c) and trains only the linear head with plain
SGD (``calibration_lr``, batch ``calibration_batch_size``, one pass): ``fusefl.calibrate_head``.

Feature and head. One-shot FedAvg: the averaged model's penultimate feature phi(x) and its head.
Ensemble: the concatenation [phi_1(x), ..., phi_K(x)] of the K members' features, and the linear map
on it that equals the ensemble's logits before calibration, W = [p_1 W_1, ..., p_K W_K],
b = sum_k p_k b_k (p_k the normalised member weights): calibration starts from the ensemble itself.
The run's metrics keep the model before calibration as ``uncalibrated_test_accuracy``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fl_platform.algorithms.base import Setup
from fl_platform.algorithms.fusefl import calibrate_head, pack_statistics
from fl_platform.algorithms.oneshot.distill import predict_logits
from fl_platform.algorithms.oneshot.protocol import OneShotConf, OneShotServer, build_module
from fl_platform.core import Broadcast, ClientUpdate, RoundContext
from fl_platform.models import StagedModel
from fl_platform.seeding import Stream, torch_generator
from fl_platform.training.flat import FlatModel
from fl_platform.training.loop import ClientData

_CALIBRATE = 0x43414C49  # "CALI": stream key of the calibration's feature draws
FLAG = "calibration"  # Broadcast.scalars key: this round computes statistics instead of training
MEMBERS = "members"  # the ensemble's calibration broadcast: every client model, stacked [K, P]
UPLOADS = ("counts", "means", "covs")


@dataclass
class CalibratedConf(OneShotConf):
    """A one-shot method that may calibrate its head (FuseFL's names and defaults)."""

    calibrate: bool = False  # one more round: per-class feature statistics, then the head is calibrated
    sample_per_class: int = 5000
    calibration_lr: float = 0.01
    calibration_batch_size: int = 128

    def inactive_fields(self, run: Any) -> dict[str, str]:
        if self.calibrate:
            return {}
        return dict.fromkeys(("sample_per_class", "calibration_lr", "calibration_batch_size"),
                             "a setting of the classifier calibration, and calibrate=false")


def staged(module: nn.Module) -> StagedModel:
    if not isinstance(module, StagedModel):
        raise ValueError(f"calibrate=true needs a model with a penultimate feature and a linear head (a staged "
                         f"model from fl_platform.models); got {type(module).__name__}")
    return module


@torch.no_grad()
def features(models: list[nn.Module], x: torch.Tensor, batch_size: int = 1024) -> torch.Tensor:
    """The concatenated penultimate features of ``models`` (eval mode) over ``x``, on the CPU."""
    for m in models:
        staged(m).eval()
    device = next(iter(models[0].parameters())).device
    out = [torch.cat([m.features(x[i : i + batch_size].to(device)) for m in models], dim=1).cpu()
           for i in range(0, x.shape[0], batch_size)]
    return torch.cat(out) if out else torch.zeros(0, sum(staged(m).feature_dim for m in models))


def client_statistics(setup: Setup, client_id: int, broadcast: Broadcast, data: ClientData,
                      device: torch.device | str) -> ClientUpdate:
    """The calibration round on a client: the class statistics of the broadcast model's feature."""
    vectors = broadcast.tensors[MEMBERS] if MEMBERS in broadcast.tensors else broadcast.tensors["weights"][None]
    models = [build_module(setup, v, device) for v in vectors]
    idx = data.indices
    feats = features(models, data.x.index_select(0, idx))
    tensors = pack_statistics(feats, data.y.index_select(0, idx).cpu(), setup.num_classes, correction=1)
    n = data.num_samples
    return ClientUpdate(client_id, tensors, {"n": float(n)}, n)


def head_vector(head: nn.Linear) -> torch.Tensor:
    return torch.cat([head.weight.detach().reshape(-1), head.bias.detach()]).to("cpu", torch.float32)


def linear_from(vector: torch.Tensor, in_features: int, out_features: int) -> nn.Linear:
    with torch.random.fork_rng(devices=[]):  # built then overwritten: no run RNG consumed
        head = nn.Linear(in_features, out_features)
    with torch.no_grad():
        head.weight.copy_(vector[: in_features * out_features].view(out_features, in_features))
        head.bias.copy_(vector[in_features * out_features :])
    return head


class CalibratedServer(OneShotServer):
    """A ``OneShotServer`` whose last round, with ``cfg.calibrate``, calibrates the head.

    Subclasses say what the calibration round sends (``calibration_tensors``), which head it starts
    from (``initial_head``), where the calibrated head goes (``set_head``) and how the model before
    calibration scores (``uncalibrated_logits``)."""

    def __init__(self, cfg: CalibratedConf, setup: Setup, initial_weights: torch.Tensor) -> None:
        if cfg.sample_per_class < 1 or cfg.calibration_lr <= 0 or cfg.calibration_batch_size < 1:
            raise ValueError("algorithm.sample_per_class, calibration_lr and calibration_batch_size must be positive")
        super().__init__(cfg, setup, initial_weights)
        self.calibrated = False
        self._uncalibrated: dict[str, float] = {}

    def calibration_round(self, ctx: RoundContext) -> bool:
        return bool(self.cfg.calibrate) and ctx.round == ctx.num_rounds - 1

    def broadcast(self, ctx: RoundContext) -> Broadcast:
        if not self.cfg.calibrate:
            return super().broadcast(ctx)
        training = ctx.num_rounds - 1
        if training < 1 or (training > 1 and not self.multi_round):
            need = "rounds >= 2" if self.multi_round else "rounds=2"
            raise ValueError(f"algorithm {self.cfg.name!r} with calibrate=true trains, then runs one calibration "
                             f"round: set {need}, got rounds={ctx.num_rounds}")
        if self.calibration_round(ctx):
            staged(build_module(self.setup, self.weights, "cpu"))
            return Broadcast(self.calibration_tensors(), scalars={FLAG: 1.0})
        return Broadcast({"weights": self.weights})

    def aggregate(self, ctx: RoundContext, result: Any) -> dict[str, float]:
        if not self.calibration_round(ctx):
            return super().aggregate(ctx, result)
        if not isinstance(result, list) or not result:
            raise RuntimeError(f"round {ctx.round + 1}: the calibration needs the clients' statistics (list mode)")
        head = self.initial_head()
        gen = torch_generator(self.setup.seed, Stream.ALGORITHM, _CALIBRATE, ctx.round)
        out = calibrate_head(head, result, self.cfg, gen, self.setup.seed, ctx.round)
        self.set_head(head)
        self.calibrated = True
        params, nbytes = self.final_size()
        return {**out, "model_params": params, "model_bytes": nbytes}

    def calibration_tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def initial_head(self) -> nn.Linear:
        raise NotImplementedError

    def set_head(self, head: nn.Linear) -> None:
        raise NotImplementedError

    def uncalibrated_logits(self, x: torch.Tensor, teacher_logits: list[torch.Tensor], fm: FlatModel,
                            batch_size: int) -> torch.Tensor:
        raise NotImplementedError

    def extra_metrics(self, teacher_logits: list[torch.Tensor], y: torch.Tensor) -> dict[str, float]:
        return dict(self._uncalibrated)

    def evaluate(self, fm: FlatModel, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> dict[str, float]:
        self._uncalibrated = {}
        if self.calibrated and self.teachers:
            teachers = self.teacher_modules(fm.device)
            logits = [predict_logits(m, x, batch_size) for m in teachers]
            before = self.uncalibrated_logits(x, logits, fm, batch_size)
            self._uncalibrated = {"uncalibrated_test_accuracy": float((before.argmax(1) == y).float().mean())}
        return super().evaluate(fm, x, y, batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "calibrated": self.calibrated}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.calibrated = bool(state.get("calibrated", False))


def ensemble_head(members: list[StagedModel], weights: torch.Tensor) -> nn.Linear:
    """The linear map on the concatenated member features that equals the weighted logit ensemble."""
    p = (weights / weights.sum()).to(torch.float32)
    weight = torch.cat([pk * m.head.weight.detach() for pk, m in zip(p, members)], dim=1)
    bias = sum(pk * m.head.bias.detach() for pk, m in zip(p, members))
    return linear_from(torch.cat([weight.reshape(-1), bias]), weight.shape[1], weight.shape[0])


def concat_logits(members: list[nn.Module], head: nn.Linear, x: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``head`` on the concatenated member features (the calibrated ensemble's logits)."""
    return predict_logits(head, features(members, x, batch_size), batch_size).to(x.device)
