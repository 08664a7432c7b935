"""Algorithms by name: the built-ins, installed plug-ins (entry points) and specs registered in-process.

Every algorithm is an ``AlgorithmSpec`` named by an import reference (``module:SPEC``) and loaded
by ``fl_platform.plugins.load``: the built-ins from the table below, an installed package's from
the entry-point group ``fl_platform.algorithms``::

    # the plug-in's pyproject.toml
    [project.entry-points."fl_platform.algorithms"]
    fedadam = "my_algorithm.fedadam:SPEC"

after which ``algorithm=fedadam`` is a choice like ``algorithm=fedavg`` (fl_platform/config.py
registers its conf with Hydra). Code that is not installed is named directly:
``algorithm=plugin algorithm._target_=mypkg.alg:SPEC`` (:func:`spec_of`), or handed to
``fl_platform.api.run(algorithm=SPEC)`` (:func:`register_algorithm`).
"""

from __future__ import annotations

import logging
import sys

from fl_platform.algorithms.base import AlgorithmSpec
from fl_platform.plugins import ALGORITHM_ENTRY_POINTS, PluginError, entry_points, load, target_of

log = logging.getLogger(__name__)

BUILTIN: dict[str, str] = {
    "fedavg": "fl_platform.algorithms.fedavg:SPEC",
    "fedprox": "fl_platform.algorithms.fedprox:SPEC",
    "scaffold": "fl_platform.algorithms.scaffold:SPEC",
    "fedbn": "fl_platform.algorithms.fedbn:SPEC",
    "fedper": "fl_platform.algorithms.fedper:SPEC",
    "fedrep": "fl_platform.algorithms.fedper:FEDREP",
    "ditto": "fl_platform.algorithms.ditto:SPEC",
    "feddyn": "fl_platform.algorithms.feddyn:SPEC",
    "moon": "fl_platform.algorithms.moon:SPEC",
    "fednova": "fl_platform.algorithms.fednova:SPEC",
    "fedimpro": "fl_platform.algorithms.fedimpro:SPEC",
    "vhl": "fl_platform.algorithms.vhl:SPEC",
    "baow": "fl_platform.algorithms.baow:SPEC",
    "oneshot_fedavg": "fl_platform.algorithms.oneshot.fedavg:SPEC",
    "oneshot_ensemble": "fl_platform.algorithms.oneshot.ensemble:SPEC",
    "oneshot_feddf": "fl_platform.algorithms.oneshot.feddf:SPEC",
    "oneshot_dense": "fl_platform.algorithms.oneshot.dense:SPEC",
    "oneshot_coboost": "fl_platform.algorithms.oneshot.coboost:SPEC",
    "oneshot_adi": "fl_platform.algorithms.oneshot.adi:SPEC",
    "fusefl": "fl_platform.algorithms.fusefl:SPEC",
}

#: The option of the ``algorithm`` config group that names its spec by ``algorithm._target_``.
PLUGIN = "plugin"

_REGISTERED: dict[str, AlgorithmSpec] = {}  # register_algorithm, this process only


def algorithm_refs() -> dict[str, str]:
    """name -> reference of every built-in and installed (entry-point) algorithm."""
    refs = dict(BUILTIN)
    for name, ep in entry_points(ALGORITHM_ENTRY_POINTS).items():
        if name in refs or name == PLUGIN:
            log.warning("the installed plug-in algorithm %s=%s is ignored: %s is a built-in name", name, ep.value,
                        name)
            continue
        refs[name] = ep.value
    return refs


def algorithm_names(refs: dict[str, str] | None = None) -> list[str]:
    """Every name ``algorithm=<name>`` accepts (``plugin`` aside); ``refs`` as in :func:`get_algorithm`."""
    return sorted(set(algorithm_refs() if refs is None else refs) | set(_REGISTERED))


def builtin_algorithm_names() -> list[str]:
    return sorted(BUILTIN)


def load_spec(ref: str, key: str = "algorithm._target_") -> AlgorithmSpec:
    """The ``AlgorithmSpec`` that ``ref`` names (an error naming ``key`` if it is something else)."""
    spec = load(ref, key)
    if not isinstance(spec, AlgorithmSpec):
        raise PluginError(f"{key}={ref} is a {type(spec).__name__}, not an AlgorithmSpec: point it at the module's "
                          "SPEC = AlgorithmSpec(name, Conf, ClientHalf, ServerHalf, summary) (docs/algorithm-api.md)")
    check_spec(spec, f"{key}={ref}")
    return spec


