"""The user's own code: load objects by import path or entry point, and make them reach every process.

A plug-in is named by a reference: ``package.module:attribute`` (``attribute`` may be dotted), or
Hydra's ``package.module.attribute``. ``model._target_``, ``dataset._target_`` and
``algorithm._target_`` hold one; an installed package declares algorithms under the entry-point
group ``fl_platform.algorithms`` (``name = "package.module:SPEC"``), so that ``algorithm=<name>``
works after ``pip install`` (algorithms/registry.py). The built-in algorithms are references too,
loaded by the same :func:`load`.

Objects handed to the Python API (fl_platform/api.py) that no import path reaches (defined in a
notebook or script, lambdas, data in memory) get an ``object:`` reference that only this process
resolves: a config naming one cannot be rerun elsewhere, and says so. The reference resolves while
the config that ``api.compose`` returned is alive (:func:`hold_for`), and no longer: a notebook's
many runs do not keep every data set and class they were given.

Reaching other processes: Ray workers unpickle the run's setup, which holds the plug-in's classes
by reference, so their modules must be importable there. :func:`import_roots` finds the folders a
setup's objects were imported from (outside the installed environment and the standard library);
:class:`ImportRoots` puts them on ``sys.path`` of the process that unpickles it, before anything
that needs them is loaded (fl_platform/rounds/setup.py). A folder inside this checkout travels as a
path relative to it, so it also resolves on a Ray node that received the checkout; packages
outside it are shipped to cluster nodes by the engine's runtime environment
(:func:`cluster_py_modules`, fl_platform/engine/ray_cluster.py).
"""

from __future__ import annotations

import collections.abc
import contextlib
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import sys
import sysconfig
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import fl_platform

log = logging.getLogger(__name__)

ALGORITHM_ENTRY_POINTS = "fl_platform.algorithms"
OBJECT_PREFIX = "object:"  # a Python object given to this process (api.py), not importable elsewhere
REPO_PREFIX = "repo:"  # an import root relative to the checkout (fl_platform.REPO_ROOT) of the receiver


class PluginError(ValueError):
    """A plug-in reference that cannot be loaded, or that loads something of the wrong kind."""


# ---------------------------------------------------------------- loading by reference

class _Held:
    """An ``object:`` reference's object, in a box that can be weakly referenced (whatever the object is)."""

    __slots__ = ("__weakref__", "obj")

    def __init__(self, obj: Any) -> None:
        self.obj = obj


# ``object:`` reference -> its box, weakly: the configs naming it hold the boxes (hold_for), so an object
# lives exactly as long as a config that can run it. (A plain dict kept every notebook run's data and
# classes for the life of the process; weak values alone lost them as soon as api.compose returned.)
_OBJECTS: weakref.WeakValueDictionary[str, _Held] = weakref.WeakValueDictionary()


