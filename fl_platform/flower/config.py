"""Our Hydra config <-> Flower's run config (flat, dotted keys), and the deployment settings.

Flower's run config is a flat mapping of dotted keys to bool/int/float/str, and the SuperLink
refuses an override whose key is not among the app's defaults in ``[tool.flwr.app.config]``.
So the defaults list the *union* of the keys of every option of every config group (FedProx's
``algorithm.mu`` next to SCAFFOLD's ``algorithm.weighting``), and the value ``""`` (``UNSET``)
means "not set: the selected option's own default from conf/ applies". A run config is turned
back into Hydra overrides and composed against conf/, so a deployment runs exactly the config
``python -m fl_platform.run <same overrides>`` would simulate, validated by the same schemas.

Values TOML cannot hold are encoded as strings: ``None`` as ``"null"``, lists as JSON
(``model.hidden = "[128]"``). Deployment-only settings live under ``deploy.*`` (DeployConf).
The simulation engine group is not part of a run config.

The defaults list the built-ins' keys only. Keys they do not list (a plug-in's or a custom
model's/loader's own fields, ``algorithm.max_norm``) travel in one key, ``extra``: a JSON object of
dotted keys (``extra = '{"algorithm.max_norm": 0.05}'``), unpacked before composing, so they are
validated like any other key and a plug-in deploys without editing pyproject.toml.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

import fl_platform

UNSET = ""  # the key is left to conf/ (the selected option's own default)
NULL = "null"  # None
EXCLUDED_GROUPS = ("engine", "eval")  # simulation-only (eval: per-client evaluation runs on the engines)
DEPLOY = "deploy"
EXTRA = "extra"  # JSON object {dotted key: value} of the keys [tool.flwr.app.config] does not list

RunConfig = dict[str, bool | int | float | str]


@dataclass
class DeployConf:
    """``deploy.*`` keys: how the ServerApp waits for SuperNodes and replies, and where results go."""

    round_timeout: float = 600.0  # seconds to wait for a round's replies before going on without them
    min_replies: int = 1  # fewer valid replies than this in a round stops the run
    min_nodes: int = 0  # SuperNodes to wait for before round 1 (0: one per client, i.e. num_clients)
    connect_timeout: float = 600.0  # seconds to wait for min_nodes SuperNodes
    poll_interval: float = 0.2  # seconds between polls for replies
    # identify queries outstanding at once (0: every new SuperNode asked at once). Each is a ClientApp process on
    # its node: many SuperNodes on one machine otherwise start them all together (50: ~16 GB, docs/deploy.md)
    identify_in_flight: int = 0
    run_dir: str = ""  # "" = outputs/flower/<time>_<algorithm>_<dataset>_s<seed>_run<id> in the ServerApp's cwd
    device: str = "auto"  # training/evaluation device (a SuperNode's node config may override it)

    def __post_init__(self) -> None:
        checks = [
            (self.round_timeout > 0, "round_timeout", "must be > 0"),
            (self.min_replies >= 1, "min_replies", "must be >= 1"),
            (self.min_nodes >= 0, "min_nodes", "must be >= 0"),
            (self.connect_timeout > 0, "connect_timeout", "must be > 0"),
            (self.poll_interval > 0, "poll_interval", "must be > 0"),
            (self.identify_in_flight >= 0, "identify_in_flight", "must be >= 0 (0: no bound)"),
        ]
        for ok, key, message in checks:
            if not ok:
                raise ValueError(f"{DEPLOY}.{key} {message}, got {getattr(self, key)!r}")

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> DeployConf:
        valid = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key not in valid:
                raise ValueError(f"unknown run-config key {DEPLOY}.{key!r}; valid {DEPLOY} keys: "
                                 f"{', '.join(sorted(valid))}")
            if value == UNSET:
                continue
            kind = type(getattr(cls(), key))
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            ok = {bool: isinstance(value, bool), str: isinstance(value, str),
                  int: numeric and float(value).is_integer(), float: numeric}[kind]
            if not ok:
                raise ValueError(f"run-config key {DEPLOY}.{key} must be a {kind.__name__}, got {value!r}")
            kwargs[key] = kind(value)
        return cls(**kwargs)


# ---------------------------------------------------------------- composing Hydra configs


def conf_dir() -> Path:
    """conf/ beside the fl_platform package that is running (the repository or an installed FAB)."""
    return fl_platform.REPO_ROOT / "conf"


def compose(overrides: Iterable[str] = ()) -> DictConfig:
    """The config ``python -m fl_platform.run <overrides>`` would run."""
    from fl_platform.config import compose as compose_config

    directory = conf_dir()
    if not (directory / "config.yaml").is_file():
        raise FileNotFoundError(f"Hydra config directory {directory} has no config.yaml; the Flower app "
                                "must ship conf/ (see [tool.flwr.app] fab-include in pyproject.toml)")
    return compose_config(overrides, directory)


@lru_cache(maxsize=4)
def _config_groups(directory: Path) -> tuple[str, ...]:
    top = compose()
    return tuple(sorted(p.name for p in directory.iterdir()
                        if p.is_dir() and p.name in top and p.name not in EXCLUDED_GROUPS))


def config_groups() -> list[str]:
    """Config groups that belong in a run config (folders of conf/ that are keys of the config)."""
    return list(_config_groups(conf_dir()))


def group_options(group: str) -> list[str]:
    """The built-in options of a config group: conf/<group>/*.yaml and, for ``algorithm``, the built-in
    algorithms. Installed plug-ins are left out: their fields travel in ``extra``, so what is installed
    never changes (or breaks) the exported defaults."""
    options = {p.stem for p in (conf_dir() / group).glob("*.yaml")}
    if group == "algorithm":
        from fl_platform.algorithms.registry import builtin_algorithm_names

        options.update(builtin_algorithm_names())
    return sorted(options)


# ---------------------------------------------------------------- flattening


def _encode(value: Any) -> bool | int | float | str:
    if value is None:
        return NULL
    if isinstance(value, list | tuple):
        return json.dumps(list(value))
    if isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot put {type(value).__name__} value {value!r} into a Flower run config")


def _flatten(node: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in node.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _container(cfg: DictConfig) -> dict[str, Any]:
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]


@lru_cache(maxsize=256)
def _option_defaults(group: str, option: str) -> tuple[tuple[str, Any], ...]:
    """The flattened defaults of one option of a group, from conf/ (composed once per process)."""
    return tuple(_flatten(_container(compose([f"{group}={option}"])[group]), f"{group}.").items())


@lru_cache(maxsize=1)
def _group_keys() -> dict[str, tuple[str, ...]]:
    """Every key any option of each group has (cached). Each compose picks the i-th option of every group at
    once (an option's fields do not depend on the other groups' choices), so it takes as many composes as
    the largest group has options (21), not one per option (65): 20 s -> 7 s on 2 cores."""
    options = {group: list(group_options(group)) for group in config_groups()}
    union: dict[str, dict[str, None]] = {group: {} for group in options}
    for i in range(max((len(o) for o in options.values()), default=0)):
        chosen = {group: o[i] for group, o in options.items() if i < len(o)}
        cfg = compose([f"{group}={option}" for group, option in chosen.items()])
        for group in chosen:
            union[group].update(dict.fromkeys(_flatten(_container(cfg[group]), f"{group}.")))
    keys: dict[str, tuple[str, ...]] = {}
    for group, found in union.items():
        names = [f"{group}.name"] if f"{group}.name" in found else []
        keys[group] = tuple(names + sorted(k for k in found if k not in names))
    return keys


def flatten_config(cfg: DictConfig, deploy: DeployConf | None = None, minimal: bool = True,
                   known: Iterable[str] | None = None) -> RunConfig:
    """The run config of ``cfg``.

    Top-level and non-group keys (``rounds``, ``train.*``) and each group's ``name`` are always
    written. A group option's own fields are written only where they differ from that option's
    defaults in conf/ (``minimal``; all of them otherwise): the rest stay UNSET and compose back to
    the same values. Keys not in ``known`` (default: the keys of pyproject's
    ``[tool.flwr.app.config]``, when there is one) go into the JSON object ``extra``, which the
    SuperLink accepts since it is one of the defaults.
    """
    from fl_platform.config_checks import check_flower_server

    data = _container(cfg)
    check_flower_server(data)  # (engine.* and eval.* are not written: a setting of theirs is refused)
    groups = set(config_groups())
    flat: RunConfig = {}
    for key, value in data.items():
        if key in EXCLUDED_GROUPS or key == "hydra":
            continue
        if not isinstance(value, Mapping):
            flat[key] = _encode(value)
            continue
        own = _flatten(value, f"{key}.")
        if minimal and key in groups and isinstance(value.get("name"), str):
            defaults = dict(_option_defaults(key, value["name"]))
            own = {k: v for k, v in own.items() if k == f"{key}.name" or k not in defaults or defaults[k] != v}
        flat.update({k: _encode(v) for k, v in own.items()})
    for key, value in asdict(deploy or DeployConf()).items():
        flat[f"{DEPLOY}.{key}"] = value
    if known is None:
        known = pyproject_defaults() or flat
    known = set(known)
    extra = {k: v for k, v in flat.items() if k not in known}
    flat = {k: v for k, v in flat.items() if k in known}
    if extra:
        flat[EXTRA] = json.dumps(extra)
    return flat


def default_run_config(overrides: Iterable[str] = ()) -> RunConfig:
    """The ``[tool.flwr.app.config]`` defaults: the default experiment plus every key of every
    option of every group, UNSET inside groups except ``<group>.name``.

    So a run config may set any option's keys (the SuperLink refuses keys it has no default
    for), and choosing another option (``algorithm.name="fedprox"``) picks up that option's own
    defaults from conf/. ``overrides`` add the group keys of the config they compose (UNSET): a
    custom model's or plug-in algorithm's own fields (``+model.width=64``), which no option lists.
    """
    flat = unpack_extra(flatten_config(compose(), minimal=False))
    for group, keys in _group_keys().items():
        for key in keys:
            if key != f"{group}.name":
                flat[key] = UNSET
    if overrides:
        groups = set(config_groups())
        for key in unpack_extra(flatten_config(compose(overrides), minimal=False)):
            if key.partition(".")[0] in groups and not key.endswith(".name"):
                flat.setdefault(key, UNSET)
    flat[EXTRA] = UNSET
    ordered = dict(sorted(flat.items(), key=lambda kv: kv[0].count(".") > 0))  # top-level keys first
    return {k: (UNSET if v == NULL else v) for k, v in ordered.items()}


def pyproject_defaults(path: Path | None = None) -> RunConfig | None:
    """The flattened ``[tool.flwr.app.config]`` of pyproject.toml beside conf/ (None if there is none)."""
    import tomllib

    path = path or fl_platform.REPO_ROOT / "pyproject.toml"
    if not path.is_file():
        return None
    with open(path, "rb") as fh:
        table = tomllib.load(fh).get("tool", {}).get("flwr", {}).get("app", {}).get("config")
    return None if table is None else _flatten(table)


def check_keys(run_config: Mapping[str, Any], defaults: Mapping[str, Any]) -> None:
    """The SuperLink refuses a run config with keys its app has no default for; say which, here."""
    missing = sorted(set(run_config) - set(defaults))
    if missing:
        raise ValueError(f"run-config keys {missing} are not in [tool.flwr.app.config] of pyproject.toml, so the "
                         f"SuperLink would refuse the run ('Invalid run configuration'); put them in the JSON "
                         f"object {EXTRA!r} (export_config does), or regenerate the defaults with "
                         "`python -m fl_platform.flower.export_config --pyproject` when a built-in gained them")


def unpack_extra(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """``run_config`` with the keys of its JSON object ``extra`` in place of ``extra`` (each checked: a
    dotted key the run config does not already hold, a scalar or list value)."""
    flat = {k: v for k, v in run_config.items() if k != EXTRA}
    raw = run_config.get(EXTRA, UNSET)
    if raw == UNSET:
        return flat
    try:
        extra = json.loads(raw) if isinstance(raw, str) else None
    except json.JSONDecodeError as err:
        raise ValueError(f"run-config key {EXTRA} must be a JSON object of dotted keys, e.g. "
                         f"'{{\"algorithm.max_norm\": 0.05}}'; got {raw!r} ({err})") from None
    if not isinstance(extra, dict):
        raise ValueError(f"run-config key {EXTRA} must be a JSON object of dotted keys, got {raw!r}")
    for key, value in extra.items():
        if key in flat or key.partition(".")[0] == DEPLOY or key == EXTRA:
            raise ValueError(f"run-config key {key!r} in {EXTRA} is a key of [tool.flwr.app.config] (or deploy.*): "
                             f"set it directly, not in {EXTRA}")
        if key.partition(".")[0] in EXCLUDED_GROUPS:
            raise ValueError(f"run-config key {key!r} in {EXTRA}: {', '.join(EXCLUDED_GROUPS)}.* are simulation "
                             "settings, which a Flower deployment does not run; leave them out")
        if isinstance(value, dict) or value is None:
            raise ValueError(f"run-config key {key!r} in {EXTRA}: give a dotted key per leaf value "
                             f"({key}.<field>), and null as the string 'null'; got {value!r}")
        flat[key] = _encode(value)
    return flat


# ---------------------------------------------------------------- run config -> Hydra


def _render(value: Any) -> str:
    """A run-config value in Hydra's override grammar."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if not isinstance(value, str):
        raise TypeError(f"run-config values must be bool, int, float or str, got {value!r}")
    if value == NULL:
        return "null"
    if value[:1] in "[{":
        return value  # a list/dict in Hydra syntax (JSON is valid Hydra syntax)
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def to_overrides(run_config: Mapping[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Hydra overrides for ``run_config`` and its ``deploy.*`` part (group choices first)."""
    from fl_platform.config import OPEN_OPTIONS

    run_config = unpack_extra(run_config)
    groups = {p.name for p in conf_dir().iterdir() if p.is_dir()}
    chosen = {key.partition(".")[0]: value for key, value in run_config.items()
              if key.count(".") == 1 and key.endswith(".name")}

    def users(head: str, rest: str) -> bool:  # a field of the user's code in an open option (+: added)
        schema = OPEN_OPTIONS.get(head, {}).get(chosen.get(head))  # type: ignore[arg-type]
        return schema is not None and rest.partition(".")[0] not in {f.name for f in fields(schema)}

    choices: list[str] = []
    values: list[str] = []
    deploy: dict[str, Any] = {}
    for key, value in run_config.items():
        head, _, rest = key.partition(".")
        if head == DEPLOY:
            deploy[rest] = value
        elif value == UNSET:
            continue
        elif head in groups and rest == "name":
            if not isinstance(value, str):
                raise ValueError(f"run-config key {key} must name an option of conf/{head}/, got {value!r}")
            choices.append(f"{head}={value}")
        else:
            values.append(f"{'+' if users(head, rest) else ''}{key}={_render(value)}")
    return choices + values, deploy


def from_run_config(run_config: Mapping[str, Any]) -> tuple[DictConfig, DeployConf]:
    """Compose our experiment config (and the deployment settings) from a Flower run config."""
    overrides, deploy = to_overrides(run_config)
    try:
        cfg = compose(overrides)
    except Exception as err:  # Hydra's errors name the key; say where it came from
        raise ValueError(f"the Flower run config does not give a valid experiment config: {err}") from err
    return cfg, DeployConf.from_flat(deploy)


# ---------------------------------------------------------------- TOML


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = nested
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    # TOML: plain keys of a table must come before its sub-tables
    def order(node: dict[str, Any]) -> dict[str, Any]:
        plain = {k: v for k, v in node.items() if not isinstance(v, dict)}
        tables = {k: order(v) for k, v in node.items() if isinstance(v, dict)}
        return {**plain, **tables}

    return order(nested)


def to_toml(flat: Mapping[str, Any], table: str | None = None) -> str:
    """``flat`` as TOML, nested tables for dotted keys; under ``[table]`` when given."""
    import tomli_w

    nested = _nest(flat)
    if table:
        for part in reversed(table.split(".")):
            nested = {part: nested}
    return tomli_w.dumps(nested)
