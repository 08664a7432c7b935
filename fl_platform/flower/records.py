"""Broadcast / ClientUpdate <-> Flower RecordDicts, generically.

Every algorithm's messages travel the same way, so an algorithm needs no Flower code:

train message (server -> client)                 reply (client -> server)
  "context"  ConfigRecord: round (0-based), seed,   "update"   ArrayRecord: ClientUpdate.tensors
             num_rounds, num_clients, client_id      "weights"  MetricRecord: ClientUpdate.weights
                                                     "metrics"  MetricRecord: name -> [sum, count]
  "tensors"  ArrayRecord: Broadcast.tensors          "info"     MetricRecord: client_id, num_samples,
  "scalars"  ConfigRecord: Broadcast.scalars                    bytes_up, num-examples (Flower's name)
  "client"   ConfigRecord: Broadcast.per_client[id]  "payloads" ArrayRecord (optional): name -> the
                                                                compressor's payload bytes (uint8)
                                                     "payload_shapes" MetricRecord: name -> shape

A client is told its own id and what it needs to train (the seed: its minibatch order, augmentation
and compression draws are (seed, round, client) streams, as in the simulator), never the round's cohort:
its ``RoundContext.clients`` is itself alone. No DP noise is derived from anything here: in a
deployment the server and each client draw it from their own OS CSPRNG (``privacy.clipping.gaussian_noise``).
Under local DP the reply's sample count is 0 and its metrics are only what compression computes
from the noised update (``ClientPrivacy.apply``).

Tensors keep their names, shapes and dtypes. ``message_nbytes`` is the size of a message as
Flower serialises it (its distinct objects: identical array chunks are sent once).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fl_platform.core import Broadcast, ClientUpdate, Metrics, RoundContext
from fl_platform.rounds.simulation import SERVER_COLUMNS

CONTEXT, TENSORS, SCALARS, CLIENT = "context", "tensors", "scalars", "client"
UPDATE, WEIGHTS, METRICS, INFO = "update", "weights", "metrics", "info"
PAYLOADS, PAYLOAD_SHAPES = "payloads", "payload_shapes"  # compressed tensors (see payloads.py)
IDENTIFY = "query.identify"  # server -> node: which client (partition-id) do you hold?


class InvalidReply(ValueError):
    """A reply that cannot be a client update (missing records, wrong types, bad values)."""


def encode_tensors(tensors: dict[str, torch.Tensor]) -> ArrayRecord:
    return ArrayRecord({k: t.detach().to("cpu").contiguous() for k, t in tensors.items()})


def _tensors(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return dict(record.to_torch_state_dict())


def encode_train(ctx: RoundContext, broadcast: Broadcast, client_id: int,
                 tensors: ArrayRecord | None = None) -> RecordDict:
    """What client ``client_id`` receives this round (only its own per-client settings, not the cohort).

    ``tensors``: ``encode_tensors(broadcast.tensors)`` built once and shared by the round's messages.
    """
    context = ConfigRecord({"round": ctx.round, "seed": ctx.seed, "num_rounds": ctx.num_rounds,
                            "num_clients": ctx.num_clients, "client_id": int(client_id)})
    own = broadcast.per_client.get(client_id, {})
    return RecordDict({
        CONTEXT: context,
        TENSORS: tensors if tensors is not None else encode_tensors(broadcast.tensors),
        SCALARS: ConfigRecord({k: float(v) for k, v in broadcast.scalars.items()}),
        CLIENT: ConfigRecord({k: float(v) for k, v in own.items()}),
    })


def decode_train(content: RecordDict) -> tuple[RoundContext, Broadcast, int]:
    """(round context, broadcast, client id) from a train message (the context's cohort: the client alone)."""
    missing = [k for k in (CONTEXT, TENSORS, SCALARS, CLIENT) if k not in content]
    if missing:
        raise ValueError(f"train message lacks records {missing}; was it sent by fl_platform's ServerApp?")
    c = content.config_records[CONTEXT]
    client_id = int(c["client_id"])
    ctx = RoundContext(round=int(c["round"]), seed=int(c["seed"]), clients=(client_id,),
                       num_rounds=int(c["num_rounds"]), num_clients=int(c["num_clients"]))
    own = {k: float(v) for k, v in content.config_records[CLIENT].items()}
    broadcast = Broadcast(_tensors(content.array_records[TENSORS]),
                          {k: float(v) for k, v in content.config_records[SCALARS].items()},
                          {client_id: own} if own else {})
    return ctx, broadcast, client_id


def encode_update(update: ClientUpdate, payloads: dict[str, torch.Tensor] | None = None) -> RecordDict:
    """A client's reply (its new state stays on the client, in ``context.state``).

    ``payloads``: compressed wire bytes that replace the tensors of the same names.
    """
    payloads = payloads or {}
    info = {"client_id": int(update.client_id), "num_samples": int(update.num_samples),
            "bytes_up": int(update.bytes_up), "num-examples": int(update.num_samples)}
    content = RecordDict({
        UPDATE: encode_tensors({k: t for k, t in update.tensors.items() if k not in payloads}),
        WEIGHTS: MetricRecord({k: float(v) for k, v in update.weights.items()}),
        METRICS: MetricRecord({k: [float(s), float(n)] for k, (s, n) in update.metrics.values.items()}),
        INFO: MetricRecord(info),
    })
    if payloads:
        content[PAYLOADS] = encode_tensors(payloads)
        content[PAYLOAD_SHAPES] = MetricRecord({k: [int(d) for d in update.tensors[k].shape] for k in payloads})
    return content


def decode_payloads(content: RecordDict) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]]]:
    """A reply's compressed payloads (uint8 tensors) and the shapes of the tensors they encode."""
    if PAYLOADS not in content:
        return {}, {}
    try:
        payloads = _tensors(content.array_records[PAYLOADS])
        shapes = {k: tuple(int(d) for d in v) for k, v in content.metric_records[PAYLOAD_SHAPES].items()}
    except Exception as err:
        raise InvalidReply(f"reply payloads cannot be read: {err!r}") from err
    bad = [k for k, t in payloads.items() if t.dtype != torch.uint8 or t.dim() != 1]
    if bad:
        raise InvalidReply(f"payloads {bad} are not byte strings")
    return payloads, shapes


