"""Our Flower apps in one process: the ServerApp and a ClientApp per client over an in-process Grid.

    python -m fl_platform.flower.local algorithm=fedprox num_clients=4 clients_per_round=4 rounds=3

runs the experiment ``python -m fl_platform.run <same overrides>`` would simulate, but through the
Flower path: the run config (flattened, composed back), the messages and records, the strategy
and the ClientApp's own data loading, one SuperNode per client (``partition-id`` = client id).
It checks in seconds that an algorithm (a plug-in included) survives Flower, before a deployment
(docs/deploy.md); with every client in every round the final model equals the simulator's. Each
node loads the dataset itself, as a SuperNode does: keep the number of clients small.

``LocalGrid`` delivers each message straight to the ClientApp, synchronously at push time (one
Context per node, kept across rounds as a SuperNode keeps it); the tests also use its failure
injection (``down``, ``unavailable``, ``tamper``).
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from flwr.app import Context, Error, Message, Metadata, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity


class LocalGrid(Grid):
    """A Grid whose nodes run ``client_app`` in this process, synchronously at push time.

    ``down`` holds node ids that never answer (a node that died unnoticed), ``unavailable`` node
    ids for which the SuperLink answers itself with "node unavailable" (a node known to be
    offline); ``tamper(reply)`` may rewrite a reply before the server pulls it (to test rejection).
    """

    def __init__(self, client_app: Any, node_configs: Iterable[Mapping[str, Any]], run_config: Mapping[str, Any],
                 run_id: int = 1, first_node_id: int = 1000) -> None:
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = 1  # the SuperLink's node id
        TaskIdentity.task_id = 1
        self.app = client_app
        self.contexts = {
            first_node_id + i: Context(run_id=run_id, node_id=first_node_id + i, node_config=dict(nc),
                                       state=RecordDict(), run_config=dict(run_config))
            for i, nc in enumerate(node_configs)
        }
        self.down: set[int] = set()
        self.unavailable: set[int] = set()
        self.tamper: Callable[[Message], Message | None] | None = None
        self._replies: dict[str, Message] = {}
        self.pushed: list[Message] = []

    def set_run(self, run: Any) -> None:  # pragma: no cover - not used by our ServerApp
        self._run = run

    @property
    def run(self) -> Any:  # pragma: no cover
        return self._run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:  # pragma: no cover
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> list[int]:
        return sorted(self.contexts)

    def get_nodes(self) -> list[Any]:  # pragma: no cover
        return []

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for msg in messages:
            mid = uuid.uuid4().hex
            msg.metadata.__dict__["_message_id"] = mid
            self.pushed.append(msg)
            ids.append(mid)
            nid = msg.metadata.dst_node_id
            if nid in self.down:
                continue
            if nid in self.unavailable:  # as the SuperLink makes it: from the SuperLink itself
                md = msg.metadata
                self._replies[mid] = Message(
                    Error(code=5, reason="Error: Node Unavailable"),
                    metadata=Metadata(run_id=md.run_id, message_id="", src_node_id=1, dst_node_id=1,
                                      reply_to_message_id=mid, group_id=md.group_id, created_at=time.time(),
                                      ttl=md.ttl, message_type=md.message_type))
                continue
            try:
                reply = self.app(msg, self.contexts[nid])
            except Exception as err:  # what a SuperNode sends back when the ClientApp raises
                reply = Message(Error(code=2, reason=f"{type(err)}:<'{err}'>"), reply_to=msg)
            if self.tamper is not None:
                reply = self.tamper(reply)
            if reply is not None:
                self._replies[mid] = reply
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self._replies.pop(mid) for mid in list(message_ids) if mid in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        return self.pull_messages(self.push_messages(messages))


def nodes_for(num_clients: int, threads: int = 1) -> list[dict[str, Any]]:
    """One SuperNode's node config per client."""
    return [{"partition-id": i, "num-partitions": num_clients, "threads": threads} for i in range(num_clients)]


def run_local(overrides: Iterable[str] = (), run_dir: str | Path | None = None, **deploy: Any) -> dict[str, Any]:
    """Run the experiment of ``overrides`` through the ServerApp and in-process ClientApps; the summary."""
    import torch

    from fl_platform.flower.client_app import app as client_app
    from fl_platform.flower.config import DeployConf, compose, flatten_config
    from fl_platform.flower.server_app import run_server

    cfg = compose(list(overrides))
    deploy = {"round_timeout": 60.0, "poll_interval": 0.01, "connect_timeout": 10.0, **deploy}
    run_config = flatten_config(cfg, DeployConf(**deploy))
    threads = torch.get_num_threads()  # the ClientApp sets torch's threads for the process (threads=1)
    try:
        grid = LocalGrid(client_app, nodes_for(cfg.num_clients), run_config)
        return run_server(grid, run_config, run_id=1, run_dir=run_dir)
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fl_platform.flower.local", description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m fl_platform.run")
    parser.add_argument("--run-dir", type=Path, help="where results go (default: outputs/flower/<time>_...)")
    args = parser.parse_args(argv)
    try:
        summary = run_local(args.overrides, args.run_dir)
    except Exception as err:  # Hydra's and our config errors name the key
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    print(f"final test accuracy: {summary['final_test_accuracy']:.4f} after {summary['rounds']} rounds "
          f"through Flower ({summary['num_clients']} in-process SuperNodes)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
