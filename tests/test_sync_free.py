"""No host synchronisation inside a client's steps, plain loop and vectorised cohorts (issue 25, item 5).

A GPU runs ahead of the host only as long as the host never waits for it. On this CPU-only machine the
test counts, with a ``TorchFunctionMode``, every call that would make the host wait for a CUDA device:

* reads of a device tensor's values: ``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``bool()``,
  ``float()``, ``int()``, ops whose output size depends on values (``nonzero``, ``masked_select``,
  ``unique``, indexing with a boolean mask), and ``bincount`` (CUDA reads the input's min and max);
* blocking host-to-device copies: ``.to(device)``, ``.cuda()`` or ``copy_`` of a *host* tensor without
  ``non_blocking=True``, ``torch.tensor``/``torch.as_tensor`` of host data with a ``device``, and ops
  mixing a host tensor (not a 0-dim scalar) with device tensors.

Reads of a host tensor are not counted (no device to wait for): e.g. ``torch.optim.Adam``'s step
counter, a CPU tensor it reads with ``.item()`` every step.

"Host" tensors are emulated: a tensor made by a factory (``torch.tensor``, ``from_numpy``, ``randperm``,
``zeros``, ...) without a ``device`` argument lives on the host (on a GPU machine it would be a CPU
tensor); results of ops on host tensors only are host tensors too; everything else is on the device.

A fit's count must not grow with its number of steps or epochs (one read per step, e.g. a per-step
``loss.item()``, turns the test red), and the per-fit reads after the last step are the listed ones.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from fl_platform.models import build_model
from fl_platform.training.flat import FlatModel
from fl_platform.training.hooks import ComposedHooks, GradientCorrectionHook, ProximalHook
from fl_platform.training.loop import ClientData, LocalTrainer, TrainConfig
from fl_platform.training.vectorised import CohortMember, CohortTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

T = torch.Tensor
READS = {T.item: "item", T.tolist: "tolist", T.numpy: "numpy", T.cpu: "cpu", T.__bool__: "bool",
         T.__float__: "float", T.__int__: "int", T.__index__: "index", T.nonzero: "nonzero",
         torch.nonzero: "nonzero", T.masked_select: "masked_select", torch.masked_select: "masked_select",
         torch.unique: "unique", T.unique: "unique", torch.argwhere: "argwhere"}
FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.empty, torch.full,
             torch.arange, torch.randperm, torch.rand, torch.randn, torch.randint, torch.linspace}
COPIES = {T.to, T.cuda, T.copy_}
BINCOUNT = {torch.bincount, T.bincount}
FROM_DATA = {torch.tensor, torch.as_tensor}  # with a device: a blocking copy of host data


def _host(t: object) -> bool:
    return isinstance(t, torch.Tensor) and getattr(t, "_fl_host", False)


def _mark(out: object) -> None:
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            t._fl_host = True


class SyncCounter(TorchFunctionMode):
    """Counts the calls that would synchronise a CUDA device with the host (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: Counter[str] = Counter()
        self._from_numpy = torch.from_numpy

    # ``torch.from_numpy`` bypasses torch-function modes: wrapped while counting, its tensors are host ones.
    def __enter__(self):
        original = self._from_numpy

        def from_numpy(array):
            out = original(array)
            out._fl_host = True
            return out

        torch.from_numpy = from_numpy
        return super().__enter__()

    def __exit__(self, *exc):
        torch.from_numpy = self._from_numpy
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in READS or func in BINCOUNT:
            if not (args and _host(args[0])):
                self.events[READS.get(func, "bincount")] += 1
            else:
                _mark(out)
            return out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func in FACTORIES:
            if kwargs.get("device") is None or self._optimiser_step_counter(kwargs["device"]):
                _mark(out)
            elif func in FROM_DATA and (not isinstance(args[0], torch.Tensor) or _host(args[0])):
                self.events["blocking host-to-device copy"] += 1
            return out
        if func is T.pin_memory:
            _mark(out)
            return out
        if func in COPIES:
            src = args[1] if func is T.copy_ else args[0]
            dst_host = _host(args[0]) if func is T.copy_ else not self._moves_to_device(args[1:], kwargs)
            if _host(src) and not dst_host and not kwargs.get("non_blocking", False) \
                    and not (len(args) > 2 and func is T.to and args[-1] is True):
                self.events["blocking host-to-device copy"] += 1
            if _host(src):  # (on the CPU, a copy to the "device" may return its source itself)
                out._fl_host = dst_host
            return out
        if func in (T.__getitem__, T.__setitem__) and any(t.dtype == torch.bool for t in tensors[1:]):
            self.events["boolean-mask indexing"] += 1
        host = [_host(t) for t in tensors]
        if tensors and all(host):
            _mark(out)
        elif any(h and t.dim() > 0 for h, t in zip(host, tensors)):
            self.events["host tensor in a device op"] += 1
        return out

    @staticmethod
    def _optimiser_step_counter(device: object) -> bool:
        """A tensor ``torch.optim`` makes with ``device="cpu"`` (Adam's step when neither capturable nor
        fused): a host tensor on a GPU machine too, read with ``.item()`` every step without a sync."""
        return torch.device(device).type == "cpu" and "/torch/optim/" in sys._getframe(2).f_code.co_filename

    @staticmethod
    def _moves_to_device(args: tuple, kwargs: dict) -> bool:
        """Whether ``Tensor.to(*args, **kwargs)`` names a device (or a device tensor) as its target."""
        targets = [*args, kwargs.get("device")]
        return any(isinstance(a, torch.device | str) or (isinstance(a, torch.Tensor) and not _host(a))
                   for a in targets if a is not None)


INPUT = (1, 8, 8)


def _clients(sizes: list[int]) -> list[ClientData]:
    """Clients' rows of shared device tensors (made with an explicit device: not host tensors)."""
    g = torch.Generator().manual_seed(0)
    total = sum(sizes)
    x = torch.randn(total, *INPUT, generator=g, device="cpu")
    y = torch.randint(0, 10, (total,), generator=g, device="cpu")
    starts = torch.tensor([0, *sizes]).cumsum(0).tolist()
    return [ClientData(x, y, torch.arange(lo, lo + n, device="cpu")) for lo, n in zip(starts, sizes)]


def _model(name: str) -> FlatModel:
    torch.manual_seed(0)
    options = {"norm": "batch"} if name == "cnn" else {}
    return FlatModel(build_model(name, INPUT, 10, **options))


def _hooks(fm: FlatModel) -> ComposedHooks:
    """FedProx's and SCAFFOLD's gradient corrections together (their tensors made on the device)."""
    anchor = fm.params.detach().clone()
    correction = torch.full_like(anchor, 1e-3)
    return ComposedHooks(ProximalHook(0.1, anchor), GradientCorrectionHook(correction))


def _count_plain(name: str, epochs: int, **train) -> Counter[str]:
    fm = _model(name)
    trainer = LocalTrainer(fm, TrainConfig(epochs=epochs, batch_size=4, **train))
    data, hooks = _clients([23])[0], _hooks(fm)
    with SyncCounter() as counter:
        trainer.fit(data, hooks, seed=0, round=0, client=0)
    return counter.events


def _count_cohort(name: str, epochs: int, **train) -> Counter[str]:
    fm = _model(name)
    cohort = CohortTrainer(fm, TrainConfig(epochs=epochs, batch_size=4, **train))
    start = fm.vector.detach().clone()
    datas = _clients([23, 9, 14, 5])  # short last batches: padding (MLP), per-batch-size calls (BatchNorm)
    members = [CohortMember(c, d, start, _hooks(fm)) for c, d in enumerate(datas)]
    cohort.unsupported_reason(datas[0].x, datas[0].y)  # the model's probe: once per trainer, before any fit
    with SyncCounter() as counter:
        cohort.fit(members, seed=0, round=0)
    return counter.events


SETTINGS = [{}, {"momentum": 0.9, "clip_norm": 1.0}, {"optimizer": "adam", "lr": 1e-3}, {"precision": "bf16"}]


def test_the_counter_sees_each_kind_of_sync():
    """The instrument itself: each kind of call it must catch is counted, a device-side op is not."""
    dev = torch.zeros(3, device="cpu")
    with SyncCounter() as counter:
        dev.sum().item()
        bool(dev.any())
        float(dev[0])
        dev.tolist()
        dev[dev > 0]
        dev.nonzero()
        hosts = [torch.from_numpy(dev.numpy().copy()), torch.zeros(3), torch.tensor([1.0, 2.0, 3.0]), torch.ones(3)]
        hosts[0].to("cpu")
        dev.copy_(hosts[1])
        hosts[2].to("cpu", non_blocking=True)  # not counted: asynchronous
        dev + hosts[3]
        (dev * 2).add_(1)  # not counted: stays on the device
        torch.bincount(dev.long(), minlength=3)
        torch.tensor(7, device=dev.device)
        torch.as_tensor([1.0], device=dev.device)
        torch.as_tensor(dev, device=dev.device)  # not counted: already there
        hosts[3].sum().item()  # not counted: a host value (Adam's step counter)
        torch.zeros(3, device=dev.device).index_add_(0, dev.long(), dev)  # not counted: bincount's sync-free twin
    assert counter.events == Counter({"item": 1, "bool": 1, "float": 1, "tolist": 1, "boolean-mask indexing": 1,
                                      "nonzero": 1, "numpy": 1, "blocking host-to-device copy": 4,
                                      "host tensor in a device op": 1, "bincount": 1})


# After the last step, once per fit: the loss sum, the finiteness of the trained vector and the correct
# count are read for the metrics and the NonFiniteError check.
PLAIN_PER_FIT = Counter({"float": 2, "bool": 1})


@pytest.mark.parametrize("model", ["mlp", "cnn"])
@pytest.mark.parametrize("train", SETTINGS, ids=["sgd", "momentum-clip", "adam", "bf16"])
def test_plain_loop_steps_do_not_synchronise(model, train):
    one, three = _count_plain(model, 1, **train), _count_plain(model, 3, **train)
    assert three == one, f"syncs grow with the steps: 6 steps {dict(one)}, 18 steps {dict(three)}"
    assert one == PLAIN_PER_FIT


# Once per fit: the losses and correct counts of all rows (two tolist), the rows' finiteness (one bool
# of the all-rows check, one tolist).
COHORT_PER_FIT = Counter({"tolist": 3, "bool": 1})


@pytest.mark.parametrize("model", ["mlp", "cnn"])
@pytest.mark.parametrize("train", SETTINGS, ids=["sgd", "momentum-clip", "adam", "bf16"])
def test_vectorised_steps_do_not_synchronise(model, train):
    if model == "cnn" and train.get("precision") == "bf16":
        pytest.skip("BatchNorm under vmap has no bf16 rule: such a cohort trains one by one "
                    "(tests/test_vectorised.py::test_bf16_batchnorm_cohort_is_not_vectorisable)")
    one, three = _count_cohort(model, 1, **train), _count_cohort(model, 3, **train)
    assert three == one, f"syncs grow with the steps: 1 epoch {dict(one)}, 3 epochs {dict(three)}"
    assert one == COHORT_PER_FIT


# ------------------------------------------------------------------ hooks, S-SGD compression, one-shot servers
# Per-step code outside the loop's default hooks: each count compares a short run with a longer one.


def _count_fedimpro(mode: str, epochs: int) -> Counter[str]:
    """A fit with FedImpro's loss-replacing hook (its per-step class statistics update included)."""
    from fl_platform.algorithms.fedimpro import ClassStats, FedImproHook, split_info

    fm = _model("mlp")
    split = split_info(fm.model, "auto")
    mu = torch.rand(10, split.dim, generator=torch.Generator().manual_seed(1), device="cpu")
    sigma = torch.full((10, split.dim), 0.1, device="cpu")
    hook = FedImproHook(split, mu, sigma, ClassStats(mode, mu, sigma, 0.1), (1.0, 0.5),
                        torch.Generator(device="cpu").manual_seed(0), 0.1)
    trainer = LocalTrainer(fm, TrainConfig(epochs=epochs, batch_size=4))
    with SyncCounter() as counter:
        trainer.fit(_clients([23])[0], hook, seed=0, round=0, client=0)
    return counter.events


@pytest.mark.parametrize("mode", ["exact", "last_batch"])
def test_fedimpro_class_statistics_do_not_synchronise(mode):
    """``ClassStats.update`` runs every step: counts by ``index_add_`` (not ``bincount``), the last-batch
    running averages by ``torch.where`` (not boolean masks)."""
    one, three = _count_fedimpro(mode, 1), _count_fedimpro(mode, 3)
    assert three == one, f"syncs grow with the steps: 6 steps {dict(one)}, 18 steps {dict(three)}"
    assert one == PLAIN_PER_FIT


def _count_acpsgd(steps: int, error_feedback: bool) -> Counter[str]:
    """ACP-SGD steps (world of one). A ``TorchFunctionMode`` does not reach autograd hooks, so the
    post-accumulate-grad hooks are taken off and called by hand after backward, in backward's order."""
    import torch.nn.functional as F

    from fl_platform.compression.errorfeedback import ErrorFeedback
    from fl_platform.compression.registry import build_compressor
    from fl_platform.ssgd.acp import ACPSGDSync

    fm = _model("mlp")
    comp = build_compressor("acpsgd", rank=1, error_feedback=error_feedback)
    assert isinstance(comp, ErrorFeedback) == error_feedback
    sync = ACPSGDSync(fm, comp, 0, 1)
    for h in sync._handles:
        h.remove()
    data = _clients([8])[0]
    with SyncCounter() as counter:
        for s in range(steps):
            fm.grad.zero_()
            F.cross_entropy(fm.model(data.x), data.y).backward()
            for e in reversed(sync.entries):
                sync._hook_for(e)(e.param)
            sync.before_step(s)
    return counter.events


@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "error-feedback"])
def test_acpsgd_hook_does_not_synchronise(error_feedback):
    """The wrapper passes the phase from its host step count: the factors' step counter is not read."""
    two, six = _count_acpsgd(2, error_feedback), _count_acpsgd(6, error_feedback)
    assert six == two, f"syncs grow with the steps: 2 steps {dict(two)}, 6 steps {dict(six)}"
    assert two == Counter()


