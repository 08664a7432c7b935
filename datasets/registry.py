"""Source names -> loaders, with one entry point that checks names and options up front."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable

from fl_platform.datasets.source import SourceData
from fl_platform.datasets.sources.cifar import load_cifar10, load_cifar100
from fl_platform.datasets.sources.digits import load_digits
from fl_platform.datasets.sources.hf import load_hf
from fl_platform.datasets.sources.idx import load_fashion_mnist, load_mnist
from fl_platform.datasets.sources.leaf import load_femnist
from fl_platform.datasets.sources.shakespeare import load_shakespeare
from fl_platform.datasets.sources.synthetic import load_synthetic

Loader = Callable[..., SourceData]

# Every loader takes (root, download, seed, *, options...) and returns a SourceData.
SOURCES: dict[str, Loader] = {
    "digits": load_digits,
    "synthetic": load_synthetic,
    "mnist": load_mnist,
    "fashion_mnist": load_fashion_mnist,
    "cifar10": load_cifar10,
    "cifar100": load_cifar100,
    "femnist": load_femnist,
    "shakespeare": load_shakespeare,
    "hf": load_hf,  # any Hugging Face `datasets` data set, local or from the Hub (extra: fl-platform[hf])
}

# Sources whose samples carry a natural group id (writer, speaker, device): "natural" is their default.
GROUPED_SOURCES = frozenset({"synthetic", "femnist", "shakespeare"})


def source_options(name: str) -> dict[str, object]:
    """The keyword options of a source with their defaults (what ``load_source`` accepts as **options)."""
    loader = get_loader(name)
    return {
        p.name: p.default
        for p in inspect.signature(loader).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }


def get_loader(name: str) -> Loader:
    try:
        return SOURCES[name]
    except KeyError:
        raise ValueError(
            f"unknown dataset source {name!r}; valid names: {', '.join(sorted(SOURCES))}"
        ) from None


def load_source(
    name: str,
    root: str | os.PathLike[str] | None = None,
    download: bool = False,
    seed: int = 0,
    **options: object,
) -> SourceData:
    """Load source ``name``; ``options`` go to its loader (see ``source_options(name)``).

    ``download`` only matters for sources that can be fetched (mnist, fashion_mnist, cifar10,
    cifar100, shakespeare, hf with a Hub name) and is off by default: nothing touches the network
    unless asked.
    """
    loader = get_loader(name)
    valid = source_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for source {name!r}; "
            f"valid options: {', '.join(sorted(valid)) or '(none)'}"
        )
    return loader(root=root, download=download, seed=seed, **options)
