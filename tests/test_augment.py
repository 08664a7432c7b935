"""Crop + flip of training minibatches (datasets/augment.py): torchvision's semantics, draws from
(seed, round, client, step, position), the same batches on the sequential and vectorised paths and
on every engine, and config keys that act or are refused."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from fl_platform.datasets.augment import Augmentation, AugmentConf, crop_flip, sample_hash
from fl_platform.datasets.registry import load_source
from fl_platform.experiment import build
from fl_platform.training.flat import FlatModel
from fl_platform.training.hooks import TrainHooks
from fl_platform.training.loop import ClientData, LocalTrainer, TrainConfig

from .conftest import compose_config
from .test_engine_determinism import run
from .test_vectorised import SIZES, TOL, _compare_fit, _data, _model

AUG = Augmentation(crop_padding=2, hflip=True, fill=(-0.5,))


def _python_hash(key: int, step: int, pos: int) -> int:
    """sample_hash with Python integers (exact): the reference for the overflow-free int64 version."""
    def mix(v: int) -> int:
        v ^= v >> 16
        v = v * 0x7FEB352D & 0xFFFFFFFF
        v ^= v >> 15
        v = v * 0x846CA68B & 0xFFFFFFFF
        return v ^ v >> 16

    h = mix(key >> 32 & 0xFFFFFFFF)
    h = mix(h ^ key & 0xFFFFFFFF)
    h = mix(h ^ step)
    return mix(h ^ pos)


def test_hash_is_the_exact_32_bit_hash():
    keys = [0, 1, 2**62 + 12345, 2**63 - 1, 987654321987654321]
    for key in keys:
        for step in (0, 7, 2**31 + 5):
            got = sample_hash(torch.full((6,), key, dtype=torch.int64), step, torch.arange(6)).tolist()
            assert got == [_python_hash(key, step, p) for p in range(6)]


def test_crop_flip_is_pad_crop_then_mirror():
    """Per sample: F.pad with the fill value, slice at (dy, dx), mirror where flipped (torchvision's
    RandomCrop(padding) then RandomHorizontalFlip)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 6, 7, generator=g)
    fill = torch.tensor([-1.0, -2.0, -3.0]).view(3, 1, 1)
    dy, dx = torch.tensor([0, 4, 2, 1, 3]), torch.tensor([4, 0, 2, 3, 1])
    flip = torch.tensor([False, True, True, False, True])
    out = crop_flip(x, dy, dx, flip, 2, fill)
    for i in range(5):
        padded = torch.cat([F.pad(x[i, c : c + 1], [2, 2, 2, 2], value=float(fill[c])) for c in range(3)])
        want = padded[:, dy[i] : dy[i] + 6, dx[i] : dx[i] + 7]
        if flip[i]:
            want = want.flip(-1)
        assert torch.equal(out[i], want), i
    assert torch.equal(out[2], x[2].flip(-1))  # the centre offset (p, p) is the image itself


def test_draws_are_uniform_offsets_and_fair_flips():
    aug = Augmentation(crop_padding=4, hflip=True, fill=(0.0,))
    keys = Augmentation.client_keys(0, 3, range(200))
    dy, dx, flip = aug.draws(keys.repeat_interleave(100), 5, torch.arange(100).repeat(200))
    n = dy.numel()
    for offsets in (dy, dx):
        counts = torch.bincount(offsets, minlength=9)
        assert counts.numel() == 9 and int(counts.min()) > 0
        assert float((counts / n - 1 / 9).abs().max()) < 0.01  # 20,000 draws: sd of a share ~0.002
    assert abs(float(flip.float().mean()) - 0.5) < 0.015
    assert abs(float(torch.corrcoef(torch.stack([dy.float(), dx.float()]))[0, 1])) < 0.03
    off = Augmentation(crop_padding=0, hflip=False, fill=(0.0,)).draws(keys, 0, torch.arange(200))
    assert int(off[0].abs().sum() + off[1].abs().sum()) == 0 and not bool(off[2].any())


def test_clients_get_different_crops_and_a_rerun_the_same():
    x = torch.randn(8, 1, 6, 6, generator=torch.Generator().manual_seed(1))
    a, b = (AUG.apply(x, k, step=3) for k in Augmentation.client_keys(11, 2, [4, 5]))
    assert not torch.equal(a, b)  # two clients, same round, same batch
    again = AUG.apply(x, Augmentation.client_keys(11, 2, [4])[0], step=3)
    assert torch.equal(a, again)  # rerun: the same crops
    for seed, round, step in ((12, 2, 3), (11, 3, 3), (11, 2, 4)):  # every coordinate of the draw acts
        assert not torch.equal(a, AUG.apply(x, Augmentation.client_keys(seed, round, [4])[0], step=step))
    rows = torch.stack([x, x])
    cohort = AUG.apply_cohort(rows, Augmentation.client_keys(11, 2, [4, 5]), step=3)
    assert torch.equal(cohort[0], a) and torch.equal(cohort[1], b)


