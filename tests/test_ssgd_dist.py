"""S-SGD with 2 gloo processes under torchrun, checked against single-process references.

Two torchrun launches: the CLI (``fl-ssgd`` -> ``torchrun -m fl_platform.ssgd``) with PowerSGD,
and this file run as a torchrun script, which trains several scenarios in one process group (to
pay process start-up once). Each reference replays the same shards in this process with the
library pieces only (compressors, FlatModel, optimiser): no DDP, no hook, no collective.
Loopback only (c10d rendezvous on 127.0.0.1, a port the OS picks), bounded timeouts; the launched
process group is killed on timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from fl_platform.ssgd.config import compose_ssgd_config
from fl_platform.ssgd.distributed import shard_indices
from fl_platform.ssgd.launch import torchrun_command

COMMON = ["train.batch_size=16", "train.lr=0.1", "train.momentum=0.9", "ssgd.threads=1",
          "logger.progress=false", "ssgd.check_replicas=true", "log_every_steps=6"]
SCENARIOS: dict[str, list[str]] = {
    "dense": [*COMMON, "train.steps=12"],
    "topk": [*COMMON, "train.steps=12", "compressor=topk", "compressor.ratio=0.05"],
    "acpsgd": [*COMMON, "train.steps=12", "compressor=acpsgd", "compressor.rank=2"],
    "powersgd": [*COMMON, "train.steps=12", "compressor=powersgd"],
    # Two DDP buckets ([b2, W2], [b1, W1]: 4 KB caps), so two buckets' P and Q all-reduces are in flight
    "powersgd_buckets": [*COMMON, "train.steps=12", "compressor=powersgd", "ssgd.bucket_cap_mb=0.004"],
    "local": [*COMMON, "train.steps=14", "ssgd.sync=local", "ssgd.period=4"],
}
WORLD = 2
TIMEOUT_S = 240


def _env() -> dict[str, str]:
    return {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1"}


def _launch(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; on timeout stop torchrun and its workers.

    torchrun starts every worker in a session of its own, so killing torchrun's process group would
    leave the workers running (holding the output pipe: the test would wait forever). SIGTERM makes
    torchrun stop its workers (SIGTERM, then SIGKILL after 30 s); only if it has not ended a minute
    later is its session killed."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate(timeout=60)
        pytest.fail(f"{' '.join(cmd)} did not finish in {TIMEOUT_S} s:\n{out[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-5000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def scenario_runs(tmp_path_factory) -> Path:
    """Every scenario trained by 2 gloo workers (this file run by torchrun); run dirs by name."""
    out = tmp_path_factory.mktemp("ssgd_dist")
    _launch(torchrun_command(WORLD, [str(out)], target=(__file__,)), out)
    return out


# ---------------------------------------------------------------- single-process references


class Reference:
    """The run's data, model and optimiser in this process, one step per call with a given gradient."""

    def __init__(self, overrides: list[str]) -> None:
        from fl_platform.ssgd.trainer import build_flat_model, load_data, steps_per_epoch, train_config
        from fl_platform.training.optim import make_optimizer

        self.cfg = compose_ssgd_config(overrides)
        self.data = load_data(self.cfg, torch.device("cpu"))
        self.tc = train_config(self.cfg)
        self.shard = self.data.num_train // WORLD
        self.per_epoch = steps_per_epoch(self.shard, self.tc)
        self.total = self.tc.num_steps(self.shard)
        self.new_model = lambda: build_flat_model(self.cfg, self.data, torch.device("cpu"))
        tc = self.tc
        self.new_optimizer = lambda: make_optimizer(tc.optimizer, tc.lr, momentum=tc.momentum,
                                                    weight_decay=tc.weight_decay, nesterov=tc.nesterov)

    def batches(self, step: int) -> list[torch.Tensor]:
        """Each worker's sample indices at ``step`` (what the trainer draws)."""
        epoch, k = divmod(step, self.per_epoch)
        b = self.tc.batch_size
        return [shard_indices(self.data.num_train, WORLD, r, self.cfg.seed, epoch)[k * b : (k + 1) * b]
                for r in range(WORLD)]

    def grad(self, fm, idx: torch.Tensor) -> torch.Tensor:
        fm.grad.zero_()
        F.cross_entropy(fm.model(self.data.train_x[idx]), self.data.train_y[idx]).backward()
        return fm.grad.clone()


