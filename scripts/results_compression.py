#!/usr/bin/env python
"""BAOW against uniform Top-k at equal bytes and FedAvg -> docs/results/compression.md.

    nice -n 19 python scripts/results_compression.py --jobs 2     # run what is missing, write the document
    python scripts/results_compression.py --from-artefacts         # rebuild it from docs/results/data/compression/
    python scripts/results_compression.py --budget tiny --out /tmp/cmp   # a check of the pipeline (minutes)
    python scripts/results_compression.py --preset gpu --plan      # BAOW's paper setting (CIFAR-10): what would run

CPU settings: Fashion-MNIST, Dirichlet(alpha) label skew with alpha in {0.1, 0.5} over 100 clients,
10 per round, an MLP (784-128-10), one local epoch, 150 rounds, and ``system=heterogeneous``
(uplinks log-uniform over 0.2-20 Mbit/s, each downlink 10x its uplink, compute log-normal around
1000 samples/s, 50 ms per transfer). Every row of a seed sees the same partition, initial model,
sampled clients and devices.

Rows: dense FedAvg; the noise floor (FedAvg with only its minibatch orders changed); FedAvg +
layer-wise Top-k with one ratio for every client, chosen so that the mean upload per client equals
BAOW's (``EQUAL_RATIO``: from the seeds' sampled clients and bandwidths before any training, see
``equal_bytes_ratio``; the document checks the runs' logged bytes); FedAvg + Top-k at BAOW's
straggler ratio rho0 (the card's fairness rule: the same rho0); BAOW (BCRS ratios + OPWA); with
error feedback (BAOW and the equal-bytes Top-k); BAOW's ratios with plain averaging (BCRS alone);
OPWA capped at gamma_max = 2; and a rho0 sweep, each rho0 with its own equal-bytes Top-k. At
rho0 = 0.1 (``RHO_SAME``) also the paper's own baseline, Top-k at that rho0 for every client, and BCRS
alone, 10 seeds each, so that the speed claim there is judged against the comparison the paper makes.
Method and statistics: scripts/results_common.py and docs/results/README.md.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import results_common as rc  # noqa: E402

DOC = "compression"
Row, Setting = rc.Row, rc.Setting
RHO0 = 0.01
TOPK_RHO0 = f"Top-k at rho0 = {RHO0:g} for every client"  # the paper's Top-k baseline's row
SWEEP = (0.003, 0.03, 0.1)
RHO_SAME = 0.1  # the sweep's rho0 that also has the paper's same-rho0 Top-k baseline and BCRS alone (10 seeds)
ROUNDS = 150
SEEDS5, SEEDS10 = list(range(5)), list(range(10))
COMMON = ["dataset=fashion_mnist", "model=mlp", "model.hidden=[128]", "partition=dirichlet", "num_clients=100",
          "clients_per_round=10", "eval_every=1", "train.epochs=1", "train.batch_size=32", "train.lr=0.05",
          "system=heterogeneous"]
# The uniform Top-k ratio whose mean upload per client equals BAOW's at each rho0, over the seeds of
# the rows that use it (0-9 for rho0 = 0.01, 0-4 for the sweep) and 150 rounds of this setting's
# sampled clients and bandwidths (equal_bytes_ratio; the bandwidths do not depend on alpha). The
# document compares the runs' logged bytes.
EQUAL_RATIO = {0.003: 0.03137, 0.01: 0.140316, 0.03: 0.354791, 0.1: 0.610641}
EQUAL_RATIO_GPU = 0.13973  # the same for the ResNet-18 of baow_cifar10 (its own layer sizes): equal_bytes_ratio
TARGETS = (0.90, 0.95)  # time to target: these fractions of dense FedAvg's mean final accuracy
SPEEDUP_TARGET = 0.90  # the target of the speedup columns and the verdict


def _tag(rho0: float) -> str:
    return f"{rho0:g}".replace(".", "")


def topk(ratio: float, ef: bool = False) -> list[str]:
    return ["compressor=topk", f"compressor.ratio={ratio:g}", "compressor.index=auto",
            f"compressor.error_feedback={'true' if ef else 'false'}"]


def topk_same_label(rho0: float) -> str:
    return f"Top-k at rho0 = {rho0:g} for every client"


def rows_of(seeds5: list[int], seeds10: list[int], sweep: bool) -> list[Row]:
    """The rows of one alpha (``sweep``: with the rho0 sweep)."""
    eq = EQUAL_RATIO[RHO0]
    rows = [Row("fedavg", "FedAvg (dense)", "fedavg", [], seeds10),
            Row("topk_equal", "Top-k, uniform ratio, BAOW's mean bytes", "fedavg", topk(eq), seeds10,
                f"uniform ratio {eq:g}: the mean upload of BAOW at rho0 = {RHO0:g}"),
            Row("topk_rho0", TOPK_RHO0, "fedavg", topk(RHO0), seeds10,
                "the straggler's ratio for everyone (the card: give Top-k the same rho0)"),
            Row("baow", "BAOW (BCRS + OPWA)", "baow", [f"algorithm.rho0={RHO0:g}"], seeds10),
            rc.noise_row(seeds10),
            Row("baow_ef", "BAOW + error feedback", "baow", [f"algorithm.rho0={RHO0:g}", "algorithm.error_feedback=true"],
                seeds5, "client residuals (stale between participations)", "baow", 2),
            Row("topk_equal_ef", "Top-k, uniform ratio, BAOW's mean bytes, + error feedback", "fedavg", topk(eq, True),
                seeds5, "as topk_equal, with client residuals", "topk_equal", 2),
            Row("baow_plain", "BAOW's ratios, plain averaging (BCRS alone)", "baow",
                [f"algorithm.rho0={RHO0:g}", "algorithm.aggregation=plain"], seeds5,
                "OPWA off: each coordinate divided by the round's total weight", "baow", 2),
            Row("baow_cap2", "BAOW, OPWA capped at gamma_max = 2", "baow", [f"algorithm.rho0={RHO0:g}",
                                                                           "algorithm.gamma_max=2"],
                seeds5, "OPWA's amplification capped at 2x (the card's safeguard)", "baow", 3)]
    if sweep:
        for rho0 in SWEEP:
            seeds = seeds10 if rho0 == RHO_SAME else seeds5  # a verdict rests on rho0 = RHO_SAME's rows
            rows += [Row(f"baow_rho{_tag(rho0)}", f"BAOW, rho0 = {rho0:g}", "baow", [f"algorithm.rho0={rho0:g}"], seeds,
                         f"rho0 = {rho0:g}", "baow", 2),
                     Row(f"topk_equal_rho{_tag(rho0)}", f"Top-k, uniform ratio, BAOW's mean bytes at rho0 = {rho0:g}",
                         "fedavg", topk(EQUAL_RATIO[rho0]), seeds, f"uniform ratio {EQUAL_RATIO[rho0]:g}", "topk_equal", 2)]
        tag = _tag(RHO_SAME)
        rows += [Row(f"topk_same_rho{tag}", topk_same_label(RHO_SAME), "fedavg", topk(RHO_SAME), seeds10,
                     f"the straggler's ratio at rho0 = {RHO_SAME:g} for everyone (the paper's baseline: the same rho0)",
                     "topk_rho0", 2),
                 Row(f"baow_plain_rho{tag}", f"BAOW's ratios at rho0 = {RHO_SAME:g}, plain averaging (BCRS alone)", "baow",
                     [f"algorithm.rho0={RHO_SAME:g}", "algorithm.aggregation=plain"], seeds10,
                     "OPWA off: each coordinate divided by the round's total weight", "baow_plain", 2)]
    return rows


PAPER = "BAOW (Tang et al., ICPP 2024), specs/baow.md"


def _diff(rho0: float) -> str:
    return ("Fashion-MNIST and an MLP (the paper: CNNs on CIFAR-10/100 and SVHN); uplinks log-uniform over 0.2-20 "
            f"Mbit/s (the paper's bandwidths, client counts, alpha and rho0 were not recovered); rho0 = {rho0:g}; "
            "150 rounds")


def claims(alpha: str, rho0: float = RHO0) -> dict[str, rc.PaperClaim]:
    """The paper's speed claim is against Top-k at the same rho0 (its baseline): the equal-bytes row is our
    control, so a verdict never rests on it."""
    diff = _diff(rho0)
    at = "" if rho0 == RHO0 else f" at rho0 = {rho0:g}"
    return {
        "baseline": rc.PaperClaim("", "a baseline of the paper", None, None, ""),
        "accuracy": rc.PaperClaim(f"BAOW{at} vs dense FedAvg, accuracy (alpha {alpha})", "CIFAR-10/100, SVHN, Dirichlet "
                                  "(the best case over settings)", "up to +13 %", 1, diff, PAPER),
        "speed_rho0": rc.PaperClaim(f"BAOW{at} vs FedAvg + Top-k at the same rho0, time to target (alpha {alpha})",
                                    "CIFAR-10/100, SVHN, Dirichlet; Top-k baselines", "3.37x (2.02-3.37x)", 1,
                                    f"{diff}; target {SPEEDUP_TARGET:.0%} of dense FedAvg's final accuracy",
                                    PAPER, baselines=(topk_same_label(rho0),)),
        "speed_equal": rc.PaperClaim(f"BAOW{at} vs FedAvg + Top-k at equal bytes, time to target (alpha {alpha})",
                                     "as above (the paper's Top-k baselines; equal bytes is our control)",
                                     "3.37x (2.02-3.37x)", 1,
                                     f"{diff}; target {SPEEDUP_TARGET:.0%} of dense FedAvg's final accuracy", PAPER,
                                     baselines=(topk_same_label(rho0),)),
        "topk": rc.PaperClaim("Top-k (+EF) vs dense FedAvg", "compressors.md: S-SGD throughput on GPU clusters, no "
                              "FL accuracy claim", None, None, "federated, not data-centre S-SGD"),
    }


def cpu_settings(budget: str) -> list[Setting]:
    tiny = budget == "tiny"
    seeds5, seeds10 = ([0, 1], [0, 1]) if tiny else (SEEDS5, SEEDS10)
    out = []
    for k, alpha in enumerate(("0.1", "0.5")):
        overrides = [*COMMON, f"partition.alpha={alpha}"]
        if tiny:
            overrides = [{"train.epochs=1": "train.steps=2", "clients_per_round=10": "clients_per_round=5"}.get(o, o)
                         for o in overrides]
        rows = rows_of(seeds5, seeds10, sweep=k == 0)
        if k:  # alpha 0.5: the sweep and the cap run at alpha 0.1 only; its second-tier rows after alpha 0.1's
            rows = [r if r.priority == 1 else replace_priority(r, 3) for r in rows if r.tag != "baow_cap2"]
        out.append(Setting(f"alpha{alpha.replace('.', '')}", f"Fashion-MNIST, Dirichlet({alpha}), 100 clients / 10 per "
                           "round, MLP, heterogeneous uplinks", overrides, 6 if tiny else ROUNDS, rows,
                           {"fedavg": ["algorithm=fedavg"], "baow": ["algorithm=baow"]}, paper=claims(alpha)))
    return out


def replace_priority(row: Row, priority: int) -> Row:
    from dataclasses import replace

    return replace(row, priority=priority)


# GPU: BAOW's paper setting as far as the card has it (CIFAR-10, Dirichlet, Top-k FedAvg baselines).
def gpu_settings() -> list[Setting]:
    rows = [Row("fedavg", "FedAvg (dense)", "fedavg", [], SEEDS10), rc.noise_row(SEEDS10),
            Row("topk_equal", "Top-k, uniform ratio, BAOW's mean bytes", "fedavg", topk(EQUAL_RATIO_GPU), SEEDS10),
            Row("topk_rho0", TOPK_RHO0, "fedavg", topk(RHO0), SEEDS10),
            Row("baow", "BAOW (BCRS + OPWA)", "baow", [], SEEDS10),
            Row("baow_plain", "BAOW's ratios, plain averaging (BCRS alone)", "baow", ["algorithm.aggregation=plain"],
                SEEDS10, "OPWA off: each coordinate divided by the round's total weight", "baow", 2)]
    title = ("CIFAR-10, Dirichlet(0.1), 100 clients / 10 per round, ResNet-18, E = 1, 500 rounds, "
             "heterogeneous uplinks (conf/experiment/baow_cifar10.yaml)")
    paper = claims("0.1")
    return [Setting("cifar10", title, [], 0, rows, {"fedavg": ["algorithm=fedavg"], "baow": ["algorithm=baow"]},
                    "baow_cifar10", "baow", paper)]


def settings_of(budget: str, preset: str) -> list[Setting]:
    return gpu_settings() if preset == "gpu" else cpu_settings(budget)


# ----------------------------------------------------------------------------- equal bytes (run once)


def equal_bytes_ratio(rho0: float, seeds: list[int] = SEEDS10, rounds: int = ROUNDS, preset: str | None = None) -> float:
    """The uniform Top-k ratio whose upload per client equals BAOW's mean over these seeds' sampled clients
    and bandwidths (bisection on the layer-wise Top-k payload size of the setting's own model: its
    layer sizes and dense buffers decide the ratio). How ``EQUAL_RATIO`` was computed:
    ``python -c "import sys; sys.path.insert(0, 'scripts'); import results_compression as c;
    print(c.equal_bytes_ratio(0.01), {r: c.equal_bytes_ratio(r, c.SEEDS5) for r in c.SWEEP})"``; and
    ``EQUAL_RATIO_GPU`` (ResNet-18 of conf/experiment/baow_cifar10.yaml): ``c.equal_bytes_ratio(0.01,
    c.SEEDS10, 500, "baow_cifar10")``."""
    import torch

    from fl_platform.algorithms.baow import keep_ratios
    from fl_platform.compression.topk import TopK
    from fl_platform.models import build_model
    from fl_platform.rounds.sampling import sample_clients
    from fl_platform.system.model import build_system
    from fl_platform.training.flat import FlatModel

    sys.path.insert(0, str(REPO / "scripts" / "bench"))
    from common import compose

    if preset is None:
        cfg = compose(*COMMON, "partition.alpha=0.1", f"rounds={rounds}")
        model = build_model("mlp", (1, 28, 28), 10, hidden=[128])
    else:  # the preset's model on CIFAR-10's 3 x 32 x 32 images, 10 classes
        cfg = compose(f"+experiment={preset}", f"rounds={rounds}")
        options = {k: v for k, v in cfg.model.items() if k != "name"}
        model = build_model(cfg.model.name, (3, 32, 32), 10, **options)
    torch.manual_seed(0)
    slots = FlatModel(model).slots

    def nbytes(ratio: float) -> int:
        return sum(TopK(ratio).payload_nbytes(s.numel) if s.is_param else 4 * s.numel for s in slots)

    total = count = 0
    for seed in seeds:
        system = build_system(cfg.system, seed)
        for r in range(rounds):
            clients = sample_clients(seed, r, cfg.num_clients, cfg.clients_per_round)
            ratios = keep_ratios(rho0, {c: system.uplink_bandwidth(c, r) for c in clients})
            total += sum(nbytes(rho) for rho in ratios.values())
            count += len(clients)
    target = total / count
    lo, hi = 1e-5, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if nbytes(mid) < target else (lo, mid)
    return lo if abs(nbytes(lo) - target) <= abs(nbytes(hi) - target) else hi


# ----------------------------------------------------------------------------- measures


def upload_kib(run: rc.Run) -> float:
    """Mean upload per client per round (KiB), from the logged bytes."""
    return sum(r.get("bytes_up", 0) for r in run["rows"]) / sum(r.get("num_clients", 0) for r in run["rows"]) / 1024


def sim_time(run: rc.Run) -> float:
    return sum(r.get("simulated_time_s", 0.0) for r in run["rows"])


def time_to(run: rc.Run, target: float, k: int = rc.K_LAST) -> float | None:
    """Simulated seconds until the mean of the last ``k`` evaluations first reaches ``target`` (None: never)."""
    t, window = 0.0, []
    for row in run["rows"]:
        t += row.get("simulated_time_s", 0.0)
        if row.get("test_accuracy") is not None:
            window = [*window[-(k - 1):], float(row["test_accuracy"])] if k > 1 else [float(row["test_accuracy"])]
            if len(window) == k and statistics.fmean(window) >= target:
                return t
    return None


def judged(claim: rc.PaperClaim, s: Setting, *tags: str) -> rc.PaperClaim:
    """``claim`` as a verdict on the rows ``tags``: a comparison with a row not tuned on a validation split is
    untested (README.md, "Verdicts")."""
    return replace(claim, untuned=rc.untuned_reason(s, *tags))


def _mean_cell(fn: Callable[[rc.Run], float], fmt: str) -> Callable[[str, dict[int, rc.Run]], str]:
    def cell(_tag: str, runs: dict[int, rc.Run]) -> str:
        return fmt.format(statistics.fmean(fn(r) for r in runs.values()))
    return cell


def targets_of(runs: dict[str, dict[int, rc.Run]]) -> list[float]:
    """The targets: ``TARGETS`` x dense FedAvg's mean final accuracy, unrounded (the speedups move with a
    rounded target: BAOW over equal-bytes Top-k at alpha 0.5 read 1.04x at 70.7 %, 1.01x at 70.75 %)."""
    base = statistics.fmean(rc.accuracies(runs["fedavg"]).values())
    return [f * base for f in TARGETS]


def speedup(a: dict[int, rc.Run], b: dict[int, rc.Run], target: float) -> tuple[rc.Interval, str]:
    """Time-to-target speedup of ``a`` over ``b`` (t_b / t_a), paired by seed, as an interval of its log over
    the seeds where both reach the target; and the count of seeds that reached it (a, b, both)."""
    ta = {s: time_to(r, target) for s, r in a.items()}
    tb = {s: time_to(r, target) for s, r in b.items()}
    both = sorted(s for s in set(ta) & set(tb) if ta[s] is not None and tb[s] is not None)
    common = set(ta) & set(tb)
    iv = rc.interval([math.log(tb[s] / ta[s]) for s in both])
    reached = (f"{sum(ta[s] is not None for s in common)}/{sum(tb[s] is not None for s in common)}/{len(both)} "
               f"of {len(common)}")
    return iv, reached


def fmt_ratio(iv: rc.Interval) -> str:
    """An interval of a log ratio, as ``x [lo, hi]`` (factor)."""
    if iv.n == 0:
        return "-"
    if iv.n < 2 or iv.half != iv.half:
        return f"{math.exp(iv.mean):.2f}x"
    return f"{math.exp(iv.mean):.2f}x [{math.exp(iv.lo):.2f}, {math.exp(iv.hi):.2f}]"


# ----------------------------------------------------------------------------- sections

SWEEP_TAGS = ("baow_rho", "topk_equal_rho", "topk_same_rho", "baow_plain_rho")  # not in the main (rho0 = 0.01) table
_S = _tag(RHO_SAME)
# rho0 = RHO_SAME: BAOW and BCRS alone against the paper's baseline (Top-k at the same rho0) and our control
SAME_TAGS = ["fedavg", f"topk_same_rho{_S}", f"topk_equal_rho{_S}", f"baow_plain_rho{_S}", f"baow_rho{_S}"]
SAME_PAIRS = [(f"baow_rho{_S}", f"topk_same_rho{_S}", "BAOW vs the straggler's ratio for everyone (the paper's Top-k "
               "baseline: same rho0)"),
              (f"baow_plain_rho{_S}", f"topk_same_rho{_S}", "BCRS alone (plain averaging) vs the paper's Top-k baseline"),
              (f"baow_rho{_S}", f"baow_plain_rho{_S}", "OPWA's effect (same ratios and bytes)"),
              (f"baow_rho{_S}", f"topk_equal_rho{_S}", "BAOW vs one ratio for everyone, equal mean bytes (our control)"),
              (f"baow_plain_rho{_S}", f"topk_equal_rho{_S}", "BCRS alone vs one ratio, equal mean bytes")]

# (row, against, what the comparison isolates)
PAIRS = [("baow", "topk_equal", "BAOW vs one ratio for everyone, equal mean bytes"),
         ("baow", "topk_rho0", "BAOW vs the straggler's ratio for everyone (the paper's Top-k baseline: same rho0)"),
         ("baow_plain", "topk_equal", "BCRS alone (plain averaging) vs one ratio, equal mean bytes"),
         ("baow", "baow_plain", "OPWA's effect (same ratios and bytes)"),
         ("baow_cap2", "baow", "capping OPWA's amplification at 2x"),
         ("baow_ef", "topk_equal_ef", "BAOW vs one ratio, equal bytes, both with error feedback"),
         ("baow_ef", "baow", "error feedback's effect on BAOW"),
         ("topk_equal_ef", "topk_equal", "error feedback's effect on uniform Top-k")]


def _kib_pair(ra: dict[int, rc.Run], rb: dict[int, rc.Run]) -> str:
    """Mean upload per client per round of two rows, over the seeds they share (as their paired columns)."""
    seeds = sorted(set(ra) & set(rb))
    return " / ".join(f"{statistics.fmean(upload_kib(r[k]) for k in seeds):.1f}" for r in (ra, rb))


def pair_table(s: Setting, runs: dict[str, dict[int, rc.Run]], pairs: list[tuple[str, str, str]], target: float
               ) -> tuple[str, dict[tuple[str, str], tuple[rc.Interval, rc.Interval]]]:
    header = ["row", "against", "what it isolates", "upload KiB/client/round (row / against)", "seeds",
              "accuracy difference (paired, 95% CI)", "p", "reading",
              f"speedup to {100 * target:.2f} % (t_against / t_row, 95% CI)", "reached (row/against/both)", "reading "]
    rows, out = [], {}
    for a, b, what in pairs:
        ra, rb = runs.get(a), runs.get(b)
        if not ra or not rb:
            continue
        d = rc.paired(rc.accuracies(ra), rc.accuracies(rb))
        sp, reached = speedup(ra, rb, target)
        out[(a, b)] = (d, sp)
        kib = _kib_pair(ra, rb)
        rows.append([s.row(a).label, s.row(b).label, what, kib, str(d.n), rc.fmt_diff(d), rc.fmt_p(d), rc.reading(d),
                     fmt_ratio(sp), reached, rc.reading(sp, "faster", "slower")])
    return rc.md_table(header, rows), out


def target_table(s: Setting, runs: dict[str, dict[int, rc.Run]], tags: list[str], targets: list[float]) -> str:
    header = ["row"] + [f"to {100 * t:.2f} %: seeds reaching, simulated s (mean ± 95% CI)" for t in targets] + [
        "simulated s, all rounds", "slowest upload per round (s)"]
    rows = []
    for tag in tags:
        r = runs.get(tag)
        if not r:
            continue
        cells = [s.row(tag).label]
        for t in targets:
            times = [v for v in (time_to(run, t) for run in r.values()) if v is not None]
            cells.append(f"{len(times)}/{len(r)}: {_fmt_s(rc.interval(times)) if times else '-'}")
        cells.append(_fmt_s(rc.interval([sim_time(run) for run in r.values()])))
        cells.append(f"{statistics.fmean(statistics.fmean(x['sim_upload_max_s'] for x in run['rows']) for run in r.values()):.2f}")
        rows.append(cells)
    return rc.md_table(header, rows)


def _fmt_s(iv: rc.Interval) -> str:
    return f"{iv.mean:.0f}" if iv.n < 2 else f"{iv.mean:.0f} ± {iv.half:.0f}"


def sweep_table(s: Setting, runs: dict[str, dict[int, rc.Run]], target: float) -> str:
    header = ["rho0", "BAOW mean keep ratio", "uniform Top-k ratio", "upload KiB/client/round (BAOW / Top-k)", "seeds",
              "BAOW accuracy", "BAOW minus Top-k (95% CI)", "reading", "BAOW minus FedAvg (95% CI)", "reading ",
              f"speedup to {100 * target:.2f} % over Top-k", "reached (BAOW/Top-k/both)"]
    fedavg = rc.accuracies(runs["fedavg"])
    rows = []
    for rho0 in sorted((*SWEEP, RHO0)):
        a, b = ("baow", "topk_equal") if rho0 == RHO0 else (f"baow_rho{_tag(rho0)}", f"topk_equal_rho{_tag(rho0)}")
        ra, rb = runs.get(a), runs.get(b)
        if not ra or not rb:
            continue
        acc = rc.accuracies(ra)
        shared = set(acc) & set(rb) & set(fedavg)  # every cell of the row over the same seeds
        acc = {k: v for k, v in acc.items() if k in shared}
        d, dfa = rc.paired(acc, rc.accuracies(rb)), rc.paired(acc, fedavg)
        sp, reached = speedup(ra, rb, target)
        ratio = statistics.fmean(row["baow_mean_ratio"] for k in sorted(shared) for row in ra[k]["rows"]
                                 if "baow_mean_ratio" in row)
        kib = _kib_pair(ra, rb)
        rows.append([f"{rho0:g}", f"{ratio:.3f}", f"{EQUAL_RATIO[rho0]:g}", kib, str(d.n),
                     rc.fmt_mean(rc.interval(list(acc.values()))), rc.fmt_diff(d), rc.reading(d), rc.fmt_diff(dfa),
                     rc.reading(dfa), fmt_ratio(sp), reached])
    if not rows:
        return ""
    return ("### rho0 sweep\n\nEach rho0 against its own uniform Top-k at equal mean bytes, every cell of a row over "
            f"the seeds its rows share (rho0 = {RHO0:g}: the main rows).\n\n" + rc.md_table(header, rows))


def same_rho0_section(s: Setting, cells: dict[str, dict[int, rc.Run]], runs: dict[str, dict[int, rc.Run]],
                      target: float, targets: list[float]
                      ) -> tuple[str, list[tuple[rc.PaperClaim, rc.Interval | None, str, str]]]:
    """rho0 = RHO_SAME against the paper's own baseline (Top-k at that rho0 for every client), with BCRS alone
    beside it: the section and its verdict rows (accuracy against FedAvg, speed against the same-rho0 Top-k
    and, untested, against our equal-bytes control)."""
    base, baow, equal = (f"{x}_rho{_S}" for x in ("topk_same", "baow", "topk_equal"))
    paper = claims(f"{s.name[5:6]}.{s.name[6:]}", RHO_SAME)
    if s.row(base) is None:
        return "", []
    if not runs.get(base) or not runs.get(baow):  # planned, not run: the claim stays in the table, untested
        return "", [(paper["speed_rho0"], None, s.row(base).label, "not run yet (the setting's missing runs)")]
    extra = {"upload KiB/client/round": _mean_cell(upload_kib, "{:.1f}"),
             "simulated s, all rounds": _mean_cell(sim_time, "{:.0f}")}
    table, diffs = rc.main_table(s, cells, SAME_TAGS, extra)
    pairs, found = pair_table(s, runs, SAME_PAIRS, target)
    text = (f"### rho0 = {RHO_SAME:g} against the paper's baseline (Top-k at the same rho0)\n\n"
            f"The rho0 sweep's rho0 = {RHO_SAME:g} with the comparison the paper makes: Top-k at ratio {RHO_SAME:g} for "
            "every client (BAOW's straggler ratio for everyone), and BAOW's ratios with plain averaging (BCRS alone); "
            "FedAvg is the main rows' dense FedAvg and the target the same "
            f"{100 * target:.2f} %.\n\nRows:\n" + rc.rows_list(s, SAME_TAGS[1:]) + "\n" + table + "\n" + pairs + "\n"
            + target_table(s, runs, SAME_TAGS, targets) + "\n")
    verdicts: list[tuple[rc.PaperClaim, rc.Interval | None, str, str]] = []
    if baow in diffs:
        verdicts.append((judged(paper["accuracy"], s, baow, "fedavg"), diffs[baow], "FedAvg",
                         f"{rc.fmt_diff(diffs[baow])} points"))
    for key, against in (("speed_rho0", base), ("speed_equal", equal)):
        if (baow, against) in found:
            sp = found[(baow, against)][1]
            verdicts.append((judged(paper[key], s, baow, against), sp, s.row(against).label,
                             f"{fmt_ratio(sp)} ({sp.n} seeds reaching)"))
    return text, verdicts


def section(s: Setting, cells: dict[str, dict[int, rc.Run]], plots: Path | None, suffix: str
            ) -> tuple[str, list[tuple[rc.PaperClaim, rc.Interval | None, str, str]]]:
    runs = rc.setting_runs(s, cells)
    if not runs["fedavg"]:
        return rc.setting_header(s) + "Not run yet.\n", []
    tags = [r.tag for r in s.rows if not r.tag.startswith(SWEEP_TAGS)]
    tags = [*[t for t in tags if t != rc.NOISE], rc.NOISE]
    extra = {"upload KiB/client/round": _mean_cell(upload_kib, "{:.1f}"),
             "simulated s, all rounds": _mean_cell(sim_time, "{:.0f}")}
    table, diffs = rc.main_table(s, cells, tags, extra)
    targets = targets_of(runs)
    target = targets[TARGETS.index(SPEEDUP_TARGET)]
    pairs, found = pair_table(s, runs, PAIRS, target)
    eq_bytes = ""
    if runs.get("baow") and runs.get("topk_equal"):
        kb, kt = (statistics.fmean(upload_kib(r) for r in runs[t].values()) for t in ("baow", "topk_equal"))
        eq_bytes = (f"Equal bytes, checked from the artefacts: BAOW sent {kb:.2f} KiB per client per round on average, "
                    f"uniform Top-k at ratio {EQUAL_RATIO[RHO0]:g} {kt:.2f} KiB ({100 * (kt / kb - 1):+.1f} %); "
                    f"dense FedAvg {statistics.fmean(upload_kib(r) for r in runs['fedavg'].values()):.1f} KiB.\n\n")
    main_tags = ["fedavg", "topk_equal", "topk_rho0", "baow", "baow_ef", "baow_plain"]
    plot_tags = [t for t in main_tags if runs.get(t)]
    text = (rc.setting_header(s) + "Rows:\n" + rc.rows_list(s, tags) + "\n" + rc.missing_runs(s, cells) + table + "\n"
            + eq_bytes
            + "### BAOW against Top-k, paired by seed\n\nAccuracy: the mean of the last 5 evaluations. Time to target: "
            f"the simulated seconds until the mean of the last {rc.K_LAST} evaluations first reaches the target "
            f"({SPEEDUP_TARGET:.0%} of dense FedAvg's mean final accuracy here); the speedup is the geometric mean over "
            "the seeds where both reach it, its 95% interval from the paired t-interval of the log ratio.\n\n" + pairs
            + "\n### Time to target\n\nTargets: " + ", ".join(f"{100 * t:.2f} %" for t in targets)
            + f" ({', '.join(f'{f:.0%}' for f in TARGETS)} of dense FedAvg's mean final accuracy).\n\n"
            + target_table(s, runs, [t for t in tags if t != rc.NOISE], targets) + "\n")
    sweep = sweep_table(s, runs, target)
    if sweep:
        text += sweep + "\n"
    same, same_verdicts = same_rho0_section(s, cells, runs, target, targets)
    text += same
    for x, what in (("round", "round"), ("bytes_up", "cumulative upload"), ("simulated_time_s", "simulated time")):
        name = f"{DOC}_{s.name}_{x}{suffix}.png"
        if plots is not None:
            rc.plot_cells({s.row(t).label: list(runs[t].values()) for t in plot_tags}, plots / name,
                          f"alpha {s.name[5:6]}.{s.name[6:]}: test accuracy vs {what}, mean and 95% band", x=x)
        text += f"![accuracy vs {what}]({name})\n"
    alpha = f"{s.name[5:6]}.{s.name[6:]}"
    verdicts: list[tuple[rc.PaperClaim, rc.Interval | None, str, str]] = []
    if "baow" in diffs:
        verdicts.append((judged(s.paper["accuracy"], s, "baow", "fedavg"), diffs["baow"], "FedAvg",
                         f"{rc.fmt_diff(diffs['baow'])} points"))
    for key, against in (("speed_rho0", "topk_rho0"), ("speed_equal", "topk_equal")):
        if ("baow", against) in found:
            sp = found[("baow", against)][1]
            verdicts.append((judged(s.paper[key], s, "baow", against), sp, s.row(against).label,
                             f"{fmt_ratio(sp)} ({sp.n} seeds reaching)"))
    verdicts += same_verdicts
    for tag in ("topk_equal", "topk_equal_ef"):
        if tag in diffs:
            claim = rc.PaperClaim(f"{s.row(tag).label} (alpha {alpha})", s.paper["topk"].paper_setting, None, None,
                                  s.paper["topk"].differences)
            verdicts.append((claim, diffs[tag], "FedAvg", f"{rc.fmt_diff(diffs[tag])} points"))
    return text, verdicts


def build(settings: list[Setting], cells: dict[str, dict[int, rc.Run]], plots: Path | None, command: str,
          artefacts: Path) -> str:
    suffix = rc.suffix_of(DOC, artefacts)
    sections, verdicts = [], []
    for s in settings:
        text, v = section(s, cells, plots, suffix)
        sections.append(text)
        verdicts += v
    gpu = any(s.preset for s in settings)
    return ("# Compression: BAOW vs uniform Top-k at equal bytes vs FedAvg" + (" (GPU preset)" if gpu else "") + "\n\n"
            f"{rc.provenance(DOC, artefacts, cells, command)}\n\n"
            "Every compressed row runs without error feedback unless its name says so (the card's BAOW default, matched "
            "by the Top-k rows); Top-k is layer-wise, with int32 indices or a bitmap, whichever is smaller, counted in "
            "the upload bytes. Simulated time: per round, the slowest sampled client's download + compute + upload "
            f"under the system model. {rc.method_paragraph()}\n\n"
            "## Verdict against the paper\n\n" + rc.verdict_table(verdicts) + "\n" + "\n".join(sections))


def main(argv: list[str] | None = None) -> int:
    return rc.cli(DOC, argv, __doc__, settings_of, build, presets=("cpu", "gpu"))


if __name__ == "__main__":
    sys.exit(main())
