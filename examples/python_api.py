"""Run experiments from Python with fl_platform.api (docs/python-api.md).

    python examples/python_api.py [--run-dir DIR]

1. ``by_overrides``: the config as command-line overrides; exactly what
   ``python -m fl_platform.run <OVERRIDES>`` runs (tests/test_api.py checks both give the same summary).
2. ``by_objects``: your own ``nn.Module`` class, data as tensors, a partition given by hand (one
   index list per client) and an algorithm spec object (here FedAdam from the tutorial's file).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fl_platform import api

OVERRIDES = ["algorithm=fedprox", "algorithm.mu=0.01", "rounds=5", "num_clients=20", "clients_per_round=5",
             "train.epochs=1", "seed=3", "logger.progress=false"]


def by_overrides(run_dir: str | Path | None = None) -> api.Result:
    return api.run(OVERRIDES, run_dir=run_dir)


class TwoLayerNet(nn.Module):
    """Any nn.Module: the platform passes input_shape and num_classes because __init__ takes them."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, hidden: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def toy_data(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Four Gaussian classes in 8 dimensions, as tensors (any arrays or tensors work)."""
    g = torch.Generator().manual_seed(seed)
    centres = 3.0 * torch.eye(4, 8)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 4, (n,), generator=g)
        return centres[y] + torch.randn(n, 8, generator=g), y

    return (*draw(800), *draw(200))


def by_objects() -> api.Result:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "my_algorithm"))  # the tutorial's one file
    from fedadam import SPEC as FEDADAM

    train_x, train_y, test_x, test_y = toy_data()
    # A partition by hand: 8 clients; client k holds the training samples of class k % 4 with index = k mod 2.
    clients = [np.flatnonzero((train_y.numpy() == k % 4) & (np.arange(800) % 2 == k // 4)) for k in range(8)]
    return api.run(["rounds=5", "clients_per_round=4", "train.epochs=1", "algorithm.server_lr=0.03",
                    "logger.progress=false"],
                   model=TwoLayerNet, data=(train_x, train_y, test_x, test_y), partition=clients,
                   algorithm=FEDADAM)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", type=Path, help="write the overrides run's files here (as the CLI does)")
    args = parser.parse_args(argv)
    first = by_overrides(args.run_dir)
    print(f"overrides: final test accuracy {first.summary['final_test_accuracy']:.4f} after "
          f"{first.summary['rounds']} rounds; accuracy by round {first.metric('test_accuracy')}")
    second = by_objects()
    print(f"objects: {second.summary['algorithm']} on {second.summary['num_clients']} hand-made clients: final "
          f"test accuracy {second.summary['final_test_accuracy']:.4f}")
    print(json.dumps({"overrides": first.summary, "objects": second.summary}, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
