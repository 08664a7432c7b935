"""One GPU per parallel job slot, for sweeps that run several experiments at once on one machine.

Without this every parallel job sees every GPU and trains on GPU 0 (``engine.device=auto`` picks
``cuda:0``), so ``--jobs 4`` on 4 GPUs stacks four runs on one device. Each slot gets one GPU id,
slots dealt round-robin over the visible GPUs (more slots than GPUs: some GPUs take two), and a job
sees only its slot's GPU through ``CUDA_VISIBLE_DEVICES``, set before CUDA is initialised:

* ``scripts/results_*.py --jobs N``: the driver hands each job a free slot (``run_jobs``);
* ``hydra/launcher=joblib``: the jobs run in ``n_jobs`` long-lived worker processes, and CUDA, once
  initialised in a process, cannot change device list; so each worker process claims a free slot for
  its lifetime (an exclusive ``flock`` on ``<sweep dir>/.gpu_slots/slot-<k>``, released by the OS when
  the process ends) at its first job (:func:`pin_joblib_worker`).
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("fl_platform")

_NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
_claimed: tuple[int, str, Any] | None = None  # this process's (slot, GPU id, open lock file), kept for its life


def visible_gpus(environ: dict[str, str] | os._Environ[str] | None = None) -> list[str]:
    """GPU ids this process may hand out: ``CUDA_VISIBLE_DEVICES``'s entries when set, else one per
    device the NVIDIA driver lists (read without initialising CUDA, which would fix the device list)."""
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip() and g.strip() != "-1"]
    try:
        return [str(i) for i in range(len(list(_NVIDIA_GPUS.iterdir())))]
    except OSError:
        return []


def slot_gpu(slot: int, gpus: list[str]) -> str:
    """The GPU id of job slot ``slot`` (round-robin over ``gpus``)."""
    return gpus[slot % len(gpus)]


def pin_joblib_worker(hydra_cfg: Any) -> str | None:
    """Under ``hydra/launcher=joblib`` with more than one visible GPU: this worker process's GPU id, set
    in ``CUDA_VISIBLE_DEVICES`` (claimed at its first job, the same for its later jobs). None elsewhere."""
    global _claimed
    launcher = str(hydra_cfg.launcher.get("_target_", "")) if hydra_cfg.get("launcher") else ""
    if not launcher.endswith("JoblibLauncher"):
        return None
    from joblib import effective_n_jobs

    slots = max(1, effective_n_jobs(int(hydra_cfg.launcher.get("n_jobs", -1))))
    if _claimed is None:
        gpus = visible_gpus()
        if len(gpus) < 2:
            return None  # nothing to spread (no GPU, or one)
        _claimed = _claim(Path(str(hydra_cfg.sweep.dir)) / ".gpu_slots", slots, gpus)
    os.environ["CUDA_VISIBLE_DEVICES"] = _claimed[1]
    log.info("joblib worker %d: GPU slot %d of %d, CUDA_VISIBLE_DEVICES=%s", os.getpid(), _claimed[0], slots,
             _claimed[1])
    return _claimed[1]


def _claim(folder: Path, slots: int, gpus: list[str]) -> tuple[int, str, Any]:
    """The first free slot under ``folder``, claimed for this process's life: (slot, GPU id, lock file)."""
    folder.mkdir(parents=True, exist_ok=True)
    for slot in range(slots):
        handle = open(folder / f"slot-{slot}", "a+")  # noqa: SIM115 (held open for the process's life)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        return slot, slot_gpu(slot, gpus), handle
    slot = os.getpid() % slots  # more live worker processes than slots (joblib replaced one still exiting)
    log.warning("joblib worker %d: every GPU slot of %s is held; sharing slot %d", os.getpid(), folder, slot)
    return slot, slot_gpu(slot, gpus), None