@pytest.mark.parametrize("bits", [4, 3], ids=["whole-bytes", "bit-planes"])
def test_qsgd_encode_and_decode_do_not_synchronise(bits):
    """S-SGD's hook encodes and decodes every segment every step: QSGD's levels are in range by
    construction, so ``pack_uint`` is not asked to check them, and decoding's mask is a Python int."""
    from fl_platform.compression.base import Key
    from fl_platform.compression.qsgd import QSGD

    comp = QSGD(bits=bits, bucket=64)
    x = torch.randn(1000, device="cpu")

    def count(steps: int) -> Counter[str]:
        with SyncCounter() as counter:
            for s in range(steps):
                payload, state = comp.encode(x, None, Key(step=s))
                comp.decode(payload, state)
        return counter.events

    assert count(2) == count(6) == Counter()


@pytest.mark.parametrize(("ratio", "index"), [(0.1, "bitmap"), (0.01, "auto"), (0.01, "int32")])
def test_topk_encode_and_decode_do_not_synchronise(ratio, index):
    """Top-k in S-SGD's all-gather hook, every segment every step: the values are gathered by their sorted
    indices (not ``flat[mask]``) and a bitmap decodes by the mask's running count (not ``nonzero``), so
    neither reads a result size back. (``auto`` picks the bitmap for a 10-coordinate bias even at 0.01.)"""
    from fl_platform.compression.topk import TopK

    comp = TopK(ratio, index)
    xs = [torch.randn(1000, device="cpu"), torch.randn(10, device="cpu")]

    def count(steps: int) -> Counter[str]:
        with SyncCounter() as counter:
            for _ in range(steps):
                for x in xs:
                    comp.decode(comp.encode(x)[0])
        return counter.events

    assert count(2) == count(6) == Counter()


