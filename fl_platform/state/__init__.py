"""Client-state manager: where per-client state (control variates, EF residuals, ...) lives."""

from fl_platform.state.store import MemoryStore, StateStore, make_store

__all__ = ["MemoryStore", "StateStore", "make_store"]
