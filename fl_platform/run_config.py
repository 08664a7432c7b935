"""The door: a run's configuration, read once from Hydra's composed ``DictConfig``, typed.

Every runtime composes its config with Hydra (the CLI, ``fl_platform.api``, a Flower run config,
``fl_platform.ssgd``) and hands it to :func:`read_config`, which turns it into one
:class:`RunConfig`: the dataclass tree of fl_platform/config.py (``Config``; ``SSGDConfig`` for
S-SGD) with each group's chosen option as its schema dataclass (``model=cnn``: a ``CNNConf``), a
section the config lacks as ``None``, and the user's own fields of an open option
(``model=custom``, ``dataset=custom``, ``algorithm=plugin``: ``+model.width=64``) as attributes of
that section. Its fields read as the tree's (``run.rounds``, ``run.train.lr``, ``run.engine``);
its properties are what the layers below take (``source_options``, ``train_config``,
``algorithm_conf``, ...). The layers below never see the ``DictConfig``; it stays on the run
config as ``raw`` for what needs the YAML form only: config.yaml, the resume comparison and
wandb's config dict. Every start-up check runs on it in fl_platform/config_checks.py.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, fields, is_dataclass
from enum import Enum
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from fl_platform.datasets.augment import AugmentConf
from fl_platform.training.loop import TrainConfig

# (dataset fields the platform reads itself; the rest are the source's own options)
_DATASET_OWN = ("name", "root", "download", "augment")


def options_of(node: Any, exclude: tuple[str, ...] = ("name",)) -> dict[str, Any]:
    """The fields of a typed group section except ``exclude``, as plain Python values (enums as their
    values), the user's own fields of an open option included."""
    return {k: plain(v) for k, v in vars(node).items() if k not in exclude}


def plain(value: Any) -> Any:
    """``value`` as plain Python: enums as their values, dataclasses (their fields and the user's) as dicts."""
    if isinstance(value, Enum):
        return value.value
    if is_dataclass(value) and not isinstance(value, type):
        return {k: plain(v) for k, v in vars(value).items()}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def _typed(node: Any) -> Any:
    """``node`` as its schema's dataclass (nested sections too), plain lists and dicts elsewhere.

    Like ``OmegaConf.to_object``, but a missing mandatory value (``???``: a group the config leaves
    out, ``model._target_`` not given) becomes None, so that the checks can name it, and keys beyond
    a schema's fields (``+model.width=64``) become attributes of its instance."""
    if isinstance(node, ListConfig):
        return [_typed(node[i]) for i in range(len(node))]
    if not isinstance(node, DictConfig):
        return node
    items = {str(k): None if OmegaConf.is_missing(node, k) else _typed(node[k]) for k in node}
    schema = OmegaConf.get_type(node)
    if schema is None or not is_dataclass(schema):
        return items
    init = {f.name for f in fields(schema) if f.init}
    obj = schema(**{k: v for k, v in items.items() if k in init})
    for key, value in items.items():
        if key not in init:
            object.__setattr__(obj, key, value)
    return obj


