"""FedBN (Li et al., ICLR 2021): BatchNorm layers stay local.

Each client keeps its own BatchNorm affine parameters (weight, bias) and running statistics
(running_mean, running_var) across rounds in the client-state manager; every other tensor is
averaged as in FedAvg. The server never averages, nor moves, any BatchNorm entry: they travel as
zeros in the delta and the server restores them after its step (algorithms/personal.py). A client's
personalised model is the global one with its own BatchNorm layers; it is what per-client
evaluation (``eval.clients``) scores as ``personal_*``. A model without BatchNorm is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fl_platform.algorithms.base import AlgorithmSpec, Setup
from fl_platform.algorithms.fedavg import FedAvgConf
from fl_platform.algorithms.personal import PersonalPartClient, PersonalPartServer


@dataclass
class FedBNConf(FedAvgConf):
    name: str = "fedbn"


def batchnorm_tensors(model: nn.Module) -> list[str]:
    """Dotted names of every BatchNorm layer's affine parameters and float running statistics."""
    names = []
    for prefix, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            names += [f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters(recurse=False)]
            names += [f"{prefix}.{n}" if prefix else n for n, b in module.named_buffers(recurse=False)
                      if b is not None and b.is_floating_point()]
    return names


class FedBNClient(PersonalPartClient):
    select = staticmethod(batchnorm_tensors)


class FedBNServer(PersonalPartServer):
    client_class = FedBNClient

    def check(self, setup: Setup, count: int) -> None:
        if count == 0:
            model = getattr(setup.model_fn, "name", "the model")
            raise ValueError(f"algorithm=fedbn keeps BatchNorm layers local, but model={model} has none (it would "
                             "be FedAvg): use model=cnn model.norm=batch, or model=resnet18")


SPEC = AlgorithmSpec("fedbn", FedBNConf, FedBNClient, FedBNServer,
                     "FedBN: BatchNorm parameters and statistics stay local (per-client state)")
