"""Joining a Ray cluster and shipping the project's code to its nodes.

``engine.address`` names the cluster (``host:port`` of its head, or ``auto`` for one started on
this machine with ``ray start``); without it the engine starts a local Ray, unless this process
already runs one (then it joins that one and leaves it running).

``engine.runtime_env`` is Ray's runtime environment for the run's job:

* ``auto`` (default): when joining a cluster (``engine.address``), ship this checkout (the
  repository root with ``fl_platform/``, ``algorithms/``, ``datasets/`` and ``conf/``, without
  virtual environments, git data, outputs, data and results) as the job's ``working_dir``, so that
  a node needs only Python and the dependencies; the workers import the shipped copy. A local Ray
  started by the engine runs on this machine, which has the code: nothing is shipped.
  The user's plug-in code (a custom model, data loader or algorithm, fl_platform/plugins.py) goes
  too: inside the checkout with it, a package outside it as a ``py_modules`` entry.
* ``null`` or ``{}``: ship nothing; every node must hold an identical install (plug-ins included).
* a mapping: Ray's ``runtime_env``, merged over the shipped checkout (also for a local Ray: a
  mapping is a job's whole environment; its keys replace the default's, ``working_dir: null`` drops
  the shipped code), e.g. ``{env_vars: {OMP_NUM_THREADS: "1"}}``
  or ``{pip: [...]}``.

A runtime environment belongs to a job, which the engine creates only when it connects: when Ray
was initialized before the engine (by this process), a mapping is refused instead of being ignored.

A local Ray that the engine starts listens on 127.0.0.1 only: Ray has no authentication, and by
default on Linux its processes listen on every interface, where any machine that reaches this one
could run code in it. Ray decides its address when it is first imported, from
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` (0: loopback), so :func:`keep_local_ray_on_loopback` sets that
before the engine imports Ray (unless the environment already says otherwise); a process that
imported Ray earlier (a notebook) gets a warning naming the address it listens on.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Never shipped (gitignore syntax, relative to the repository root; Ray also honours .gitignore).
EXCLUDES = ["/.venv/", "/.git/", "/outputs/", "/multirun/", "/runs/", "/wandb/", "/data/", "/docs/results/",
            "__pycache__/", "*.pyc", "/.pytest_cache/", "/.ruff_cache/", "/.hypothesis/", "*.egg-info/"]


#: Ray reads it once, when it is imported: "0" keeps every process of a Ray started here on 127.0.0.1.
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def keep_local_ray_on_loopback(address: str | None) -> None:
    """Before the engine first imports Ray in this process: without ``engine.address`` (the engine starts
    a local Ray, unless this process already runs one) that Ray listens on loopback only. The
    environment variable is Ray's own switch and is left alone when set; it does not stop this process
    from joining a cluster later (``engine.address``)."""
    if address is None and "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_ENV, "0")


def warn_if_listening_beyond_loopback(ray: Any) -> None:
    """Warn when the Ray the engine just started listens on a network address (Ray was imported before
    :func:`keep_local_ray_on_loopback` could act, or the environment asked for it)."""
    node = ray.get_runtime_context().get_node_id()
    (address,) = [n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node]
    try:
        loopback = ipaddress.ip_address(address).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        log.warning("the local Ray this run started listens on %s, not only on 127.0.0.1: Ray has no "
                    "authentication, and any machine that reaches that address can run code here. Set "
                    "%s=0 before Python imports Ray (the engine does when it imports Ray first)", address,
                    LOOPBACK_ENV)


def raw_value(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg.key`` as set (None stays None), as a plain container."""
    from omegaconf import DictConfig, OmegaConf

    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value


def default_runtime_env() -> dict[str, Any]:
    """Ship this checkout (its root keeps the layout ``fl_platform/__init__.py`` mounts), or the
    installed package when there is no checkout."""
    import fl_platform

    root = Path(fl_platform.REPO_ROOT)
    if (root / "pyproject.toml").is_file() and (root / "conf").is_dir() and (root / "fl_platform").is_dir():
        return {"working_dir": str(root), "excludes": list(EXCLUDES)}
    return {"py_modules": [str(Path(fl_platform.__file__).parent)]}


def runtime_env_for(value: Any, joining: bool) -> dict[str, Any] | None:
    """The job's runtime_env for ``engine.runtime_env`` = ``value`` (None: none)."""
    if value is None or (isinstance(value, Mapping) and not value):
        return None
    if value == "auto":
        return default_runtime_env() if joining else None
    if isinstance(value, Mapping):
        merged = {**default_runtime_env(), **dict(value)}
        if merged.get("working_dir") is None and "excludes" not in value:  # nothing left to exclude from
            merged.pop("excludes", None)
        return {k: v for k, v in merged.items() if v is not None} or None
    raise ValueError(f"engine.runtime_env must be auto, null or a mapping (Ray's runtime_env), got {value!r}")


def with_plugin_modules(runtime_env: dict[str, Any]) -> dict[str, Any]:
    """``runtime_env`` plus, as ``py_modules``, the packages of the user's code that this process's runs
    use and that neither the shipped checkout nor the installed environment holds (fl_platform/plugins.py),
    so cluster nodes import them as the driver does."""
    from fl_platform import plugins

    extra = [m for m in plugins.cluster_py_modules(plugins.in_use()) if m not in runtime_env.get("py_modules", [])]
    return {**runtime_env, "py_modules": [*runtime_env.get("py_modules", []), *extra]} if extra else runtime_env


def _host_port(address: str) -> tuple[str, int] | None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        return socket.gethostbyname(host.removeprefix("ray://")), int(port)
    except OSError:
        return None


def connect(cfg: Any) -> bool:
    """Make sure this process is connected to Ray as ``engine.*`` asks; True when the engine started
    the connection (and must shut it down)."""
    import ray

    address = raw_value(cfg, "address")
    setting = raw_value(cfg, "runtime_env", "auto")
    if ray.is_initialized():
        if isinstance(setting, Mapping) and setting:
            raise ValueError("engine.runtime_env is set, but Ray was initialized in this process before the engine "
                             "and a runtime environment belongs to the job: pass it to ray.init, or let the engine "
                             "connect (engine.address)")
        current = ray.get_runtime_context().gcs_address
        if address not in (None, "auto") and _host_port(address) != _host_port(current):
            raise ValueError(f"engine.address={address} but this process is already connected to the Ray cluster "
                             f"at {current}; a process joins one cluster")
        return False
    runtime_env = runtime_env_for(setting, joining=address is not None)
    if runtime_env is not None and address is not None:
        runtime_env = with_plugin_modules(runtime_env)
    if runtime_env is not None:
        log.info("Ray job runtime_env: %s", runtime_env)
    ray.init(address=address, runtime_env=runtime_env, include_dashboard=False,
             log_to_driver=False, configure_logging=True, logging_level=logging.WARNING)
    if address is None:
        warn_if_listening_beyond_loopback(ray)
    return True
