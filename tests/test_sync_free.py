"""No host synchronisation inside a client's steps, plain loop and vectorised cohorts (issue 25, item 5).

A GPU runs ahead of the host only as long as the host never waits for it. On this CPU-only machine the
test counts, with a ``TorchFunctionMode``, every call that would make the host wait for a CUDA device:

* reads of a device tensor's values: ``.item()``, ``.tolist()``, ``.numpy()``, ``.cpu()``, ``bool()``,
  ``float()``, ``int()``, and ops whose output size depends on values (``nonzero``, ``masked_select``,
  ``unique``, indexing with a boolean mask);
* blocking host-to-device copies: ``.to(device)``, ``.cuda()`` or ``copy_`` of a *host* tensor without
  ``non_blocking=True``, and ops mixing a host tensor (not a 0-dim scalar) with device tensors.

"Host" tensors are emulated: a tensor made by a factory (``torch.tensor``, ``from_numpy``, ``randperm``,
``zeros``, ...) without a ``device`` argument lives on the host (on a GPU machine it would be a CPU
tensor); results of ops on host tensors only are host tensors too; everything else is on the device.

A fit's count must not grow with its number of steps or epochs (one read per step, e.g. a per-step
``loss.item()``, turns the test red), and the per-fit reads after the last step are the listed ones.
"""

from __future__ import annotations

from collections import Counter

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
        if func in READS:
            self.events[READS[func]] += 1
            return out
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if func in FACTORIES:
            if kwargs.get("device") is None:
                _mark(out)
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
    assert counter.events == Counter({"item": 1, "bool": 1, "float": 1, "tolist": 1, "boolean-mask indexing": 1,
                                      "nonzero": 1, "numpy": 1, "blocking host-to-device copy": 2,
                                      "host tensor in a device op": 1})


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