pytestmark = [
    pytest.mark.slow,  # torchrun processes
    pytest.mark.usefixtures("one_torch_thread"),  # tiny models: one torch thread (conftest)
    pytest.mark.xdist_group("ssgd_dist"),  # one pytest worker: scenario_runs (a torchrun) runs once
]


def _saved(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt")


def _assert_same_model(saved: dict[str, torch.Tensor], fm, atol: float) -> None:
    expected = fm.state_dict()
    assert set(saved) == set(expected)
    for name, t in expected.items():
        torch.testing.assert_close(saved[name], t, atol=atol, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


# ---------------------------------------------------------------- the tests


def test_uncompressed_two_workers_equal_one_process_with_the_combined_batch(scenario_runs):
    """Mean of two half-batch gradients == gradient of the combined batch (MLP: no BatchNorm)."""
    ref = Reference(SCENARIOS["dense"])
    fm, opt = ref.new_model(), ref.new_optimizer()
    for step in range(ref.total):
        opt.step(fm.params, ref.grad(fm, torch.cat(ref.batches(step))))
    run = scenario_runs / "dense"
    _assert_same_model(_saved(run), fm, atol=2e-5)
    rows = _rows(run)
    assert rows[-1]["step"] == 12 and all(r["replica_max_abs_diff"] == 0.0 for r in rows)  # bit-identical
    summary = json.loads((run / "summary.json").read_text())
    assert summary["sync"] == "ddp" and summary["world_size"] == 2 and summary["backend"] == "gloo"
    assert summary["bytes_per_worker_total"] == 12 * summary["dense_bytes_per_step"]


def test_topk_uses_all_gather_and_matches_its_single_process_simulation(scenario_runs):
    """Steps 0-1 dense (DDP's bucket rebuild), then per-tensor Top-k with per-worker error feedback."""
    from fl_platform.compression.registry import make_compressor
    from fl_platform.compression.topk import TopK

    ref = Reference(SCENARIOS["topk"])
    comp = make_compressor(ref.cfg.compressor)
    fm, opt = ref.new_model(), ref.new_optimizer()
    slots = [s for s in fm.slots if s.is_param]
    states: list[dict[str, dict]] = [{} for _ in range(WORLD)]
    for step in range(ref.total):
        grads = [ref.grad(fm, idx) for idx in ref.batches(step)]
        if step < 2:
            mean = (grads[0] + grads[1]) / WORLD
        else:
            mean = torch.zeros_like(grads[0])
            for s in slots:
                part = mean[s.offset : s.offset + s.numel]
                for w in range(WORLD):
                    payload, states[w][s.name] = comp.encode(grads[w][s.offset : s.offset + s.numel].view(s.shape),
                                                             states[w].get(s.name))
                    part += comp.decode(payload).reshape(-1)
            mean /= WORLD
        opt.step(fm.params, mean)
    run = scenario_runs / "topk"
    _assert_same_model(_saved(run), fm, atol=2e-5)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["sync"] == "ddp+allgather"
    tk = TopK(0.05)
    sparse = sum(tk.payload_nbytes(s.numel) for s in slots)
    assert summary["bytes_per_worker_total"] == 2 * summary["dense_bytes_per_step"] + 10 * sparse
    assert all(r["replica_max_abs_diff"] == 0.0 for r in _rows(run))


def test_acpsgd_wrapper_matches_its_single_process_simulation(scenario_runs):
    """Alternating P/Q factors all-reduced from step 0, local EF, shared factors after each all-reduce."""
    from fl_platform.compression.base import Key
    from fl_platform.compression.registry import make_compressor

    ref = Reference(SCENARIOS["acpsgd"])
    comp = make_compressor(ref.cfg.compressor)
    fm, opt = ref.new_model(), ref.new_optimizer()
    slots = [s for s in fm.slots if s.is_param]
    states = [[comp.init_state(s.shape, Key(ref.cfg.seed, tensor=(i,))) for i, s in enumerate(slots)]
              for _ in range(WORLD)]
    for step in range(ref.total):
        grads = [ref.grad(fm, idx) for idx in ref.batches(step)]
        mean = torch.empty_like(grads[0])
        for i, s in enumerate(slots):
            encoded = [comp.encode(grads[w][s.offset : s.offset + s.numel].view(s.shape), states[w][i])
                       for w in range(WORLD)]
            total = comp.sum(p for p, _ in encoded)
            for w in range(WORLD):
                states[w][i] = comp.after_aggregate(encoded[w][1], total, WORLD)
            mean[s.offset : s.offset + s.numel] = comp.decode(total, states[0][i]).reshape(-1) / WORLD
        opt.step(fm.params, mean)
    run = scenario_runs / "acpsgd"
    _assert_same_model(_saved(run), fm, atol=2e-5)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["sync"] == "acpsgd" and all(r["replica_max_abs_diff"] == 0.0 for r in _rows(run))
    assert summary["bytes_per_worker_total"] < 0.5 * 12 * summary["dense_bytes_per_step"]


@pytest.mark.parametrize("name, buckets", [("powersgd", 1), ("powersgd_buckets", 2)])
def test_powersgd_hook_matches_its_single_process_simulation(scenario_runs, name, buckets):
    """Rank-1 PowerSGD per weight matrix (warm-started Q, EF against the global approximation), biases dense,
    with one DDP bucket and with two (their all-reduces once deadlocked gloo's two worker threads)."""
    from fl_platform.compression.base import Key
    from fl_platform.compression.registry import make_compressor

    ref = Reference(SCENARIOS[name])
    psgd = make_compressor(ref.cfg.compressor).inner  # ErrorFeedback(PowerSGD): the hook does EF itself
    fm, opt = ref.new_model(), ref.new_optimizer()
    slots = [s for s in fm.slots if s.is_param]
    qs = {i: psgd.init_state(s.shape, Key(ref.cfg.seed, tensor=(i,)))["q"] for i, s in enumerate(slots)
          if psgd.compressible(s.shape)}
    residuals: list[dict[int, torch.Tensor]] = [{} for _ in range(WORLD)]
    for step in range(ref.total):
        grads = [ref.grad(fm, idx) for idx in ref.batches(step)]
        mean = (grads[0] + grads[1]) / WORLD
        for i, s in enumerate(slots):
            if step < 2 or i not in qs:
                continue
            ms = [psgd.matrix(g[s.offset : s.offset + s.numel].view(s.shape)) + residuals[w].get(i, 0)
                  for w, g in enumerate(grads)]
            q = qs[i].view(ms[0].shape[1], psgd.rank)
            p_sum = sum(psgd.p_step(m, q) for m in ms)
            steps = [psgd.q_step(m, p_sum) for m in ms]
            approx, q_mean = psgd.reconstruct(steps[0][0], sum(q_w for _, q_w in steps), WORLD)
            for w in range(WORLD):
                residuals[w][i] = ms[w] - approx
            qs[i] = q_mean.reshape(-1)
            mean[s.offset : s.offset + s.numel] = approx.reshape(-1)
        opt.step(fm.params, mean)
    run = scenario_runs / name
    _assert_same_model(_saved(run), fm, atol=2e-5)
    summary = json.loads((run / "summary.json").read_text())
    rows = _rows(run)
    assert summary["sync"] == "ddp+powersgd" and all(r["replica_max_abs_diff"] == 0.0 for r in rows)
    assert rows[-1]["collectives"] == 6 * 2 * buckets  # steps 6-11: P and Q of every bucket


def test_local_sgd_replicas_are_identical_right_after_averaging(scenario_runs):
    """Period 4 over 14 steps: averages after steps 4, 8, 12 and a final one; replicas drift in between."""
    ref = Reference(SCENARIOS["local"])
    models = [ref.new_model() for _ in range(WORLD)]
    opts = [ref.new_optimizer() for _ in range(WORLD)]  # momentum stays local
    for step in range(ref.total):
        for fm, opt, idx in zip(models, opts, ref.batches(step)):
            opt.step(fm.params, ref.grad(fm, idx))
        if (step + 1) % 4 == 0 or step + 1 == ref.total:
            mean = (models[0].vector + models[1].vector) / WORLD
            for fm in models:
                fm.vector.copy_(mean)
    run = scenario_runs / "local"
    _assert_same_model(_saved(run), models[0], atol=2e-5)
    rows = _rows(run)
    assert all(r["replica_max_abs_diff"] == 0.0 for r in rows)  # identical right after every average
    assert all(r["replica_diff_before_sync"] > 1e-4 for r in rows)  # and they really had drifted apart
    summary = json.loads((run / "summary.json").read_text())
    assert summary["sync"] == "local"
    assert summary["num_params"] == models[0].param_count
    assert summary["bytes_per_worker_total"] == 4 * 4 * models[0].num_params  # 4 averages of the flat (aligned) model


def test_cli_two_workers_powersgd_learns_digits(tmp_path):
    """``fl-ssgd --nproc-per-node 2 compressor=powersgd``: rank 0 alone writes one run directory."""
    cmd = [sys.executable, "-m", "fl_platform.ssgd.launch", "--nproc-per-node", "2", "compressor=powersgd",
           "train.epochs=6", "ssgd.threads=1", "logger.progress=false"]
    result = _launch(cmd, tmp_path)
    runs = [p.parent for p in tmp_path.rglob("summary.json")]
    assert len(runs) == 1 and f"run_dir: {runs[0]}" in result.stdout
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["sync"] == "ddp+powersgd" and summary["world_size"] == 2
    assert summary["final_test_accuracy"] > 0.9  # the bar: rank-1 PowerSGD, 2 x 32 per step, 6 epochs
    rows = _rows(runs[0])
    assert len(rows) == 6 and rows[-1]["epoch"] == 6.0
    # After the 2 dense warm-up steps, each step sends P and Q (rank 1) plus the biases dense.
    assert rows[-1]["bytes_per_worker"] < 0.1 * rows[-1]["step"] / 6 * summary["dense_bytes_per_step"]
    assert (runs[0] / "model.pt").exists() and (runs[0] / "config.yaml").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_fl_ssgd_stops_its_workers(tmp_path, sig):
    """fl-ssgd stopped (Ctrl-C, SIGTERM: to it alone) stops torchrun and the workers, which torchrun starts
    in sessions of their own: none is left training, orphaned."""
    import psutil

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "fl_platform.ssgd.launch", "--nproc-per-node", "2", "train.epochs=100000",
           "ssgd.threads=1", "logger.progress=false", "eval_every=0", "save_model=false", f"run_dir={run_dir}"]

    def workers() -> list[psutil.Process]:
        """torchrun (``-m fl_platform.ssgd`` is in its command line too) and the workers."""
        found = []
        for proc in psutil.process_iter(["cmdline"]):
            line = proc.info["cmdline"] or []
            if "fl_platform.ssgd" in line and f"run_dir={run_dir}" in line:
                found.append(proc)
        return found

    from .conftest import interruptible  # here: torchrun's workers run this file as a script

    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=interruptible)
    left: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ((run_dir / "metrics.jsonl").exists() and len(workers()) == WORLD + 1):
            assert launcher.poll() is None and time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.5)
        launcher.send_signal(sig)  # to fl-ssgd alone, as a scheduler or a parent process would
        launcher.wait(timeout=120)
        _, left = psutil.wait_procs(workers(), timeout=10)
    finally:
        for proc in [*workers(), psutil.Process(launcher.pid)] if launcher.poll() is None else workers():
            proc.kill()  # clean up what this test started, by PID
    assert not left, f"torchrun or workers left running after fl-ssgd ended: {[p.pid for p in left]}"


# ---------------------------------------------------------------- the torchrun side


def _worker_main(out: str) -> None:
    from fl_platform.ssgd.distributed import init_distributed, shutdown
    from fl_platform.ssgd.trainer import SSGDTrainer

    ctx = init_distributed("gloo", "cpu", timeout_s=120)
    ok = False
    try:
        for name, overrides in SCENARIOS.items():
            cfg = compose_ssgd_config([*overrides, f"run_dir={Path(out) / name}"])
            SSGDTrainer(cfg, ctx).run()
        ok = True
    finally:
        shutdown(barrier=ok)


if __name__ == "__main__":
    from fl_platform.ssgd.distributed import end_worker

    _worker_main(sys.argv[1])
    end_worker(0)
