#!/usr/bin/env python
"""GPU smoke test: every GPU path of the engine once, one PASS/FAIL line per check (run by scripts/gpu_smoke.sh).

Needs a CUDA device; nothing else (the data is CIFAR-shaped synthetic images written in CIFAR-10's
own file format into a temporary data root, read by the real loader). Under 5 minutes on one GPU
(the ``time-budget`` check fails beyond that). Exit code 0 only when every check passed; a failed
check prints ``FAIL <name>: <why>`` (its traceback on stderr) and the run goes on to the next one.

    python scripts/gpu_smoke.py                  # all checks, on the GPUs this process sees
    python scripts/gpu_smoke.py --only deterministic,checkpoint-resume
    python scripts/gpu_smoke.py --list           # the checks, without running them
    python scripts/gpu_smoke.py --cpu-dry-run    # the same checks' code on this CPU (see below)

Checks (docs/engine.md, GPUs): ``cuda`` (CUDA visible); ``inline-resnet18`` (ResNet-18 trains on
CUDA inline and evaluates there); ``sync-free-loop`` (the training loop's steps free of host
synchronisation, ``torch.cuda.set_sync_debug_mode``: after a warm-up fit, a fit of 3 epochs makes the
synchronising calls of a fit of 1, plain loop and vectorised cohort); ``bf16`` (``train.precision=bf16``: the forward
pass really runs in bfloat16, and a run with ``train.channels_last`` trains, finite and different
from fp32; ``train.compile`` on the CNN); ``ray-1-worker-per-gpu`` and ``ray-2-workers-per-gpu``
(CUDA in every worker, one GPU id per worker, every GPU used and the workers spread evenly over the
distinct GPU ids, the driver's evaluation on a GPU, equal to inline within GPU float tolerance,
``worker_busy_frac`` printed); ``gpu-less-worker`` (``engine.device=auto`` workers of a Ray that declares
no GPUs train on the CPU although CUDA is visible to them: a child process, Ray's CUDA_VISIBLE_DEVICES
override for GPU-less actors off); ``worker-eval`` (``engine.eval_device=worker``: worker 0 evaluates
on its GPU, the row equal to the driver's evaluation); ``cohort-size-auto`` (vectorised cohorts sized from the worker's GPU
share, CNN); ``vmap-batchnorm`` (ResNet-18 with BatchNorm trained as a vmapped cohort on CUDA,
the cohort path really taken, equal to one-by-one training within tolerance); ``scaffold-
distributed-state``; ``deterministic`` (``engine.deterministic=true`` on Ray: two runs
bit-identical); ``checkpoint-resume`` (SCAFFOLD with disk state on Ray, deterministic,
checkpointed every round: a run interrupted after round 2 and resumed ends bit-identical to the
uninterrupted run of 3 rounds);
``time-budget`` (all of it within 5 minutes).

``--cpu-dry-run`` runs the same code on this CPU, so that the script is known to work before a GPU
is lent: Ray is started with ``--declared-gpus`` GPUs (default 2) that do not exist; the Ray runs
train with ``engine.device=cpu`` and their checks expect CPU workers without GPU ids; one more check,
``fail-loud``, expects the default ``engine.device=auto`` to stop such a run (a worker given a GPU
without CUDA); ``sync-free-loop`` counts synchronising calls with the ``TorchFunctionMode`` of
tests/test_sync_free.py instead of CUDA's sync debug mode. A dry run proves the script, not the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray binds 127.0.0.1

sys.path.insert(0, str(REPO / "scripts" / "bench"))
from common import compose, write_cifar_like  # noqa: E402

BUDGET_S = 300.0  # issue 25: under 5 minutes on one GPU
TOLERANCE = 1e-3  # max |w - w_ref| between runs that differ only in float summation order (GPU kernels)
# Comparisons train ResNet-18 one local step per round, one round: its training is chaotic (on the
# smoke's data a 1e-7 change of the weights grows to 4e-3 in 2 SGD steps at lr 0.05, measured on the
# CPU), so runs that differ only in their GPU kernels' rounding agree within TOLERANCE only then.


class CheckFailed(AssertionError):
    """A check's condition does not hold (its message says which and by how much)."""


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


