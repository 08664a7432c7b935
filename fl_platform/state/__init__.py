"""Client-state manager: where per-client state (control variates, EF residuals, ...) lives."""

from fl_platform.state.disk import DiskStore
from fl_platform.state.distributed import DistributedStore, home_worker
from fl_platform.state.store import STORE_KINDS, MemoryStore, StateStore, make_store

__all__ = ["STORE_KINDS", "DiskStore", "DistributedStore", "MemoryStore", "StateStore", "home_worker", "make_store"]
