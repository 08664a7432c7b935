"""Schemas of the Hydra ``system`` group: how fast each client computes and communicates."""

from __future__ import annotations

from dataclasses import dataclass, field

DISTRIBUTIONS = ("constant", "uniform", "loguniform", "lognormal")
SYSTEM_KINDS = ("none", "sampled", "trace")


@dataclass
class DistConf:
    """One per-client quantity: ``constant`` (value), ``uniform`` / ``loguniform`` (low, high),
    ``lognormal`` (median, sigma of the log)."""

    dist: str = "constant"
    value: float = 1.0
    low: float = 1.0
    high: float = 1.0
    median: float = 1.0
    sigma: float = 0.0


@dataclass
class SystemConf:
    name: str = "none"  # none (no simulated time) | sampled (from the distributions) | trace (CSV)
    compute_sps: DistConf = field(default_factory=lambda: DistConf(value=1000.0))  # training samples / s
    uplink_mbps: DistConf = field(default_factory=lambda: DistConf(value=10.0))  # Mbit/s (10^6 bit/s)
    downlink_mbps: DistConf = field(default_factory=lambda: DistConf(value=50.0))
    # When set, a client's downlink is its uplink times this (one network, asymmetric links) and
    # ``downlink_mbps`` is ignored; None draws the downlink independently.
    downlink_per_uplink: float | None = None
    latency_s: float = 0.0  # added to each transfer (download and upload)
    jitter_sigma: float = 0.0  # per-round log-normal factor on both bandwidths, drawn from (seed, round, client)
    trace: str | None = None  # name=trace: CSV with columns compute_sps, uplink_mbps, downlink_mbps
    trace_assign: str = "modulo"  # trace rows without client_id: client c gets row c mod R, or a random row


SYSTEM_OPTIONS = ("none", "uniform", "lognormal", "heterogeneous", "trace")


def system_schemas() -> dict[str, type[SystemConf]]:
    """Every option of the ``system`` group shares one schema; the YAMLs pick the distributions."""
    return dict.fromkeys(SYSTEM_OPTIONS, SystemConf)
