"""Entry points: the per-rank worker (``python -m fl_platform.ssgd``) and ``fl-ssgd``, which wraps torchrun.

Every rank composes the config from the same overrides before joining the process group, so a
bad override fails on every rank at once with the same message (printed by rank 0) instead of
leaving the others waiting in a collective. The last line rank 0 prints is ``run_dir: <path>``.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading

USAGE = """usage: torchrun --nproc_per_node=N -m fl_platform.ssgd [key=value ...]
       fl-ssgd [--nproc-per-node N] [key=value ...]

Overrides use Hydra syntax over conf/ssgd.yaml, e.g.
  compressor=powersgd compressor.rank=2 model=cnn train.epochs=5 ssgd.sync=local ssgd.period=8
--cfg prints the composed config and exits."""

ERRORS = (ValueError, TypeError, KeyError, FileNotFoundError, RuntimeError, FloatingPointError)


def _is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _fail(err: BaseException) -> int:
    if _is_main():
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
    return 1


def run_worker(argv: list[str] | None = None) -> int:
    """One rank's run: compose the config, join the group, train, leave the group."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        return 0
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from fl_platform.ssgd.config import compose_ssgd_config

    show = "--cfg" in args
    try:
        cfg = compose_ssgd_config([a for a in args if a != "--cfg"])
    except (HydraException, OmegaConfBaseException, *ERRORS) as err:
        return _fail(err)
    if show:
        if _is_main():
            print(cfg.to_yaml())
        return 0
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    from fl_platform.ssgd.distributed import init_distributed, shutdown
    from fl_platform.ssgd.trainer import SSGDTrainer

    s = cfg.ssgd
    try:
        ctx = init_distributed(s.backend, s.device, s.timeout_s)
    except ERRORS as err:
        return _fail(err)
    ok = False
    try:
        trainer = SSGDTrainer(cfg, ctx)
        summary = trainer.run()
        ok = True
    except ERRORS as err:
        if logging.getLogger().isEnabledFor(logging.DEBUG):
            raise
        print(f"error (rank {ctx.rank}): {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return 1
    finally:
        shutdown(barrier=ok)
    if ctx.is_main and trainer.run_dir is not None:
        acc = summary.get("final_test_accuracy")
        shown = "not evaluated" if acc is None else f"{acc:.4f}"
        print(f"final test accuracy: {shown} after {summary['steps']} steps ({summary['epochs']:.2f} epochs) "
              f"on {ctx.world_size} workers, {summary['sync']}, {summary['steps_per_s']:.1f} steps/s", flush=True)
        print(f"run_dir: {trainer.run_dir.path}", flush=True)
    return 0


def torchrun_command(nproc: int, args: list[str], target: tuple[str, ...] = ("-m", "fl_platform.ssgd")) -> list[str]:
    """torchrun for ``nproc`` workers on this host: like ``--standalone`` (c10d rendezvous on a port the
    OS picks, so two launches never race for one), with the workers reaching it on the loopback address.
    The stores torchrun serves (the rendezvous's and the agent's TCPStore) still listen on every
    interface, whatever host they are given (seen with ``ss -ltnp``: ``*:<port>``)."""
    import uuid

    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--nnodes=1",
            "--rdzv-backend=c10d", "--rdzv-endpoint=127.0.0.1:0", f"--rdzv-id={uuid.uuid4().hex[:12]}",
            *target, *args]


def main(argv: list[str] | None = None) -> int:
    """``fl-ssgd``: start ``--nproc-per-node`` workers on this host with torchrun (or run in place under torchrun)."""
    parser = argparse.ArgumentParser(prog="fl-ssgd", usage=USAGE, add_help=False)
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=None)
    parser.add_argument("-h", "--help", action="store_true")
    known, overrides = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.help:
        print(USAGE)
        return 0
    if "LOCAL_RANK" in os.environ:  # already a torchrun worker
        return run_worker(overrides)
    nproc = known.nproc_per_node or 1
    if nproc < 1:
        print(f"error: --nproc-per-node must be >= 1, got {nproc}", file=sys.stderr)
        return 2
    return run_torchrun(torchrun_command(nproc, overrides))


def run_torchrun(cmd: list[str], grace_s: float = 60.0) -> int:
    """Run torchrun and wait for it. Interrupted (Ctrl-C, SIGTERM), stop it with SIGTERM and wait up
    to ``grace_s``: torchrun then stops its workers (SIGTERM, SIGKILL after 30 s). It starts each worker
    in a session of its own, so killing torchrun outright (what ``subprocess.call`` does) leaves the
    workers running, orphaned, for the rest of their run. Only if it has not ended by then is it killed."""
    proc = subprocess.Popen(cmd)

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    main_thread = threading.current_thread() is threading.main_thread()  # where handlers can be set
    previous = signal.signal(signal.SIGTERM, terminate) if main_thread else None
    try:
        return proc.wait()
    except BaseException:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        raise
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    raise SystemExit(main())
