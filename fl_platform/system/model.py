"""The system model: per-client compute speed and bandwidths, and each round's simulated time.

Each client's profile is drawn from (seed, client id) only, one stream per quantity, so it never
depends on scheduling, on the number of clients, or on which other quantities are configured:
every method compared under the same config sees the same devices. Optional jitter multiplies
the bandwidths by a log-normal factor drawn from (seed, round, client).

A sampled client k in round t takes
    T_k = latency + bytes_down_k / down_k + samples_k / speed_k + latency + bytes_up_k / up_k
where bytes are the real payload sizes and samples_k the training samples it processed; the
round's simulated time is max_k T_k (the straggler). Clients are assumed to train one at a time
on their own device, so simulated time is unrelated to how the simulator packs clients onto
workers.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fl_platform.seeding import Stream, numpy_rng
from fl_platform.system.config import DISTRIBUTIONS, QUANTITIES, SYSTEM_KINDS, DistConf, SystemConf

MBPS = 1e6 / 8  # bytes per second in one Mbit/s
_QUANTITIES = QUANTITIES
TRACE_COLUMNS = _QUANTITIES


@dataclass(frozen=True)
class ClientProfile:
    compute_sps: float  # training samples per second
    uplink_Bps: float  # bytes per second
    downlink_Bps: float
    latency_s: float


@dataclass(frozen=True)
class ClientTime:
    download_s: float
    compute_s: float
    upload_s: float

    @property
    def total_s(self) -> float:
        return self.download_s + self.compute_s + self.upload_s


def _check_dist(d: DistConf, key: str) -> None:
    if d.dist not in DISTRIBUTIONS:
        raise ValueError(f"system.{key}.dist must be one of {', '.join(DISTRIBUTIONS)}; got {d.dist!r}")
    if d.dist == "constant" and not d.value > 0:
        raise ValueError(f"system.{key}.value must be > 0, got {d.value}")
    if d.dist in ("uniform", "loguniform") and not 0 < d.low <= d.high:
        raise ValueError(f"system.{key} needs 0 < low <= high, got low={d.low}, high={d.high}")
    if d.dist == "lognormal" and not (d.median > 0 and d.sigma >= 0):
        raise ValueError(f"system.{key} needs median > 0 and sigma >= 0, got median={d.median}, sigma={d.sigma}")


def draw(d: DistConf, rng) -> float:
    if d.dist == "constant":
        return float(d.value)
    if d.dist == "uniform":
        return float(rng.uniform(d.low, d.high))
    if d.dist == "loguniform":
        return float(math.exp(rng.uniform(math.log(d.low), math.log(d.high))))
    return float(d.median * math.exp(d.sigma * rng.standard_normal()))


def system_conf(conf: Any) -> SystemConf:
    """A SystemConf from a dataclass, an OmegaConf node or a dict."""
    if isinstance(conf, SystemConf):
        return conf
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(SystemConf), conf))  # type: ignore[return-value]


def read_trace(path: str | Path) -> tuple[list[dict[str, float]], dict[int, int] | None]:
    """Rows of a trace CSV (header: compute_sps, uplink_mbps, downlink_mbps[, latency_s][, client_id])."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"system.trace: no file {str(path)!r}")
    with path.open(newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"system.trace {str(path)!r} lacks column(s) {missing}; "
                             f"needed: {list(TRACE_COLUMNS)}, optional: latency_s, client_id")
        rows: list[dict[str, float]] = []
        ids: dict[int, int] = {}
        for i, rec in enumerate(reader):
            try:
                row = {c: float(rec[c]) for c in (*TRACE_COLUMNS, "latency_s") if rec.get(c) not in (None, "")}
            except ValueError as err:
                raise ValueError(f"system.trace {str(path)!r} line {i + 2}: {err}") from None
            if any(row[c] <= 0 for c in TRACE_COLUMNS):
                raise ValueError(f"system.trace {str(path)!r} line {i + 2}: speeds and bandwidths must be > 0")
            if rec.get("client_id") not in (None, ""):
                ids[int(rec["client_id"])] = len(rows)
            rows.append(row)
    if not rows:
        raise ValueError(f"system.trace {str(path)!r} has no rows")
    if ids and len(ids) != len(rows):
        raise ValueError(f"system.trace {str(path)!r}: give client_id on every row or on none")
    return rows, (ids or None)


