"""Shared fixtures: compose run configs in-process exactly as the CLI does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from fl_platform.config import register_configs

# Every Ray process of the tests (Ray started here, by RayEngine, by Flower's simulation, or in a
# subprocess, which inherits this environment) binds 127.0.0.1, never the machine's network address.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"

register_configs()


def compose_config(*overrides: str) -> DictConfig:
    """The config ``python -m fl_platform.run <overrides>`` would run (progress bar off)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=["logger.progress=false", *overrides])


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
