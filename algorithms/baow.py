"""BAOW (Tang et al., ICPP 2024): bandwidth-aware Top-k ratios (BCRS) + overlap-weighted averaging (OPWA).

Per round (specs/baow.md; the formulas marked reconstructed there are implemented as written and
each choice is a config field, documented in docs/compression.md):

* BCRS, server: client k's keep ratio from this round's uplink bandwidth b_k (the system model's),
  ``ratio_rule=straggler``: rho_k = min(1, rho_0 b_k / min_j b_j), so every upload takes about as
  long as the slowest client's rho_0 upload; ``ratio_rule=budget``: rho_k = min(1, rho_0 |S| b_k /
  sum_j b_j). Sent in ``Broadcast.per_client``. Without a system model every b_k is equal and
  rho_k = rho_0.
* Client: FedAvg local training, then the shared Top-k compressor keeps the ceil(rho_k d_l)
  largest |delta| of each layer (``scope=layer``; ``global``: over all parameters); BatchNorm
  buffers are sent dense. Optional error feedback (``error_feedback``, default off) keeps a
  residual per client. Upload: the Top-k payload (values + int32 indices or a bitmap,
  ``index=auto`` picks the smaller); bytes_up is its real size. The server derives the mask from
  the indices, so the mask costs no uplink bytes.
* OPWA, server: with p_k = w_k / sum w (w_k = n_k, or n_k rho_k with ``bcrs_reweight=ratio``) and
  m_k the kept mask, Delta_j = sum_k p_k m_kj delta_kj / c_j where c_j = sum_k p_k m_kj > 0, else 0.
  Clients send w_k m_k * delta_k and w_k m_k; both are sums, so hierarchical aggregation is exact.
  ``gamma_max`` caps the amplification 1/c_j at gamma_max (c_j floored at 1/gamma_max);
  ``aggregation=plain`` divides by sum w instead (Top-k FedAvg with BCRS ratios, an ablation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fl_platform.algorithms.base import (
    AlgorithmSpec,
    ClientAlgorithm,
    ServerAlgorithm,
    ServerStepConf,
    StateSpec,
)
from fl_platform.compression.base import Key
from fl_platform.compression.errorfeedback import ErrorFeedback
from fl_platform.compression.topk import INDEX_FORMATS, TopK
from fl_platform.compression.vector import Layout, VectorCompressor
from fl_platform.core import Aggregate, Broadcast, ClientUpdate, RoundContext
from fl_platform.privacy.spec import PrivacyUnsupported, PrivateUploads

RATIO_RULES = ("straggler", "budget")
AGGREGATIONS = ("opwa", "plain")
REWEIGHTS = ("none", "ratio")


@dataclass
class BAOWConf(ServerStepConf):
    name: str = "baow"
    rho0: float = 0.01  # keep ratio of the slowest sampled client
    ratio_rule: str = "straggler"  # straggler: rho0 b_k / b_min | budget: rho0 |S| b_k / sum b
    scope: str = "layer"  # Top-k per layer, or global (over all parameters)
    index: str = "auto"  # int32 | bitmap | auto (the smaller payload)
    aggregation: str = "opwa"  # opwa: per-coordinate renormalisation | plain: divide by sum of weights
    gamma_max: float | None = None  # cap on OPWA's amplification 1/c_j (None: no cap)
    error_feedback: bool = False  # client residual accumulation (not confirmed in the paper)
    bcrs_reweight: str = "none"  # none: p_k ~ n_k | ratio: p_k ~ n_k rho_k

    def inactive_fields(self, run: Any) -> dict[str, str]:
        out = super().inactive_fields(run)
        if self.aggregation == "plain":
            out["gamma_max"] = "it caps OPWA's amplification, and aggregation=plain"
        system = run.get("system")
        if system is None or system.name == "none":
            why = "without a system model every client's bandwidth is equal, so every keep ratio is rho0"
            out.update(ratio_rule=why, bcrs_reweight=why)
        if run.rounds == 1:
            out["error_feedback"] = "the residual enters a client's second upload, and rounds=1"
        privacy = run.get("privacy")
        if privacy is not None and privacy.name != "none":
            out["bcrs_reweight"] = f"under privacy={privacy.name} every client's clipped update counts once"
        return out


def _check(cfg: BAOWConf) -> None:
    if not 0 < cfg.rho0 <= 1:
        raise ValueError(f"algorithm.rho0 must be in (0, 1], got {cfg.rho0}")
    for key, value, valid in (("ratio_rule", cfg.ratio_rule, RATIO_RULES), ("aggregation", cfg.aggregation, AGGREGATIONS),
                              ("bcrs_reweight", cfg.bcrs_reweight, REWEIGHTS), ("index", cfg.index, INDEX_FORMATS),
                              ("scope", cfg.scope, ("layer", "global"))):
        if value not in valid:
            raise ValueError(f"algorithm.{key} must be one of {', '.join(valid)}; got {value!r}")
    if cfg.gamma_max is not None and cfg.gamma_max < 1:
        raise ValueError(f"algorithm.gamma_max must be >= 1 (or null), got {cfg.gamma_max}")


def keep_ratios(rho0: float, bandwidths: dict[int, float], rule: str = "straggler") -> dict[int, float]:
    """BCRS: each sampled client's keep ratio from its uplink bandwidth."""
    if not bandwidths:
        return {}
    if rule == "straggler":
        b_min = min(bandwidths.values())
        return {c: min(1.0, rho0 * b / b_min) for c, b in bandwidths.items()}
    total = sum(bandwidths.values())
    return {c: min(1.0, rho0 * len(bandwidths) * b / total) for c, b in bandwidths.items()}