def object_ref(obj: Any, held: list[Any]) -> str:
    """A reference to ``obj``: its import path when importing it gives back ``obj`` itself, else an
    ``object:`` reference that :func:`load` resolves in this process while the caller keeps ``held``
    (to which it appends what keeps the reference resolvable) alive: see :func:`hold_for`."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if module and qualname and module != "__main__" and "<" not in qualname:
        try:
            if _resolve_attr(importlib.import_module(module), qualname) is obj:
                return f"{module}:{qualname}"
        except (ImportError, AttributeError):
            pass
    name = qualname or type(obj).__name__
    ref = f"{OBJECT_PREFIX}{name}@{id(obj):x}"
    box = _OBJECTS.get(ref)  # a live box under ref holds obj itself (no other live object has its id)
    if box is None:  # one box per object: every config naming it holds the same one
        box = _OBJECTS[ref] = _Held(obj)
    held.append(box)
    return ref


def hold_for(config: Any, held: list[Any]) -> None:
    """Keep ``held`` (what :func:`object_ref` appended) alive exactly as long as ``config``, the object
    whose references name them: the run reads this same object (RunConfig.raw; Result.config is it).

    A finalizer on ``config`` holds them and lets go when it is collected. Not a WeakKeyDictionary: a
    DictConfig hashes and compares by content, which changes when it is edited (cfg.rounds = 5) and is
    equal for two configs. A copy made outside the platform (OmegaConf.merge, deepcopy) does not hold
    them: its references resolve while the original lives."""
    if held:
        weakref.finalize(config, list.clear, list(held))


def _resolve_attr(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def load(ref: str, key: str) -> Any:
    """The object ``ref`` names; ``key`` (e.g. ``model._target_``) names the setting in errors."""
    if not isinstance(ref, str) or not ref.strip():
        raise PluginError(f"{key} must be an import path such as mypkg.module:Name, got {ref!r}")
    ref = ref.strip()
    if ref.startswith(OBJECT_PREFIX):
        box = _OBJECTS.get(ref)
        if box is not None:
            return box.obj
        raise PluginError(f"{key}={ref} names a Python object given to fl_platform.api in the process that "
                          "wrote this config; it does not exist here (another process, or the config that "
                          "fl_platform.api.compose returned, or the Result of api.run, is no longer kept). "
                          "Define it in an importable module and give its import path (mypkg.module:Name) "
                          "instead, or keep that config")
    if ":" in ref:
        module_name, _, attr = ref.partition(":")
        module = _import(module_name, ref, key)
    else:  # Hydra's dotted form: the longest importable module prefix, then attributes
        parts = ref.split(".")
        if len(parts) < 2:
            raise PluginError(f"{key}={ref} is not an import path: write module:Name (or module.Name)")
        for cut in range(len(parts) - 1, 0, -1):
            name = ".".join(parts[:cut])
            try:
                module = importlib.import_module(name)
            except ModuleNotFoundError as err:
                if err.name and (name == err.name or name.startswith(err.name + ".")):
                    continue  # not a module: try the shorter prefix
                raise PluginError(f"{key}={ref}: importing {name} failed: {err}") from err
            except Exception as err:
                raise PluginError(f"{key}={ref}: importing {name} raised {type(err).__name__}: {err}") from err
            attr = ".".join(parts[cut:])
            break
        else:
            module = _import(parts[0], ref, key)  # raises, naming the missing package
            attr = ".".join(parts[1:])
    try:
        obj = _resolve_attr(module, attr)
    except AttributeError:
        names = sorted(n for n in vars(module) if not n.startswith("_"))
        raise PluginError(f"{key}={ref}: module {module.__name__} ({getattr(module, '__file__', '?')}) has no "
                          f"attribute {attr!r}; it defines {', '.join(names[:20]) or 'nothing public'}") from None
    return obj


def _import(name: str, ref: str, key: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name is not None and name != err.name and not name.startswith(err.name + "."):
            raise PluginError(f"{key}={ref}: importing {name} failed: {err}") from err
        raise PluginError(f"{key}={ref}: no module named {err.name or name!r} on this Python's path "
                          f"(sys.path); install your package (pip install -e <dir>) or add its folder to "
                          f"PYTHONPATH") from None
    except Exception as err:  # the user's module raised while importing
        raise PluginError(f"{key}={ref}: importing {name} raised {type(err).__name__}: {err}") from err


def target_of(node: Any, section: str, what: str) -> str:
    """``<section>._target_`` of a config section, or an error saying how to set it."""
    from omegaconf import DictConfig, OmegaConf

    missing = (OmegaConf.is_missing(node, "_target_") if isinstance(node, DictConfig)
               else getattr(node, "_target_", None) is None)
    target = None if missing else getattr(node, "_target_", None)
    if not target:
        raise PluginError(f"{section}={getattr(node, 'name', '?')} needs {section}._target_=<module>:<{what}> "
                          "(an import path of your own code)")
    return str(target)


# ---------------------------------------------------------------- signatures

def parameters(fn: Callable[..., Any]) -> tuple[dict[str, inspect.Parameter], bool]:
    """``fn``'s named parameters (a class: its constructor's) and whether it takes ``**kwargs``."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return {}, True  # no signature to check against (a builtin): accept, the call will tell
    named = {n: p for n, p in sig.parameters.items()
             if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)}
    return named, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())