@functools.cache
def _oneshot_tests() -> ModuleType:
    """tests/test_oneshot_datafree.py, for its tiny BatchNorm teachers (by path: pytest imports with importlib)."""
    path = Path(__file__).with_name("test_oneshot_datafree.py")
    spec = importlib.util.spec_from_file_location("_sync_free_oneshot", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _datafree_server(cfg):
    return _oneshot_tests()._server(cfg)


def _datafree_counts(base, g_steps: int, kd_batch_size: int) -> Counter[str]:
    from dataclasses import replace

    cfg = replace(base, epochs=2, g_steps=g_steps, synthesis_batch_size=8, kd_batch_size=kd_batch_size, nz=8, ngf=4)
    server, _, _ = _datafree_server(cfg)
    with SyncCounter() as counter:
        server.build(None)
    return counter.events


@pytest.mark.parametrize("method", ["dense", "coboost"])
def test_datafree_generator_and_distillation_steps_do_not_synchronise(method):
    """Two epochs of DENSE / Co-Boosting: 2 generator steps and 2 distillation (and reweighting) batches
    per pass against 6 and 8. The best batch and its cost stay on the device, the KD loss is summed
    there, augmentation draws travel pinned, the ensemble weights are checked once per reweighting."""
    from fl_platform.algorithms.oneshot.coboost import CoBoostConf
    from fl_platform.algorithms.oneshot.dense import DenseConf

    base = DenseConf() if method == "dense" else CoBoostConf()
    short, long = _datafree_counts(base, 2, 8), _datafree_counts(base, 6, 2)
    assert long == short, f"syncs grow with the steps: {dict(short)} against {dict(long)}"


def test_synthesis_server_distill_does_not_synchronise():
    """``SynthesisServer.distill`` reads its mean KD loss once per pass, whatever the number of batches."""
    from dataclasses import replace

    from fl_platform.algorithms.oneshot.dense import DenseConf
    from fl_platform.algorithms.oneshot.distill import LogitEnsemble

    def count(kd_batch_size: int) -> Counter[str]:
        server, teachers, student = _datafree_server(replace(DenseConf(), kd_batch_size=kd_batch_size))
        student.train()
        low, _ = server.input_range()
        pool = [torch.rand(8, *INPUT, generator=torch.Generator().manual_seed(i), device="cpu") for i in range(2)]
        opt = torch.optim.SGD(student.parameters(), lr=0.01, momentum=0.9)
        with SyncCounter() as counter:
            server.distill(LogitEnsemble(teachers), None, student, opt, pool, low, torch.Generator().manual_seed(0))
        return counter.events

    assert count(8) == count(2) == Counter({"float": 1})


def test_feddf_distillation_steps_do_not_synchronise():
    """FedDF's epoch order goes to the device once per pass; its steps slice it there."""
    from dataclasses import replace

    from fl_platform.algorithms.oneshot.dense import DenseConf
    from fl_platform.algorithms.oneshot.feddf import FedDFConf, FedDFServer

    def count(steps: int) -> Counter[str]:
        donor, _, _ = _datafree_server(replace(DenseConf()))
        server = FedDFServer(FedDFConf(steps=steps, batch_size=4, eval_every=1000, val_fraction=0.25,
                                       cache_dir=None), donor.setup, donor.teachers[0])
        server.teachers, server.sizes = donor.teachers, donor.sizes
        g = torch.Generator().manual_seed(3)
        server.server_x = torch.rand(20, 1, 8, 8, generator=g)
        server.server_y = torch.randint(0, 4, (20,), generator=g)
        with SyncCounter() as counter:
            server.build(None)
        return counter.events

    short, long = count(4), count(12)  # 15 unlabelled samples: 3 steps a pass, reshuffled 1 and 4 times
    assert long == short, f"syncs grow with the steps: 4 steps {dict(short)}, 12 steps {dict(long)}"