@dataclass
class Target:
    """Where the checks run: real GPUs, or (dry run) this CPU with GPUs declared to Ray."""

    dry: bool
    gpus: int  # CUDA devices, or the GPUs declared to Ray in a dry run
    root: Path  # the data root (CIFAR-shaped synthetic images)
    results: dict[str, Any] = field(default_factory=dict)  # what later checks compare with
    busy: dict[str, float] = field(default_factory=dict)  # worker_busy_frac per Ray check

    @property
    def device(self) -> str:
        return "cpu" if self.dry else "cuda"

    @property
    def ray_device(self) -> list[str]:
        """Ray runs train on the CPU in a dry run (the default ``auto`` would stop: see ``fail-loud``)."""
        return ["engine.device=cpu"] if self.dry else []

    def needs(self, key: str, check: str) -> Any:
        expect(key in self.results, f"needs the result of {check}, which did not pass")
        return self.results[key]


def run(overrides: list[str], run_dir: Path | None = None):
    from fl_platform.experiment import build

    exp = build(compose(*overrides), run_dir)
    t0 = time.perf_counter()
    try:
        exp.simulation.run()
    finally:
        exp.engine.close()
    return exp, time.perf_counter() - t0


def max_diff(a, b) -> float:
    return float((a - b).abs().max())


def base(t: Target, *extra: str) -> list[str]:
    return ["dataset=cifar10", f"dataset.root={t.root}", "model=resnet18", "model.width=16", "num_clients=8",
            "clients_per_round=4", "rounds=1", "train.steps=1", "train.batch_size=32", "eval_batch_size=500",
            "save_model=false", *extra]


def cnn(t: Target, *extra: str) -> list[str]:
    return ["dataset=cifar10", f"dataset.root={t.root}", "model=cnn", "num_clients=40", "clients_per_round=20",
            "rounds=2", "train.steps=2", "train.batch_size=16", "save_model=false", *extra]


def check_eval(exp, t: Target) -> str:
    """The driver evaluated on the target's device (a GPU of its node under Ray) and timed it."""
    dev = exp.simulation.eval_model.device
    expect(dev.type == t.device, f"the driver evaluated on {dev}, not on {t.device}")
    row = exp.simulation.history[-1]
    expect("test_accuracy" in row and row["test_accuracy"] == row["test_accuracy"],
           f"no finite test_accuracy in the last row: {row.get('test_accuracy')}")
    expect("eval_time_s" in row, "the evaluated row has no eval_time_s column")
    return str(dev)


def check_workers(rows: list[dict], t: Target, workers: int) -> str:
    """CUDA in every worker; each holds one GPU id; every GPU used, the workers spread evenly over the
    distinct (node, GPU id) pairs. Dry run: every worker on the CPU, none holding a GPU."""
    expect(len(rows) == workers, f"{len(rows)} workers described, {workers} asked for")
    devices = [(r["worker"], r["device"]) for r in rows]
    expect(all(r["device"].startswith(t.device) for r in rows), f"a worker does not train on {t.device}: {devices}")
    if t.dry:
        expect(all(not r["gpu_ids"] for r in rows), f"a CPU worker holds GPU ids: {[r['gpu_ids'] for r in rows]}")
        return f"all {workers} on cpu, no GPU ids"
    expect(all(len(r["gpu_ids"]) == 1 for r in rows), f"a worker holds not exactly one GPU id: "
                                                       f"{[(r['worker'], r['gpu_ids']) for r in rows]}")
    load = Counter((r["node"], r["gpu_ids"][0]) for r in rows)
    expect(len(load) == min(workers, t.gpus), f"{len(load)} distinct GPUs used by {workers} workers on {t.gpus} "
                                              f"GPUs: {dict(load)}")
    expect(max(load.values()) - min(load.values()) <= 1, f"workers per GPU not even: {dict(load)}")
    # Two workers on one GPU id must be on one physical device: the CUDA device each reports is its
    # visible device 0 (Ray sets CUDA_VISIBLE_DEVICES to its ids), so the ids are what tells them apart.
    return f"{len(load)} distinct GPU ids {sorted(g for _, g in load)}, {dict(Counter(load.values()))} loads"