@dataclass(frozen=True, eq=False)
class RunConfig:
    """One run's configuration: the typed tree (``tree``) plus the composed YAML form (``raw``).

    Attribute reads fall through to the tree (``run.seed``, ``run.model.name``), so that code and
    plug-in algorithms written against the composed config (``inactive_fields(run)``: ``run.rounds``,
    ``run.get("privacy")``) read the same names."""

    tree: Any  # fl_platform.config.Config, or fl_platform.ssgd.config.SSGDConfig
    raw: DictConfig

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("tree", "raw"):
            raise AttributeError(name)
        return getattr(self.tree, name)

    def get(self, key: str, default: Any = None) -> Any:
        """A top-level section or value, ``default`` when the config has none (DictConfig's ``get``)."""
        value = getattr(self.tree, key, None)
        return default if value is None else value

    # ------------------------------------------------------------------ data and model
    @property
    def source_options(self) -> dict[str, Any]:
        """The dataset's own options (its loader's arguments), without the platform's fields."""
        return options_of(self.tree.dataset, exclude=_DATASET_OWN)

    @property
    def augment(self) -> AugmentConf:
        """``dataset.augment`` (a copy)."""
        return copy.deepcopy(self.tree.dataset.augment)

    @property
    def partition_options(self) -> dict[str, Any]:
        """The partitioner's arguments (``partition`` without its name)."""
        return options_of(self.tree.partition)

    @property
    def model_options(self) -> dict[str, Any]:
        """The model builder's arguments (``model`` without its name; ``custom``: ``_target_`` and the user's)."""
        return options_of(self.tree.model)

    def name_of(self, group: str) -> str:
        """The name of ``group`` for summaries: the option's, or the user's plug-in's (outputs.plugin_name)."""
        from fl_platform.outputs import plugin_name

        node = getattr(self.tree, group)
        return plugin_name(group, node.name, getattr(node, "_target_", None))

    # ------------------------------------------------------------------ training and algorithm
    @property
    def train_config(self) -> TrainConfig:
        """The train section (a copy); a cosine schedule's horizon (``lr_schedule.rounds``) defaults to
        the run's rounds."""
        train = copy.deepcopy(self.tree.train)
        rounds = getattr(self.tree, "rounds", None)
        if rounds is not None and train.lr_schedule.name == "cosine" and train.lr_schedule.rounds is None:
            train.lr_schedule.rounds = int(rounds)
        return train

    @property
    def algorithm_spec(self) -> Any:
        """The algorithm's ``AlgorithmSpec`` (``algorithm=plugin``: loaded from ``algorithm._target_``)."""
        from fl_platform.algorithms.registry import spec_of

        return spec_of(self.tree.algorithm)

    @property
    def algorithm_name(self) -> str:
        """For logs and summaries: ``algorithm.name``, or the spec's for ``algorithm=plugin``."""
        from fl_platform.algorithms.registry import PLUGIN

        name = self.tree.algorithm.name
        return self.algorithm_spec.name if name == PLUGIN else name

    @property
    def algorithm_conf(self) -> Any:
        """The algorithm section as its spec's conf dataclass (a fresh one). ``algorithm=plugin``: its
        fields but ``_target_`` onto the SPEC's conf, so a field the conf lacks is an error naming it."""
        from omegaconf.errors import OmegaConfBaseException

        from fl_platform.algorithms.registry import PLUGIN
        from fl_platform.config_checks import ConfigError

        spec, node = self.algorithm_spec, self.tree.algorithm
        if node.name != PLUGIN:
            return copy.deepcopy(node) if isinstance(node, spec.conf) else spec.conf(**options_of(node, ()))
        own = options_of(node, exclude=("name", "_target_"))
        try:
            return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(spec.conf), own))
        except OmegaConfBaseException as err:
            key = getattr(err, "full_key", None) or "?"
            names = [f.name for f in fields(spec.conf) if f.name != "name"]
            raise ConfigError(f"algorithm.{key}: {str(err).splitlines()[0]} (algorithm._target_={node._target_}: "
                              f"{spec.conf.__name__} has fields {', '.join(names) or 'none'})") from None

    # ------------------------------------------------------------------ optional sections
    @property
    def compressor_options(self) -> dict[str, Any] | None:
        """The compressor section as a plain dict (what travels to the workers), None without one."""
        comp = getattr(self.tree, "compressor", None)
        return None if comp is None else options_of(comp, exclude=())

    @property
    def eval_clients(self) -> str:
        """``eval.clients`` (none when the config has no eval section)."""
        ev = getattr(self.tree, "eval", None)
        return "none" if ev is None else str(plain(ev.clients))

    @property
    def early_stop_conf(self) -> Any:
        """The ``early_stop`` section (off when the config has none)."""
        from fl_platform.rounds.callbacks import EarlyStopConf

        early = getattr(self.tree, "early_stop", None)
        return EarlyStopConf() if early is None else early

    @property
    def callback_items(self) -> list[Any]:
        """The ``callbacks`` entries as plain values (import paths or ``{_target_: ..., args}``)."""
        return plain(list(getattr(self.tree, "callbacks", None) or []))

    # ------------------------------------------------------------------ the YAML form
    def to_yaml(self) -> str:
        """config.yaml: the composed config, resolved."""
        return OmegaConf.to_yaml(self.raw, resolve=True)

    def to_container(self) -> dict[str, Any]:
        """The composed config as plain values (wandb's config dict, the resume comparison)."""
        return OmegaConf.to_container(self.raw, resolve=True, enum_to_str=True)  # type: ignore[return-value]


def read_config(cfg: DictConfig | RunConfig) -> RunConfig:
    """The door: ``cfg`` (Hydra's composed config) as the typed :class:`RunConfig` (a RunConfig as is)."""
    if isinstance(cfg, RunConfig):
        return cfg
    if not isinstance(cfg, DictConfig):
        raise TypeError(f"expected a composed config (omegaconf.DictConfig), got a {type(cfg).__name__}")
    tree = _typed(cfg)
    if not is_dataclass(tree):
        raise TypeError("the config was not composed onto the schemas (a loaded YAML file?): compose it with "
                        "fl_platform.config.compose (or fl_platform.api.compose)")
    return RunConfig(tree, cfg)