def describe(fn: Callable[..., Any]) -> str:
    """``module:Name(a, b=1, ...)`` for messages (parameters without their annotations)."""
    name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return name
    shown = [str(p.replace(annotation=inspect.Parameter.empty)) for p in params]
    return f"{name}({', '.join(shown)})"


def check_arguments(fn: Callable[..., Any], given: Mapping[str, Any], filled: Iterable[str], section: str,
                    ref: str) -> None:
    """Refuse, naming them, the fields of config section ``section`` that ``fn`` has no parameter for,
    the parameters without a default that neither the config nor the platform (``filled``) gives, and
    a value that its parameter's annotation does not admit (:func:`annotation_problem`)."""
    named, var_kw = parameters(fn)
    values, given, filled = dict(given), set(given), set(filled)
    unknown = sorted(given - set(named)) if not var_kw else []
    options = sorted(n for n in named if n not in filled)
    if unknown:
        raise PluginError(f"{', '.join(f'{section}.{k}' for k in unknown)}: not a parameter of {describe(fn)} "
                          f"({section}._target_={ref}); its parameters: {', '.join(options) or 'none'}")
    missing = sorted(n for n, p in named.items()
                     if p.default is inspect.Parameter.empty and n not in given and n not in filled
                     and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
    if missing:
        raise PluginError(f"{describe(fn)} ({section}._target_={ref}) needs "
                          f"{', '.join(f'+{section}.{k}=<value>' for k in missing)}")
    hints = _type_hints(fn)
    for name in sorted(given & set(named)):
        annotation = hints.get(name, named[name].annotation)
        problem = annotation_problem(values[name], annotation)
        if problem is not None:
            raise PluginError(f"{section}.{name}={values[name]!r}: parameter {name} of {describe(fn)} "
                              f"({section}._target_={ref}) is annotated {_type_name(annotation)}, {problem}")


def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """``fn``'s resolved annotations (a class: its constructor's); {} when they do not resolve (the
    raw annotations are used then, and a string one is not checked)."""
    import typing

    target = fn.__init__ if inspect.isclass(fn) else fn  # type: ignore[misc]
    try:
        return typing.get_type_hints(target)
    except Exception:  # an annotation naming what its module does not define: check what resolves
        return {}


def _type_name(annotation: Any) -> str:
    return annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")


def annotation_problem(value: Any, annotation: Any) -> str | None:
    """Why a config value (None, bool, int, float, str, list, dict: what Hydra parses) does not fit
    ``annotation``, or None when it fits or the annotation is not one a config value can be checked
    against (a class of the user's, a string that did not resolve). Hydra reads ``nan``, ``inf``,
    numbers, ``true``/``false`` and ``null`` as values, so a ``str`` parameter given one says how to
    quote it; an ``int`` is accepted for a ``float``."""
    import types
    import typing

    if annotation in (inspect.Parameter.empty, Any, object) or isinstance(annotation, str | typing.TypeVar):
        return None
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        problems = [annotation_problem(value, a) for a in args]
        if any(p is None for p in problems):
            return None
        return f"got {_described(value)}"
    if origin is typing.Literal:
        return None if value in args else f"one of {', '.join(map(repr, args))}; got {_described(value)}"
    if annotation is type(None):
        return None if value is None else f"got {_described(value)}"
    got = f"got {_described(value)}"
    if annotation is bool:
        return None if isinstance(value, bool) else got
    if annotation is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else got
    if annotation is float:
        return None if isinstance(value, int | float) and not isinstance(value, bool) else got
    if annotation is str:
        if isinstance(value, str):
            return None
        if value is None or isinstance(value, int | float | bool):
            return f"{got} (Hydra reads it as a value, not text: quote it, e.g. '{value}')"
        return got
    container = origin or annotation
    if container in _SEQUENCES:
        if not isinstance(value, list | tuple):
            return f"a list, {got}"
        if container is tuple and args and args[-1] is not Ellipsis:  # tuple[int, str]: one type per item
            if len(args) != len(value):
                return f"{len(args)} items, {got}"
            kinds = list(args)
        else:  # list[int], tuple[int, ...], Sequence[float]
            kinds = [args[0]] * len(value) if args else []
        for i, (item, kind) in enumerate(zip(value, kinds)):
            problem = annotation_problem(item, kind)
            if problem is not None:
                return f"item {i}: {problem}"
        return None
    if container in _MAPPINGS:
        return None if isinstance(value, dict) else f"a mapping, {got}"
    return None  # a class of the user's (or a torch type): not something a config value can be checked against


_SEQUENCES = (list, tuple, set, frozenset, collections.abc.Sequence, collections.abc.MutableSequence,
              collections.abc.Iterable, collections.abc.Collection)
_MAPPINGS = (dict, collections.abc.Mapping, collections.abc.MutableMapping)


def _described(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


# ---------------------------------------------------------------- entry points

def entry_points(group: str) -> dict[str, importlib.metadata.EntryPoint]:
    """The entry points of ``group`` in the installed distributions (first one wins per name).

    Read once per state of ``sys.path``: listing them parses every installed distribution's metadata
    (~7-13 ms here) and one run's start-up asks several times, while the state costs ~2 ms to take.
    Installing or removing a distribution (pip) changes its ``sys.path`` folder's modification time
    and its list of ``.dist-info``/``.egg-info`` folders; editing an ``entry_points.txt`` in place
    changes that file's time: either way the next call reads them again."""
    return dict(_entry_points(group, _path_state()))


PathState = tuple[tuple[str, int | None, tuple[tuple[str, int], ...]], ...]


def _path_state() -> PathState:
    """``sys.path`` with each folder's modification time and the modification time of each of its
    distributions' ``entry_points.txt`` (None and () for what is not a readable folder)."""
    state = []
    for entry in sys.path:
        folder = entry or "."
        try:
            mtime = os.stat(folder).st_mtime_ns
            with os.scandir(folder) as it:
                dists = sorted(e.name for e in it if e.name.endswith((".dist-info", ".egg-info")))
        except OSError:
            state.append((entry, None, ()))
            continue
        files = []
        for name in dists:
            with contextlib.suppress(OSError):  # a distribution without entry points has no file
                files.append((name, os.stat(os.path.join(folder, name, "entry_points.txt")).st_mtime_ns))
        state.append((entry, mtime, tuple(files)))
    return tuple(state)


@functools.lru_cache(maxsize=32)
def _entry_points(group: str, path_state: PathState) -> dict[str, importlib.metadata.EntryPoint]:
    """``entry_points`` for one ``path_state`` (the cache's key, not read here)."""
    out: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=group):
        if ep.name in out and out[ep.name].value != ep.value:
            log.warning("entry point %s=%s of group %s ignored: %s=%s came first", ep.name, ep.value, group,
                        ep.name, out[ep.name].value)
            continue
        out.setdefault(ep.name, ep)
    return out


# ---------------------------------------------------------------- reaching other processes

def _installed_dirs() -> list[Path]:
    keys = ("stdlib", "platstdlib", "purelib", "platlib")
    dirs = {Path(p).resolve() for k in keys if (p := sysconfig.get_paths().get(k))}
    dirs.update(Path(p).resolve() for p in sys.path if p and Path(p).name in ("site-packages", "dist-packages"))
    return sorted(dirs)


def _module_of(obj: Any) -> str | None:
    """The module that defines ``obj`` (a class or function), or ``obj``'s class."""
    if inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismethod(obj):
        return obj.__module__
    return type(obj).__module__


def module_root(module_name: str) -> Path | None:
    """The ``sys.path`` folder that module ``module_name``'s top-level package was imported from,
    or None when the module comes with the environment (installed, standard library), is
    fl_platform's own, is ``__main__`` (pickled by value) or has no file."""
    top = module_name.partition(".")[0]
    if top in ("__main__", "fl_platform") or top in sys.builtin_module_names:
        return None
    module = sys.modules.get(top)
    file = getattr(module, "__file__", None)
    if file is not None:
        path = Path(file).resolve()
        root = path.parent.parent if path.name == "__init__.py" else path.parent
    else:
        paths = list(getattr(module, "__path__", None) or [])  # a namespace package
        if not paths:
            return None
        root = Path(paths[0]).resolve().parent
    if any(root == d or d in root.parents for d in _installed_dirs()):
        return None
    return root


def import_roots(objects: Iterable[Any]) -> tuple[str, ...]:
    """The import roots of ``objects``' modules (see :func:`module_root`), as portable strings:
    ``repo:<relative path>`` inside this checkout, else absolute."""
    repo = Path(fl_platform.REPO_ROOT).resolve()
    out: list[str] = []
    for obj in objects:
        name = _module_of(obj)
        root = module_root(name) if name else None
        if root is None:
            continue
        text = f"{REPO_PREFIX}{root.relative_to(repo).as_posix()}" if root == repo or repo in root.parents else str(root)
        if text not in out:
            out.append(text)
    return tuple(out)


def add_import_roots(roots: Iterable[str]) -> None:
    """Append each root that exists here to ``sys.path`` (``repo:`` roots resolve against this
    process's checkout); a root missing here is left to the runtime environment (cluster nodes)."""
    for root in roots:
        path = Path(fl_platform.REPO_ROOT) / root[len(REPO_PREFIX):] if root.startswith(REPO_PREFIX) else Path(root)
        text = str(path)
        if path.is_dir() and text not in sys.path:
            sys.path.append(text)
            importlib.invalidate_caches()


class ImportRoots:
    """Import roots that travel in a pickle: unpickling puts them on ``sys.path`` at once, so that
    objects pickled after it in the same stream (the user's classes) import in that process."""

    __slots__ = ("roots",)

    def __init__(self, roots: Iterable[str] = ()) -> None:
        self.roots = tuple(roots)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _unpickled_roots, (self.roots,)

    def __repr__(self) -> str:
        return f"ImportRoots({self.roots!r})"


def _unpickled_roots(roots: tuple[str, ...]) -> ImportRoots:
    add_import_roots(roots)
    return ImportRoots(roots)


def cluster_py_modules(objects: Iterable[Any]) -> list[str]:
    """Folders to ship to Ray cluster nodes (runtime_env ``py_modules``) for plug-ins imported from
    outside this checkout and outside the environment: each one's top-level package folder.

    A top-level single-file module cannot travel as a ``py_modules`` entry (Ray ships folders as
    packages): that is an error naming it and the ways out."""
    repo = Path(fl_platform.REPO_ROOT).resolve()
    out: list[str] = []
    for obj in objects:
        name = _module_of(obj)
        root = module_root(name) if name else None
        if root is None or root == repo or repo in root.parents:
            continue
        top = name.partition(".")[0]
        folder = root / top
        if not folder.is_dir():
            raise PluginError(f"plug-in module {top} ({root / (top + '.py')}) is a single file outside this "
                              "checkout, which Ray cannot ship to cluster nodes: put it in a package (a folder "
                              "with __init__.py), install it on every node, or give engine.runtime_env")
        if str(folder) not in out:
            out.append(str(folder))
    return out


# Plug-in objects of the runs started in this process (for shipping code to cluster nodes), weakly: a
# run's setup holds its own while it runs, and a class of a package lives in its module, so what a
# connecting engine needs is here; a notebook's local classes go with their runs. An object that
# cannot be weakly referenced (a builtin function: it lives in its module anyway) is held as is.
_IN_USE: list[Callable[[], Any]] = []


def note_in_use(objects: Iterable[Any]) -> None:
    """Remember plug-in objects a run uses (their packages are shipped when joining a Ray cluster)."""
    live = in_use()
    for obj in objects:
        if _module_of(obj) and not any(o is obj for o in live):
            try:
                _IN_USE.append(weakref.ref(obj))
            except TypeError:
                _IN_USE.append(functools.partial(_same, obj))
            live.append(obj)


def _same(obj: Any) -> Any:
    return obj


def in_use() -> list[Any]:
    """The plug-in objects of this process's runs that are still alive."""
    pairs = [(r, r()) for r in _IN_USE]
    _IN_USE[:] = [r for r, obj in pairs if obj is not None]
    return [obj for _, obj in pairs if obj is not None]
