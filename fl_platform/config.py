"""Structured configs: one dataclass schema per config-group option, registered with Hydra.

Hydra merges ``conf/<group>/<option>.yaml`` onto its schema, so an unknown key fails at start-up
naming the key and the schema (``Key 'mux' not in 'FedProxConf'``), a wrong type names the key
and the expected type, and an unknown option lists the valid ones.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from fl_platform.algorithms.base import AlgorithmConf, AlgorithmSpec
from fl_platform.algorithms.registry import BUILTIN, PLUGIN, algorithm_names, algorithm_refs, get_algorithm
from fl_platform.algorithms.server_opt import ServerOptConf, server_opt_schemas
from fl_platform.compression.registry import CompressorConf, compressor_schemas
from fl_platform.datasets.augment import AugmentConf
from fl_platform.privacy.config import PrivacyConf, privacy_schemas
from fl_platform.rounds.callbacks import EarlyStopConf
from fl_platform.system.config import SystemConf, system_schemas
from fl_platform.training.loop import TrainConfig

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- dataset


@dataclass
class DatasetConf:
    name: str = MISSING
    root: str | None = None  # default: $FL_DATA_ROOT, else ../shared/data beside the repository
    download: bool = False  # opt-in; never at test time
    # Crop/flip of training minibatches (datasets/augment.py, docs/data.md); images only, off unless
    # the papers' recipe for the data set uses it (CIFAR-10/100).
    augment: AugmentConf = field(default_factory=AugmentConf)


def _crop_flip() -> AugmentConf:
    """RandomCrop(32, padding=4) + RandomHorizontalFlip: the CIFAR recipe of FedImpro, VHL, FuseFL, DENSE."""
    return AugmentConf(crop_padding=4, hflip=True)


@dataclass
class DigitsConf(DatasetConf):
    name: str = "digits"
    test_fraction: float = 0.2


@dataclass
class SyntheticConf(DatasetConf):
    name: str = "synthetic"
    alpha: float = 0.5
    beta: float = 0.5
    iid: bool = False
    size_mean: float = 4.0
    size_sigma: float = 2.0
    min_size: int = 50
    max_size: int | None = None

    def inactive_fields(self) -> dict[str, str]:
        """Fields the other settings make inert (field -> why); the config check refuses them set."""
        if self.iid:
            return dict.fromkeys(("alpha", "beta"), "it spreads the devices' models and features apart, and "
                                 "dataset.iid=true gives every device one shared model and feature mean")
        return {}


@dataclass
class MNISTConf(DatasetConf):
    name: str = "mnist"


@dataclass
class FashionMNISTConf(DatasetConf):
    name: str = "fashion_mnist"


@dataclass
class CIFAR10Conf(DatasetConf):
    name: str = "cifar10"
    augment: AugmentConf = field(default_factory=_crop_flip)


@dataclass
class CIFAR100Conf(DatasetConf):
    name: str = "cifar100"
    label_mode: str = "fine"
    augment: AugmentConf = field(default_factory=_crop_flip)


@dataclass
class HFConf(DatasetConf):
    """Any Hugging Face ``datasets`` data set (datasets/sources/hf.py, docs/data.md)."""

    name: str = "hf"
    path: str = MISSING  # a local file or folder (as given, else under root), else a Hub name
    subset: str | None = None  # the data set's configuration ("name" in load_dataset)
    revision: str | None = None  # Hub only: a commit, tag or branch to pin
    split: str = "train"
    test_split: str | None = "test"  # a split (a test file when path is a file); null: use test_fraction
    test_fraction: float | None = None  # stratified share of `split` held out as the test set
    image_column: str | None = None  # null: the one Image column, if any
    label_column: str | None = None  # null: the one ClassLabel column, else "label"/"labels"
    feature_columns: list[str] | None = None  # tabular: the numeric columns (null: all but label/group)
    group_column: str | None = None  # natural groups (writer, device) for partition=natural
    channels: int | None = None  # images: 1 (grayscale) or 3 (RGB); null: the first image's
    normalize: bool = True  # standardise per channel/feature
    mean: list[float] | None = None  # null: the training split's statistics
    std: list[float] | None = None


@dataclass
class FEMNISTConf(DatasetConf):
    name: str = "femnist"
    max_writers: int | None = None


@dataclass
class ShakespeareConf(DatasetConf):
    name: str = "shakespeare"
    seq_len: int = 80
    stride: int = 20
    max_speakers: int | None = None


@dataclass
class CustomDatasetConf(DatasetConf):
    """The user's own loader: ``dataset=custom dataset._target_=mypkg.data:load +dataset.<arg>=...``.

    The loader returns a ``SourceData`` (datasets/source.py) and is called with its own arguments
    from this section (checked against its signature at start-up: an unknown one is an error naming
    it) plus whichever of ``root``, ``download`` and ``seed`` it takes; any partitioner splits it."""

    name: str = "custom"
    _target_: str = MISSING


# ---------------------------------------------------------------- partition


@dataclass
class PartitionConf:
    name: str = MISSING


@dataclass
class IIDConf(PartitionConf):
    name: str = "iid"


@dataclass
class DirichletConf(PartitionConf):
    name: str = "dirichlet"
    alpha: float = 0.5
    min_size: int = 5


@dataclass
class ShardsConf(PartitionConf):
    name: str = "shards"
    classes_per_client: int = 2


@dataclass
class PowerLawConf(PartitionConf):
    name: str = "power_law"
    exponent: float = 1.5


@dataclass
class NaturalConf(PartitionConf):
    name: str = "natural"


@dataclass
class FlwrPartitionConf(PartitionConf):
    """A flwr-datasets partitioner on our data (datasets/flwr_interop.py; extra fl-platform[hf])."""

    name: str = "flwr"
    partitioner: str = "IidPartitioner"  # a class of flwr_datasets.partitioner
    options: dict[str, Any] = field(default_factory=dict)  # its arguments but num_partitions and seed


# ---------------------------------------------------------------- model


class Norm(StrEnum):
    none = "none"
    batch = "batch"
    group = "group"


@dataclass
class ModelConf:
    name: str = MISSING


@dataclass
class MLPConf(ModelConf):
    name: str = "mlp"
    hidden: list[int] = field(default_factory=lambda: [128])


@dataclass
class CNNConf(ModelConf):
    name: str = "cnn"
    channels: list[int] = field(default_factory=lambda: [32, 64])
    hidden: int = 128
    norm: Norm = Norm.none


@dataclass
class ResNet18Conf(ModelConf):
    name: str = "resnet18"
    width: int = 64
    norm: Norm = Norm.batch


@dataclass
class LSTMConf(ModelConf):
    name: str = "lstm"
    embed_dim: int = 8
    hidden: int = 256
    num_layers: int = 2


@dataclass
class CustomModelConf(ModelConf):
    """The user's own ``nn.Module``: ``model=custom model._target_=mypkg.nets:WideNet +model.width=64``.

    ``_target_`` is a class or function returning the module; it is called with its own arguments
    from this section (checked against its signature at start-up: an unknown one is an error naming
    it) plus ``input_shape`` and ``num_classes`` when it takes them (fl_platform/models/custom.py)."""

    name: str = "custom"
    _target_: str = MISSING


# ---------------------------------------------------------------- algorithm


@dataclass
class PluginAlgorithmConf(AlgorithmConf):
    """An algorithm from the user's module that is not installed as a plug-in:
    ``algorithm=plugin algorithm._target_=mypkg.alg:SPEC +algorithm.<field>=...``; the fields are
    the SPEC's conf dataclass's, checked against it at start-up (run_config.RunConfig.algorithm_conf)."""

    name: str = PLUGIN
    _target_: str = MISSING


# ---------------------------------------------------------------- engine, logger, top level


class EngineName(StrEnum):
    inline = "inline"
    ray = "ray"


class NonFinitePolicy(StrEnum):
    fail = "fail"
    skip = "skip"


class SchedulerPolicy(StrEnum):
    lpt = "lpt"  # longest-processing-time-first on each worker's measured speed
    round_robin = "round_robin"  # the i-th sampled client to worker i mod W, whatever the speeds


#: TEST ONLY: where in a round the worker of ``fault_injection.client`` exits, or hangs (``fault_injection.at``).
FAULT_STEPS = ("train", "hang", "merge", "commit", "hang_commit")


@dataclass
class FaultInjectionConf:
    """TEST ONLY: the Ray worker that trains ``client`` exits abruptly (os._exit) when it starts it,
    in round ``round`` (1-based; None: the first time); the engine must recover with the same result.
    ``slow_worker``/``slow_factor`` make one worker slower (scheduler tests): timing changes, results not."""

    client: int | None = None
    round: int | None = None
    # TEST ONLY: where in that round it exits: train (as it starts the client), merge (when the reduction
    # tree asks it to add a partner's partial, after its result arrived) or commit (when the engine asks
    # it to apply the round's new client states); hang: it sleeps at that client instead, hang_commit: when
    # asked to apply the states (round_timeout_s).
    at: str = "train"
    # TEST ONLY: worker ``slow_worker`` (inline or Ray) sleeps (slow_factor - 1) x each client's
    # measured training time after it, so its clients really take slow_factor times as long.
    slow_worker: int | None = None
    slow_factor: float = 1.0


@dataclass
class EngineConf:
    name: EngineName = EngineName.inline
    num_workers: int | None = None  # inline: 1; ray: what Ray sees (GPUs, else CPUs)
    device: str = "auto"  # auto = cuda if available, else cpu
    cpus_per_worker: float = 1.0
    gpus_per_worker: float | None = None  # None: an even split of its GPU (one Ray bundle per GPU, workers dealt over them)
    # torch intra-op threads per worker; None: cpus_per_worker (min 1), so 1 inline: no thread cliff on a shared machine
    threads_per_worker: int | None = None
    state_store: str = "memory"  # memory | disk | distributed (see docs/engine.md)
    # disk/distributed: where client state lives. Inline: None = <run dir>/client_state. Ray: a path
    # interpreted on every node (node-local folders; None: the node's FL_NODE_STATE_DIR or temp dir).
    state_dir: str | None = None
    state_dir_shared: bool = False  # ray + disk: state_dir is one folder that every node sees (a shared filesystem)
    state_backend: str = "disk"  # distributed: what each home worker keeps its clients' state in (memory | disk)
    state_cache_mb: float = 256.0  # disk: RAM for the write-behind LRU cache of client states, per store
    state_fsync: bool = False  # disk stores: fsync client-state files and folders (survive a machine crash)
    nonfinite: NonFinitePolicy = NonFinitePolicy.fail
    max_restarts: int = 3  # ray: a dead worker is restarted (and its clients rerun) at most this often per round
    scheduler: SchedulerPolicy = SchedulerPolicy.lpt  # how a round's clients are spread over workers
    scheduler_smoothing: float = 0.5  # weight of the newest round in each worker's runtime estimate
    address: str | None = None  # ray: an existing cluster to join (host:port of its head, or "auto"); None starts a local one
    # ray: the job's runtime_env. auto = ship this checkout (code + conf/) when joining a cluster;
    # null/{} = nothing (nodes hold an identical install); a mapping = Ray's runtime_env, merged over the shipped checkout (also locally).
    runtime_env: Any = "auto"
    fault_injection: FaultInjectionConf = field(default_factory=FaultInjectionConf)
    # Clients a worker trains at once, vectorised (docs/vectorised.md): 1 = one by one; "auto" = as
    # many as fit in half of the worker's share of its device's memory. Validated by parse_cohort_size.
    cohort_size: Any = 1
    # Where the global model is evaluated: auto = inline: engine.device; ray with GPU workers: a GPU of the driver's
    # node, or worker 0's GPU when that node has none; ray with CPU workers: the driver's CPU. cuda (ray: holds 0.1
    # of a GPU on the driver's node, so Ray accounts for it), cpu (the driver's), or worker (ray: worker 0's device).
    eval_device: str = "auto"
    start_timeout_s: float = 600.0  # ray: workers not started within this many seconds: an error naming what is missing
    # ray: a worker that has not answered one of the engine's calls (its share of a round's training, applying
    # states, evaluation, checkpoint parts) this many seconds after it was sent counts as hung (a deadlock, a
    # stuck device): it is killed, replaced and the call made again, as for a dead one (engine.max_restarts).
    # None: wait as long as it takes.
    round_timeout_s: float | None = None
    # torch deterministic algorithms in every worker (cuDNN/cuBLAS too); an operation without a deterministic
    # CUDA kernel stops the run naming this key. CPU results are bit-identical either way (docs/engine.md, Determinism)
    deterministic: bool = False

    def inactive_fields(self) -> dict[str, str]:
        """Fields the other settings make inert (field -> why); the config check refuses them set."""
        if self.state_store == "distributed":
            return {}
        return {"state_backend": f"what a distributed store's home workers keep client states in, and "
                                 f"engine.state_store={self.state_store}"}


#: ``logger.wandb_mode``: what ``wandb.init(mode=...)`` takes.
WANDB_MODES = ("online", "offline", "disabled", "shared")


@dataclass
class LoggerConf:
    progress: bool = True
    wandb: bool = False
    wandb_project: str = "fl_platform"
    wandb_mode: str = "offline"  # offline needs no network and no API key
    log_every: int = 1  # a log line every k rounds (and the last one)

    def inactive_fields(self) -> dict[str, str]:
        """Fields the other settings make inert (field -> why); the config check refuses them set."""
        if self.wandb:
            return {}
        return dict.fromkeys(("wandb_project", "wandb_mode"), "a wandb setting, and logger.wandb=false "
                             "(use logger=wandb)")


class EvalClients(StrEnum):
    none = "none"  # the server's test set only
    sample = "sample"  # also each client of the round, on its local test split
    all = "all"  # also every client, on its local test split


@dataclass
class EvalConf:
    """Per-client evaluation on local test splits (fl_platform/rounds/client_eval.py, docs/personalisation.md)."""

    clients: EvalClients = EvalClients.none
    local_test_fraction: float = 0.2  # of each client's rows, stratified, held out as its local test split
    finetune_steps: int = 0  # k > 0: also evaluate after k local SGD steps from the (personal) model


@dataclass
class Config:
    seed: int = 0
    rounds: int = 30
    num_clients: int = 100
    clients_per_round: int = 10
    eval_every: int = 1
    eval_batch_size: int = 1024
    save_model: bool = True
    checkpoint_every: int = 0  # rounds between checkpoints (0: none); >0 also makes the run dir stable
    resume: str = "auto"  # auto: continue from the run dir's checkpoint if any; never: start over; or a run dir
    train: TrainConfig = field(default_factory=TrainConfig)
    dataset: DatasetConf = MISSING
    partition: PartitionConf = MISSING
    model: ModelConf = MISSING
    algorithm: Any = MISSING
    compressor: CompressorConf = MISSING  # uplink compression (fl_platform/compression, docs/compression.md)
    system: SystemConf = MISSING  # client speeds and bandwidths for simulated time (fl_platform/system)
    privacy: PrivacyConf = MISSING  # client-level differential privacy (fl_platform/privacy, docs/privacy.md)
    server_opt: ServerOptConf = MISSING  # adaptive server optimisers (algorithms/server_opt.py, FedAdam/Yogi/Adagrad)
    engine: EngineConf = field(default_factory=EngineConf)
    logger: LoggerConf = field(default_factory=LoggerConf)
    # Between rounds (fl_platform/rounds/callbacks.py, docs/python-api.md): early stopping on a validation
    # split of the clients' training rows; on_round_end callbacks (import paths or {_target_: ..., args}).
    early_stop: EarlyStopConf = field(default_factory=EarlyStopConf)
    callbacks: list[Any] = field(default_factory=list)
    eval: EvalConf = field(default_factory=EvalConf)  # per-client evaluation (eval.clients)


GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "dataset": {"digits": DigitsConf, "synthetic": SyntheticConf, "mnist": MNISTConf,
                "fashion_mnist": FashionMNISTConf, "cifar10": CIFAR10Conf, "cifar100": CIFAR100Conf,
                "femnist": FEMNISTConf, "shakespeare": ShakespeareConf, "hf": HFConf, "custom": CustomDatasetConf},
    "partition": {"iid": IIDConf, "dirichlet": DirichletConf, "shards": ShardsConf,
                  "power_law": PowerLawConf, "natural": NaturalConf, "flwr": FlwrPartitionConf},
    "model": {"mlp": MLPConf, "cnn": CNNConf, "resnet18": ResNet18Conf, "lstm": LSTMConf, "custom": CustomModelConf},
    "compressor": compressor_schemas(),
    "system": system_schemas(),
    "privacy": privacy_schemas(),
    "server_opt": server_opt_schemas(),
}

#: Options whose section also holds the user's own arguments (``+model.width=64``), checked against the
#: plug-in at start-up rather than by Hydra: group -> option -> its schema (the platform's fields).
OPEN_OPTIONS: dict[str, dict[str, type]] = {
    "model": {"custom": CustomModelConf}, "dataset": {"custom": CustomDatasetConf},
    "algorithm": {PLUGIN: PluginAlgorithmConf},
}


def run_dir_for(resume: str, checkpoint_every: Any, stamped: str, stable: str) -> str:
    """Hydra's run dir: ``resume=<dir>`` reuses that dir; with checkpoints on, a dir derived from the
    command-line overrides, so rerunning the same command finds its checkpoint; else time-stamped."""
    resume = str(resume)
    if resume not in ("auto", "never"):
        return resume
    return stable if int(checkpoint_every) > 0 else stamped


def register_resolvers() -> None:
    import hashlib

    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("fl_run_dir", run_dir_for, replace=True)
    OmegaConf.register_new_resolver(
        "fl_hash", lambda text: hashlib.sha1(str(text).encode()).hexdigest()[:10], replace=True)
    # train.epochs in conf/config.yaml: its default only while train.steps is unset, so that a run with
    # train.steps has no epochs value it would ignore (an explicit train.epochs beside it is refused).
    OmegaConf.register_new_resolver("fl_unless_set", lambda other, value: value if other is None else None,
                                    replace=True)
    # Run directories and sweep folders name the user's plug-ins, not plugin/custom (outputs.plugin_name).
    OmegaConf.register_new_resolver("fl_name", _plugin_name, replace=True)


def _plugin_name(group: str, name: str, target: Any = None) -> str:
    from fl_platform.outputs import plugin_name

    return plugin_name(group, name, target)


def register_configs() -> None:
    """Register the schema of every group option as ``schema/<group>/<option>``.

    The schemas live outside the option groups so that Hydra's "available options" lists only
    the YAML options; each YAML extends its schema with ``- /schema/<group>/<option>@_here_``.
    Called by every :func:`compose`: what is already stored is not stored again (see ``_store``).
    """
    register_resolvers()
    _store(None, "base_config", Config)
    for group, options in GROUP_SCHEMAS.items():
        for option, schema in options.items():
            _store(f"schema/{group}", option, schema)
    _store("schema/algorithm", PLUGIN, PluginAlgorithmConf)
    refs = algorithm_refs()
    for name in algorithm_names(refs):
        try:
            spec = get_algorithm(name, refs)
        except Exception as err:  # a broken installed plug-in must not take the built-ins down with it
            log.warning("algorithm %s not available: %s", name, err)
            continue
        if name in BUILTIN:  # conf/algorithm/<name>.yaml extends the schema
            _store("schema/algorithm", name, spec.conf)
        else:
            register_algorithm_option(name, spec)


#: (group, name) -> (the schema given, the ConfigStore's entry made of it), for ``_store``.
_STORED: dict[tuple[str | None, str], tuple[Any, Any]] = {}


def _entry(group: str | None, name: str) -> Any:
    """The ConfigStore's entry ``group/name`` (None if there is none)."""
    repo: Any = ConfigStore.instance().repo
    for part in group.split("/") if group else ():
        repo = repo.get(part) if isinstance(repo, dict) else None
    return repo.get(f"{name}.yaml") if isinstance(repo, dict) else None