class SystemModel:
    def __init__(self, conf: Any, seed: int) -> None:
        c = system_conf(conf)
        if c.name not in SYSTEM_KINDS or c.name == "none":
            raise ValueError(f"system.name must be one of sampled, trace for a system model; got {c.name!r}")
        for q in _QUANTITIES:
            _check_dist(getattr(c, q), q)
        if c.latency_s < 0 or c.jitter_sigma < 0:
            raise ValueError(f"system.latency_s and system.jitter_sigma must be >= 0, got {c.latency_s}, "
                             f"{c.jitter_sigma}")
        if c.downlink_per_uplink is not None and not c.downlink_per_uplink > 0:
            raise ValueError(f"system.downlink_per_uplink must be > 0 (or null), got {c.downlink_per_uplink}")
        if c.trace_assign not in ("modulo", "random"):
            raise ValueError(f"system.trace_assign must be modulo or random, got {c.trace_assign!r}")
        self.conf = c
        self.seed = int(seed)
        self._rows: list[dict[str, float]] | None = None
        self._ids: dict[int, int] | None = None
        if c.name == "trace":
            if not c.trace:
                raise ValueError("system=trace needs system.trace=<path to a CSV file>")
            self._rows, self._ids = read_trace(c.trace)
            if self._ids is not None and c.trace_assign != SystemConf().trace_assign:
                raise ValueError(f"system.trace_assign={c.trace_assign!r} has no effect: every row of the trace "
                                 f"{c.trace!r} names its client_id")
        self._cache: dict[int, tuple[float, float, float, float]] = {}

    def _draw_base(self, client: int) -> tuple[float, float, float, float]:
        c = self.conf
        if self._rows is not None:
            if self._ids is not None:
                if client not in self._ids:
                    raise KeyError(f"system.trace {c.trace!r} has no row for client_id {client}")
                row = self._rows[self._ids[client]]
            elif c.trace_assign == "modulo":
                row = self._rows[client % len(self._rows)]
            else:
                row = self._rows[int(numpy_rng(self.seed, Stream.SYSTEM, client, 9).integers(len(self._rows)))]
            return row["compute_sps"], row["uplink_mbps"] * MBPS, row["downlink_mbps"] * MBPS, \
                row.get("latency_s", c.latency_s)
        values = [draw(getattr(c, q), numpy_rng(self.seed, Stream.SYSTEM, client, i)) for i, q in enumerate(_QUANTITIES)]
        if c.downlink_per_uplink is not None:
            values[2] = values[1] * c.downlink_per_uplink
        return values[0], values[1] * MBPS, values[2] * MBPS, c.latency_s

    def profile(self, client: int, round: int | None = None) -> ClientProfile:
        """Client ``client``'s devices (in ``round``, when bandwidths jitter)."""
        base = self._cache.get(int(client))
        if base is None:
            base = self._cache[int(client)] = self._draw_base(int(client))
        sps, up, down, lat = base
        if round is not None and self.conf.jitter_sigma > 0:
            s = self.conf.jitter_sigma
            up *= math.exp(s * numpy_rng(self.seed, Stream.SYSTEM, client, 3, round).standard_normal())
            if self.conf.downlink_per_uplink is not None:  # one network: both directions move together
                down = up * self.conf.downlink_per_uplink
            else:
                down *= math.exp(s * numpy_rng(self.seed, Stream.SYSTEM, client, 4, round).standard_normal())
        return ClientProfile(sps, up, down, lat)

    def uplink_bandwidth(self, client: int, round: int | None = None) -> float:
        return self.profile(client, round).uplink_Bps

    def client_time(self, client: int, round: int, samples: float, bytes_up: float, bytes_down: float) -> ClientTime:
        p = self.profile(client, round)
        return ClientTime(p.latency_s + bytes_down / p.downlink_Bps, samples / p.compute_sps,
                          p.latency_s + bytes_up / p.uplink_Bps)

    def round_metrics(self, round: int, stats: Mapping[int, Mapping[str, float]]) -> dict[str, float]:
        """The metrics row's simulated time (the straggler's) and its breakdown.

        ``stats`` maps each client that reported back to its ``samples``, ``bytes_up``, ``bytes_down``.
        """
        if not stats:
            return {"simulated_time_s": 0.0}
        times = {c: self.client_time(c, round, s["samples"], s["bytes_up"], s["bytes_down"]) for c, s in stats.items()}
        straggler = max(sorted(times), key=lambda c: times[c].total_s)
        t = times[straggler]
        uploads = [x.upload_s for x in times.values()]
        return {"simulated_time_s": t.total_s, "sim_download_s": t.download_s, "sim_compute_s": t.compute_s,
                "sim_upload_s": t.upload_s, "sim_upload_max_s": max(uploads), "sim_upload_min_s": min(uploads),
                "sim_straggler": straggler}


def build_system(conf: Any, seed: int) -> SystemModel | None:
    """The system model of a ``system`` config (None for ``system=none`` or no config)."""
    if conf is None:
        return None
    c = system_conf(conf)
    if c.name == "none":
        return None
    return SystemModel(c, seed)


def samples_processed(metrics_values: Mapping[str, list[float]], batch_size: int, num_samples: int,
                      epochs: int) -> float:
    """Training samples a client processed: the loop's count when reported, else an estimate."""
    if "train_loss" in metrics_values:
        return float(metrics_values["train_loss"][1])
    if "local_steps" in metrics_values:
        return float(metrics_values["local_steps"][0]) * batch_size
    return float(num_samples * epochs)


def client_stat(update: Any, train: Any) -> dict[str, float]:
    """What the system model needs from one ClientUpdate: its real upload bytes and samples trained."""
    return {"bytes_up": float(update.bytes_up),
            "samples": samples_processed(update.metrics.values, train.batch_size, update.num_samples,
                                         train.epochs or 0)}