def check_spec(spec: AlgorithmSpec, where: str) -> None:
    """Refuse at start-up, naming the class, a spec whose parts would fail only mid-run: a ``Conf`` that
    is not an ``AlgorithmConf`` dataclass, a client half that is not a ``ClientAlgorithm``, a server
    half that is not a ``ServerAlgorithm`` or does not define ``aggregate`` (the base one only raises)."""
    import dataclasses
    import inspect

    from fl_platform.algorithms.base import AlgorithmConf, ClientAlgorithm, ServerAlgorithm

    name = _qualified
    head = f"{where}: algorithm {spec.name!r}"
    conf, server = spec.conf, spec.server
    if not (inspect.isclass(conf) and dataclasses.is_dataclass(conf)):
        raise PluginError(f"{head}: its conf {name(conf)} is not a dataclass; decorate it with @dataclass (its "
                          "fields are the algorithm's config keys, checked and typed at start-up)")
    if not issubclass(conf, AlgorithmConf):
        raise PluginError(f"{head}: its conf {name(conf)} does not extend fl_platform.algorithms.base.AlgorithmConf "
                          "(or ServerStepConf for a server_lr); subclass it")
    for half, base in (("client", ClientAlgorithm), ("server", ServerAlgorithm)):
        cls = getattr(spec, half)
        if not (inspect.isclass(cls) and issubclass(cls, base)):
            what = "class" if inspect.isclass(cls) else type(cls).__name__
            raise PluginError(f"{head}: its {half} half {name(cls)} ({what}) is not a subclass of "
                              f"fl_platform.algorithms.base.{base.__name__}; subclass it (docs/algorithm-api.md)")
    if server.aggregate is ServerAlgorithm.aggregate:
        raise PluginError(f"{head}: its server half {name(server)} does not define aggregate(self, ctx, result), "
                          "the step from the clients' summed (or listed) contributions to the new global model; "
                          "without it the run would fail after the first round's training")


def get_algorithm(name: str | AlgorithmSpec, refs: dict[str, str] | None = None) -> AlgorithmSpec:
    """The spec of algorithm ``name``; a spec is returned as it is (a setup carries its resolved spec
    to the workers, so they never look a name up). ``refs``: :func:`algorithm_refs` when the caller
    already has them (one scan of the installed distributions for many look-ups, not one each)."""
    if isinstance(name, AlgorithmSpec):
        return name
    if name in _REGISTERED:
        return _REGISTERED[name]
    refs = algorithm_refs() if refs is None else refs
    if name not in refs:
        raise ValueError(f"unknown algorithm {name!r}; valid choices: {', '.join(algorithm_names())} (or "
                         f"algorithm={PLUGIN} algorithm._target_=<module>:SPEC for your own)")
    return load_spec(refs[name], f"algorithm={name}")


def register_algorithm(spec: AlgorithmSpec, name: str | None = None) -> str:
    """Make ``spec`` the algorithm ``name`` (default ``spec.name``) in this process, a config-group
    option like the built-ins; returns the name. A built-in or installed name is refused."""
    name = name or spec.name
    if not isinstance(spec, AlgorithmSpec):
        raise TypeError(f"register_algorithm takes an AlgorithmSpec, got {type(spec).__name__}")
    check_spec(spec, f"register_algorithm({spec.name!r})")
    refs = algorithm_refs()
    if name in refs and _loads_as(refs[name], spec):
        return name  # the built-in or installed algorithm itself: already an option under that name
    if name == PLUGIN or name in refs:
        raise ValueError(f"algorithm name {name!r} is taken (built-in or installed); give another name")
    old = _REGISTERED.get(name, spec)
    if old is not spec:  # another object under the name: algorithm=<name> now runs other code, say so
        if old == spec:
            log.debug("algorithm %r registered again with an equal spec (%s)", name, _described(spec))
        else:
            log.warning("algorithm %r re-registered: algorithm=%s now runs %s instead of %s", name, name,
                        _described(spec), _described(old))
    _REGISTERED[name] = spec
    from fl_platform.config import register_algorithm_option

    register_algorithm_option(name, spec)
    return name


def _qualified(obj: object) -> str:
    """``module:QualName`` of a class or function, for messages."""
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', type(obj).__name__)}"


def _described(spec: AlgorithmSpec) -> str:
    """``module:NAME`` of a spec that a module of its halves holds (``plugin_pkg.alg:SPEC``), else
    ``AlgorithmSpec '<its name>'``, with the classes of its conf and halves: which code the name runs."""
    path = f"AlgorithmSpec {spec.name!r}"
    for module in dict.fromkeys(cls.__module__ for cls in (spec.server, spec.client, spec.conf)):
        attr = next((a for a, v in list(vars(sys.modules.get(module, sys)).items()) if v is spec), None)
        if attr is not None:
            path = f"{module}:{attr}"
            break
    return (f"{path} (conf {_qualified(spec.conf)}, client {_qualified(spec.client)}, "
            f"server {_qualified(spec.server)})")


def _loads_as(ref: str, spec: AlgorithmSpec) -> bool:
    """Whether ``ref`` (a built-in's or an entry point's) is the object ``spec`` (False if it fails to load)."""
    try:
        return load(ref, "algorithm") is spec
    except PluginError:
        return False


def unregister_algorithm(name: str) -> None:
    """Forget an algorithm :func:`register_algorithm` registered, and its config option."""
    if _REGISTERED.pop(name, None) is not None:
        from fl_platform.config import unregister_algorithm_option

        unregister_algorithm_option(name)


def spec_of(node: object) -> AlgorithmSpec:
    """The spec of an ``algorithm`` config section: ``algorithm._target_`` for ``algorithm=plugin``,
    else its name."""
    name = getattr(node, "name", None)
    if name == PLUGIN:
        return load_spec(target_of(node, "algorithm", "SPEC"))
    return get_algorithm(name)  # type: ignore[arg-type]
