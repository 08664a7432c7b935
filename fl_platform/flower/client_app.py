"""The ClientApp: one SuperNode = one client, trained by the algorithm's client half.

Each SuperNode says who it is in its node config::

    flower-supernode ... --node-config "partition-id=3 num-partitions=10 data-root=/data"

``partition-id`` is our client id (so the client's random streams (seed, round, client id) are
the ones the simulator uses), ``num-partitions`` must match the run's ``num_clients``, and
``data-root`` is where the dataset files are. With ``data-mode="partition"`` (the default) the
node loads the run's dataset and keeps its own partition, computed by our partitioners from the
run's seed; with ``data-mode="local"`` the whole dataset under ``data-root`` (in one of our
formats) is this client's data. Optional: ``device`` (overrides ``deploy.device``) and
``threads`` (torch intra-op threads).

The client's persistent state (SCAFFOLD's control variate, a compressor's error-feedback
residual) lives in ``context.state``; Flower keeps it on the SuperNode between rounds. A
configured compressor is applied by the simulator's own uplink hook: the reply carries what the
server decodes, and ``bytes_up`` the payload's size. Under client-level DP (``privacy=central|local``)
the node clips its update (and under local DP adds its own noise) before compressing it, with the
simulator's code (fl_platform/privacy/clipping.py); the ServerApp adds the central noise. Both draw
their noise from their own OS CSPRNG (``privacy.setup.deployed``), never from the seed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from omegaconf import DictConfig

from fl_platform.algorithms.base import ClientAlgorithm, StateSpec
from fl_platform.algorithms.registry import get_algorithm
from fl_platform.compression.uplink import UplinkCompression, make_uplink
from fl_platform.config import options_of
from fl_platform.datasets.federated import FederatedDataset, build_federated_dataset
from fl_platform.flower.config import DeployConf, from_run_config
from fl_platform.flower.payloads import PayloadCodec
from fl_platform.flower.records import IDENTIFY, decode_train, encode_update
from fl_platform.flower.state import ContextStateStore
from fl_platform.privacy.clipping import ClientPrivacy
from fl_platform.privacy.setup import deployed, make_client_privacy
from fl_platform.rounds.setup import resolve_device
from fl_platform.training.flat import FlatModel
from fl_platform.training.loop import ClientData, LocalTrainer, NonFiniteError

log = logging.getLogger(__name__)

DATA_MODES = ("partition", "local")
NODE_KEYS = ("partition-id", "num-partitions", "data-root", "data-mode", "device", "threads")


@dataclass(frozen=True)
class NodeSettings:
    """What a SuperNode's ``--node-config`` says about its client and data."""

    partition_id: int
    num_partitions: int | None = None
    data_root: str | None = None
    data_mode: str = "partition"
    device: str | None = None
    threads: int | None = None

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> NodeSettings:
        def integer(key: str, required: bool = False) -> int | None:
            value = node_config.get(key)
            if value is None:
                if required:
                    raise ValueError(f"node config lacks {key!r} (this SuperNode's client id); start it with "
                                     f"--node-config \"{key}=<id> num-partitions=<n>\"; it has keys "
                                     f"{sorted(node_config)}")
                return None
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"node config {key} must be a non-negative integer, got {value!r}")
            return value

        mode = node_config.get("data-mode", "partition")
        if mode not in DATA_MODES:
            raise ValueError(f"node config data-mode must be one of {', '.join(DATA_MODES)}, got {mode!r}")
        root = node_config.get("data-root")
        device = node_config.get("device")
        threads = integer("threads")
        if threads == 0:
            raise ValueError("node config threads must be >= 1, got 0")
        return cls(partition_id=integer("partition-id", required=True),  # type: ignore[arg-type]
                   num_partitions=integer("num-partitions"), data_root=str(root) if root else None,
                   data_mode=str(mode), device=str(device) if device else None, threads=threads)


@dataclass
class ClientRuntime:
    """Everything a node needs to train its client, built once per process and run."""

    cfg: DictConfig
    deploy: DeployConf
    node: NodeSettings
    device: torch.device
    data: ClientData
    trainer: LocalTrainer
    client: ClientAlgorithm
    uplink: UplinkCompression | None  # the simulator's compressor hook (None: compressor=none)
    codec: PayloadCodec | None  # puts the compressor's payload bytes on the wire
    state_specs: dict[str, StateSpec]  # the algorithm's per-client state plus the compressor's (ef.*)
    privacy: ClientPrivacy | None = None  # client-level DP: clips (local DP: noises) before compression

    @property
    def client_id(self) -> int:
        return self.node.partition_id


def load_node_data(cfg: DictConfig, node: NodeSettings) -> tuple[FederatedDataset, int]:
    """The dataset this node trains on and the index of its client in it."""
    ds = cfg.dataset
    root = node.data_root if node.data_root is not None else ds.root
    source_options = options_of(ds, exclude=("name", "root", "download", "augment"))
    augment = options_of(ds.augment, exclude=())
    if node.data_mode == "local":
        # The node's own files are the client's data: one client holding every training sample.
        data = build_federated_dataset(ds.name, num_clients=1, partition_name="iid", seed=cfg.seed, root=root,
                                       download=False, source_options=source_options, augment=augment)
        return data, 0
    data = build_federated_dataset(ds.name, num_clients=cfg.num_clients, partition_name=cfg.partition.name,
                                   seed=cfg.seed, root=root, download=False, source_options=source_options,
                                   partition_options=options_of(cfg.partition), augment=augment)
    if data.num_clients != cfg.num_clients:
        raise ValueError(f"the partition has {data.num_clients} clients, the run config says "
                         f"num_clients={cfg.num_clients}")
    return data, node.partition_id


