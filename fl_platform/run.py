"""Command line: ``python -m fl_platform.run key=value ...`` (or the ``fl-run`` console script).

One experiment per call; ``-m`` runs a Hydra sweep, one run directory per job. The last line
printed is ``run_dir: <path>``; a failed run exits non-zero with the reason on stderr (in a sweep,
a failed job is recorded as failed and the other jobs run: docs/sweeps.md). Hydra
composes the config and picks the run directory; the run itself is ``fl_platform.api.run_config``,
what ``fl_platform.api.run`` calls from Python.
"""

from __future__ import annotations

import importlib
import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.plugins import Plugins
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig

from fl_platform import REPO_ROOT
from fl_platform.config import register_configs

log = logging.getLogger("fl_platform")

register_configs()
# hydra/launcher=ray_cluster. Hydra finds plugins by scanning the ``hydra_plugins`` package's folders,
# which an editable install of fl_platform does not expose; registering it here always works.
Plugins.instance().register(importlib.import_module("hydra_plugins.fl_platform_launcher.ray_cluster").RayClusterLauncher)


class JobFailed(CompactHydraException):
    """A sweep's job that failed. Hydra records it as failed and goes on with the other jobs (an exit
    would end the whole sweep); the sweep then exits non-zero with this message, without a traceback.
    ``reason``: the run's error, for a launcher's own report (ray_cluster)."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


def _fail(err: BaseException) -> None:
    reason = f"{type(err).__name__}: {err}"
    print(f"error: {reason}", file=sys.stderr, flush=True)
    if logging.getLogger().isEnabledFor(logging.DEBUG):
        raise err
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN:
        raise JobFailed(f"error: job #{hc.job.num} ({' '.join(hc.overrides.task)}) failed: {reason}", reason) from None
    sys.exit(1)


# conf/ by its absolute path (as config.compose): a relative one is resolved against the calling file under
# ``python -m`` but as a Python package ('conf', which does not exist) under the fl-run console script.
@hydra.main(version_base="1.3", config_path=str(REPO_ROOT / "conf"), config_name="config")
def main(cfg: DictConfig) -> float | None:
    from fl_platform.api import run_config
    from fl_platform.gpu_slots import pin_joblib_worker

    pin_joblib_worker(HydraConfig.get())  # hydra/launcher=joblib: one GPU per worker process, before CUDA starts
    run_dir = HydraConfig.get().runtime.output_dir
    try:
        summary = run_config(cfg, run_dir).summary
    except (ValueError, TypeError, KeyError, FileNotFoundError, RuntimeError, FloatingPointError) as err:
        _fail(err)
        return None
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback through the training loop; a sweep stops too
        again = ("rerun the same command to continue after the last checkpoint" if cfg.checkpoint_every > 0
                 else "no checkpoint was kept (checkpoint_every=0): a rerun starts over")
        print(f"error: interrupted; {again} (run dir {run_dir})", file=sys.stderr, flush=True)
        sys.exit(130)
    acc = summary.get("final_test_accuracy")
    best = summary.get("best_test_accuracy")
    result = f"final test accuracy: {acc:.4f} (best {best:.4f})" if acc is not None else "no evaluation"
    print(f"{result} after {summary['rounds']} rounds in {summary['wall_time_s']:.1f} s", flush=True)
    print(f"run_dir: {run_dir}", flush=True)
    return acc


if __name__ == "__main__":
    main()
