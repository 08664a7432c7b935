"""The ClientApp: one SuperNode = one client, trained by the algorithm's client half.

Each SuperNode says who it is in its node config::

    flower-supernode ... --node-config "partition-id=3 num-partitions=10 data-root=/data"

``partition-id`` is our client id (so the client's random streams (seed, round, client id) are
the ones the simulator uses), ``num-partitions`` must match the run's ``num_clients``, and
``data-root`` is where the dataset files are. With ``data-mode="partition"`` (the default) the
node loads the run's dataset and keeps its own partition, computed by our partitioners from the
run's seed; with ``data-mode="local"`` the whole dataset under ``data-root`` (in one of our
formats) is this client's data. Optional: ``device`` (overrides ``deploy.device``),
``threads`` (torch intra-op threads), ``cache-dir`` and ``cache-entries`` (the node cache's folder
and size; 0: off).

The client's persistent state (SCAFFOLD's control variate, a compressor's error-feedback
residual) lives in ``context.state``; Flower keeps it on the SuperNode between rounds. A
configured compressor is applied by the simulator's own uplink hook: the reply carries what the
server decodes, and ``bytes_up`` the payload's size. Under client-level DP (``privacy=central|local``)
the node clips its update (and under local DP adds its own noise) before compressing it, with the
simulator's code (fl_platform/privacy/clipping.py); the ServerApp adds the central noise. Both draw
their noise from their own OS CSPRNG (``privacy.setup.deployed``), never from the seed.

Flower 1.42 starts a ClientApp process per message, so a round pays a Python start, the imports and
whatever the app prepares. This module imports only Flower's message types at load (torch and our
training code when a train message arrives); what the run config and the data give this client
(``_prepare``: the composed config's settings and the client's own rows) is kept in the node's
disk cache (``node_cache.py``), so after a node's first round its set-up is a read of its own
partition. Each train message logs one ``timing`` line with the phases of the device's round
(scripts/bench/deploy_round.py, docs/benchmarks.md).
"""

from __future__ import annotations

import time

_MODULE_START = time.perf_counter(), time.process_time()  # our module's first line: before it, Flower's

import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
from collections import OrderedDict  # noqa: E402
from collections.abc import Mapping  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

from flwr.app import Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

if TYPE_CHECKING:
    import torch

    from fl_platform.algorithms.base import ClientAlgorithm, StateSpec
    from fl_platform.compression.uplink import UplinkCompression
    from fl_platform.datasets.federated import FederatedDataset
    from fl_platform.flower.node_cache import NodeCache
    from fl_platform.flower.payloads import PayloadCodec
    from fl_platform.privacy.clipping import ClientPrivacy
    from fl_platform.rounds.setup import ExperimentSetup
    from fl_platform.training.loop import ClientData, LocalTrainer

log = logging.getLogger("flwr.fl_platform.client_app")  # under flwr's logger: shown in the SuperNode's log

DATA_MODES = ("partition", "local")
NODE_KEYS = ("partition-id", "num-partitions", "data-root", "data-mode", "device", "threads", "cache-dir",
             "cache-entries")
CACHE_KEYS = ("cache-dir", "cache-entries")  # where the cache is, not what it holds: not in its key
CACHE_FOLDER = "fl_platform-cache"  # under $FLWR_HOME (the SuperNode's Flower home) unless cache-dir is set


@dataclass(frozen=True)
class NodeSettings:
    """What a SuperNode's ``--node-config`` says about its client and data."""

    partition_id: int
    num_partitions: int | None = None
    data_root: str | None = None
    data_mode: str = "partition"
    device: str | None = None
    threads: int | None = None
    cache_dir: str | None = None  # the node's cache folder (default: $FLWR_HOME/fl_platform-cache/node-<hash>)
    cache_entries: int = 4  # entries kept (runs x configs); 0: no cache, every message prepares anew

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
        cache_dir = node_config.get("cache-dir")
        entries = integer("cache-entries")
        return cls(partition_id=integer("partition-id", required=True),  # type: ignore[arg-type]
                   num_partitions=integer("num-partitions"), data_root=str(root) if root else None,
                   data_mode=str(mode), device=str(device) if device else None, threads=threads,
                   cache_dir=str(cache_dir) if cache_dir else None,
                   cache_entries=4 if entries is None else entries)


