#!/usr/bin/env python
"""GPU smoke test: every GPU path of the engine once, one line per check (run by scripts/gpu_smoke.sh).

Needs a CUDA device; nothing else (the data is CIFAR-shaped synthetic images written in CIFAR-10's
own file format into a temporary data root, read by the real loader). Under 5 minutes on one GPU.

    python scripts/gpu_smoke.py            # all checks
    python scripts/gpu_smoke.py --list     # the checks, without running them (works without a GPU)

Checks: inline ResNet-18; Ray with 1 and 2 workers per GPU (fractional shares, the results equal
inline's within GPU float tolerance); vectorised cohorts with ``engine.cohort_size=auto`` (the
budget from the worker's own GPU share); SCAFFOLD with distributed client state on Ray; a
checkpoint written on the GPU run and resumed; where each run evaluated (the driver's device); the
training loop's steps free of host synchronisation (``torch.cuda.set_sync_debug_mode``), plain and
vectorised; ``train.precision=bf16`` with ``train.channels_last`` and ``train.compile``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray binds 127.0.0.1

sys.path.insert(0, str(REPO / "scripts" / "bench"))
from common import compose, write_cifar_like  # noqa: E402


def run(overrides: list[str], run_dir: Path | None = None):
    from fl_platform.experiment import build

    exp = build(compose(*overrides), run_dir)
    t0 = time.perf_counter()
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    return exp, time.perf_counter() - t0


def base(root: Path, *extra: str) -> list[str]:
    return ["dataset=cifar10", f"dataset.root={root}", "model=resnet18", "model.width=16", "num_clients=8",
            "clients_per_round=4", "rounds=2", "train.steps=2", "train.batch_size=32", "eval_batch_size=500",
            *extra]


def checks(root: Path, gpus: int) -> list[tuple[str, Callable[[], str]]]:
    import torch

    out: list[tuple[str, Callable[[], str]]] = []
    state: dict = {}

    def inline() -> str:
        exp, secs = run(base(root, "engine=inline"))
        state["inline"] = exp.simulation.server.weights.clone()
        acc = exp.simulation.history[-1]["test_accuracy"]
        return f"ResNet-18 (width 16) 2 rounds in {secs:.1f} s, acc {acc:.3f}, eval on {exp.simulation.eval_model.device}"

    def ray(per_gpu: int) -> Callable[[], str]:
        def check() -> str:
            workers = per_gpu * gpus
            exp, secs = run(base(root, "engine=ray", f"engine.num_workers={workers}"))
            diff = float((exp.simulation.server.weights - state["inline"]).abs().max())
            if not diff < 1e-3:
                raise AssertionError(f"weights differ from inline by {diff:.2e} (> 1e-3)")
            rows = exp.engine.describe_workers()  # where Ray put each worker (its ray.get_gpu_ids()) and what it trains on
            if any(not r["device"].startswith("cuda") for r in rows):
                raise AssertionError(f"a worker does not train on CUDA: {[(r['worker'], r['device']) for r in rows]}")
            load = Counter((r["node"], ",".join(r["gpu_ids"])) for r in rows)
            if len(load) != min(workers, gpus) or max(load.values()) - min(load.values()) > 1:
                raise AssertionError(f"workers per GPU not even over the {gpus} GPUs: {dict(load)}")
            share = min(r["gpu_share"] for r in rows)
            busy = exp.simulation.history[-1]["worker_busy_frac"]  # (the last round evaluates: counted in)
            return (f"{workers} workers ({share:g} GPU each, GPUs {sorted(load)}) in {secs:.1f} s, max |w - inline| = "
                    f"{diff:.1e}, eval on {exp.simulation.eval_model.device}, worker_busy_frac {busy:.2f}")
        return check

    def cohort_auto() -> str:
        overrides = ["dataset=cifar10", f"dataset.root={root}", "model=cnn", "num_clients=40", "clients_per_round=20",
                     "rounds=2", "train.steps=2", "train.batch_size=16"]
        ref, _ = run([*overrides, "engine=inline"])
        exp, secs = run([*overrides, "engine=ray", f"engine.num_workers={gpus}", "engine.cohort_size=auto"])
        diff = float((exp.simulation.server.weights - ref.simulation.server.weights).abs().max())
        if not diff < 1e-3:
            raise AssertionError(f"vectorised weights differ from sequential by {diff:.2e}")
        return f"CNN, 20 clients/round vectorised in {secs:.1f} s, max |w - sequential| = {diff:.1e}"

    def scaffold() -> str:
        workers = max(2, gpus)
        overrides = base(root, "algorithm=scaffold", "rounds=3", "engine=ray", f"engine.num_workers={workers}",
                         "engine.state_store=distributed")
        exp, secs = run(overrides)
        ref, _ = run(base(root, "algorithm=scaffold", "rounds=3", "engine=inline"))
        diff = float((exp.simulation.server.weights - ref.simulation.server.weights).abs().max())
        if not diff < 1e-3:
            raise AssertionError(f"SCAFFOLD on Ray differs from inline by {diff:.2e}")
        return f"{workers} workers, distributed state, 3 rounds in {secs:.1f} s, max |w - inline| = {diff:.1e}"

    def resume() -> str:
        from fl_platform.experiment import run_experiment

        with tempfile.TemporaryDirectory() as tmp:
            overrides = base(root, "algorithm=scaffold", "rounds=3", "checkpoint_every=1", "engine=ray",
                             f"engine.num_workers={gpus}", "engine.state_store=disk")
            whole = run_experiment(compose(*overrides), Path(tmp) / "a")
            run_experiment(compose(*[o for o in overrides if not o.startswith("rounds=")], "rounds=2"), Path(tmp) / "b")
            resumed = run_experiment(compose(*overrides), Path(tmp) / "b")
            if resumed["final_test_accuracy"] != whole["final_test_accuracy"]:
                raise AssertionError(f"resumed {resumed['final_test_accuracy']} != {whole['final_test_accuracy']}")
        return "checkpoint after round 2 on GPU, resumed to round 3: same final accuracy"

    def sync_free() -> str:
        """The loop's steps under torch.cuda.set_sync_debug_mode: a fit of 3 epochs makes no more
        synchronising calls than one of 1 epoch (the per-fit metric reads after the last step are the
        only ones), plain loop (ResNet-18, bf16, channels-last) and vectorised cohort (CNN)."""
        import warnings

        from fl_platform.models import build_model
        from fl_platform.training.flat import FlatModel
        from fl_platform.training.loop import ClientData, LocalTrainer, TrainConfig
        from fl_platform.training.vectorised import CohortMember, CohortTrainer

        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (cpu: --cpu checks the script)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(400, 3, 32, 32, generator=g).to(dev)
        y = torch.randint(0, 10, (400,), generator=g).to(dev)
        datas = [ClientData(x, y, torch.arange(i * 100, i * 100 + n, device=dev))
                 for i, n in enumerate((100, 37, 64, 90))]

        def syncs(fit: Callable[[], object]) -> int:
            if dev.type != "cuda":
                fit()
                return 0
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    fit()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            return sum("synchroniz" in str(w.message) for w in caught)

        def counts(name: str, cohort: bool, **train) -> list[int]:
            out = []
            for epochs in (1, 3):
                torch.manual_seed(0)
                options = {"width": 16} if name == "resnet18" else {}
                fm = FlatModel(build_model(name, (3, 32, 32), 10, **options), dev)
                cfg = TrainConfig(epochs=epochs, batch_size=16, lr=0.05, **train)
                if cohort:
                    trainer = CohortTrainer(fm, cfg)
                    trainer.unsupported_reason(x, y)  # the one-off probe, outside the count
                    members = [CohortMember(c, d, fm.vector.detach().clone()) for c, d in enumerate(datas)]
                    out.append(syncs(lambda t=trainer, m=members: t.fit(m, seed=0, round=0)))
                else:
                    trainer = LocalTrainer(fm, cfg)
                    out.append(syncs(lambda t=trainer: t.fit(datas[0], seed=0, round=0, client=0)))
            if out[0] != out[1]:
                raise AssertionError(f"{name}: synchronising calls grow with the steps: {out[0]} (1 epoch), "
                                     f"{out[1]} (3 epochs)")
            return out

        plain = counts("resnet18", False, precision="bf16", channels_last=True)
        cohort = counts("cnn", True, precision="bf16")
        return f"per fit, 1 and 3 epochs: plain loop {plain}, vectorised {cohort} synchronising calls"

    def step_options() -> str:
        exp, secs = run(base(root, "engine=inline", "train.precision=bf16", "train.channels_last=true"))
        acc = exp.simulation.history[-1]["test_accuracy"]
        diff = float((exp.simulation.server.weights - state["inline"]).abs().max())
        if not (acc == acc and diff < 0.5):
            raise AssertionError(f"bf16 + channels_last: accuracy {acc}, max |w - fp32| = {diff:.2e}")
        _, secs2 = run(["dataset=cifar10", f"dataset.root={root}", "model=cnn", "num_clients=8", "clients_per_round=4",
                        "rounds=2", "train.steps=2", "train.batch_size=32", "engine=inline", "train.compile=true"])
        return (f"ResNet-18 bf16 + channels_last 2 rounds in {secs:.1f} s (acc {acc:.3f}, max |w - fp32| = "
                f"{diff:.1e}); CNN with train.compile=true in {secs2:.1f} s (compile included)")

    out.append(("cuda", lambda: f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"))
    out.append(("inline-resnet18", inline))
    out.append(("sync-free-loop", sync_free))
    out.append(("bf16-channels-last-compile", step_options))
    out.append(("ray-1-worker-per-gpu", ray(1)))
    out.append(("ray-2-workers-per-gpu", ray(2)))
    out.append(("cohort-size-auto", cohort_auto))
    out.append(("scaffold-distributed-state", scaffold))
    out.append(("checkpoint-resume", resume))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print the checks and exit")
    ap.add_argument("--cpu", action="store_true", help="run the checks on the CPU (checks the script itself)")
    args = ap.parse_args(argv)
    if args.list:
        with tempfile.TemporaryDirectory() as tmp:
            for name, _ in checks(Path(tmp), 1):
                print(name)
        return 0
    import torch

    if not torch.cuda.is_available() and not args.cpu:
        print("FAIL cuda: no CUDA device visible (torch.cuda.is_available() is False)")
        return 1
    failed = 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        write_cifar_like(Path(tmp))
        for name, check in checks(Path(tmp), max(1, torch.cuda.device_count())):
            if args.cpu and name == "cuda":
                continue
            try:
                print(f"PASS {name}: {check()}", flush=True)
            except Exception as err:  # one line per check; the traceback goes to stderr
                failed += 1
                print(f"FAIL {name}: {type(err).__name__}: {err}", flush=True)
                traceback.print_exc(file=sys.stderr)
    print(f"{'all checks passed' if not failed else f'{failed} check(s) failed'} in {time.perf_counter() - t0:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
