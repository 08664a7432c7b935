"""The protocol every one-shot method shares (specs/oneshot.md, "Shared protocol").

Client half: start from the common initial weights, train locally once (``train.epochs`` is
the "many local epochs" of the card), upload the full weight vector and ``n_k``. The trained
vector is cached on disk under a key made of everything that determines it (initial weights,
the client's samples, the local-training settings, seed, round, client id, model, device), so
a second method run on the same (seed, partition, settings) reuses the same client models
instead of retraining them. That is how every server-side method is compared on identical
teachers, as the card's pitfalls ask.

Server half (list mode): receives every client's vector in client-id order, runs its method
(``build``), and reports beside its own test accuracy the references the card asks for: the
logit ensemble, one-shot FedAvg and the clients' own accuracies.

Server data. FedDF needs unlabelled data on the server. The protocol therefore holds out
``server_fraction`` of the training set (a seeded random subset, the same for every method):
no client ever trains on it, and the server half sees it through ``attach_data``. The default
0.1 is shared by every one-shot method so that all of them see the same client models.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fl_platform.algorithms.base import AlgorithmConf, ClientAlgorithm, ServerAlgorithm, Setup
from fl_platform.algorithms.oneshot.distill import combine_logits, predict_logits
from fl_platform.core import Broadcast, ClientUpdate, Metrics, RoundContext
from fl_platform.seeding import Stream, numpy_rng, seed_torch_global
from fl_platform.training.flat import FlatModel
from fl_platform.training.loop import ClientData, LocalTrainer

_HOLDOUT = 0x484F4C44  # "HOLD": the stream key of the server split
_CACHE_FORMAT = 1


@dataclass
class OneShotConf(AlgorithmConf):
    """Settings every one-shot method shares (the client half and the references)."""

    name: str = "oneshot_fedavg"
    # Client checkpoints: one file per client model, reused by every method (null: always train).
    cache_dir: str | None = "outputs/oneshot_cache"
    # Share of the training set held out for the server; no client trains on it.
    server_fraction: float = 0.1
    # Device for the server-side method (distillation, synthesis): cpu, cuda or auto.
    server_device: str = "cpu"

    def __post_init__(self) -> None:
        # Absolute now, on the driver: Ray workers may run in another directory.
        if self.cache_dir:
            self.cache_dir = str(Path(self.cache_dir).expanduser().resolve())


def server_split(num_train: int, fraction: float, seed: int) -> np.ndarray:
    """Sorted positions of the training samples held out for the server (a pure function of the seed)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"algorithm.server_fraction must be in [0, 1), got {fraction}")
    count = round(fraction * num_train)
    if count == 0:
        return np.zeros(0, dtype=np.int64)
    rng = numpy_rng(seed, Stream.ALGORITHM, _HOLDOUT)
    return np.sort(rng.choice(num_train, size=count, replace=False)).astype(np.int64)


def require_one_block(data: Any, algorithm: str) -> None:
    """Refuse a dataset whose training features are held in row blocks (datasets/federated.py): the
    hold-out split is drawn over all training rows and ``HoldoutFilter`` applies it to a client's rows of
    the one training tensor."""
    if len(data.train_blocks) != 1:
        raise NotImplementedError(
            f"algorithm {algorithm!r}: the server's hold-out split needs the training features in one tensor; "
            f"{data.name}'s are held in {len(data.train_blocks)} row blocks (Synthetic beyond "
            "64 MiB of features); fewer clients or another source")


class HoldoutFilter:
    """Removes the server's held-out samples from a client's index slice (cached per worker).

    The client's tensor is the dataset's one training tensor (``require_one_block`` at start-up)."""

    def __init__(self, fraction: float, seed: int) -> None:
        self.fraction = fraction
        self.seed = seed
        self._mask: torch.Tensor | None = None

    def __call__(self, data: ClientData) -> ClientData:
        if self.fraction == 0.0:
            return data
        num_train = data.x.shape[0]
        if self._mask is None or self._mask.numel() != num_train or self._mask.device != data.indices.device:
            mask = torch.zeros(num_train, dtype=torch.bool)
            mask[torch.from_numpy(server_split(num_train, self.fraction, self.seed))] = True
            self._mask = mask.to(data.indices.device)
        keep = data.indices[~self._mask[data.indices]]
        return ClientData(data.x, data.y, keep, data.augment)