@dataclass
class Prepared:
    """What the run config and the data give this node's client: the experiment's settings with
    only this client's rows (``setup.dataset``), built by ``_prepare`` and kept in the node cache."""

    setup: ExperimentSetup  # dataset: this client's own rows, no test set (own_rows)
    num_clients: int
    device: str  # deploy.device: the training device unless the node config says otherwise


@dataclass
class ClientRuntime:
    """Everything a node needs to train its client, built once per process and run."""

    node: NodeSettings
    setup: ExperimentSetup
    device: torch.device
    data: ClientData
    trainer: LocalTrainer
    client: ClientAlgorithm
    uplink: UplinkCompression | None  # the simulator's compressor hook (None: compressor=none)
    codec: PayloadCodec | None  # puts the compressor's payload bytes on the wire
    state_specs: dict[str, StateSpec]  # the algorithm's per-client state plus the compressor's (ef.*)
    privacy: ClientPrivacy | None = None  # client-level DP: clips (local DP: noises) before compression
    cache: str = "off"  # how its set-up was had: hit, miss, stale, corrupt, off (node_cache.py) or memory

    @property
    def client_id(self) -> int:
        return self.node.partition_id


def own_rows(data: FederatedDataset, client: int) -> FederatedDataset:
    """A dataset holding client ``client``'s rows only (in the simulator's order) and no test set: what
    a node keeps, so that nothing of the other clients' data is cached on it."""
    import numpy as np

    from fl_platform.datasets.federated import FederatedDataset
    from fl_platform.datasets.partition import Partition

    x, y = data.client_data(client)  # copies (index_select): no view onto the whole set
    n = int(x.shape[0])
    return FederatedDataset(train_blocks=[x], train_y=y, test_x=None, test_y=None,
                            partition=Partition(np.arange(n), np.array([0, n])), num_classes=data.num_classes,
                            input_shape=tuple(data.input_shape), name=data.name,
                            block_starts=np.array([0, n], dtype=np.int64), client_block=np.zeros(1, dtype=np.int64),
                            vocab=data.vocab, augment=data.augment)


def _prepare(run_config: Mapping[str, Any], node: NodeSettings) -> Prepared:
    """Compose the run's config and load this client's data: the one place the ClientApp reads the
    experiment config (everything after it reads the typed ``ExperimentSetup``)."""
    from fl_platform.config_checks import check_run
    from fl_platform.datasets.federated import build_federated_dataset
    from fl_platform.experiment import make_setup
    from fl_platform.flower.config import from_run_config
    from fl_platform.run_config import read_config

    composed, deploy = from_run_config(run_config)
    cfg = read_config(composed)  # the door: typed from here on
    check_run(cfg)
    if node.num_partitions is not None and node.num_partitions != cfg.num_clients:
        raise ValueError(f"node config num-partitions={node.num_partitions} but the run has "
                         f"num_clients={cfg.num_clients}")
    if node.partition_id >= cfg.num_clients:
        raise ValueError(f"node config partition-id={node.partition_id} is out of range for "
                         f"num_clients={cfg.num_clients}")
    ds = cfg.dataset
    root = node.data_root if node.data_root is not None else ds.root
    source_options, augment = cfg.source_options, cfg.augment
    if node.data_mode == "local":
        # The node's own files are the client's data: one client holding every training sample.
        dataset = build_federated_dataset(ds.name, num_clients=1, partition_name="iid", seed=cfg.seed, root=root,
                                          download=False, source_options=source_options, augment=augment)
        local = 0
    else:
        dataset = build_federated_dataset(ds.name, num_clients=cfg.num_clients, partition_name=cfg.partition.name,
                                          seed=cfg.seed, root=root, download=False, source_options=source_options,
                                          partition_options=cfg.partition_options, augment=augment)
        if dataset.num_clients != cfg.num_clients:
            raise ValueError(f"the partition has {dataset.num_clients} clients, the run config says "
                             f"num_clients={cfg.num_clients}")
        local = node.partition_id
    setup = make_setup(cfg, dataset)
    # Keep only this client's rows: the same samples in the same order as the simulator's index
    # slice, so its minibatches (drawn from (seed, round, client id)) are identical.
    setup.dataset = own_rows(dataset, local)
    return Prepared(setup=setup, num_clients=int(cfg.num_clients), device=deploy.device)