def _store(group: str | None, name: str, schema: Any, make: Callable[[], Any] | None = None) -> None:
    """``ConfigStore.store(group, name, make())`` (default: the ``schema`` dataclass itself) unless the entry
    made of this very ``schema`` is still there: turning the dataclasses into structured configs again was
    half of each compose's time (1.5 of 2.6 s). An entry removed or replaced since is stored again."""
    given, made = _STORED.get((group, name), (None, None))
    if given is schema and made is not None and _entry(group, name) is made:
        return
    ConfigStore.instance().store(group=group, name=name, node=schema if make is None else make())
    _STORED[(group, name)] = (schema, _entry(group, name))


def register_algorithm_option(name: str, spec: AlgorithmSpec) -> None:
    """Make ``spec`` the option ``algorithm=<name>`` (its conf dataclass as the schema, ``name`` set),
    listed among the group's choices; what plug-in algorithms get instead of a YAML file."""
    from omegaconf import OmegaConf

    def option() -> Any:
        node = OmegaConf.structured(spec.conf)
        node.name = name
        return node

    _store("schema/algorithm", name, spec.conf)
    _store("algorithm", name, spec.conf, option)


def unregister_algorithm_option(name: str) -> None:
    """Drop the option ``algorithm=<name>`` that :func:`register_algorithm_option` made."""
    repo = ConfigStore.instance().repo
    for group in ("algorithm",):
        repo.get(group, {}).pop(f"{name}.yaml", None)
    repo.get("schema", {}).get("algorithm", {}).pop(f"{name}.yaml", None)


def compose(overrides: Any = (), conf_dir: Any = None) -> Any:
    """The config ``python -m fl_platform.run <overrides>`` would run (Hydra's compose of conf/, whose
    folder is ``conf_dir``, default: beside the running fl_platform package)."""
    from pathlib import Path

    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    import fl_platform

    register_configs()
    directory = Path(conf_dir) if conf_dir is not None else fl_platform.REPO_ROOT / "conf"
    if not (directory / "config.yaml").is_file():
        raise FileNotFoundError(f"Hydra config directory {directory} has no config.yaml")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(directory.resolve()), version_base="1.3"):
            return hydra_compose(config_name="config", overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()