class Recorder(TrainHooks):
    """Keeps every training minibatch the loop hands to the loss."""

    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []

    def loss(self, model, batch):
        self.batches.append(batch.x.clone())
        return super().loss(model, batch)


def _fit_batches(client: int, augment: Augmentation | None, data_seed: int = 0) -> list[torch.Tensor]:
    x = torch.randn(1, 1, 8, 8, generator=torch.Generator().manual_seed(data_seed))
    y = torch.zeros(1, dtype=torch.long)
    fm = FlatModel(_model("mlp"))
    hooks = Recorder()
    LocalTrainer(fm, TrainConfig(epochs=3, batch_size=1, lr=0.01)).fit(
        ClientData(x, y, torch.zeros(1, dtype=torch.long), augment), hooks, seed=7, round=1, client=client)
    return hooks.batches


def test_the_loop_augments_per_client_and_reproducibly():
    """One sample per client (so the shuffle is trivial): what the model sees is the crop alone."""
    plain = _fit_batches(0, None)
    first, second, rerun = _fit_batches(0, AUG), _fit_batches(1, AUG), _fit_batches(0, AUG)
    assert all(torch.equal(p, plain[0]) for p in plain)
    assert not all(torch.equal(a, p) for a, p in zip(first, plain))
    assert not all(torch.equal(a, b) for a, b in zip(first, second))
    assert all(torch.equal(a, b) for a, b in zip(first, rerun))
    assert len({tuple(b.flatten().tolist()) for b in first}) > 1  # the epochs draw anew


@pytest.mark.parametrize("model, options", [("mlp", {}), ("cnn", {"channels": [4, 8], "hidden": 16, "norm": "batch"})],
                         ids=["mlp-padded", "cnn-batchnorm-by-batch-size"])
def test_vectorised_cohort_equals_the_loop_with_augmentation(model, options):
    datas = [ClientData(d.x, d.y, d.indices, AUG) for d in _data()]
    fm = FlatModel(_model(model, **options))
    cfg = TrainConfig(epochs=2, batch_size=5, lr=0.05, momentum=0.9)
    _, res = _compare_fit(fm, cfg, datas, [None] * len(SIZES), TOL)
    # the augmentation acted: training without it ends elsewhere
    _, plain = _compare_fit(fm, cfg, _data(), [None] * len(SIZES), TOL)
    assert float((res[3].vector - plain[3].vector).abs().max()) > 1e-3


# ------------------------------------------------------------------ through the experiment

TINY = ("dataset=digits", "num_clients=6", "clients_per_round=6", "rounds=2", "train.epochs=1",
        "train.batch_size=16", "model=cnn", "model.channels=[4,4]", "model.hidden=8", "save_model=false",
        "engine.threads_per_worker=1", "seed=3")
ON = ("dataset.augment.crop_padding=1", "dataset.augment.hflip=true")


def _run(*overrides: str) -> tuple[torch.Tensor, list[dict]]:
    return run(*TINY, *overrides)  # (final global weights, metric rows without timings)


_RUNS: dict[tuple[str, ...], tuple[torch.Tensor, list[dict]]] = {}


def _cached(*overrides: str):
    if overrides not in _RUNS:
        _RUNS[overrides] = _run(*overrides)
    return _RUNS[overrides]


@pytest.mark.parametrize("key", ["dataset.augment.crop_padding=1", "dataset.augment.hflip=true"])
def test_each_augment_key_changes_the_run(key):
    off, on = _cached(), _cached(key)
    assert float((off[0] - on[0]).abs().max()) > 1e-4


def test_vectorised_engine_equals_sequential_with_augmentation():
    seq, vec = _cached(*ON), _cached(*ON, "engine.cohort_size=6")
    assert float((seq[0] - vec[0]).abs().max()) <= TOL


@pytest.mark.ray
def test_ray_equals_inline_with_augmentation(ray_session):
    inline = _cached(*ON)
    ray = _run(*ON, "engine=ray", "engine.num_workers=2")
    assert float((inline[0] - ray[0]).abs().max()) <= 1e-6
    assert [r["train_loss"] for r in inline[1]] == pytest.approx([r["train_loss"] for r in ray[1]], rel=1e-6)


