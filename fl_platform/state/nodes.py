"""Node-local folders for client states: no node ever reads another node's path.

On a Ray cluster a home worker keeps its clients' states (``state_backend=disk``) in a folder of
its own node, found on that node: ``engine.state_dir`` (the same path interpreted on every node),
else the node's ``FL_NODE_STATE_DIR`` environment variable (set where the node is started, e.g.
``FL_NODE_STATE_DIR=/local/ssd ray start ...``), else the node's temporary folder. Under it each run
has its own folder and each node and worker a subfolder::

    <root>/<run id>/node-<node id>/worker-<w>/

The node id in the path means a worker restarted on another node never picks up files that are
not its node's (on a machine hosting several nodes, as in tests, they would be visible). These
folders are a run's working copy, removed when the run closes: checkpoints gather the states to
the driver (``gathered.py``), so nothing a resumed run needs lives only on a node.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

NODE_STATE_ENV = "FL_NODE_STATE_DIR"


def node_state_root(state_dir: str | None) -> Path:
    """Where this node keeps client-state folders (evaluated on the node)."""
    if state_dir:
        return Path(state_dir).expanduser()
    env = os.environ.get(NODE_STATE_ENV)
    if env:
        return Path(env).expanduser()
    return Path(tempfile.gettempdir()) / "fl_state"


def node_state_dir(state_dir: str | None, run_id: str, node_id: str) -> Path:
    """This run's folder on this node; each home worker adds ``worker-<w>``."""
    return node_state_root(state_dir) / run_id / f"node-{node_id[:16]}"
