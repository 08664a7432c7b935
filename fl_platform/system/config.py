"""Schemas of the Hydra ``system`` group: how fast each client computes and communicates."""

from __future__ import annotations

from dataclasses import dataclass, field

DISTRIBUTIONS = ("constant", "uniform", "loguniform", "lognormal")
SYSTEM_KINDS = ("none", "sampled", "trace")
DIST_PARAMS = ("value", "low", "high", "median", "sigma")
QUANTITIES = ("compute_sps", "uplink_mbps", "downlink_mbps")


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

    def inactive_fields(self) -> dict[str, str]:
        """The parameters the other distributions use (field -> why)."""
        used = {"constant": ("value",), "uniform": ("low", "high"), "loguniform": ("low", "high"),
                "lognormal": ("median", "sigma")}.get(self.dist, DIST_PARAMS)
        return {k: f"a parameter of another distribution, and dist={self.dist}" for k in DIST_PARAMS if k not in used}


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

    def inactive_fields(self) -> dict[str, str]:
        """Fields (dotted, e.g. ``uplink_mbps.value``) that have no effect with the other settings,
        each with the reason; the FL config check refuses them when they differ from the default."""
        def every(q: str, why: str) -> dict[str, str]:
            return {f"{q}.{k}": why for k in ("dist", *DIST_PARAMS)}

        if self.name == "none":
            out: dict[str, str] = {}
            for q in QUANTITIES:
                out.update(every(q, "system=none has no system model"))
            rest = ("downlink_per_uplink", "latency_s", "jitter_sigma", "trace", "trace_assign")
            return {**out, **dict.fromkeys(rest, "system=none has no system model")}
        if self.name != "trace":
            return self._sampled_inactive()
        out = {}
        for q in QUANTITIES:
            out.update(every(q, "the trace CSV gives every client's speeds and bandwidths"))
        if not self.jitter_sigma:
            out["downlink_per_uplink"] = ("with a trace it only ties the jittered downlink to the uplink, and "
                                          "jitter_sigma=0")
        return out

    def _sampled_inactive(self) -> dict[str, str]:
        why = f"used only by system.name=trace, and name={self.name}"
        out = {"trace": why, "trace_assign": why}
        for q in QUANTITIES:
            out.update({f"{q}.{k}": v for k, v in getattr(self, q).inactive_fields().items()})
        if self.downlink_per_uplink is not None:
            out.update({f"downlink_mbps.{k}": "system.downlink_per_uplink sets the downlink"
                        for k in ("dist", *DIST_PARAMS)})
        return out


SYSTEM_OPTIONS = ("none", "uniform", "lognormal", "heterogeneous", "trace")


def system_schemas() -> dict[str, type[SystemConf]]:
    """Every option of the ``system`` group shares one schema; the YAMLs pick the distributions."""
    return dict.fromkeys(SYSTEM_OPTIONS, SystemConf)
