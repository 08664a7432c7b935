"""How the platform's own messages travel between the driver and Ray workers.

Only values the engine wraps in :class:`Packed` are affected; every other tensor in the process is
pickled by torch as usual. A packed value's CPU tensors travel as numpy arrays, whose buffers
pickle protocol 5 moves without a copy (torch's own pickling of a tensor costs about 0.3 ms more
per message: measured 1.95 vs 1.22 ms for a call with a 9,610-parameter model each way). Kept by
issue 25 item 9's rule (a CPU-side speed-up stays only where a benchmark shows it gains more than
5 %): on the engine benchmark (100/10, Ray with 2 workers) rounds with these reductions take 0.70
[0.53, 0.92] of the time they take with every tensor through torch's pickling (10 paired runs on a
shared host; docs/benchmarks.md, "CPU micro-optimisations"). The
receiver gets the original value back, bit-identical, with writable CPU tensors. A tensor on an
accelerator is copied to the CPU before it travels, so nothing is ever deserialised onto a device
the receiver may not have (the receiver moves what it needs to its own device).

A packed value goes through the platform's own pickler (``_Pickler``: Ray's cloudpickle with these
reductions in its dispatch table, and only there): they reach every tensor of exactly
``torch.Tensor`` type anywhere in the value, and tensor subclasses (``nn.Parameter``) keep torch's
pickling, slower but equally exact. The value is pickled in one pass into one bytes object and its
arrays' buffers are handed to whoever pickles the ``Packed`` (Ray) to move out of band. A worker's
5-client result (a 9,610-parameter aggregate) takes 28 us to pack and 12 us to unpack this way
(pickling alone), against 70 and 60 us when the engine walked the value in Python to swap its
tensors before pickling it.

The dataset's tensors (a ``FederatedDataset``, exactly that type, anywhere in the value) are the
exception to "writable": they arrive as views of the received buffers, not copies. Through Ray that
is the node's object-store copy, shared by every worker of the node, so a node holds the training
data once however many workers it runs (a million Synthetic clients: 3.4 GB per node instead of one
more copy per worker). Nothing writes to a dataset's tensors; a worker that did would change them
for the other workers of its node.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections import ChainMap
from typing import Any

import numpy as np
import torch
from ray import cloudpickle

from fl_platform.datasets.federated import FederatedDataset

_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool, torch.complex64, torch.complex128}


def _tensor_from(data: Any, requires_grad: bool, shared: bool) -> torch.Tensor:
    """The receiver's tensor: a writable copy of ``data`` (a numpy array), or with ``shared`` a view of
    it (a dataset's: module docstring)."""
    if shared:
        with warnings.catch_warnings():  # Ray's zero-copy arrays are flagged read-only; torch warns
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            t = torch.from_numpy(data)
    else:  # a writable copy: Ray hands out read-only zero-copy arrays
        t = torch.from_numpy(np.array(data))
    _RECEIVED[0] += t.numel() * t.element_size()
    return t.requires_grad_() if requires_grad else t


def _reduce_tensor(t: torch.Tensor, shared: bool = False) -> tuple[Any, tuple[Any, ...]]:
    requires_grad = t.requires_grad
    t = t.detach().cpu()
    if t.layout == torch.strided and t.dtype in _NUMPY_DTYPES and not t.is_quantized:
        return _tensor_from, (t.resolve_conj().resolve_neg().numpy(), requires_grad, shared)
    return t.__reduce_ex__(5)  # bfloat16, sparse, quantized: torch's pickling (CPU tensors only)


def _reduce_shared(t: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    return _reduce_tensor(t, shared=True)


class _Shared:
    """A dataset's tensor in a message: it travels like any other and arrives as a view."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _reduce_shared(self.tensor)


def _shared(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _Shared(value)
    if isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
        return [_Shared(v) for v in value]  # the training features' row blocks
    return value


def _reduce_dataset(data: FederatedDataset) -> tuple[Any, tuple[Any, ...]]:
    return _rebuild, (type(data), {k: _shared(v) for k, v in data.__getstate__().items()})


def _rebuild(cls: type, state: dict[str, Any]) -> Any:
    out = object.__new__(cls)
    vars(out).update(state)
    return out


class _Pickler(cloudpickle.Pickler):
    """Pickles a Packed value: its tensors as numpy arrays (writable copies on arrival), a
    ``FederatedDataset``'s as views. Only this pickler has these reductions (no process-wide
    serialiser); they apply to tensors of exactly ``torch.Tensor`` type and datasets of exactly
    ``FederatedDataset`` type, anywhere in the value (subclasses keep their own pickling). It is
    Ray's cloudpickle, so what Ray itself could send still travels: classes and functions defined
    in a function or in ``__main__`` (a user's model or data class given to the Python API) go by
    value."""

    dispatch_table = ChainMap({torch.Tensor: _reduce_tensor, FederatedDataset: _reduce_dataset},
                              cloudpickle.Pickler.dispatch_table)


class _ViewsPickler(_Pickler):
    """``_Pickler`` with every tensor arriving as a view (``Packed(views=True)``)."""

    dispatch_table = ChainMap({torch.Tensor: _reduce_shared}, _Pickler.dispatch_table)


#: Tensor bytes this process has received in Packed messages (what the engine reports as the driver's
#: inbound traffic per round: ``received_bytes()`` before and after).
_RECEIVED = [0]


def received_bytes() -> int:
    return _RECEIVED[0]


def _load(header: bytes, buffers: list[Any]) -> Any:
    return pickle.loads(header, buffers=buffers)


class Packed:
    """Wrap a message for Ray: the receiver unpickles the value itself, not a ``Packed``.

    ``views=True``: every tensor arrives as a read-only view of the received buffer, like a
    dataset's; for a receiver that only reads it (a reduction step that sums two partial
    aggregates into a new one), which saves a copy of each.
    """

    __slots__ = ("value", "views")

    def __init__(self, value: Any, views: bool = False) -> None:
        self.value = value
        self.views = views

    def __reduce_ex__(self, protocol: int) -> tuple[Any, tuple[bytes, list[pickle.PickleBuffer]]]:
        # The value through our own pickler (no walk over the value), its arrays' buffers apart:
        # whoever pickles the Packed (Ray) moves them out of band, without a copy.
        buffers: list[pickle.PickleBuffer] = []
        out = io.BytesIO()
        pickler = (_ViewsPickler if self.views else _Pickler)(
            out, protocol=5, buffer_callback=buffers.append if protocol >= 5 else None)
        pickler.dump(self.value)
        return _load, (out.getvalue(), buffers)