def build_module(setup: Setup, vector: torch.Tensor, device: torch.device | str) -> nn.Module:
    """A fresh model of the experiment's architecture holding ``vector`` (no global RNG consumed)."""
    with torch.random.fork_rng(devices=[]):
        fm = FlatModel(setup.model_fn(), device)
    fm.load(vector.to(fm.device, fm.vector.dtype))
    return fm.model


def fresh_vector(setup: Setup, *keys: int) -> torch.Tensor:
    """Initial weights of a new model drawn from (seed, ALGORITHM, *keys) (a fresh student)."""
    with torch.random.fork_rng(devices=[]):
        seed_torch_global(setup.seed, Stream.ALGORITHM, *keys)
        return FlatModel(setup.model_fn()).vector.detach().clone()


def average(vectors: list[torch.Tensor], weights: list[float] | None = None) -> torch.Tensor:
    """sum_k p_k w_k with p_k = weights / sum(weights) (uniform when None), in float64."""
    p = torch.tensor(weights if weights is not None else [1.0] * len(vectors), dtype=torch.float64)
    if p.sum() <= 0:
        raise ValueError(f"cannot average with non-positive total weight {p.tolist()}")
    p = p / p.sum()
    total = torch.zeros_like(vectors[0], dtype=torch.float64)
    for w, v in zip(p, vectors):
        total.add_(v.to(torch.float64), alpha=float(w))
    return total.to(torch.float32)


def count_model(module: nn.Module) -> tuple[int, int]:
    """(parameter count, bytes of parameters and float buffers at float32)."""
    params = sum(p.numel() for p in module.parameters())
    buffers = sum(b.numel() for b in module.buffers() if b.is_floating_point())
    return params, 4 * (params + buffers)


class OneShotClient(ClientAlgorithm):
    """Train once from the broadcast weights, upload the full weights (cached per client model)."""

    def __init__(self, cfg: OneShotConf, setup: Setup) -> None:
        super().__init__(cfg, setup)
        self.holdout = HoldoutFilter(cfg.server_fraction, setup.seed)

    @classmethod
    def uploads(cls, cfg: OneShotConf) -> dict[str, str | None]:
        from fl_platform.algorithms.oneshot.calibration import UPLOADS  # it builds on this module

        calibration = dict.fromkeys(UPLOADS) if getattr(cfg, "calibrate", False) else {}
        return {"weights": None, **calibration}  # the trained model itself, not an update

    def contribution_sizes(self) -> dict[str, int]:
        return {"weights": self.setup.vector_size}

    def cache_key(self, ctx: RoundContext, client_id: int, weights: torch.Tensor, data: ClientData,
                  trainer: LocalTrainer) -> str:
        """A digest of everything that determines the trained client model."""
        meta = {"format": _CACHE_FORMAT, "model": repr(self.setup.model_fn), "train": asdict(trainer.cfg),
                "seed": ctx.seed, "round": ctx.round, "client": client_id, "device": trainer.fm.device.type}
        h = hashlib.sha256(json.dumps(meta, sort_keys=True, default=str).encode())
        h.update(weights.detach().cpu().numpy().tobytes())
        idx = data.indices
        h.update(idx.cpu().numpy().tobytes())
        h.update(data.y.index_select(0, idx).cpu().numpy().tobytes())
        h.update(data.x.index_select(0, idx).cpu().numpy().tobytes())
        return h.hexdigest()

    def train(self, ctx: RoundContext, client_id: int, broadcast: Broadcast,
              state: dict[str, torch.Tensor] | None, data: ClientData, trainer: LocalTrainer) -> ClientUpdate:
        data = self.holdout(data)
        from fl_platform.algorithms.oneshot.calibration import FLAG, client_statistics

        if broadcast.scalars.get(FLAG):  # the calibration round (calibration.py)

            return client_statistics(self.setup, client_id, broadcast, data, trainer.fm.device)
        weights = broadcast.tensors["weights"]
        n = data.num_samples
        path = None
        # Only the one-shot upload (round 0) is cached; later rounds of multi-round FedAvg are not.
        if self.cfg.cache_dir and ctx.round == 0:
            path = Path(self.cfg.cache_dir) / f"{self.cache_key(ctx, client_id, weights, data, trainer)}.pt"
        metrics = Metrics()
        if path is not None and path.exists():
            saved = torch.load(path, map_location="cpu", weights_only=True)
            vector = saved["vector"]
            for name, (total, count) in saved["metrics"].items():
                metrics.add(name, total, count)
            metrics.add("cache_hit", 1.0, 1.0)
        else:
            trainer.fm.load(weights)
            metrics = trainer.fit(data, None, seed=ctx.seed, round=ctx.round, client=client_id)
            vector = trainer.fm.vector.detach().to("cpu", copy=True)
            if path is not None:
                from fl_platform.outputs import atomic_torch_save

                atomic_torch_save({"vector": vector, "metrics": {k: list(v) for k, v in metrics.values.items()},
                                   "client": client_id, "num_samples": n}, path)
            metrics.add("cache_hit", 0.0, 1.0)
        return ClientUpdate(client_id, {"weights": vector}, {"n": float(n)}, n, metrics)


