"""Source names -> loaders, with one entry point that checks names and options up front.

``custom`` is the user's own loader, named by ``_target_`` (``dataset=custom
dataset._target_=mypkg.data:load``): any callable returning a ``SourceData``, called with its own
options plus whichever of ``root``, ``download`` and ``seed`` it takes (fl_platform/plugins.py).
"""

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

CUSTOM = "custom"  # the user's loader, by dataset._target_
_TARGET = "_target_"
_PLATFORM_ARGS = ("root", "download", "seed")  # what load_source passes a loader that takes them

# Sources whose samples carry a natural group id (writer, speaker, device): "natural" is their default.
GROUPED_SOURCES = frozenset({"synthetic", "femnist", "shakespeare"})


def source_options(name: str) -> dict[str, object]:
    """The keyword options of a source with their defaults (what ``load_source`` accepts as **options);
    ``custom``: only ``_target_`` (its loader's own options are checked when it is loaded)."""
    if name == CUSTOM:
        return {_TARGET: None}
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
            f"unknown dataset source {name!r}; valid names: {', '.join(sorted(SOURCES))} "
            f"(or {CUSTOM} with _target_=<module>:<loader> for your own)"
        ) from None


def custom_loader(ref: object, options: dict[str, object], root: object = None, download: bool = False) -> Loader:
    """The user's loader ``ref``, after checking ``options`` against its signature; refused: a root or
    download it does not take (they would do nothing)."""
    from fl_platform.plugins import check_arguments, describe, load, parameters

    if not ref or ref == "???":
        raise ValueError(f"dataset={CUSTOM} needs dataset._target_=<module>:<function returning a SourceData>")
    loader = load(str(ref), "dataset._target_")
    if not callable(loader):
        raise TypeError(f"dataset._target_={ref} is a {type(loader).__name__}, not a function")
    check_arguments(loader, options, _PLATFORM_ARGS, "dataset", str(ref))
    named, var_kw = parameters(loader)
    for key, value, unset in (("root", root, None), ("download", download, False)):
        if key not in named and not var_kw and value != unset:
            raise ValueError(f"dataset.{key}={value!r} has no effect: {describe(loader)} "
                             f"(dataset._target_={ref}) takes no {key} argument")
    return loader


def load_custom(ref: object, root: str | os.PathLike[str] | None, download: bool, seed: int,
                options: dict[str, object]) -> SourceData:
    """The user's loader ``ref`` called with ``options`` and what it takes of root/download/seed."""
    from fl_platform.plugins import parameters

    loader = custom_loader(ref, options, root, download)
    named, _ = parameters(loader)
    given = {"root": root, "download": download, "seed": seed}
    source = loader(**{k: v for k, v in given.items() if k in named}, **options)
    if not isinstance(source, SourceData):
        raise TypeError(f"dataset._target_={ref} returned a {type(source).__name__}; a loader returns a "
                        "fl_platform.datasets.source.SourceData (train/test arrays, num_classes, input_shape)")
    return source


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
    if name == CUSTOM:
        own = dict(options)
        return load_custom(own.pop(_TARGET, None), root, download, seed, own)
    loader = get_loader(name)
    valid = source_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(
            f"unknown option(s) {', '.join(map(repr, unknown))} for source {name!r}; "
            f"valid options: {', '.join(sorted(valid)) or '(none)'}"
        )
    return loader(root=root, download=download, seed=seed, **options)