def node_cache(node: NodeSettings, node_config: Mapping[str, Any]) -> NodeCache | None:
    """This SuperNode's cache (None: ``cache-entries=0``, or a folder it cannot use safely, logged)."""
    if node.cache_entries == 0:
        return None
    from flwr.common.config import get_flwr_home

    from fl_platform.flower.node_cache import NodeCache, node_folder

    if node.cache_dir is not None:
        folder = Path(node.cache_dir).expanduser()
    else:
        folder = node_folder(get_flwr_home() / CACHE_FOLDER, node_config, ignore=CACHE_KEYS)
    try:
        return NodeCache(folder, node.cache_entries)
    except OSError as err:
        log.warning("node cache not used (%s): this node prepares its data on every message", err)
        return None


def prepared_for(run_config: Mapping[str, Any], node_config: Mapping[str, Any],
                 node: NodeSettings) -> tuple[Prepared, str]:
    """``_prepare``'s result from the node cache or built (and stored); with how it was had."""
    cache = node_cache(node, node_config)
    if cache is None:
        return _prepare(run_config, node), "off"
    from fl_platform.flower.node_cache import CacheKey, code_identity

    key = CacheKey.of(run_config=dict(run_config), node={k: v for k, v in node_config.items() if k not in CACHE_KEYS},
                      data_root_env=os.environ.get("FL_DATA_ROOT"), code=code_identity())
    prepared = cache.get_or_build(key, lambda: _prepare(run_config, node))
    return prepared, cache.last.outcome


def build_runtime(run_config: Mapping[str, Any], node_config: Mapping[str, Any]) -> ClientRuntime:
    import torch

    from fl_platform.algorithms.registry import get_algorithm
    from fl_platform.compression.uplink import make_uplink
    from fl_platform.flower.payloads import PayloadCodec
    from fl_platform.privacy.setup import deployed, make_client_privacy
    from fl_platform.rounds.setup import resolve_device
    from fl_platform.training.flat import FlatModel
    from fl_platform.training.loop import ClientData, LocalTrainer

    node = NodeSettings.from_node_config(node_config)
    if node.threads:
        torch.set_num_threads(node.threads)
    prepared, outcome = prepared_for(run_config, node_config, node)
    setup = prepared.setup
    device = resolve_device(node.device or prepared.device)
    own = setup.dataset
    data = ClientData(own.train_x.to(device), own.train_y.to(device), torch.arange(own.num_train, device=device),
                      own.augment)
    fm = FlatModel(setup.model(), device)
    trainer = LocalTrainer(fm, setup.train)
    # (the kept dataset holds one client; the algorithm is told the run's number of clients; an algorithm's
    # privacy noise comes from this node's OS CSPRNG, as DP's does)
    alg_setup = replace(setup.algorithm_setup(fm.num_params, fm.num_buffers), num_clients=prepared.num_clients,
                        secure_noise=True)
    client = get_algorithm(setup.algorithm).client(setup.algorithm_conf, alg_setup)
    uplink = make_uplink(setup.compressor, fm, client)
    specs = {**client.state_spec(), **(uplink.state_spec() if uplink is not None else {})}
    log.debug("client %d: %d samples of %s on %s (set-up: %s)", node.partition_id, data.num_samples, own.name,
              device, outcome)
    codec = PayloadCodec(uplink) if uplink is not None else None
    # (local DP: the noise from this node's own OS CSPRNG, never from the seed the server sent)
    privacy = make_client_privacy(deployed(setup.privacy), get_algorithm(setup.algorithm), setup.algorithm_conf)
    return ClientRuntime(node, setup, device, data, trainer, client, uplink, codec, specs, privacy, outcome)


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
    else:
        runtime.cache = "memory"  # this process built it for an earlier message
    _RUNTIMES.move_to_end(key)
    return runtime


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc; None elsewhere): the SuperNode's spawn, the
    Python start, Flower's imports, the message pull and the FAB install, before our module loads."""
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


_FLOWER_START = process_age()  # at our module's first lines (approximately: /proc counts in 10 ms ticks)
_first_message = True