def gpu_less_workers(root: str) -> dict:
    """(Run by ``gpu-less-worker`` in a child process, with RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0.) A
    Ray instance of its own that declares no GPUs: what a GPU-less Ray task sees of CUDA, and the
    device and GPU ids of two ``engine.device=auto`` workers of a one-round CNN run."""
    import ray

    ray.init(address="local", num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote(num_gpus=0)
        def sees() -> dict:
            import torch

            return {"cuda": torch.cuda.is_available(), "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}

        seen = ray.get(sees.remote(), timeout=120)
        with tempfile.TemporaryDirectory() as tmp:
            run(cnn(Target(False, 0, Path(root)), "engine=ray", "engine.num_workers=2", "rounds=1"), Path(tmp))
            workers = json.loads((Path(tmp) / "run.json").read_text())["workers"]
        return {"seen": seen, "workers": [[w["device"], w["gpu_ids"]] for w in workers]}
    finally:
        ray.shutdown()


def checks(t: Target) -> list[tuple[str, Callable[[], str]]]:
    import torch

    out: list[tuple[str, Callable[[], str]]] = []

    def cuda() -> str:
        if t.dry:
            expect(not torch.cuda.is_available(), "--cpu-dry-run on a machine with CUDA: run without it")
            return f"dry run: no CUDA, {t.gpus} GPUs declared to Ray, torch {torch.__version__}"
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        return (f"{torch.cuda.device_count()} x {', '.join(names)}, torch {torch.__version__}, "
                f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")

    def inline() -> str:
        exp, secs = run(base(t, "engine=inline"))
        t.results["inline"] = exp.simulation.server.weights.clone()
        rows = exp.engine.describe_workers()
        expect(all(r["device"].startswith(t.device) for r in rows),
               f"the inline worker trains on {[r['device'] for r in rows]}, not on {t.device}")
        where = check_eval(exp, t)
        acc = exp.simulation.history[-1]["test_accuracy"]
        return f"ResNet-18 (width 16) 1 round in {secs:.1f} s, acc {acc:.3f}, eval on {where}"

    def ray(per_gpu: int) -> Callable[[], str]:
        def check() -> str:
            workers = per_gpu * t.gpus
            ref = t.needs("inline", "inline-resnet18")
            exp, secs = run(base(t, "engine=ray", f"engine.num_workers={workers}", *t.ray_device))
            placed = check_workers(exp.engine.describe_workers(), t, workers)
            where = check_eval(exp, t)
            diff = max_diff(exp.simulation.server.weights, ref)
            expect(diff < TOLERANCE, f"weights differ from inline by {diff:.2e} (> {TOLERANCE})")
            if per_gpu == 1:
                t.results["ray-test-loss"] = exp.simulation.history[-1]["test_loss"]
            busy = exp.simulation.history[-1]["worker_busy_frac"]  # (the last round evaluates: counted in)
            expect(0.0 < busy <= 1.0, f"worker_busy_frac {busy} outside (0, 1]")
            t.busy[f"ray-{per_gpu}-per-gpu"] = busy
            return (f"{workers} workers ({placed}) in {secs:.1f} s, max |w - inline| = {diff:.1e}, eval on {where}, "
                    f"worker_busy_frac {busy:.3f}")
        return check

    def worker_eval() -> str:
        """engine.eval_device=worker (what auto does when the driver's node has no GPU): worker 0 evaluates
        on its device, and the row equals the driver's evaluation of ray-1-worker-per-gpu."""
        ref = t.needs("ray-test-loss", "ray-1-worker-per-gpu")
        exp, secs = run(base(t, "engine=ray", f"engine.num_workers={t.gpus}", "engine.eval_device=worker",
                             *t.ray_device))
        expect(exp.simulation.evaluator.where == "worker 0", f"evaluated on {exp.simulation.evaluator.where}")
        device = exp.engine.describe_workers()[0]["device"]
        expect(device.startswith(t.device), f"worker 0 evaluates on {device}, not on {t.device}")
        loss = exp.simulation.history[-1]["test_loss"]
        expect(abs(loss - ref) <= TOLERANCE * max(1.0, abs(ref)), f"test_loss {loss} on worker 0, {ref} on the driver")
        return f"worker 0 on {device} evaluated in {secs:.1f} s: test_loss {loss:.5f} (driver: {ref:.5f})"

    def fail_loud() -> str:
        """Dry run only: Ray gives each worker a declared GPU, and this CPU-only torch must stop the run."""
        try:
            run(base(t, "engine=ray", f"engine.num_workers={t.gpus}", "rounds=1", "engine.start_timeout_s=120"))
        except Exception as err:  # the engine's start-up error, whatever its class
            text = f"{type(err).__name__}: {err}"
            expect("Ray gave this worker GPU(s)" in text and "engine.device=cpu" in text,
                   f"stopped, but not with the fail-loud error: {text[:300]}")
            return "engine.device=auto with declared GPUs and no CUDA stops the run: " + text.splitlines()[0][:160]
        raise CheckFailed("a worker given a GPU by Ray trained without CUDA (engine.device=auto)")

    def cohort_auto() -> str:
        ref, _ = run(cnn(t, "engine=inline"))
        exp, secs = run(cnn(t, "engine=ray", f"engine.num_workers={t.gpus}", "engine.cohort_size=auto",
                            *t.ray_device))
        diff = max_diff(exp.simulation.server.weights, ref.simulation.server.weights)
        expect(diff < TOLERANCE, f"vectorised weights differ from sequential by {diff:.2e}")
        return f"CNN, 20 clients/round vectorised in {secs:.1f} s, max |w - sequential| = {diff:.1e}"

    def vmap_batchnorm() -> str:
        """ResNet-18 (BatchNorm) as vmapped cohorts on the device: the worker kept its cohort trainer (a
        fallback to one-by-one training drops it and logs why), and equals one-by-one training."""
        ref = t.needs("inline", "inline-resnet18")
        exp, secs = run(base(t, "engine=inline", "engine.cohort_size=4"))
        worker = exp.engine.workers[0]
        expect(worker.cohort is not None, "the cohort path fell back to one-by-one training (see its warning)")
        expect(worker.device.type == t.device, f"the cohort trained on {worker.device}")
        diff = max_diff(exp.simulation.server.weights, ref)
        expect(diff < TOLERANCE, f"vmapped ResNet-18 differs from one-by-one training by {diff:.2e}")
        return f"ResNet-18 with BatchNorm, 4 clients per vmapped chunk, in {secs:.1f} s, max |w - sequential| = {diff:.1e}"

    def scaffold() -> str:
        workers = max(2, t.gpus)
        # (the CNN: no BatchNorm, not chaotic over 3 rounds of 2 steps; the check is the state's path)
        exp, secs = run(cnn(t, "algorithm=scaffold", "rounds=3", "engine=ray", f"engine.num_workers={workers}",
                            "engine.state_store=distributed", *t.ray_device))
        ref, _ = run(cnn(t, "algorithm=scaffold", "rounds=3", "engine=inline"))
        diff = max_diff(exp.simulation.server.weights, ref.simulation.server.weights)
        expect(diff < TOLERANCE, f"SCAFFOLD on Ray differs from inline by {diff:.2e}")
        return f"CNN, {workers} workers, distributed state, 3 rounds in {secs:.1f} s, max |w - inline| = {diff:.1e}"

    def deterministic() -> str:
        """engine.deterministic=true on Ray: deterministic kernels in every worker (an operation without
        one stops the round), and two runs give the same bits."""
        overrides = base(t, "engine=ray", f"engine.num_workers={t.gpus}", "engine.deterministic=true", "rounds=2",
                         "train.steps=2", *t.ray_device)
        a, secs = run(overrides)
        b, _ = run(overrides)
        wa, wb = a.simulation.server.weights, b.simulation.server.weights
        expect(torch.equal(wa, wb), f"two deterministic runs differ by {max_diff(wa, wb):.2e}")
        return f"{t.gpus} workers, 2 runs of {secs:.1f} s: bit-identical weights"

    def resume() -> str:
        from fl_platform.experiment import build, execute

        sys.path.insert(0, str(REPO / "tests"))
        from interrupt import StopAfter  # the resume tests' Ctrl-C reporter (plain Python)

        with tempfile.TemporaryDirectory() as tmp:
            overrides = base(t, "algorithm=scaffold", "rounds=3", "train.steps=2", "checkpoint_every=1", "engine=ray",
                             f"engine.num_workers={t.gpus}", "engine.state_store=disk", "engine.deterministic=true",
                             *t.ray_device)
            whole = execute(compose(*overrides), Path(tmp) / "a")
            exp = build(compose(*overrides), Path(tmp) / "b", reporter=StopAfter(2))
            try:
                exp.simulation.run()
                raise CheckFailed("the run was not interrupted after round 2")
            except KeyboardInterrupt:
                pass
            finally:
                exp.engine.close()
            expect((Path(tmp) / "b" / "checkpoint" / "LATEST").exists(), "no checkpoint published by round 2")
            resumed = execute(compose(*overrides), Path(tmp) / "b")
            expect(len(resumed.history) == 3 and resumed.history[-1]["round"] == whole.history[-1]["round"],
                   f"the resumed run ends at round {resumed.history[-1].get('round')}, not 3")
            sw, sr = whole.model.state_dict(), resumed.model.state_dict()
            differ = [k for k in sw if not torch.equal(sw[k], sr[k])]
            expect(not differ, f"resumed model differs from the uninterrupted one in {len(differ)} tensors, "
                               f"e.g. {differ[:3]}")
            expect(resumed.summary["final_test_accuracy"] == whole.summary["final_test_accuracy"],
                   f"resumed accuracy {resumed.summary['final_test_accuracy']} != {whole.summary['final_test_accuracy']}")
        return "SCAFFOLD, disk state: interrupted after round 2, resumed to round 3: bit-identical model and accuracy"

    def sync_free() -> str:
        """A fit of 3 epochs makes no more synchronising calls than one of 1 epoch (the per-fit metric
        reads after the last step are the only ones), plain loop (ResNet-18, bf16, channels-last) and
        vectorised cohort (CNN). On CUDA counted by torch.cuda.set_sync_debug_mode("warn"); in a dry run
        by tests/test_sync_free.py's SyncCounter, which emulates the host/device split on the CPU."""
        import warnings

        from fl_platform.models import build_model
        from fl_platform.training.flat import FlatModel
        from fl_platform.training.loop import ClientData, LocalTrainer, TrainConfig
        from fl_platform.training.vectorised import CohortMember, CohortTrainer

        if t.dry:  # the test's CPU emulation of what would synchronise a GPU (needs pytest: a dev install)
            sys.path.insert(0, str(REPO / "tests"))
            from test_sync_free import SyncCounter

        dev = torch.device(t.device)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(400, 3, 32, 32, generator=g).to(dev)
        y = torch.randint(0, 10, (400,), generator=g).to(dev)
        datas = [ClientData(x, y, torch.arange(i * 100, i * 100 + n, device=dev))
                 for i, n in enumerate((100, 37, 64, 90))]

        def syncs(fit: Callable[[], object]) -> int:
            if t.dry:
                with SyncCounter() as counter:
                    fit()
                return sum(counter.events.values())
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
            """Synchronising calls of a fit of 1 and of 3 epochs, after an uncounted fit of 1: the
            process's first fit of a model also makes one-off calls (on the H200, 2026-12-04: 4
            against 3 for every later fit), which are not per step."""
            out = []
            for epochs in (1, 1, 3):
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
            out = out[1:]  # (the warm-up fit's count dropped)
            expect(out[0] == out[1], f"{name}: synchronising calls change with the steps: {out[0]} (1 epoch), "
                                     f"{out[1]} (3 epochs)")
            return out

        plain = counts("resnet18", False, precision="bf16", channels_last=True)
        cohort = counts("cnn", True, precision="bf16")
        how = "SyncCounter (CPU emulation)" if t.dry else "cuda sync debug mode"
        return f"per fit, 1 and 3 epochs: plain loop {plain}, vectorised {cohort} synchronising calls ({how})"

    def bf16() -> str:
        from fl_platform.models import build_model
        from fl_platform.training.loop import TrainConfig
        from fl_platform.training.step import autocast

        dev = torch.device(t.device)
        model = build_model("resnet18", (3, 32, 32), 10, width=16).to(dev)
        with autocast(TrainConfig(precision="bf16"), dev):
            logits = model(torch.randn(8, 3, 32, 32, device=dev))
        expect(logits.dtype == torch.bfloat16, f"the bf16 forward pass produced {logits.dtype} on {dev}")
        ref = t.needs("inline", "inline-resnet18")
        exp, secs = run(base(t, "engine=inline", "train.precision=bf16", "train.channels_last=true"))
        weights = exp.simulation.server.weights
        acc = exp.simulation.history[-1]["test_accuracy"]
        diff = max_diff(weights, ref)
        expect(bool(torch.isfinite(weights).all()) and acc == acc, f"bf16 run: non-finite weights or accuracy {acc}")
        expect(0.0 < diff < 0.5, f"bf16 + channels_last: max |w - fp32| = {diff:.2e}, expected in (0, 0.5)")
        _, secs2 = run(cnn(t, "engine=inline", "num_clients=8", "clients_per_round=4", "train.compile=true"))
        return (f"forward in bfloat16; ResNet-18 bf16 + channels_last 2 rounds in {secs:.1f} s (acc {acc:.3f}, "
                f"max |w - fp32| = {diff:.1e}); CNN with train.compile=true in {secs2:.1f} s (compile included)")

    def gpu_less_worker() -> str:
        """engine.device=auto workers that Ray gave no GPU train on the CPU although their process sees
        CUDA (ray_actors.worker_device): a child process starts a Ray of its own that declares no GPUs,
        with Ray's override that hides CUDA from GPU-less actors off (RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=0,
        its coming default), so its actors see this machine's GPUs."""
        import subprocess

        with tempfile.TemporaryDirectory(prefix="fl-ray-") as tmp:
            env = {**os.environ, "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0", "RAY_TMPDIR": tmp}
            code = (f"import json, sys; sys.path.insert(0, {str(REPO / 'scripts')!r}); import gpu_smoke; "
                    f"print(json.dumps(gpu_smoke.gpu_less_workers({str(t.root)!r})))")
            proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env,
                                  cwd=REPO)
        expect(proc.returncode == 0, f"the child run failed (exit {proc.returncode}): {proc.stderr[-1500:]}")
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        expect(bool(lines), f"the child printed no result: {proc.stdout[-1000:]} {proc.stderr[-1000:]}")
        out = json.loads(lines[-1])
        expect(all(dev == "cpu" and not ids for dev, ids in out["workers"]),
               f"a worker Ray gave no GPU trained on {out['workers']} (device, GPU ids)")
        seen = out["seen"]
        if not t.dry:  # on a GPU the case must really arise, else the check tested nothing
            expect(seen["cuda"], f"Ray hid CUDA from a GPU-less task (CUDA_VISIBLE_DEVICES="
                                 f"{seen['CUDA_VISIBLE_DEVICES']!r}): the case this check is for did not arise")
        return (f"2 workers on cpu, no GPU ids; a GPU-less task saw CUDA: {seen['cuda']} "
                f"(CUDA_VISIBLE_DEVICES={seen['CUDA_VISIBLE_DEVICES']!r})")

    out.append(("cuda", cuda))
    out.append(("inline-resnet18", inline))
    out.append(("sync-free-loop", sync_free))
    out.append(("bf16", bf16))
    if t.dry:
        out.append(("fail-loud", fail_loud))
    out.append(("ray-1-worker-per-gpu", ray(1)))
    out.append(("ray-2-workers-per-gpu", ray(2)))
    out.append(("worker-eval", worker_eval))
    out.append(("gpu-less-worker", gpu_less_worker))
    out.append(("cohort-size-auto", cohort_auto))
    out.append(("vmap-batchnorm", vmap_batchnorm))
    out.append(("scaffold-distributed-state", scaffold))
    out.append(("deterministic", deterministic))
    out.append(("checkpoint-resume", resume))
    return out


def cuda_context_error() -> str | None:
    """Why this process's CUDA context is unusable, or None. A device-side error (an illegal or
    misaligned address) is sticky: every later CUDA call of the process fails with it."""
    import torch

    try:
        torch.cuda.synchronize()
    except Exception as err:  # the sticky error itself, whatever torch calls its class
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return None


def run_checks(chosen: list[tuple[str, Callable[[], str]]], context_error: Callable[[], str | None]) -> list[str]:
    """Run the checks in order, one PASS/FAIL line each (tracebacks on stderr); the names that failed.

    After a check that left this process's CUDA context broken, the later checks are not run but
    failed with a line naming the check that broke it: their own errors would only repeat its error
    (on the first device run, 2026-12-04, one misaligned address read as 11 failed checks)."""
    failed: list[str] = []
    broken: str | None = None
    for name, check in chosen:
        if broken is not None:
            failed.append(name)
            print(f"FAIL {name} (0 s): not run: {broken}; run it alone with --only {name}", flush=True)
            continue
        c0 = time.perf_counter()
        try:
            detail = check()
            print(f"PASS {name} ({time.perf_counter() - c0:.0f} s): {detail}", flush=True)
        except Exception as err:  # one line per check; the traceback goes to stderr
            failed.append(name)
            print(f"FAIL {name} ({time.perf_counter() - c0:.0f} s): {type(err).__name__}: {err}", flush=True)
            traceback.print_exc(file=sys.stderr)
            lost = context_error()
            if lost is not None:
                broken = f"the CUDA context of this process was lost in {name} ({lost})"
    return failed


def start_ray(t: Target) -> None:
    """One local Ray for every check (the engine joins it and leaves it running): real GPUs, or in a
    dry run GPUs declared to Ray that do not exist. Enough logical CPUs for 2 workers per GPU."""
    import ray

    ray.init(num_cpus=max(os.cpu_count() or 1, 2 * t.gpus + 2), num_gpus=t.gpus, include_dashboard=False,
             log_to_driver=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print the checks and exit")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="run the checks' code on this CPU, with GPUs declared to Ray (proves the script, not a GPU)")
    ap.add_argument("--declared-gpus", type=int, default=2, help="GPUs declared to Ray in a dry run (default 2)")
    ap.add_argument("--only", default="", help="comma list of checks to run (default: all)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fl-gpu-smoke-") as tmp:
        if args.list:
            for name, _ in checks(Target(True, 1, Path(tmp))):
                print(name + (" (--cpu-dry-run only)" if name == "fail-loud" else ""))
            print("time-budget (on GPUs, a run of all checks)")
            return 0
        import torch

        if not args.cpu_dry_run and not torch.cuda.is_available():
            print(f"FAIL cuda: no CUDA device visible (torch {torch.__version__}, torch.version.cuda="
                  f"{torch.version.cuda}, torch.cuda.is_available() is False). This is a device check: run it on a "
                  f"machine with a GPU and a CUDA build of torch; --cpu-dry-run runs its code on the CPU.", flush=True)
            return 2
        if args.declared_gpus < 1:
            ap.error("--declared-gpus must be at least 1")
        t = Target(args.cpu_dry_run, args.declared_gpus if args.cpu_dry_run else torch.cuda.device_count(), Path(tmp))
        chosen = checks(t)
        only = [n for n in args.only.split(",") if n]
        unknown = sorted(set(only) - {n for n, _ in chosen})
        if unknown:
            ap.error(f"--only: unknown check(s) {unknown}; see --list")
        if only:
            chosen = [(n, c) for n, c in chosen if n in only or n == "cuda"]
        write_cifar_like(t.root)
        start_ray(t)
        t0 = time.perf_counter()
        failed = run_checks(chosen, (lambda: None) if t.dry else cuda_context_error)
        total = time.perf_counter() - t0
        if not t.dry and not only:
            if total <= BUDGET_S:
                print(f"PASS time-budget: {total:.0f} s <= {BUDGET_S:.0f} s", flush=True)
            else:
                failed.append("time-budget")
                print(f"FAIL time-budget: {total:.0f} s > {BUDGET_S:.0f} s (issue 25: under 5 minutes on one GPU)")
        import ray

        ray.shutdown()
    busy = ", ".join(f"{k} {v:.3f}" for k, v in t.busy.items()) or "n/a (no Ray check passed)"
    print(f"worker_busy_frac: {busy}")
    mode = f"dry run on the CPU ({t.gpus} declared GPUs)" if t.dry else f"{t.gpus} GPU(s)"
    verdict = "all checks passed" if not failed else f"{len(failed)} check(s) failed: {', '.join(failed)}"
    print(f"{verdict} in {total:.0f} s, {mode}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
