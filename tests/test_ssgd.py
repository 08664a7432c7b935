"""S-SGD runtime, in one process: shards, config, payload plumbing of the DDP hooks, a world of one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fl_platform.compression import build_compressor
from fl_platform.compression.base import Key
from fl_platform.compression.vector import Layout, VectorCompressor
from fl_platform.ssgd.config import compose_ssgd_config
from fl_platform.ssgd.distributed import free_port, shard_indices
from fl_platform.ssgd.hooks import (
    bucket_layout,
    flatten_float,
    from_wire,
    hook_mode,
    to_wire,
    unflatten_float,
)
from fl_platform.ssgd.launch import main as fl_ssgd_main
from fl_platform.ssgd.launch import torchrun_command
from fl_platform.ssgd.localsgd import LocalSGD
from fl_platform.ssgd.stats import CommStats

# ---------------------------------------------------------------- shards


def test_shards_are_disjoint_equal_and_reshuffled_every_epoch():
    n, world = 101, 4
    shards = [shard_indices(n, world, r, seed=3, epoch=0) for r in range(world)]
    assert all(s.numel() == n // world for s in shards)
    joined = torch.cat(shards)
    assert joined.unique().numel() == joined.numel() == world * (n // world)
    assert int(joined.min()) >= 0 and int(joined.max()) < n
    assert torch.equal(shards[1], shard_indices(n, world, 1, seed=3, epoch=0))  # deterministic
    assert not torch.equal(shards[1], shard_indices(n, world, 1, seed=3, epoch=1))  # new epoch, new shard
    assert not torch.equal(shards[1], shard_indices(n, world, 1, seed=4, epoch=0))


def test_shard_errors_name_the_problem():
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        shard_indices(10, 2, 2, seed=0, epoch=0)
    with pytest.raises(ValueError, match="3 training samples cannot be shared by 4 workers"):
        shard_indices(3, 4, 0, seed=0, epoch=0)


# ---------------------------------------------------------------- config


def test_an_unknown_device_is_refused_naming_the_key():
    from fl_platform.ssgd.distributed import resolve_device

    with pytest.raises(ValueError, match=r"ssgd.device must be auto, cpu, cuda or cuda:<index>; got 'foo'"):
        resolve_device("foo", 0)
    assert resolve_device("cpu", 1) == torch.device("cpu")


def test_config_reuses_the_simulator_groups():
    cfg = compose_ssgd_config(["model=cnn", "compressor=powersgd", "compressor.rank=2", "train.batch_size=8"])
    assert cfg.model.name == "cnn" and cfg.model.channels == [32, 64]
    assert cfg.compressor.name == "powersgd" and cfg.compressor.rank == 2
    assert cfg.dataset.name == "digits" and cfg.train.batch_size == 8
    assert str(cfg.ssgd.sync) == "ddp" and cfg.ssgd.start_iter == 2


@pytest.mark.parametrize("overrides, message", [
    (["ssgd.bogus=1"], "bogus"),
    (["ssgd.sync=gossip"], "gossip"),
    (["ssgd.start_iter=1"], "ssgd.start_iter must be >= 2"),
    (["ssgd.sync=local", "compressor=topk"], "ssgd.sync local SGD averages whole models"),
    (["ssgd.backend=mpi"], "ssgd.backend must be auto, gloo or nccl"),
    (["train.lr=0"], "train.lr must be > 0"),
    (["train.momentum=-0.5"], r"train.momentum must be in \[0, 1\)"),
    (["train.weight_decay=-1"], "train.weight_decay must be >= 0"),
    (["eval_batch_size=0"], "eval_batch_size must be >= 1"),
    (["eval_every=0", "eval_batch_size=7"], "eval_batch_size has no effect with eval_every=0"),
    (["train.precision=bf16"], "train.precision is a step option of the federated loop"),
    (["train.compile=true"], "train.compile is a step option of the federated loop"),
    (["train.nesterov=true", "train.momentum=0"], "train.nesterov needs train.momentum > 0"),
    # a key this run would not read (as the simulator's refusals: config_checks.refuse_inactive)
    (["train.adam_beta1=0.5"], "train.adam_beta1=0.5 has no effect in this run: an Adam setting, and "
                               "train.optimizer=sgd"),
    (["train.adam_eps=0.1"], "train.adam_eps=0.1 has no effect in this run"),
    (["train.optimizer=adam", "train.momentum=0.5"], "train.momentum=0.5 has no effect in this run: an SGD setting"),
    (["train.optimizer=adam", "train.nesterov=true"], "train.nesterov=True has no effect in this run"),
    (["train.steps=6", "train.epochs=3"], "train.epochs has no effect when train.steps is set"),
    (["compressor.scope=global"], "compressor.scope='global' has no effect in this run: compressor=none"),
    (["compressor.error_feedback=true"], "compressor.error_feedback=True has no effect in this run"),
    (["compressor.bucket_size=7"], "compressor.bucket_size=7 has no effect in this run"),
    (["compressor=topk", "compressor.tensors=[delta,state]"],
     r"compressor.tensors=\['delta', 'state'\] has no effect in this run: .* S-SGD compresses the gradient"),
    (["compressor=topk", "compressor.bucket_size=7"], "compressor.bucket_size=7 has no effect in this run: it sizes"),
    (["compressor=acpsgd", "compressor.scope=global"], "compressor.scope='global' has no effect in this run: the "
                                                       "ACP-SGD optimiser wrapper"),
    (["ssgd.period=4"], "ssgd.period=4 has no effect in this run: a local SGD setting, and ssgd.sync=ddp"),
    (["compressor=topk", "ssgd.local_start_step=2"], "ssgd.local_start_step=2 has no effect in this run"),
    (["ssgd.start_iter=5"], "ssgd.start_iter=5 has no effect in this run: .* compressor=none installs no hook"),
    (["compressor=acpsgd", "ssgd.start_iter=5"], "ssgd.start_iter=5 has no effect in this run: .* optimiser wrapper"),
    (["ssgd.sync=local", "ssgd.start_iter=5"], "ssgd.start_iter=5 has no effect in this run: .* ssgd.sync=local"),
    (["ssgd.sync=local", "ssgd.bucket_cap_mb=5"], "ssgd.bucket_cap_mb=5.0 has no effect in this run"),
    (["dataset=synthetic", "dataset.iid=true", "dataset.beta=1.0"],
     "dataset.beta=1.0 has no effect in this run: .* dataset.iid=true"),
])
def test_bad_config_fails_naming_the_key(overrides, message):
    with pytest.raises(Exception, match=message):
        compose_ssgd_config(overrides)


@pytest.mark.parametrize("overrides", [
    ["train.steps=6"],  # no epochs left to ignore (conf/ssgd.yaml: fl_unless_set)
    ["train.optimizer=adam", "train.adam_beta1=0.5"],  # no momentum left to ignore (fl_if_sgd)
    ["train.momentum=0.5", "train.nesterov=true"],
    ["compressor=topk", "compressor.scope=bucket", "compressor.bucket_size=7", "ssgd.start_iter=5",
     "ssgd.bucket_cap_mb=5"],
    ["compressor=acpsgd", "compressor.error_feedback=false", "ssgd.bucket_cap_mb=5"],
    ["ssgd.sync=local", "ssgd.period=4", "ssgd.local_start_step=2"],
    ["dataset=synthetic", "dataset.alpha=1.0", "dataset.beta=1.0"],
])
def test_keys_the_run_reads_are_accepted(overrides):
    cfg = compose_ssgd_config(overrides)
    assert cfg.train.steps in (None, 6) and (cfg.train.epochs is None) == (cfg.train.steps is not None)
    assert cfg.train.optimizer == "sgd" or cfg.train.momentum == 0.0


def test_cli_reports_bad_overrides_and_prints_config(capsys):
    assert fl_ssgd_main(["--nproc-per-node", "1", "--help"]) == 0
    assert "torchrun --nproc_per_node=N -m fl_platform.ssgd" in capsys.readouterr().out
    from fl_platform.ssgd.launch import run_worker

    assert run_worker(["ssgd.period=0"]) == 1
    assert "ssgd.period must be >= 1" in capsys.readouterr().err
    assert run_worker(["--cfg", "compressor=topk"]) == 0
    assert "name: topk" in capsys.readouterr().out
    cmd = torchrun_command(2, ["compressor=topk"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"] and "--rdzv-endpoint=127.0.0.1:0" in cmd
    assert cmd[-3:] == ["-m", "fl_platform.ssgd", "compressor=topk"]


def test_end_worker_flushes_what_the_run_printed_and_logged_then_skips_finalisation(tmp_path):
    """A torchrun worker ends through end_worker (torch's leaked gloo threads can abort Python's
    finalisation): its exit code, its buffered stdout and its log lines must survive; atexit must not run."""
    log = tmp_path / "worker.log"
    code = (
        "import atexit, logging, logging.handlers\n"
        "from fl_platform.ssgd.distributed import end_worker\n"
        f"target = logging.FileHandler({str(log)!r})\n"  # a buffering handler: written only when flushed
        "logging.basicConfig(level=logging.INFO, handlers=[logging.handlers.MemoryHandler(100, target=target)])\n"
        "logging.info('last line of the run')\n"
        "atexit.register(lambda: print('finalised'))\n"
        "print('final test accuracy: 0.9', end='')\n"
        "end_worker(3)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout to a pipe is then buffered
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "final test accuracy: 0.9"
    assert "last line of the run" in log.read_text()


# ---------------------------------------------------------------- hook plumbing


@pytest.mark.parametrize("name, mode", [("topk", "allgather"), ("qsgd", "allgather"), ("efsign", "allgather"),
                                        ("randomk", "allreduce"), ("identity", "allreduce"),
                                        ("acpsgd", "allreduce"), ("powersgd", "powersgd")])
def test_hook_mode_follows_summability(name, mode):
    assert hook_mode(build_compressor(name)) == mode


def test_wire_bytes_are_the_payload_wire_format_and_round_trip():
    x = torch.randn(3000)
    layout = bucket_layout([(20, 50), (1000,), (1000,)], 3000, "layer")
    for name in ("topk", "qsgd", "efsign"):
        vc = VectorCompressor(build_compressor(name), layout)
        vp, _ = vc.encode(x, None, Key(seed=1, step=5, sender=1))
        raw = to_wire(vp)
        assert raw.dtype == torch.uint8 and raw.numel() == vp.nbytes
        assert bytes(raw.numpy()) == vp.to_bytes()  # what travels is exactly the compressor's wire format
        assert torch.equal(vc.decode(from_wire(vp, raw)), vc.decode(vp))
    with pytest.raises(ValueError, match="wire payload has"):
        from_wire(vp, raw[:-1])


def test_summable_payloads_flatten_and_sum_like_decoded_payloads():
    layout = Layout.buckets(500, 200)
    vc = VectorCompressor(build_compressor("randomk", ratio=0.1), layout)
    xs = [torch.randn(500) for _ in range(2)]
    vps = [vc.encode(x, None, Key(seed=0, step=3, sender=r))[0] for r, x in enumerate(xs)]
    total = unflatten_float(vps[0], flatten_float(vps[0]) + flatten_float(vps[1]))
    expected = vc.decode(vps[0]) + vc.decode(vps[1])
    torch.testing.assert_close(vc.decode(total), expected)


def test_bucket_layout_checks_the_buffer():
    assert [s.shape for s in bucket_layout([(4, 3), (4,)], 16, "layer").segments] == [(4, 3), (4,)]
    assert len(bucket_layout([(4, 3), (4,)], 16, "bucket", bucket_size=5).segments) == 4
    with pytest.raises(ValueError, match="cover 16 elements but its buffer has 17"):
        bucket_layout([(4, 3), (4,)], 17, "layer")


def test_comm_stats_follow_the_ring_model():
    s = CommStats(world_size=4)
    s.all_reduce(100)
    s.all_gather(10)
    assert s.payload_bytes == 110 and s.wire_bytes == pytest.approx(2 * 3 / 4 * 100 + 3 * 10) and s.collectives == 2


def test_local_sgd_sync_points():
    from fl_platform.training.flat import FlatModel

    fm = FlatModel(torch.nn.Linear(2, 2))
    local = LocalSGD(fm, world_size=1, period=3, start_step=2)
    assert [s for s in range(12) if local.is_sync_step(s)] == [4, 7, 10]
    with pytest.raises(ValueError, match=r"ssgd\.period must be >= 1"):
        LocalSGD(fm, world_size=1, period=0)


# ---------------------------------------------------------------- a world of one, in process


def test_world_of_one_runs_and_writes_the_run_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    from fl_platform.ssgd.distributed import init_distributed, shutdown
    from fl_platform.ssgd.trainer import SSGDTrainer

    threads = torch.get_num_threads()
    ctx = init_distributed("auto", "cpu", 60)
    try:
        assert (ctx.rank, ctx.world_size, ctx.backend) == (0, 1, "gloo")
        cfg = compose_ssgd_config(["train.steps=30", "log_every_steps=10", "eval_every=2", "logger.progress=false",
                                   "ssgd.sync=local", "ssgd.period=4", "ssgd.threads=1", f"run_dir={tmp_path}"])
        summary = SSGDTrainer(cfg, ctx).run()
    finally:
        shutdown()
        torch.set_num_threads(threads)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [10, 20, 30]
    assert ["test_accuracy" in r for r in rows] == [False, True, True]  # every 2nd row, and the last
    # Averages after steps 4, 8, ..., 28 and a last one after step 30; a world of one moves nothing on the wire.
    assert [r["collectives"] for r in rows] == [2, 3, 3] and all(r["wire_bytes_per_worker"] == 0 for r in rows)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["steps"] == 30 and saved["sync"] == "local" and saved["world_size"] == 1
    assert saved == json.loads(json.dumps(summary))
    assert (tmp_path / "config.yaml").exists() and (tmp_path / "model.pt").exists()
