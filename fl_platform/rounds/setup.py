"""Everything a worker needs to train clients, in one picklable value.

The engine ships it once per worker (for Ray through the object store), so the dataset tensors
travel once per run, never per round. It may hold the user's code (a plug-in algorithm's spec and
conf, a custom model's class): unpickling it first puts the folders that code was imported from on
the receiver's ``sys.path`` (``import_roots``, fl_platform/plugins.py), so a Ray worker imports
the plug-in as the driver did.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fl_platform.algorithms.base import AlgorithmConf, AlgorithmSpec, Setup
from fl_platform.datasets.federated import FederatedDataset
from fl_platform.models import build_model
from fl_platform.plugins import ImportRoots
from fl_platform.training.loop import TrainConfig

if TYPE_CHECKING:
    from fl_platform.algorithms.server_opt import ServerOptConf
    from fl_platform.privacy.config import PrivacyConf
    from fl_platform.system.model import SystemModel


def resolve_device(device: str) -> torch.device:
    """``auto`` means CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} was requested but CUDA is not available; use device=auto or cpu")
    return dev


@dataclass(frozen=True)
class ModelFactory:
    """Builds the experiment's model by name (picklable, unlike a closure); ``custom``: ``options``
    hold the user's class or function itself as ``_target_`` (resolved once, on the driver)."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    options: dict[str, Any] = field(default_factory=dict)

    def __call__(self) -> nn.Module:
        return build_model(self.name, self.input_shape, self.num_classes, **self.options)


@dataclass
class ExperimentSetup:
    dataset: FederatedDataset
    model: ModelFactory
    algorithm: str | AlgorithmSpec  # a built-in's name, or the resolved spec (what make_setup gives)
    algorithm_conf: AlgorithmConf
    train: TrainConfig
    seed: int
    device: str = "auto"
    state_store: str = "memory"
    state_options: dict[str, Any] = field(default_factory=dict)
    nonfinite: str = "fail"  # "fail" the run or "skip" the client, logged either way
    threads: int | None = None  # torch intra-op threads per worker (None: leave torch's default)
    deterministic: bool = False  # engine.deterministic: torch deterministic algorithms in every worker
    extra: dict[str, Any] = field(default_factory=dict)
    cohort_size: int | str = 1  # clients a worker trains at once (vectorised), or "auto"
    compressor: dict[str, Any] | None = None  # the compressor group (None / name none: uplinks dense)
    system: SystemModel | None = None  # None: no simulated time
    privacy: PrivacyConf | None = None  # None / name none: no clipping or noise
    server_opt: ServerOptConf | None = None  # None / name none: the algorithm's own server step
    import_roots: tuple[str, ...] = ()  # where the user's code in this setup was imported from (plugins.py)
    finetune_steps: int = 0  # eval.finetune_steps: local steps before a client's evaluation (client_eval.py)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # ImportRoots first: unpickling it extends sys.path before the fields (the user's classes) load.
        return _restore, (ImportRoots(self.import_roots), dict(self.__dict__))

    def algorithm_setup(self, num_params: int, num_buffers: int) -> Setup:
        return Setup(model_fn=self.model, num_params=num_params, num_buffers=num_buffers,
                     num_classes=self.dataset.num_classes, input_shape=tuple(self.dataset.input_shape),
                     num_clients=self.dataset.num_clients, seed=self.seed, train=self.train,
                     extra={**self.extra, **({"system": self.system} if self.system is not None else {})},
                     server_opt=self.server_opt)


def _restore(roots: ImportRoots, fields: dict[str, Any]) -> ExperimentSetup:
    del roots  # it did its work when it was unpickled
    setup = ExperimentSetup.__new__(ExperimentSetup)
    setup.__dict__.update(fields)
    return setup
