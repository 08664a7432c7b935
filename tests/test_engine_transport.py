"""The Ray engine's message transport: a Packed value's CPU tensors travel as numpy buffers (torch's
pickling for dtypes numpy lacks), bit-identical, writable, and only the engine's own messages are
affected."""

from __future__ import annotations

import pickle

import pytest
import torch

from fl_platform.core import Aggregate, Broadcast, ClientUpdate, Metrics
from fl_platform.engine.transport import Packed
from fl_platform.rounds.engine import WorkerResult


def _roundtrip(value):
    return pickle.loads(pickle.dumps(Packed(value), protocol=5))


@pytest.mark.parametrize("t", [
    torch.randn(7, 5),
    torch.randn(7, 5).t(),  # non-contiguous
    torch.randn(4, dtype=torch.float64),
    torch.arange(10) > 4,
    torch.randint(0, 255, (3, 3), dtype=torch.uint8),
    torch.randn(3, dtype=torch.complex64).conj(),  # a lazy conjugate
    torch.randn(5).to(torch.bfloat16),  # no numpy dtype: torch's pickling
    torch.empty(0, 3),
])
def test_tensors_survive_the_transport_bit_identically(t):
    got = _roundtrip(t)
    assert isinstance(got, torch.Tensor)  # the receiver gets the value, not a Packed
    assert got.dtype == t.dtype and got.shape == t.shape
    assert torch.equal(got, t.resolve_conj())
    got.add_(1) if got.dtype != torch.bool else got.logical_not_()  # writable, not a read-only buffer view


def test_requires_grad_is_kept():
    t = torch.randn(3, requires_grad=True)
    got = _roundtrip(t)
    assert got.requires_grad and torch.equal(got.detach(), t.detach())


def test_messages_come_back_whole_with_their_tensors_as_numpy_on_the_wire():
    agg = Aggregate()
    agg.add({"delta": torch.randn(6, dtype=torch.float64)}, {"n": 3.0}, count=2)
    update = ClientUpdate(4, {"logits": torch.randn(2, 3)}, {"n": 1.0}, 5, Metrics({"loss": [1.0, 2.0]}))
    result = WorkerResult(1, agg, [update], Metrics(), {4: 0.1}, 0.2, 10, 20,
                          outbox={7: {"c": torch.ones(4)}})
    wire = pickle.dumps(Packed(result), protocol=5)
    assert b"torch._utils" not in wire and b"_rebuild_tensor" not in wire  # no torch pickling inside
    got = pickle.loads(wire)
    assert isinstance(got, WorkerResult) and got.worker_id == 1 and got.aggregate.count == 2
    assert torch.equal(got.aggregate.tensors["delta"], agg.tensors["delta"])
    assert torch.equal(got.updates[0].tensors["logits"], update.tensors["logits"])
    assert got.updates[0].metrics.values == {"loss": [1.0, 2.0]}
    assert torch.equal(got.outbox[7]["c"], torch.ones(4))
    bc = Broadcast({"weights": torch.randn(5)}, {"lr": 0.1}, {3: {"keep": 0.5}})
    back = _roundtrip(bc)
    assert isinstance(back, Broadcast) and back.scalars == bc.scalars and back.per_client == bc.per_client
    assert torch.equal(back.tensors["weights"], bc.tensors["weights"])


def test_only_packed_values_are_affected():
    """Plain tensors elsewhere in the process keep torch's own pickling (no process-wide serialiser)."""
    wire = pickle.dumps(torch.randn(3), protocol=5)
    assert b"_rebuild_tensor" in wire


def test_a_datasets_tensors_arrive_as_views_of_the_received_buffers():
    """The dataset is not copied on arrival (through Ray: every worker of a node reads the node's
    object-store copy); other tensors of the same message are writable copies."""
    from fl_platform.datasets.federated import build_federated_dataset
    from fl_platform.rounds.setup import ExperimentSetup

    data = build_federated_dataset("synthetic", num_clients=5, seed=0)
    message = {"setup": ExperimentSetup(data, None, "fedavg", None, None, 0), "weights": torch.randn(4)}
    buffers: list[pickle.PickleBuffer] = []
    wire = pickle.dumps(Packed(message), protocol=5, buffer_callback=buffers.append)
    got = pickle.loads(wire, buffers=[memoryview(b).toreadonly() for b in buffers])  # read-only, as Ray's
    ds = got["setup"].dataset
    for name in ("train_x", "train_y", "test_x", "test_y"):
        assert getattr(ds, name).data_ptr() == getattr(data, name).data_ptr()  # the buffer itself, no copy
        assert torch.equal(getattr(ds, name), getattr(data, name))
    assert got["weights"].data_ptr() != message["weights"].data_ptr()
    got["weights"].add_(1)  # still a writable copy
    assert torch.equal(ds.client_indices(3), data.client_indices(3))


def test_views_packed_tensors_arrive_as_views_and_are_counted_as_received():
    """``Packed(views=True)`` (a reduction step's inputs): no copy on arrival; every tensor's bytes
    count in ``received_bytes`` (the driver's inbound traffic per round)."""
    from fl_platform.engine.transport import received_bytes

    agg = Aggregate()
    agg.add({"delta": torch.randn(6, dtype=torch.float64)}, {"n": 3.0})
    buffers: list[pickle.PickleBuffer] = []
    before = received_bytes()
    wire = pickle.dumps(Packed(agg, views=True), protocol=5, buffer_callback=buffers.append)
    got = pickle.loads(wire, buffers=buffers)
    assert got.tensors["delta"].data_ptr() == agg.tensors["delta"].data_ptr()
    assert received_bytes() - before == 6 * 8
    plain: list[pickle.PickleBuffer] = []
    copied = pickle.loads(pickle.dumps(Packed(agg), protocol=5, buffer_callback=plain.append), buffers=plain)
    assert copied.tensors["delta"].data_ptr() != agg.tensors["delta"].data_ptr()


def test_tensors_anywhere_in_the_value_travel_as_numpy_and_older_protocols_work():
    from types import SimpleNamespace

    value = {"box": SimpleNamespace(t=torch.arange(5.0)), "pair": (torch.ones(2), 3)}
    wire = pickle.dumps(Packed(value), protocol=5)
    assert b"_rebuild_tensor" not in wire
    got = pickle.loads(wire)
    assert torch.equal(got["box"].t, torch.arange(5.0)) and torch.equal(got["pair"][0], torch.ones(2))
    old = pickle.loads(pickle.dumps(Packed(value), protocol=4))  # no out-of-band buffers before protocol 5
    assert torch.equal(old["box"].t, torch.arange(5.0)) and old["pair"][1] == 3


def test_classes_defined_in_a_function_travel_by_value():
    """A user's model or data class given to the Python API may be local: the message still pickles
    (as Ray's own pickling would), with its tensors as numpy."""

    class Local:
        def __init__(self, t: torch.Tensor) -> None:
            self.t = t

    wire = pickle.dumps(Packed({"obj": Local(torch.arange(3.0))}), protocol=5)
    assert b"_rebuild_tensor" not in wire
    got = pickle.loads(wire)["obj"]
    assert type(got).__name__ == "Local" and torch.equal(got.t, torch.arange(3.0))
