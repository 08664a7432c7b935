"""Shared fixtures: compose run configs in-process exactly as the CLI does."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from fl_platform.config import register_configs
from fl_platform.datasets.paths import ENV_VAR, data_root

# Every Ray process of the tests (Ray started here, by RayEngine, by Flower's simulation, or in a
# subprocess, which inherits this environment) binds 127.0.0.1, never the machine's network address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"

register_configs()

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Parallel runs (scripts/test.sh: three pytest workers on two cores): one torch thread per worker
    # process and per child process, so the workers oversubscribe the cores no further than their number.
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _ray_tests_are_marked(request, monkeypatch):
    """A test that uses Ray in this process must be marked ``ray``: the mark keeps a module's Ray tests on
    one pytest-xdist worker with that worker's session Ray (below) and puts them in the slow tier. An
    unmarked test fails when it starts Ray, asks for ``ray_session`` or connects the Ray engine: the last
    two would otherwise pass unnoticed wherever an earlier test left Ray running."""
    if request.node.get_closest_marker("ray") is not None:
        yield
        return
    if "ray_session" in request.fixturenames:
        pytest.fail(f"{request.node.nodeid} uses ray_session but is not marked @pytest.mark.ray", pytrace=False)
    import ray

    from fl_platform.engine import ray_engine

    def refuse(*args, **kwargs):
        pytest.fail(f"{request.node.nodeid} uses Ray but is not marked @pytest.mark.ray", pytrace=False)

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray_engine, "connect", refuse)  # RayEngine's way to Ray, running or not
    yield


def pytest_configure(config):
    """``xdist_group`` stays a known mark without pytest-xdist (``-p no:xdist``, one process), where
    ``--strict-markers`` would otherwise refuse every grouped test; it groups nothing there."""
    config.addinivalue_line("markers", "xdist_group(name): run the tests of one group on one pytest-xdist worker")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``--dist loadgroup``), each module's Ray tests form one group, run by one worker
    against that worker's session Ray (one per worker, started once); the groups spread over the workers
    like any other test, so neither waits on the other's Ray tests. A module that groups itself
    (``xdist_group`` on the module: a fixture that starts processes once) keeps its group.

    Ray and Flower tests start processes (seconds each): they count as ``slow``, so the quick tier
    ``./scripts/test.sh -m "not slow"`` is the in-process tests alone."""
    for item in items:
        if item.get_closest_marker("ray") and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(f"ray-{item.module.__name__.rsplit('.', 1)[-1]}"))
        if item.get_closest_marker("ray") or item.get_closest_marker("flower"):
            item.add_marker(pytest.mark.slow)
    # Slow tests first (order kept otherwise): pytest-xdist hands out groups with more tests first and the rest
    # in this order, so a long one-test group (the tutorial, a cluster launcher) does not start last.
    items[:] = sorted(items, key=lambda item: item.get_closest_marker("slow") is None)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """``--dist loadgroup`` groups by a suffix pytest-xdist appends to each grouped test's id; with a pytest
    it does not support the suffix is silently lost and the groups with it (pytest 9.2 + xdist 3.8)."""
    if session.config.getoption("loadgroup", default=False):
        lost = [i.nodeid for i in session.items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
        if lost:
            raise pytest.UsageError(f"pytest-xdist did not group {lost[0]} (and {len(lost) - 1} more): this pytest "
                                    "and pytest-xdist do not work together; see pyproject.toml's dev extra")


#: (overrides, the ConfigStore's entries) -> (the composed config, those entries, kept alive so their ids stay theirs)
_COMPOSED: dict[tuple, tuple[DictConfig, list[Any]]] = {}


def _store_entries() -> list[tuple[str, Any]]:
    """Every ConfigStore entry with its path: a plug-in registered or dropped since changes the list."""
    out, todo = [], [("", ConfigStore.instance().repo)]
    while todo:
        path, node = todo.pop()
        for key, value in node.items():
            if isinstance(value, dict):
                todo.append((f"{path}{key}/", value))
            else:
                out.append((f"{path}{key}", value))
    return sorted(out, key=lambda entry: entry[0])


def slot_mask(fm) -> torch.Tensor:
    """True where a tensor of the FlatModel ``fm`` lives in its flat vector, False in the alignment padding."""
    used = torch.zeros(len(fm), dtype=torch.bool)
    for s in fm.slots:
        used[s.offset : s.offset + s.numel] = True
    return used


@contextlib.contextmanager
def short_tmp(prefix: str = "flr") -> Iterator[str]:
    """A new folder under /tmp for a Ray of a test's own (``RAY_TMPDIR``), removed afterwards: short, since
    Ray's socket paths live under it and a Unix socket path holds at most 107 bytes (pytest's tmp_path is
    longer)."""
    tmp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def interruptible() -> None:
    """``preexec_fn`` of a child a test stops with SIGINT (Ctrl-C): SIGINT at its default and unblocked
    in it. A child inherits its parent's SIGINT disposition and mask, and a pytest worker that has hosted
    Ray or joblib may pass SIGINT ignored or blocked (as a shell does to a background job: there Python
    installs no KeyboardInterrupt handler), where a terminal's Ctrl-C reaches a foreground run at the
    default."""
    import signal

    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def compose_config(*overrides: str) -> DictConfig:
    """The config ``python -m fl_platform.run <overrides>`` would run (progress bar off).

    A test process composes the same overrides again and again (a third of its composes, ~0.15 s of CPU
    each); each is composed once per state of the ConfigStore and every call gets its own deep copy."""
    entries = _store_entries()
    key = (overrides, tuple((path, id(node)) for path, node in entries))
    if key not in _COMPOSED:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=["logger.progress=false", *overrides])
        _COMPOSED[key] = cfg, [node for _, node in entries]
    return copy.deepcopy(_COMPOSED[key][0])