def build_runtime(run_config: Mapping[str, Any], node_config: Mapping[str, Any]) -> ClientRuntime:
    from fl_platform.experiment import make_setup, validate

    cfg, deploy = from_run_config(run_config)
    validate(cfg)
    node = NodeSettings.from_node_config(node_config)
    if node.num_partitions is not None and node.num_partitions != cfg.num_clients:
        raise ValueError(f"node config num-partitions={node.num_partitions} but the run has "
                         f"num_clients={cfg.num_clients}")
    if node.partition_id >= cfg.num_clients:
        raise ValueError(f"node config partition-id={node.partition_id} is out of range for "
                         f"num_clients={cfg.num_clients}")
    if node.threads:
        torch.set_num_threads(node.threads)
    device = resolve_device(node.device or deploy.device)
    dataset, local = load_node_data(cfg, node)
    setup = make_setup(cfg, dataset)
    # Keep only this client's rows: the same samples in the same order as the simulator's
    # index slice, so its minibatches (drawn from (seed, round, client id)) are identical.
    x, y = dataset.client_data(local)
    data = ClientData(x.to(device), y.to(device), torch.arange(x.shape[0], device=device), dataset.augment)
    fm = FlatModel(setup.model(), device)
    trainer = LocalTrainer(fm, setup.train)
    alg_setup = replace(setup.algorithm_setup(fm.num_params, fm.num_buffers), num_clients=cfg.num_clients)
    client = get_algorithm(setup.algorithm).client(setup.algorithm_conf, alg_setup)
    uplink = make_uplink(setup.compressor, fm, client)
    specs = {**client.state_spec(), **(uplink.state_spec() if uplink is not None else {})}
    log.info("client %d: %d samples of %s on %s", node.partition_id, data.num_samples, dataset.name, device)
    codec = PayloadCodec(uplink) if uplink is not None else None
    # (local DP: the noise from this node's own OS CSPRNG, never from the seed the server sent)
    privacy = make_client_privacy(deployed(setup.privacy), get_algorithm(setup.algorithm), setup.algorithm_conf)
    return ClientRuntime(cfg, deploy, node, device, data, trainer, client, uplink, codec, specs, privacy)


_RUNTIMES: OrderedDict[tuple, ClientRuntime] = OrderedDict()
_MAX_RUNTIMES = 8


def runtime_for(context: Context) -> ClientRuntime:
    """The node's runtime, reused while the process serves the same run: Flower's simulation
    runtime and in-process tests call the app repeatedly in one process, for several nodes
    (a deployed SuperNode starts one process per message, so there it is built every time)."""
    key = (context.run_id, tuple(sorted(context.run_config.items())), tuple(sorted(context.node_config.items())))
    runtime = _RUNTIMES.get(key)
    if runtime is None:
        runtime = build_runtime(context.run_config, context.node_config)
        _RUNTIMES[key] = runtime
        while len(_RUNTIMES) > _MAX_RUNTIMES:
            _RUNTIMES.popitem(last=False)
    _RUNTIMES.move_to_end(key)
    return runtime


def train_client(msg: Message, context: Context) -> Message:
    """Run the client half on this node's data; the reply carries the contribution only."""
    rt = runtime_for(context)
    ctx, broadcast, client_id = decode_train(msg.content)
    if client_id != rt.client_id:
        raise ValueError(f"this SuperNode holds client {rt.client_id} (its partition-id) but received the "
                         f"message for client {client_id}")
    store = ContextStateStore(context.state, rt.state_specs)
    state = store.get(client_id) if store.specs else None
    own = None
    if rt.uplink is not None:  # the compressor's state (ef.*) is not the algorithm's (as in the worker)
        state, own = rt.uplink.split_state(state)
    update = rt.client.train(ctx, client_id, broadcast.to(rt.device), state, rt.data, rt.trainer)
    if not update.is_finite():
        bad = [k for k, t in update.tensors.items() if not bool(torch.isfinite(t).all())]
        raise NonFiniteError(f"client {client_id} in round {ctx.round + 1}: update tensors {bad} contain NaN/inf")
    if rt.privacy is not None:  # clip (local DP: and noise) before compression, as the simulator's worker
        rt.privacy.apply(ctx, broadcast, update)
    payloads: dict[str, torch.Tensor] = {}
    if rt.uplink is not None:  # encode, count the payload's bytes, keep what the server decodes
        originals = {k: t.detach().clone() for k, t in update.tensors.items() if k in rt.uplink.names}
        update.state = rt.uplink.merge_state(state, update.state, rt.uplink.apply(ctx, client_id, update, own))
        payloads = rt.codec.pack(ctx, client_id, originals, own, update.tensors,  # type: ignore[union-attr]
                                 update.weights)
    if update.state is not None:
        store.put(client_id, update.state)
    update.state = None
    return Message(encode_update(update, payloads), reply_to=msg)


def identify_client(msg: Message, context: Context) -> Message:
    """Tell the server which client this node holds (its partition-id)."""
    node = NodeSettings.from_node_config(context.node_config)
    info: dict[str, int] = {"partition-id": node.partition_id}
    if node.num_partitions is not None:
        info["num-partitions"] = node.num_partitions
    return Message(RecordDict({"info": MetricRecord(info)}), reply_to=msg)


app = ClientApp()
app.train()(train_client)
app.query(IDENTIFY.split(".")[1])(identify_client)
