"""Per-client state in a SuperNode's ``context.state``, behind our StateStore interface.

Flower keeps ``context.state`` (a RecordDict) on the SuperNode across the rounds of a run, and
updates it only when the ClientApp returns normally, so a client that crashes mid-round keeps
its previous state. Each client's state is one ArrayRecord ``client-<id>`` holding the flat
tensors the algorithm declared (``ClientAlgorithm.state_spec``).
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, RecordDict

from fl_platform.algorithms.base import StateSpec
from fl_platform.state.store import State, StateStore

PREFIX = "client-"


class ContextStateStore(StateStore):
    """A StateStore over a Flower ``Context.state`` RecordDict."""

    def __init__(self, record: RecordDict, specs: dict[str, StateSpec]) -> None:
        super().__init__(specs)
        self.record = record

    @staticmethod
    def key(client_id: int) -> str:
        return f"{PREFIX}{int(client_id)}"

    def get(self, client_id: int) -> State | None:
        key = self.key(client_id)
        if key not in self.record.array_records:
            return None
        state = {name: t.clone() for name, t in self.record.array_records[key].to_torch_state_dict().items()}
        self._check(client_id, state)
        return {name: t.to(self.specs[name].dtype) for name, t in state.items()}

    def put(self, client_id: int, state: State) -> None:
        self._check(client_id, state)
        self.record[self.key(client_id)] = ArrayRecord(
            {name: t.detach().to("cpu", self.specs[name].dtype).contiguous().reshape(-1)
             for name, t in state.items()})

    def clients(self) -> list[int]:
        """Client ids with a stored state."""
        return sorted(int(k[len(PREFIX):]) for k in self.record.array_records if k.startswith(PREFIX))


def state_tensor(record: RecordDict, client_id: int, name: str) -> torch.Tensor | None:
    """One stored state tensor (for inspection and tests), None when absent."""
    key = ContextStateStore.key(client_id)
    if key not in record.array_records or name not in record.array_records[key]:
        return None
    return torch.from_numpy(record.array_records[key][name].numpy())