@pytest.fixture(autouse=True)
def _bare_data_root(request, monkeypatch, tmp_path_factory):
    """Every test not marked ``shared_data`` sees an empty data root, as on a clone with no ``../shared``
    beside it: one that reads the shared files without saying so fails here, in every run, instead of
    only on a bare clone. Marked tests read the real root and skip through ``shared_dir`` when a file
    is missing (tests/test_bare_clone.py runs them against an empty root)."""
    if request.node.get_closest_marker("shared_data") is None:
        empty = tmp_path_factory.getbasetemp() / "empty-data-root"
        empty.mkdir(exist_ok=True)
        monkeypatch.setenv(ENV_VAR, str(empty))


@pytest.fixture(autouse=True)
def _private_flwr_home(monkeypatch, tmp_path_factory):
    """In-process Flower nodes keep their node cache under ``$FLWR_HOME`` (fl_platform/flower/node_cache.py):
    the session's temporary folder, never the user's ~/.flwr."""
    monkeypatch.setenv("FLWR_HOME", str(tmp_path_factory.getbasetemp() / "flwr-home"))


def shared_dir(name: str, *files: str) -> Path:
    """The folder ``name`` of the shared offline data (through ``data_root``, so ``$FL_DATA_ROOT`` works)
    holding ``files``, or skip the test naming what is missing. For tests marked ``shared_data``."""
    folder = data_root() / name
    missing = [f for f in files if not (folder / f).exists()] if folder.is_dir() else [""]
    if missing:
        pytest.skip(f"shared data {folder / missing[0]} not present (a clone without ../shared/data)")
    return folder


@pytest.fixture
def one_torch_thread():
    """One torch intra-op thread for the test, restored after: tiny models run faster and steadier with
    one, and references computed with it share the workers' kernels and rounding. Modules that want it
    for every test say ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def make_config():
    return compose_config


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray instance for the whole test session (2 CPUs, no dashboard), reused.

    Never shut down here or in tests: other tests and RayEngine reuse the running instance.
    """
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
            ignore_reinit_error=True,
        )
    return ray