def _import_for_training() -> tuple[float, float, float]:
    """Import torch, then the modules a train message needs (kept out of the set-up's timing): the wall
    seconds of each and the CPU seconds of ours."""
    start = time.perf_counter()
    import torch  # noqa: F401

    mid, cpu = time.perf_counter(), time.process_time()
    import fl_platform.algorithms.registry
    import fl_platform.compression.uplink
    import fl_platform.flower.records
    import fl_platform.flower.state
    import fl_platform.privacy.setup
    import fl_platform.rounds.setup
    import fl_platform.training.loop  # noqa: F401

    return mid - start, time.perf_counter() - mid, time.process_time() - cpu


def train_client(msg: Message, context: Context) -> Message:
    """Run the client half on this node's data; the reply carries the contribution only."""
    global _first_message
    t0, c0 = time.perf_counter(), time.process_time()
    torch_import, our_imports, our_imports_cpu = _import_for_training()
    import torch

    from fl_platform.flower.records import decode_train, encode_update
    from fl_platform.flower.state import ContextStateStore
    from fl_platform.training.loop import NonFiniteError

    t1, c1 = time.perf_counter(), time.process_time()
    rt = runtime_for(context)
    t2 = time.perf_counter()
    ctx, broadcast, client_id = decode_train(msg.content)
    if client_id != rt.client_id:
        raise ValueError(f"this SuperNode holds client {rt.client_id} (its partition-id) but received the "
                         f"message for client {client_id}")
    store = ContextStateStore(context.state, rt.state_specs)
    state = store.get(client_id) if store.specs else None
    own = None
    if rt.uplink is not None:  # the compressor's state (ef.*) is not the algorithm's (as in the worker)
        state, own = rt.uplink.split_state(state)
    t3, c3 = time.perf_counter(), time.process_time()
    update = rt.client.train(ctx, client_id, broadcast.to(rt.device), state, rt.data, rt.trainer)
    t4, c4 = time.perf_counter(), time.process_time()
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
    reply = Message(encode_update(update, payloads), reply_to=msg)
    t5, c5 = time.perf_counter(), time.process_time()
    first, _first_message = _first_message, False
    # One line per message: the phases of this device's round (seconds; scripts/bench/deploy_round.py).
    # A process's first message also pays Flower's start and the imports; later ones (in-process) do not.
    # "ours": our module, our imports, the set-up and the message codec, the part of a round that is
    # neither Flower's nor training (wall and CPU seconds: on a shared machine CPU time is the fairer).
    module = (t0 - _MODULE_START[0], c0 - _MODULE_START[1]) if first else (0.0, 0.0)
    timing = {"client": client_id, "round": ctx.round + 1, "first_in_process": first, "set_up": rt.cache,
              "flower_start": _FLOWER_START if first else 0.0, "module_import": module[0],
              "torch_import": torch_import, "our_imports": our_imports, "prepare": t2 - t1, "codec_in": t3 - t2,
              "train": t4 - t3, "codec_out": t5 - t4, "train_cpu": c4 - c3}
    timing["ours"] = module[0] + our_imports + (t3 - t1) + (t5 - t4)
    timing["ours_cpu"] = module[1] + our_imports_cpu + (c3 - c1) + (c5 - c4)
    # INFO once per process (a deployed ClientApp's every message); DEBUG for the later messages of an
    # in-process run (fl_platform/flower/local.py), which would otherwise print a line per client and round
    log.log(logging.INFO if first else logging.DEBUG, "timing %s",
            json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in timing.items()}))
    return reply


IDENTIFY_QUERY = "identify"  # records.IDENTIFY is "query.identify" (records imports torch: not at load)


def identify_client(msg: Message, context: Context) -> Message:
    """Tell the server which client this node holds (its partition-id)."""
    node = NodeSettings.from_node_config(context.node_config)
    info: dict[str, int] = {"partition-id": node.partition_id}
    if node.num_partitions is not None:
        info["num-partitions"] = node.num_partitions
    return Message(RecordDict({"info": MetricRecord(info)}), reply_to=msg)


app = ClientApp()
app.train()(train_client)
app.query(IDENTIFY_QUERY)(identify_client)