@pytest.mark.parametrize("dataset", ["shakespeare", "synthetic"])
@pytest.mark.parametrize("key", ["dataset.augment.crop_padding=4", "dataset.augment.hflip=true"])
def test_augmenting_non_images_is_refused(dataset, key, tmp_path):
    if dataset == "shakespeare":  # a small play in the real file's format, so no shared data is needed
        (tmp_path / "tiny-shakespeare").mkdir()
        play = "".join(f"{name}:\n{line * 4}\n\n" for name, line in
                       [("First Citizen", "Before we proceed any further, hear me speak. "),
                        ("All", "Speak, speak. We are resolved rather to die than to famish. "),
                        ("MENENIUS", "Why, masters, my good friends, mine honest neighbours? ")] * 2)
        (tmp_path / "tiny-shakespeare" / "input.txt").write_text(play)
        extra = ("model=lstm", "dataset.max_speakers=3", "partition=natural", f"dataset.root={tmp_path}",
                 "dataset.seq_len=20", "dataset.stride=10")
    else:
        extra = ("model=mlp", "partition=natural")
    cfg = compose_config(f"dataset={dataset}", "num_clients=3", "clients_per_round=3", *extra, key)
    with pytest.raises(ValueError, match=rf"{re.escape(key.split('=')[0])}=.*need images"):
        build(cfg)


def test_negative_padding_is_refused():
    with pytest.raises(ValueError, match=r"dataset\.augment\.crop_padding must be an integer >= 0"):
        build(compose_config(*TINY, "dataset.augment.crop_padding=-1"))


def test_defaults_follow_the_papers():
    """CIFAR-10/100: crop 4 + flip (FedImpro, VHL, FuseFL, one-shot recipes); digits and characters: off."""
    for name in ("cifar10", "cifar100"):
        aug = compose_config(f"dataset={name}").dataset.augment
        assert (aug.crop_padding, aug.hflip) == (4, True), name
    for name in ("digits", "mnist", "fashion_mnist", "femnist", "shakespeare", "synthetic"):
        aug = compose_config(f"dataset={name}").dataset.augment
        assert (aug.crop_padding, aug.hflip) == (0, False), name
    for preset in ("fedimpro_cifar10", "vhl_cifar10"):
        aug = compose_config(f"+experiment={preset}").dataset.augment
        assert (aug.crop_padding, aug.hflip) == (4, True), preset


def test_padding_fills_with_a_black_pixel():
    """digits has raw 0 pixels: their standardised value is what the crop pads with."""
    src = load_source("digits")
    assert src.pad_value == (float(src.train_x.min()),)
    plain = load_source("digits", normalize=False)
    assert plain.pad_value == (0.0,)


def test_conf_off_builds_nothing():
    assert Augmentation.build(AugmentConf(), (1, 8, 8), torch.float32, "digits") is None
    assert Augmentation.build(AugmentConf(crop_padding=0, hflip=False), (5,), torch.int64, "x") is None


def test_ssgd_applies_the_dataset_augmentation(tmp_path, monkeypatch):
    """S-SGD (one process) reads dataset.augment too: a rank's batches are cropped, keyed by (seed, epoch, rank)."""
    from fl_platform.ssgd.config import compose_ssgd_config
    from fl_platform.ssgd.distributed import free_port, init_distributed, shutdown
    from fl_platform.ssgd.trainer import SSGDTrainer

    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("GLOO_SOCKET_IFNAME", "lo")):
        monkeypatch.setenv(key, value)
    threads = torch.get_num_threads()
    ctx = init_distributed("auto", "cpu", 60)
    try:
        finals = []
        for extra in ((), ON):
            cfg = compose_ssgd_config(["train.steps=6", "logger.progress=false", "ssgd.threads=1", "eval_every=0",
                                       "save_model=false", f"run_dir={tmp_path / str(len(extra))}", *extra])
            trainer = SSGDTrainer(cfg, ctx)
            assert (trainer.data.augment is not None) is bool(extra)
            trainer.run()
            finals.append(trainer.fm.vector.detach().clone())
    finally:
        shutdown()
        torch.set_num_threads(threads)
    assert float((finals[0] - finals[1]).abs().max()) > 1e-4


@pytest.mark.slow
def test_a_flower_client_gets_the_augmentation():
    from fl_platform.flower import config as fc
    from fl_platform.flower.client_app import build_runtime

    threads = torch.get_num_threads()
    try:
        rt = build_runtime(fc.flatten_config(fc.compose([*TINY, *ON]), fc.DeployConf()), {"partition-id": 1, "threads": 1})
    finally:
        torch.set_num_threads(threads)
    assert rt.data.augment == Augmentation(1, True, load_source("digits").pad_value)
