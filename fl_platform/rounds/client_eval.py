"""Per-client evaluation on local test splits (``eval.clients``, docs/personalisation.md).

Each client's rows are split into local train and test (``FederatedDataset.with_local_test``). At
every evaluation round the engine evaluates, on the workers where clients train, the global model,
the client's personalised model where the algorithm has one (``ClientAlgorithm.personal_model``:
FedBN's local BatchNorm, FedPer/FedRep's head, Ditto's v) and, with ``eval.finetune_steps=k``, that
model after k local steps on the client's train split. Nothing here writes a client's state.

A client's numbers depend only on (seed, round, client), the global weights and its own state, so
they are the same on any engine and any number of workers; the summary below is computed from them
in client-id order on the driver. Each row carries, per evaluated model, the mean, the 10th
percentile (linear interpolation) and the mean of the worst 10% (ceil(0.1 K) lowest) of the client
accuracies; the per-client values go to ``client_metrics.jsonl`` in the run directory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fl_platform.core import Broadcast, RoundContext
from fl_platform.seeding import Stream
from fl_platform.training.loop import ClientData, LocalTrainer, eval_sums

#: The models a client may be evaluated with, as prefixes of the row keys.
MODELS = ("client", "personal", "finetuned")
CLIENT_METRICS = "client_metrics.jsonl"


def evaluate_client(client: Any, trainer: LocalTrainer, ctx: RoundContext, cid: int, broadcast: Broadcast,
                    state: dict[str, torch.Tensor] | None, train: ClientData, test: ClientData,
                    finetune_steps: int) -> dict[str, torch.Tensor]:
    """One client's test scores as device tensors: ``n`` and, per model evaluated, ``<model>_correct``
    and ``<model>_loss`` (``client``: the global model; ``personal``; ``finetuned``)."""
    fm = trainer.fm
    x, y = test.x.index_select(0, test.indices), test.y.index_select(0, test.indices)
    out = {"n": torch.tensor(float(len(test.indices)), dtype=torch.float64, device=test.indices.device)}
    if not len(test.indices):
        return out
    fm.load(broadcast.tensors["weights"])
    out["client_loss"], out["client_correct"] = eval_sums(fm.model, x, y)
    personal = client.personal_model(ctx, cid, broadcast, state)
    if personal is not None:
        fm.load(personal)
        out["personal_loss"], out["personal_correct"] = eval_sums(fm.model, x, y)
    if finetune_steps > 0:
        fm.load(broadcast.tensors["weights"] if personal is None else personal)
        cfg = dataclasses.replace(trainer.cfg, steps=finetune_steps, epochs=None)
        trainer.fit(train, None, seed=ctx.seed, round=ctx.round, client=cid, cfg=cfg, stream=Stream.FINETUNE)
        out["finetuned_loss"], out["finetuned_correct"] = eval_sums(fm.model, x, y)
    return out


def to_host(scores: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, float]]:
    """Per client: ``n_test`` and ``<model>_test_accuracy`` / ``<model>_test_loss`` (one host read per worker)."""
    names = sorted({k for s in scores.values() for k in s})
    flat = [(cid, k) for cid in sorted(scores) for k in names if k in scores[cid]]
    values = torch.stack([scores[c][k].double() for c, k in flat]).tolist() if flat else []
    raw: dict[int, dict[str, float]] = {cid: {} for cid in scores}
    for (cid, k), v in zip(flat, values):
        raw[cid][k] = v
    out: dict[int, dict[str, float]] = {}
    for cid, s in raw.items():
        n = s["n"]
        row: dict[str, float] = {"n_test": int(n)}
        for model in MODELS:
            if f"{model}_correct" in s:
                prefix = "" if model == "client" else f"{model}_"
                row[f"{prefix}test_accuracy"] = s[f"{model}_correct"] / n
                row[f"{prefix}test_loss"] = s[f"{model}_loss"] / n
        out[cid] = row
    return out


def assignment(client_ids: Sequence[int], num_workers: int, by_home: bool) -> list[list[int]]:
    """Which worker evaluates which clients: each client's home worker when states live with their
    homes (nothing is lent for an evaluation), else the i-th client on worker i mod W."""
    out: list[list[int]] = [[] for _ in range(num_workers)]
    for i, cid in enumerate(client_ids):
        out[cid % num_workers if by_home else i % num_workers].append(cid)
    return out


def summarise(per_client: dict[int, dict[str, float]]) -> dict[str, float]:
    """Row fields: per model, the mean, 10th percentile and worst-10% mean of client accuracies
    (clients without local test rows are left out), the mean client test loss, and how many clients."""
    rows = [per_client[c] for c in sorted(per_client) if per_client[c].get("n_test", 0) > 0]
    out: dict[str, float] = {"eval_clients": len(rows)}
    for model in MODELS:
        key = "test_accuracy" if model == "client" else f"{model}_test_accuracy"
        if not rows or key not in rows[0]:
            continue
        acc = np.array([r[key] for r in rows], dtype=np.float64)
        worst = np.sort(acc)[: max(1, math.ceil(0.1 * len(acc)))]
        out[f"{model}_accuracy_mean"] = float(acc.mean())
        out[f"{model}_accuracy_p10"] = float(np.percentile(acc, 10))
        out[f"{model}_accuracy_worst10"] = float(worst.mean())
        out[f"{model}_loss_mean"] = float(np.mean([r[key.replace("accuracy", "loss")] for r in rows]))
    return out


class ClientEvaluation:
    """The round loop's per-client evaluation: which clients, the engine call, the row fields and
    the side file (``client_metrics.jsonl``, one line per evaluated client and round)."""

    def __init__(self, clients: str, num_clients: int, path: Path | None = None) -> None:
        if clients not in ("all", "sample"):
            raise ValueError(f"eval.clients must be all, sample or none; got {clients!r}")
        self.clients = clients
        self.num_clients = num_clients
        self.path = Path(path) if path is not None else None

    def run(self, ctx: RoundContext, weights: torch.Tensor, engine: Any) -> dict[str, float]:
        """Evaluate after round ``ctx.round``'s server step (``weights``: the new global model)."""
        ids = list(range(self.num_clients)) if self.clients == "all" else sorted(ctx.clients)
        per_client = engine.evaluate_clients(ctx, Broadcast({"weights": weights}), ids)
        if self.path is not None:
            self._append(ctx.round + 1, per_client)
        return summarise(per_client)

    def _append(self, round: int, per_client: dict[int, dict[str, float]]) -> None:
        lines = "".join(json.dumps({"round": round, "client": c, **per_client[c]}, sort_keys=True) + "\n"
                        for c in sorted(per_client))
        with open(self.path, "a") as fh:  # one write and one fsync per round
            fh.write(lines)
            fh.flush()
            os.fsync(fh.fileno())

    def truncate_after(self, last_round: int) -> None:
        """Resume: drop the lines of rounds after the checkpoint (a torn last line too)."""
        if self.path is None or not self.path.exists():
            return
        from fl_platform.outputs import MetricsLog

        MetricsLog(self.path).truncate_after(last_round)