def _finite_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidReply(f"{name} must be a finite number, got {value!r}")
    return float(value)


def decode_update(content: RecordDict) -> ClientUpdate:
    """A ClientUpdate from a reply; raises InvalidReply naming what is wrong."""
    try:
        arrays = content.array_records
        metric_records = content.metric_records
    except Exception as err:  # pragma: no cover - a RecordDict always has these views
        raise InvalidReply(f"reply content is not a RecordDict: {err}") from err
    missing = [k for k in (UPDATE, WEIGHTS, METRICS, INFO) if k not in content]
    if missing:
        raise InvalidReply(f"reply lacks records {missing}")
    if UPDATE not in arrays or any(k not in metric_records for k in (WEIGHTS, METRICS, INFO)):
        raise InvalidReply("reply records have the wrong types (update: ArrayRecord; weights, metrics, "
                           "info: MetricRecord)")
    try:
        tensors = _tensors(arrays[UPDATE])
    except Exception as err:
        raise InvalidReply(f"reply tensors cannot be read: {err}") from err
    info = metric_records[INFO]
    for key in ("client_id", "num_samples"):
        if not isinstance(info.get(key), int):
            raise InvalidReply(f"reply info.{key} must be an int, got {info.get(key)!r}")
    weights = {k: _finite_number(f"weight {k!r}", v) for k, v in metric_records[WEIGHTS].items()}
    if info["num_samples"] < 0:
        raise InvalidReply(f"reply info.num_samples must be >= 0, got {info['num_samples']}")
    metrics = Metrics()
    for name, pair in metric_records[METRICS].items():
        if name in SERVER_COLUMNS or name.startswith("test_"):
            raise InvalidReply(f"metric {name!r} is a column the server writes (its own counts, its evaluation): "
                               "a client may not send it")
        if not isinstance(pair, list) or len(pair) != 2:
            raise InvalidReply(f"metric {name!r} must be [sum, count], got {pair!r}")
        metrics.add(name, _finite_number(f"metric {name!r}", pair[0]), _finite_number(f"metric {name!r}", pair[1]))
    bytes_up = info.get("bytes_up", 0)
    return ClientUpdate(int(info["client_id"]), tensors, weights, int(info["num_samples"]), metrics,
                        bytes_up=int(bytes_up) if isinstance(bytes_up, int) else 0)


def message_nbytes(message: Message) -> int:
    """Bytes of ``message`` as Flower serialises it for the wire (each distinct object once)."""
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())