def resolve_server_device(name: str) -> torch.device:
    from fl_platform.rounds.setup import resolve_device

    return resolve_device(name)


class OneShotServer(ServerAlgorithm):
    """List-mode server half: keeps every client model and reports the card's references.

    Subclasses implement ``build`` (the server-side method; it sets ``self.weights`` when the
    method produces one model of the clients' architecture) and, when the final model is not
    that single model, ``final_logits`` and ``final_size``.
    """

    summable = False
    multi_round = False  # only parameter averaging makes sense for more than one round

    def __init__(self, cfg: OneShotConf, setup: Setup, initial_weights: torch.Tensor) -> None:
        super().__init__(cfg, setup, initial_weights)
        self.initial = self.weights.clone()
        self.teachers: list[torch.Tensor] = []
        self.sizes: list[float] = []
        self.client_ids: list[int] = []
        self.device = resolve_server_device(cfg.server_device)
        self.server_x: torch.Tensor | None = None
        self.server_y: torch.Tensor | None = None
        self.input_low: torch.Tensor | None = None
        self.input_high: torch.Tensor | None = None

    # ------------------------------------------------------------------ data and rounds
    def attach_data(self, data: Any) -> None:
        """Keep the held-out server split (never trained on by a client) and the input range."""
        require_one_block(data, self.cfg.name)
        split = torch.from_numpy(server_split(int(data.train_x.shape[0]), self.cfg.server_fraction,
                                              self.setup.seed))
        self.server_x = data.train_x.index_select(0, split.to(data.train_x.device)).to("cpu")
        self.server_y = data.train_y.index_select(0, split.to(data.train_y.device)).to("cpu")
        x = data.train_x
        if x.dim() == 4:  # per-channel range of the (normalised) images, for generators
            self.input_low = x.amin(dim=(0, 2, 3)).to("cpu", torch.float32)
            self.input_high = x.amax(dim=(0, 2, 3)).to("cpu", torch.float32)

    def broadcast(self, ctx: RoundContext) -> Broadcast:
        if ctx.num_rounds != 1 and not self.multi_round:
            raise ValueError(f"algorithm {self.cfg.name!r} is one-shot: it needs rounds=1, got rounds="
                             f"{ctx.num_rounds} (multi-round parameter averaging is oneshot_fedavg)")
        return Broadcast({"weights": self.weights})

    def aggregate(self, ctx: RoundContext, result: Any) -> dict[str, float]:
        if not isinstance(result, list):
            raise TypeError(f"{type(self).__name__} runs in list mode and needs a list of ClientUpdates")
        if not result:
            raise RuntimeError(f"round {ctx.round}: no client model arrived (every client was rejected)")
        self.teachers = [u.tensors["weights"].detach().to("cpu", torch.float32) for u in result]
        self.sizes = [float(u.weights["n"]) for u in result]
        self.client_ids = [u.client_id for u in result]
        t0 = time.perf_counter()
        with torch.random.fork_rng(devices=[]):  # the method seeds its own draws; the driver's RNG is untouched
            extras = dict(self.build(ctx))
        params, nbytes = self.final_size()
        extras.update({"model_params": params, "model_bytes": nbytes,
                       "server_time_s": time.perf_counter() - t0})
        return extras

    # ------------------------------------------------------------------ the method
    def build(self, ctx: RoundContext) -> dict[str, float]:
        raise NotImplementedError

    def teacher_modules(self, device: torch.device | str) -> list[nn.Module]:
        """The client models, frozen and in eval mode."""
        models = [build_module(self.setup, v, device).eval() for v in self.teachers]
        for m in models:
            m.requires_grad_(False)
        return models

    def fedavg_vector(self) -> torch.Tensor:
        """One-shot FedAvg of the client models (sample-weighted, card method A)."""
        return average(self.teachers, self.sizes)

    def final_logits(self, x: torch.Tensor, teacher_logits: list[torch.Tensor], fm: FlatModel,
                     batch_size: int) -> torch.Tensor:
        """Logits of the method's final model; default: the single model in ``self.weights``."""
        fm.load(self.weights.to(fm.device))
        return predict_logits(fm.model, x, batch_size)

    def final_size(self) -> tuple[int, int]:
        """(parameters, bytes) of the final model; default: one model of the clients' architecture."""
        return count_model(build_module(self.setup, self.weights, "cpu"))

    # ------------------------------------------------------------------ evaluation
    def extra_metrics(self, teacher_logits: list[torch.Tensor], y: torch.Tensor) -> dict[str, float]:
        """Method-specific test metrics computed from the client models' logits."""
        return {}

    def evaluate(self, fm: FlatModel, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> dict[str, float]:
        """The method's test metrics plus the ensemble, one-shot FedAvg and client references."""
        if not self.teachers:
            return super().evaluate(fm, x, y, batch_size)
        teachers = self.teacher_modules(fm.device)
        logits = [predict_logits(m, x, batch_size) for m in teachers]
        ensemble = combine_logits(torch.stack(logits))
        fm.load(self.fedavg_vector().to(fm.device))
        fedavg = predict_logits(fm.model, x, batch_size)
        final = self.final_logits(x, logits, fm, batch_size)
        client_acc = [float((lg.argmax(1) == y).float().mean()) for lg in logits]
        return {**self.extra_metrics(logits, y),
            "test_loss": float(F.cross_entropy(final.double(), y)),
            "test_accuracy": float((final.argmax(1) == y).float().mean()),
            "ensemble_test_accuracy": float((ensemble.argmax(1) == y).float().mean()),
            "fedavg_test_accuracy": float((fedavg.argmax(1) == y).float().mean()),
            "client_test_accuracy_mean": sum(client_acc) / len(client_acc),
            "client_test_accuracy_min": min(client_acc),
            "client_test_accuracy_max": max(client_acc),
            "ensemble_agreement": float((final.argmax(1) == ensemble.argmax(1)).float().mean()),
        }

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "teachers": [t.clone() for t in self.teachers],
                "sizes": list(self.sizes), "client_ids": list(self.client_ids)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.teachers = [t.clone() for t in state.get("teachers", [])]
        self.sizes = list(state.get("sizes", []))
        self.client_ids = list(state.get("client_ids", []))