class BAOWClient(ClientAlgorithm):
    compresses_uplink = True  # the generic uplink compressor must stay off (compressor=none)

    def __init__(self, cfg: BAOWConf, setup) -> None:
        super().__init__(cfg, setup)
        _check(cfg)
        self._layout: Layout | None = None

    def state_spec(self) -> dict[str, StateSpec]:
        return {"residual": StateSpec(self.setup.num_params)} if self.cfg.error_feedback else {}

    @classmethod
    def uploads(cls, cfg: BAOWConf) -> dict[str, str | None]:
        return {"masked_delta": "n", "mask": "n"}

    @classmethod
    def private_uploads(cls, cfg: BAOWConf) -> PrivateUploads:
        """Under DP: the Top-k delta, clipped after BCRS's own compression (scaling keeps its support);
        the keep masks are not sent, so only ``aggregation=plain`` can run."""
        if cfg.aggregation == "opwa":
            raise PrivacyUnsupported(
                "its overlap-weighted averaging (algorithm.aggregation=opwa) divides each coordinate by how many "
                "clients kept it, a count that depends on every client's data and has no noise of its own; "
                "algorithm.aggregation=plain (BCRS Top-k with FedAvg's average, no masks sent) runs under DP")
        return PrivateUploads(("masked_delta",), ("n", "clients"))

    def contribution_sizes(self) -> dict[str, int]:
        return {"masked_delta": self.setup.vector_size, "mask": self.setup.vector_size}

    def train(self, ctx: RoundContext, client_id: int, broadcast: Broadcast, state, data, trainer) -> ClientUpdate:
        settings = broadcast.per_client.get(client_id)
        if settings is None or "ratio" not in settings:
            raise ValueError(f"baow: the broadcast of round {ctx.round + 1} has no keep ratio for client {client_id}")
        rho = float(settings["ratio"])
        fm = trainer.fm
        weights = broadcast.tensors["weights"]
        fm.load(weights)
        metrics = trainer.fit(data, self.hooks(ctx, broadcast, state, trainer), seed=ctx.seed, round=ctx.round,
                              client=client_id)
        delta = fm.vector - weights
        if self._layout is None:
            self._layout = Layout.from_slots(fm.slots, len(fm), self.cfg.scope)
        topk = TopK(rho, self.cfg.index)
        vc = VectorCompressor(ErrorFeedback(topk) if self.cfg.error_feedback else topk, self._layout)
        payload, new_state = vc.encode(delta, state, Key(ctx.seed, ctx.round, client_id))
        sparse = vc.decode(payload, new_state)
        mask = torch.ones_like(delta)
        kept = 0
        for seg, part in zip(self._layout.segments, payload.parts):
            if seg.compress:
                m = topk.mask(part)
                mask[seg.offset:seg.end] = m.to(mask.dtype)
                kept += int(m.sum())
        n = data.num_samples
        w = float(n) * (rho if self.cfg.bcrs_reweight == "ratio" else 1.0)
        metrics.add("keep_ratio", rho)
        metrics.add("upload_ratio", payload.nbytes / (4 * delta.numel()))
        return ClientUpdate(client_id, {"masked_delta": sparse.mul_(w), "mask": mask.mul_(w)},
                            {"n": w, "kept": float(kept), "clients": 1.0}, n, metrics,
                            state={"residual": new_state["residual"]} if self.cfg.error_feedback else None,
                            bytes_up=payload.nbytes)


