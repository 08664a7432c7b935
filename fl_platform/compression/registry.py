"""Compressors by name, and their config schemas (the Hydra ``compressor`` group).

``compressor=topk compressor.ratio=0.01`` selects :class:`TopKConf`; :func:`make_compressor` turns
any of these confs (dataclass, OmegaConf node or dict) into a per-tensor :class:`Compressor`,
wrapped in :class:`ErrorFeedback` when ``error_feedback`` is on. ``none`` means no compression
at all (no hook runs); ``identity`` runs the machinery with lossless payloads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from fl_platform.compression.acpsgd import ACPSGD
from fl_platform.compression.base import Compressor
from fl_platform.compression.errorfeedback import ErrorFeedback
from fl_platform.compression.identity import Identity
from fl_platform.compression.powersgd import PowerSGD
from fl_platform.compression.qsgd import QSGD
from fl_platform.compression.randomk import RandomK
from fl_platform.compression.sign import ScaledSign, Sign
from fl_platform.compression.topk import TopK


@dataclass
class CompressorConf:
    """Fields every compressor option has."""

    name: str = "none"
    error_feedback: bool = False  # a = x + e; e <- a - decode(C(a)), e kept per client / worker
    scope: str = "layer"  # layer (per tensor, FlatModel slots) | global (all parameters) | bucket
    bucket_size: int = 0  # scope=bucket: elements per bucket
    # FL: the ClientUpdate tensors to compress; the others travel dense (and are counted so).
    tensors: list[str] = field(default_factory=lambda: ["delta"])

    def inactive_fields(self, rounds: int | None = None) -> dict[str, str]:
        """Fields that have no effect with the other settings (field -> why), for a run of ``rounds``
        rounds; the FL config check refuses them when they differ from the option's default."""
        out: dict[str, str] = {}
        if self.scope != "bucket":
            out["bucket_size"] = f"it sizes the buckets of compressor.scope=bucket, and scope={self.scope}"
        if rounds == 1:
            out["error_feedback"] = "the residual enters a client's second upload, and rounds=1"
        return out


@dataclass
class NoneConf(CompressorConf):
    name: str = "none"

    def inactive_fields(self, rounds: int | None = None) -> dict[str, str]:
        return dict.fromkeys(("error_feedback", "scope", "bucket_size", "tensors"), "compressor=none compresses nothing")


@dataclass
class IdentityConf(CompressorConf):
    name: str = "identity"

    def inactive_fields(self, rounds: int | None = None) -> dict[str, str]:
        return {**super().inactive_fields(rounds),
                "error_feedback": "identity is lossless, so the residual is always zero",
                "scope": "identity is lossless whatever the layout", "bucket_size": "identity is lossless"}


@dataclass
class TopKConf(CompressorConf):
    name: str = "topk"
    ratio: float = 0.01
    index: str = "auto"  # int32 | bitmap | auto (the smaller)
    error_feedback: bool = True


@dataclass
class RandomKConf(CompressorConf):
    name: str = "randomk"
    ratio: float = 0.01
    unbiased: bool = True  # scale by d/k; with False pair it with error_feedback


@dataclass
class QSGDConf(CompressorConf):
    name: str = "qsgd"
    bits: int = 4  # s = 2^bits - 1 levels
    bucket: int = 512


@dataclass
class SignConf(CompressorConf):
    name: str = "sign"

    def inactive_fields(self, rounds: int | None = None) -> dict[str, str]:
        why = "sign encodes every element on its own, so the layout does not change the message"
        return {**super().inactive_fields(rounds), "scope": why, "bucket_size": why}


@dataclass
class EFSignConf(CompressorConf):
    name: str = "efsign"
    error_feedback: bool = True


@dataclass
class PowerSGDConf(CompressorConf):
    name: str = "powersgd"
    rank: int = 1
    min_compression_rate: float = 2.0
    warm_start: bool = True
    error_feedback: bool = True

    def inactive_fields(self, rounds: int | None = None) -> dict[str, str]:
        out = super().inactive_fields(rounds)
        if rounds == 1:
            out["warm_start"] = "the kept Q starts a client's second upload, and rounds=1"
        return out


@dataclass
class ACPSGDConf(CompressorConf):
    name: str = "acpsgd"
    rank: int = 4
    min_compression_rate: float = 2.0
    error_feedback: bool = True


_COMMON = {f.name for f in fields(CompressorConf)}

COMPRESSORS: dict[str, tuple[type[CompressorConf], Callable[..., Compressor] | None]] = {
    "none": (NoneConf, None),
    "identity": (IdentityConf, Identity),
    "topk": (TopKConf, TopK),
    "randomk": (RandomKConf, RandomK),
    "qsgd": (QSGDConf, QSGD),
    "sign": (SignConf, Sign),
    "efsign": (EFSignConf, ScaledSign),
    "powersgd": (PowerSGDConf, PowerSGD),
    "acpsgd": (ACPSGDConf, ACPSGD),
}


def compressor_names() -> list[str]:
    return sorted(COMPRESSORS)


def compressor_schemas() -> dict[str, type[CompressorConf]]:
    return {name: conf for name, (conf, _) in COMPRESSORS.items()}


def _as_dict(conf: Any) -> dict[str, Any]:
    from fl_platform.core import as_config

    return as_config(conf)


def conf_of(conf: Any) -> CompressorConf:
    """A validated schema instance from a dataclass / OmegaConf node / dict (names unknown keys); the typed
    run config's section (run_config.py) as it is."""
    if isinstance(conf, CompressorConf) and type(conf) is COMPRESSORS.get(conf.name, (None,))[0]:
        return conf
    data = _as_dict(conf)
    name = data.get("name", "none")
    if name not in COMPRESSORS:
        raise ValueError(f"unknown compressor {name!r}; valid choices: {', '.join(compressor_names())}")
    schema = COMPRESSORS[name][0]
    valid = {f.name for f in fields(schema)}
    unknown = sorted(set(data) - valid)
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} for compressor {name!r}; valid keys: {sorted(valid)}")
    return schema(**data)


def make_compressor(conf: Any) -> Compressor | None:
    """The per-tensor compressor a conf describes (None for ``none``)."""
    c = conf_of(conf)
    factory = COMPRESSORS[c.name][1]
    if factory is None:
        return None
    options = {k: v for k, v in vars(c).items() if k not in _COMMON}
    comp = factory(**options)
    return ErrorFeedback(comp) if c.error_feedback else comp


def build_compressor(name: str, error_feedback: bool | None = None, **options: Any) -> Compressor | None:
    """``build_compressor("topk", ratio=0.01)``: the same as a conf with those fields."""
    data: dict[str, Any] = {"name": name, **options}
    if error_feedback is not None:
        data["error_feedback"] = error_feedback
    return make_compressor(data)
