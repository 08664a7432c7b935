"""One Flower strategy for every algorithm: the server half does the maths, this moves the data.

``AlgorithmStrategy`` is a Flower ``Strategy`` (configure_train / aggregate_train) whose round
is: build the algorithm's broadcast once, send each sampled client's SuperNode its train message,
wait for replies (``deploy.round_timeout``), reject replies that are errors, malformed, of the wrong
size (the client half's ``contribution_sizes``), non-finite or shaped differently from the round's others (each logged with its reason, never aggregated),
then fold the accepted contributions in client-id order into our float64 ``Aggregate`` (or hand
the list sorted by client id to a non-summable algorithm) and call the server half's
``aggregate``. A round with fewer than ``deploy.min_replies`` valid replies stops the run.

``FlowerEngine`` puts the same steps behind our ``Engine`` interface, so the ServerApp runs the
simulator's own round loop (sampling from (seed, round), evaluation cadence, metrics rows,
summary) with Flower as the transport: the run directory has the simulator's format, and the
bytes in it are measured on the serialised messages.

Which SuperNode holds which client is learned by asking every node for its ``partition-id``
(a ``query.identify`` message); nodes that join later are asked when they appear.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fl_platform.algorithms.base import ServerAlgorithm
from fl_platform.core import Aggregate, Broadcast, ClientUpdate, Metrics, RoundContext
from fl_platform.flower.config import DeployConf
from fl_platform.flower.payloads import PayloadCodec
from fl_platform.flower.records import (
    IDENTIFY,
    InvalidReply,
    decode_payloads,
    decode_update,
    encode_tensors,
    encode_train,
    message_nbytes,
)
from fl_platform.rounds.engine import Engine, WorkerResult
from fl_platform.rounds.sampling import sample_clients

log = logging.getLogger(__name__)


class NotEnoughReplies(RuntimeError):
    """A round ended with fewer valid replies than ``deploy.min_replies``."""


@dataclass
class RoundPlan:
    """One round's train messages: which node got which client's message."""

    ctx: RoundContext
    messages: list[Message]
    client_of_node: dict[int, int]
    unreachable: dict[int, str]  # sampled clients no SuperNode holds
    bytes_down: int
    started: float = field(default_factory=time.perf_counter)


def signature(update: ClientUpdate) -> tuple:
    """What must agree between the replies of a round: tensor names, shapes, dtypes and weight names."""
    return (tuple(sorted((k, tuple(t.shape), str(t.dtype)) for k, t in update.tensors.items())),
            tuple(sorted(update.weights)))


class AlgorithmStrategy(Strategy):
    """Flower strategy wrapping our ServerAlgorithm (see the module docstring)."""

    def __init__(self, server: ServerAlgorithm, *, seed: int, num_rounds: int, num_clients: int,
                 clients_per_round: int, deploy: DeployConf | None = None,
                 expected_sizes: dict[str, int] | None = None, codec: PayloadCodec | None = None,
                 privacy: Any = None, uploads: Iterable[str] = ()) -> None:
        self.server = server
        self.codec = codec  # decodes compressed uplinks (None: the run has no compressor)
        # fl_platform.privacy.server.ServerPrivacy (None: no DP): under central DP every decoded reply is
        # clipped to the round's C here, whatever the client did; the noise is the round loop's.
        self.privacy = privacy
        # What a reply is checked against (ClientUpdate.problem): the names it may carry (ClientAlgorithm.uploads;
        # () = not checked) and the sizes of those whose size is known; under DP only the private ones travel.
        private = None if privacy is None else set(privacy.private.tensors)
        self.uploads = tuple(k for k in uploads if private is None or k in private)
        self.expected_sizes = {k: n for k, n in (expected_sizes or {}).items() if private is None or k in private}
        self.seed = seed
        self.num_rounds = num_rounds
        self.num_clients = num_clients
        self.clients_per_round = clients_per_round
        self.deploy = deploy or DeployConf()
        self.node_of: dict[int, int] = {}  # client id -> node id
        self.refused: dict[int, str] = {}  # node id -> why it holds no client
        self.last_stats: dict[str, object] = {}
        self._plan: RoundPlan | None = None
        self._identifying: dict[str, tuple[int, float]] = {}  # identify message id -> (node id, sent at)
        self._size_cache: dict[str, int] = {}

    # ------------------------------------------------------------------ nodes

    def _register(self, nid: int, reply: Message) -> None:
        """Record which client node ``nid`` holds from its identify reply (or why it holds none).

        The node id comes from our own record of the query: an error reply made by the SuperLink
        (node unavailable) names the SuperLink as its source.
        """
        if reply.has_error():
            self.refused[nid] = f"identify failed: {reply.error.reason}"
            log.error("SuperNode %d cannot take part: %s", nid, reply.error.reason)
            return
        try:
            info = reply.content.metric_records["info"]
            cid = int(info["partition-id"])
            parts = info.get("num-partitions")
        except (KeyError, TypeError, ValueError) as err:
            self.refused[nid] = f"malformed identify reply: {err!r}"
        else:
            if parts is not None and parts != self.num_clients:
                self.refused[nid] = f"num-partitions={parts} but the run has num_clients={self.num_clients}"
            elif not 0 <= cid < self.num_clients:
                self.refused[nid] = f"partition-id={cid} out of range for num_clients={self.num_clients}"
            elif cid in self.node_of and self.node_of[cid] != nid:
                self.refused[nid] = f"partition-id={cid} is already held by SuperNode {self.node_of[cid]}"
            else:
                self.node_of[cid] = nid
                log.info("SuperNode %d holds client %d", nid, cid)
                return
        log.error("SuperNode %d refused: %s", nid, self.refused[nid])

    def refresh(self, grid: Grid) -> None:
        """Forget nodes that left, read identify replies that arrived, ask nodes that joined.

        Never blocks: a node that joins mid-run is asked now and used from the next round on.
        """
        online = set(grid.get_node_ids())
        for cid, nid in list(self.node_of.items()):
            if nid not in online:
                log.warning("SuperNode %d (client %d) left the federation", nid, cid)
                del self.node_of[cid]
                # a node refused as a duplicate of this one may take its place
                self.refused = {n: r for n, r in self.refused.items() if "already held" not in r}
        self.refused = {n: r for n, r in self.refused.items() if n in online}
        if self._identifying:
            for reply in grid.pull_messages(sorted(self._identifying)):
                asked = self._identifying.pop(reply.metadata.reply_to_message_id, None)
                if asked is not None:
                    self._register(asked[0], reply)
            now = time.monotonic()
            for mid, (nid, sent) in list(self._identifying.items()):
                if nid not in online or now - sent > self.deploy.round_timeout:
                    log.warning("SuperNode %d did not answer the identify query; asking again", nid)
                    del self._identifying[mid]
        asking = {nid for nid, _ in self._identifying.values()}
        new = sorted(online - set(self.node_of.values()) - set(self.refused) - asking)
        if self.deploy.identify_in_flight:  # the rest are asked as replies come in
            new = new[: max(0, self.deploy.identify_in_flight - len(self._identifying))]
        if new:
            messages = [Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=nid,
                                message_type=IDENTIFY, ttl=self.deploy.round_timeout) for nid in new]
            now = time.monotonic()
            for nid, mid in zip(new, grid.push_messages(messages)):
                if mid:
                    self._identifying[mid] = (nid, now)

    def connect(self, grid: Grid) -> None:
        """Wait until ``deploy.min_nodes`` SuperNodes (default: one per client) hold clients."""
        need = self.deploy.min_nodes or self.num_clients
        deadline = time.monotonic() + self.deploy.connect_timeout
        while True:
            self.refresh(grid)
            if len(self.node_of) >= need:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"only {len(self.node_of)} of {need} SuperNodes hold a client after "
                    f"{self.deploy.connect_timeout:g} s (deploy.min_nodes, deploy.connect_timeout); "
                    f"refused nodes: {self.refused or 'none'}")
            time.sleep(self.deploy.poll_interval)
        log.info("%d SuperNodes hold clients %s", len(self.node_of), sorted(self.node_of))

    # ------------------------------------------------------------------ one round

    def round_context(self, round: int) -> RoundContext:
        """The simulator's context for 0-based ``round`` (Flower's server-round is round + 1)."""
        clients = sample_clients(self.seed, round, self.num_clients, self.clients_per_round)
        return RoundContext(round=round, seed=self.seed, clients=clients, num_rounds=self.num_rounds,
                            num_clients=self.num_clients)

    def nbytes(self, message: Message) -> int:
        """Serialised size, reusing the sizes of objects measured this round (the shared broadcast)."""
        from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

        total = 0
        for oid, obj in get_all_nested_objects(message).items():
            size = self._size_cache.get(oid)
            if size is None:
                size = len(obj.deflate())
                self._size_cache[oid] = size
            total += size
        return total

    def plan(self, ctx: RoundContext, broadcast: Broadcast) -> RoundPlan:
        """One train message per sampled client that a SuperNode holds."""
        messages: list[Message] = []
        client_of_node: dict[int, int] = {}
        unreachable: dict[int, str] = {}
        bytes_down = 0
        self._size_cache.clear()
        tensors = encode_tensors(broadcast.tensors)  # serialised once, shared by every message
        for cid in ctx.clients:
            nid = self.node_of.get(cid)
            if nid is None:
                unreachable[cid] = "no SuperNode holds this client"
                continue
            msg = Message(encode_train(ctx, broadcast, cid, tensors), dst_node_id=nid, message_type="train",
                          group_id=str(ctx.round + 1), ttl=self.deploy.round_timeout)
            bytes_down += self.nbytes(msg)
            messages.append(msg)
            client_of_node[nid] = cid
        return RoundPlan(ctx, messages, client_of_node, unreachable, bytes_down)

    def exchange(self, grid: Grid, messages: list[Message], timeout: float) -> list[Message]:
        """Push ``messages`` and pull replies until all arrived or ``timeout`` seconds passed."""
        if not messages:
            return []
        pending = {mid for mid in grid.push_messages(messages) if mid}
        deadline = time.monotonic() + timeout
        replies: list[Message] = []
        while pending:
            for reply in grid.pull_messages(sorted(pending)):
                if reply.metadata.reply_to_message_id in pending:
                    pending.discard(reply.metadata.reply_to_message_id)
                    replies.append(reply)
                else:  # a second reply to a message, or one to no message of this round
                    log.warning("ignored a reply from node %d to message %s: not a pending message of this round",
                                reply.metadata.src_node_id, reply.metadata.reply_to_message_id)
            if not pending or time.monotonic() >= deadline:
                break
            time.sleep(self.deploy.poll_interval)
        return replies

    def collect(self, plan: RoundPlan, replies: Iterable[Message]) -> WorkerResult:
        """Validate the replies and fold the accepted ones in client-id order."""
        ctx = plan.ctx
        rejected: dict[int, str] = dict(plan.unreachable)
        candidates: list[ClientUpdate] = []
        bytes_up = 0
        seen: set[int] = set()
        # Replies are matched to clients by the message they answer: a SuperLink-made error reply
        # (node unavailable) names the SuperLink, not the node, as its source.
        client_of_message = {m.metadata.message_id: plan.client_of_node[m.metadata.dst_node_id]
                             for m in plan.messages}
        for reply in replies:
            cid = client_of_message.get(reply.metadata.reply_to_message_id)
            if cid is None or cid in seen:
                log.warning("round %d: ignored an unexpected reply (from node %d)", ctx.round + 1,
                            reply.metadata.src_node_id)
                continue
            seen.add(cid)
            bytes_up += message_nbytes(reply)
            if reply.has_error():
                rejected[cid] = f"error reply (code {reply.error.code}): {reply.error.reason}"
                continue
            try:
                update = decode_update(reply.content)
            except InvalidReply as err:
                rejected[cid] = f"malformed reply: {err}"
                continue
            if update.client_id != cid:
                rejected[cid] = f"reply claims to be client {update.client_id}"
                continue
            try:
                self.unpack(ctx, update, reply)
            except (InvalidReply, ValueError, RuntimeError, IndexError) as err:
                rejected[cid] = f"undecodable payload: {err}"
                continue
            if self.privacy is not None:
                try:
                    self.privacy.bound(update)
                except ValueError as err:
                    rejected[cid] = f"not a private update: {err}"
                    continue
            why = self.unexpected(update)
            if why:
                rejected[cid] = why
                continue
            bad = [k for k, t in update.tensors.items() if t.is_floating_point() and not bool(t.isfinite().all())]
            if bad:
                rejected[cid] = f"non-finite values in {bad}"
                continue
            candidates.append(update)
        for cid in plan.client_of_node.values():
            if cid not in seen:
                rejected[cid] = f"no reply within {self.deploy.round_timeout:g} s (deploy.round_timeout)"
        accepted = self.consensus(ctx, candidates, rejected)
        for cid in sorted(rejected):
            log.warning("round %d: client %d rejected: %s", ctx.round + 1, cid, rejected[cid])
        if len(accepted) < self.deploy.min_replies:
            raise NotEnoughReplies(
                f"round {ctx.round + 1}: {len(accepted)} valid replies of {len(ctx.clients)} sampled clients, "
                f"deploy.min_replies={self.deploy.min_replies}; rejected: {rejected}")
        aggregate = Aggregate()
        metrics = Metrics()
        updates: list[ClientUpdate] = []
        for update in accepted:  # client-id order
            metrics.merge(update.metrics)
            if self.server.summable:
                aggregate.add_update(update)
            else:
                updates.append(update)
        payload = sum(u.bytes_up or sum(t.numel() * t.element_size() for t in u.tensors.values()) for u in accepted)
        self.last_stats = {"payload_bytes_up": payload}
        if rejected:
            self.last_stats["rejected_reasons"] = {str(c): rejected[c] for c in sorted(rejected)}
        return WorkerResult(worker_id=0, aggregate=aggregate, updates=updates, metrics=metrics,
                            client_seconds={}, busy_seconds=time.perf_counter() - plan.started,
                            bytes_up=bytes_up, bytes_down=plan.bytes_down, rejected=rejected)

    def unexpected(self, update: ClientUpdate) -> str | None:
        """Why a decoded reply is not a contribution of this run (``ClientUpdate.problem``), or None. Checked
        even when every reply of the round agrees (one sampled client): the consensus alone accepted a delta
        of another shape (the server step crashed) or none at all (a silent no-op round)."""
        return update.problem(self.expected_sizes, self.uploads)

    def unpack(self, ctx: RoundContext, update: ClientUpdate, reply: Message) -> None:
        """Decode the compressed payloads of a reply into ``update.tensors`` (see payloads.py)."""
        payloads, shapes = decode_payloads(reply.content)
        if not payloads:
            return
        if self.codec is None:
            raise InvalidReply(f"compressed payloads {sorted(payloads)} but this run has no compressor")
        clash = sorted(set(payloads) & set(update.tensors))
        if clash:
            raise InvalidReply(f"tensors {clash} sent both dense and compressed")
        update.tensors.update(self.codec.unpack(ctx, update.client_id, payloads, shapes, update.weights))

    @staticmethod
    def consensus(ctx: RoundContext, candidates: list[ClientUpdate], rejected: dict[int, str]) -> list[ClientUpdate]:
        """Keep the replies whose tensor names/shapes agree with the most replies (ties: lowest client id).

        Summable contributions must agree to be added; the algorithm's own code never sees the others.
        """
        candidates = sorted(candidates, key=lambda u: u.client_id)
        if not candidates:
            return []
        counts = Counter(signature(u) for u in candidates)
        first = {}
        for u in candidates:
            first.setdefault(signature(u), u.client_id)
        best = max(counts, key=lambda s: (counts[s], -first[s]))
        accepted = []
        for u in candidates:
            if signature(u) == best:
                accepted.append(u)
            else:
                rejected[u.client_id] = (f"tensors {dict((k, s) for k, s, _ in signature(u)[0])} differ from the "
                                         f"round's accepted {dict((k, s) for k, s, _ in best[0])}")
        return accepted

    def finish_round(self, plan: RoundPlan, result: WorkerResult) -> dict[str, float]:
        """The server half's step on the round's accepted contributions."""
        combined: Aggregate | list[ClientUpdate] = result.aggregate if self.server.summable else result.updates
        return self.server.aggregate(plan.ctx, combined)

    # ------------------------------------------------------------------ Flower's Strategy API

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Messages for Flower's round ``server_round`` (1-based); ``arrays`` is unused: the server
        half holds the global state."""
        if self.privacy is not None:
            raise NotImplementedError(
                "client-level DP runs through run_server (fl_platform/flower/server_app.py), whose round loop adds the "
                "noise, accounts for it and stops at privacy.target_epsilon; Flower's Strategy API path "
                "(configure_train/aggregate_train) does none of that")
        self.refresh(grid)
        ctx = self.round_context(server_round - 1)
        self._plan = self.plan(ctx, self.server.broadcast(ctx))
        return self._plan.messages

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        plan = self._plan
        if plan is None or plan.ctx.round != server_round - 1:
            raise RuntimeError(f"aggregate_train({server_round}) without configure_train for that round")
        result = self.collect(plan, replies)
        extra = self.finish_round(plan, result)
        metrics = {k: v for k, v in result.metrics.means().items() if k != "local_steps"}
        metrics.update({k: float(v) for k, v in extra.items()})
        metrics.update(num_clients=len(plan.ctx.clients) - len(result.rejected), bytes_up=result.bytes_up,
                       bytes_down=result.bytes_down)
        return ArrayRecord({"weights": self.server.weights}), MetricRecord(metrics)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """No client-side evaluation: the server evaluates the global model on the test set."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        log.info("AlgorithmStrategy(%s): %d clients, %d per round, round timeout %g s, min replies %d",
                 type(self.server).__name__, self.num_clients, self.clients_per_round,
                 self.deploy.round_timeout, self.deploy.min_replies)


class FlowerEngine(Engine):
    """The simulator's Engine interface over a Flower Grid: one round = one exchange of messages."""

    num_workers = 1

    def __init__(self, strategy: AlgorithmStrategy, grid: Grid) -> None:
        self.strategy = strategy
        self.grid = grid

    def run_round(self, ctx: RoundContext, broadcast: Broadcast) -> list[WorkerResult]:
        self.strategy.refresh(self.grid)
        plan = self.strategy.plan(ctx, broadcast)
        replies = self.strategy.exchange(self.grid, plan.messages, self.strategy.deploy.round_timeout)
        return [self.strategy.collect(plan, replies)]

    def round_stats(self) -> dict[str, float]:
        return dict(self.strategy.last_stats)  # type: ignore[arg-type]