class BAOWServer(ServerAlgorithm):
    pseudo_gradient = True

    def __init__(self, cfg: BAOWConf, setup, initial_weights: torch.Tensor) -> None:
        super().__init__(cfg, setup, initial_weights)
        _check(cfg)
        self.system = setup.extra.get("system")
        self._ratios: dict[int, float] = {}

    def ratios(self, ctx: RoundContext) -> dict[int, float]:
        """This round's keep ratio per sampled client (from this round's uplink bandwidths)."""
        if self.system is None:
            bw = dict.fromkeys(ctx.clients, 1.0)
        else:
            bw = {c: self.system.uplink_bandwidth(c, ctx.round) for c in ctx.clients}
        return keep_ratios(self.cfg.rho0, bw, self.cfg.ratio_rule)

    def broadcast(self, ctx: RoundContext) -> Broadcast:
        self._ratios = self.ratios(ctx)
        return Broadcast({"weights": self.weights}, per_client={c: {"ratio": r} for c, r in self._ratios.items()})

    def aggregate(self, ctx: RoundContext, result: Aggregate | list[ClientUpdate]) -> dict[str, float]:
        assert isinstance(result, Aggregate)
        total = result.weights.get("n", 0.0)
        if total <= 0 or "masked_delta" not in result.tensors:
            return {}
        num, cover = result.tensors["masked_delta"], result.tensors.get("mask")  # no masks under DP (plain)
        if self.cfg.aggregation == "opwa":
            floor = total / self.cfg.gamma_max if self.cfg.gamma_max else 0.0
            denom = cover.clamp(min=floor) if floor > 0 else cover
            delta = torch.where(cover > 0, num / torch.where(cover > 0, denom, torch.ones_like(denom)),
                                torch.zeros_like(num))
        else:
            delta = num / total
        self.apply_update(delta.to(torch.float32))
        p = self.setup.num_params
        ratios = [r for c, r in self._ratios.items() if c in ctx.clients]
        out: dict[str, float] = {}
        if cover is not None:
            covered = float((cover[:p] > 0).sum())
            out = {"baow_coverage": covered / p if p else 0.0,
                   "baow_overlap": result.weights.get("kept", 0.0) / covered if covered else 0.0}
        if ratios:
            out.update(baow_mean_ratio=sum(ratios) / len(ratios), baow_max_ratio=max(ratios))
        return out


SPEC = AlgorithmSpec("baow", BAOWConf, BAOWClient, BAOWServer,
                     "BAOW: bandwidth-aware Top-k ratios and overlap-weighted aggregation")
