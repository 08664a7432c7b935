"""Algorithms by name. A new algorithm is one module with a ``SPEC`` plus one line here."""

from __future__ import annotations

import importlib

from fl_platform.algorithms.base import AlgorithmSpec

_MODULES = {
    "fedavg": "fl_platform.algorithms.fedavg",
    "fedprox": "fl_platform.algorithms.fedprox",
    "scaffold": "fl_platform.algorithms.scaffold",
    "fedimpro": "fl_platform.algorithms.fedimpro",
    "vhl": "fl_platform.algorithms.vhl",
    "baow": "fl_platform.algorithms.baow",
    "oneshot_fedavg": "fl_platform.algorithms.oneshot.fedavg",
    "oneshot_ensemble": "fl_platform.algorithms.oneshot.ensemble",
    "oneshot_feddf": "fl_platform.algorithms.oneshot.feddf",
    "oneshot_dense": "fl_platform.algorithms.oneshot.dense",
    "oneshot_coboost": "fl_platform.algorithms.oneshot.coboost",
    "fusefl": "fl_platform.algorithms.fusefl",
}


def algorithm_names() -> list[str]:
    return sorted(_MODULES)


def get_algorithm(name: str) -> AlgorithmSpec:
    if name not in _MODULES:
        raise ValueError(f"unknown algorithm {name!r}; valid choices: {', '.join(algorithm_names())}")
    return importlib.import_module(_MODULES[name]).SPEC
