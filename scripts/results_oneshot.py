#!/usr/bin/env python
"""One-shot FL on Fashion-MNIST: one-shot FedAvg, ensemble, FedDF, DENSE, Co-Boosting, Fed-ADI, FuseFL -> docs/results/oneshot.md.

    nice -n 19 python scripts/results_oneshot.py --jobs 2        # run what is missing, write the document
    python scripts/results_oneshot.py --from-artefacts            # rebuild it from docs/results/data/oneshot/
    python scripts/results_oneshot.py --budget tiny --out /tmp/os # a check of the pipeline (minutes)
    python scripts/results_oneshot.py --preset gpu --plan         # the papers' CIFAR-10 settings: what would run

CPU setting (conf/experiment/oneshot_fmnist*.yaml): Fashion-MNIST, 5 clients, Dirichlet(0.5) label
skew, a BatchNorm CNN (25,090 parameters), 4 local epochs; 10% of the training set held out for the
server (no client trains on it, for every row). Every one-shot method reads the same cached client
models of a seed; FuseFL and multi-round FedAvg train their own clients on the same client data.

Rows: one-shot FedAvg (its runs also report the logit ensemble and the clients' own accuracies on the
same client models); the noise floor (the same with only the clients' minibatch orders changed,
``train.shuffle_offset=1``); one-shot FedAvg and the ensemble with FuseFL's classifier calibration
(``calibrate: true``, one more round); FedDF on the held-out split and on FEMNIST images (out of
domain); DENSE; Co-Boosting; Fed-ADI (DENSE's baseline: DeepInversion of the ensemble,
then DENSE's distillation); FuseFL with K = 2 and 4; multi-round FedAvg with the same local epochs;
and the budget curve: local epochs and generator epochs doubled. Method and statistics:
scripts/results_common.py and docs/results/README.md.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import results_common as rc  # noqa: E402

DOC = "oneshot"
Row, Setting = rc.Row, rc.Setting
SEEDS5, SEEDS10 = list(range(5)), list(range(10))
CLIENTS = 5


def algorithm_overrides() -> dict[str, list[str]]:
    """The presets' algorithm settings (conf/experiment/oneshot_fmnist_*.yaml), on top of oneshot_fmnist."""
    of = lambda preset: rc.preset_overrides(preset, with_algorithm=True)  # noqa: E731
    return {"fedavg": ["algorithm=oneshot_fedavg"], "ensemble": ["algorithm=oneshot_ensemble"],
            "feddf": of("oneshot_fmnist_feddf"), "dense": of("oneshot_fmnist_dense"),
            "coboost": of("oneshot_fmnist_coboost"), "adi": of("oneshot_fmnist_adi"),
            "fusefl": of("oneshot_fmnist_fusefl")}


@dataclass(frozen=True)
class Budget:
    epochs: int  # the clients' local epochs (FuseFL: in total over its blocks; multi-round FedAvg: its rounds)
    epochs2: int  # the budget curve's larger value
    gen: int  # DENSE and Co-Boosting generator epochs
    gen2: int
    ngf2: int  # the generators' wider setting (the card's width; main: the presets' ngf 16)
    extra: dict[str, list[str]]  # tiny: smaller server-side budgets per algorithm
    gen_card: int  # the card's generator epochs (DENSE, Co-Boosting and, as DENSE's baseline, Fed-ADI)
    feddf_card: list[str]  # the card's FedDF distillation: steps, evaluation interval, early-stopping patience


FULL = Budget(4, 8, 20, 40, 64, {}, 200, ["algorithm.steps=10000", "algorithm.eval_every=100", "algorithm.patience=1000"])
TINY = Budget(1, 2, 2, 3, 8, {"feddf": ["algorithm.steps=20", "algorithm.eval_every=10"],
                           "dense": ["algorithm.g_steps=2", "algorithm.ngf=4"],
                           "coboost": ["algorithm.g_steps=2", "algorithm.ngf=4"],
                           "adi": ["algorithm.di_steps=2"],
                           "fusefl": ["algorithm.sample_per_class=200"], "cal": ["algorithm.sample_per_class=200"]},
              4, ["algorithm.steps=40", "algorithm.eval_every=10", "algorithm.patience=20"])


def rows_of(b: Budget, seeds5: list[int], seeds10: list[int]) -> list[Row]:
    cal = ["rounds=2", "algorithm.calibrate=true", *b.extra.get("cal", [])]
    card = rc.resolved(b.feddf_card)
    fusefl = b.extra.get("fusefl", [])
    return [
        Row("fedavg", "One-shot FedAvg (the ensemble and the clients' own accuracies from the same runs)", "fedavg", [],
            seeds10),
        Row("fedavg_shuffle", "One-shot FedAvg, other minibatch orders (noise floor)", "fedavg",
            ["train.shuffle_offset=1"], seeds10, "only the clients' minibatch orders changed (train.shuffle_offset=1)"),
        # the calibrated rows on 10 seeds: the verdict on FuseFL against the calibrated ensemble rests on them
        Row("fedavg_cal", "One-shot FedAvg + FuseFL's calibration", "fedavg", cal, seeds10),
        Row("ensemble_cal", "Ensemble + FuseFL's calibration", "ensemble", cal, seeds10),
        Row("feddf", "FedDF, distilled on held-out Fashion-MNIST", "feddf", [], seeds10),
        Row("feddf_ood", "FedDF, distilled on FEMNIST (out of domain)", "feddf", ["algorithm.distill_set=femnist"], seeds10),
        Row("fusefl_k2", "FuseFL K=2", "fusefl", [f"algorithm.local_epochs={max(1, b.epochs // 2)}", *fusefl], seeds10),
        Row("fedavg_multi", f"FedAvg, {b.epochs} rounds x 1 epoch", "fedavg", [f"rounds={b.epochs}", "train.epochs=1"],
            seeds10),
        Row("fusefl_k4", "FuseFL K=4", "fusefl", ["algorithm.blocks=4", "rounds=5",
                                                  f"algorithm.local_epochs={max(1, b.epochs // 4)}", *fusefl],
            seeds5, priority=2),
        # DENSE and Fed-ADI on 10 seeds: DENSE's claim is over Fed-ADI (its best baseline), paired by seed
        Row("dense", "DENSE", "dense", [f"algorithm.epochs={b.gen}"], seeds10, priority=2),
        Row("adi", "Fed-ADI", "adi", [f"algorithm.epochs={b.gen}"], seeds10, priority=2),
        Row("coboost", "Co-Boosting", "coboost", [f"algorithm.epochs={b.gen}"], seeds10, priority=2),
        # the budget curve: twice the local epochs / generator epochs
        Row("fedavg_e2", f"One-shot FedAvg, {b.epochs2} local epochs", "fedavg", [f"train.epochs={b.epochs2}"], seeds5,
            priority=3),
        Row("feddf_e2", f"FedDF (held-out), {b.epochs2} local epochs", "feddf", [f"train.epochs={b.epochs2}"], seeds5,
            priority=3),
        Row("fusefl_k2_e2", f"FuseFL K=2, {b.epochs2 // 2} epochs per block", "fusefl",
            [f"algorithm.local_epochs={max(1, b.epochs2 // 2)}", *fusefl], seeds5, priority=3),
        Row("fedavg_multi_e2", f"FedAvg, {b.epochs2} rounds x 1 epoch", "fedavg", [f"rounds={b.epochs2}", "train.epochs=1"],
            seeds5, priority=3),
        Row("dense_g2", f"DENSE, {b.gen2} generator epochs", "dense", [f"algorithm.epochs={b.gen2}"], seeds5, priority=3),
        Row("coboost_g2", f"Co-Boosting, {b.gen2} generator epochs", "coboost", [f"algorithm.epochs={b.gen2}"], seeds5,
            priority=3),
        # the generators at the card's width (ngf 64), main generator epochs
        Row("dense_w", f"DENSE, generator width ngf {b.ngf2}", "dense", [f"algorithm.ngf={b.ngf2}"], seeds5, priority=4),
        Row("coboost_w", f"Co-Boosting, generator width ngf {b.ngf2}", "coboost", [f"algorithm.ngf={b.ngf2}"], seeds5,
            priority=4),
        # the cards' server-side budgets (issue 28 item 4), 10 seeds: the verdicts at the paper's budget rest on them
        Row("feddf_card", f"FedDF (held-out), {at_card(int(card['algorithm.steps']), CARD_STEPS)} distillation steps, "
            f"early stop after {int(card['algorithm.patience']):,}", "feddf", b.feddf_card, seeds10, priority=5),
        Row("dense_card", f"DENSE, {at_card(b.gen_card, CARD_GEN)} generator epochs", "dense",
            [f"algorithm.epochs={b.gen_card}"], seeds10, priority=5),
        Row("coboost_card", f"Co-Boosting, {at_card(b.gen_card, CARD_GEN)} generator epochs", "coboost",
            [f"algorithm.epochs={b.gen_card}"], seeds10, priority=5),
        Row("adi_card", f"Fed-ADI, {b.gen_card} epochs (DENSE's baseline at DENSE's card budget)", "adi",
            [f"algorithm.epochs={b.gen_card}"], seeds10, priority=6),
    ]


def cpu_settings(budget: str) -> list[Setting]:
    tiny = budget == "tiny"
    b = TINY if tiny else FULL
    seeds5, seeds10 = ([0, 1], [0, 1]) if tiny else (SEEDS5, SEEDS10)
    algs = algorithm_overrides()
    for name, extra in b.extra.items():
        if name in algs:
            algs[name] = [*algs[name], *extra]
    overrides = ["+experiment=oneshot_fmnist", "dataset=fashion_mnist", "num_clients=5", "partition.alpha=0.5",
                 *(["train.epochs=1"] if tiny else [])]
    return [Setting("alpha05", f"Fashion-MNIST, 5 clients, Dirichlet(0.5), BatchNorm CNN, {b.epochs} local epochs", overrides, 1,
                    rows_of(b, seeds5, seeds10), algs)]


# ----------------------------------------------------------------------------- GPU: the papers' settings


def gpu_settings() -> list[Setting]:
    """CIFAR-10, 5 clients, Dirichlet(0.5), ResNet-18 (conf/experiment/oneshot_cifar10*.yaml, fusefl_cifar10)."""
    algs = {"fedavg": ["algorithm=oneshot_fedavg"], "ensemble": ["algorithm=oneshot_ensemble"],
            "feddf": rc.preset_overrides("oneshot_cifar10_feddf", with_algorithm=True),
            "dense": rc.preset_overrides("oneshot_cifar10_dense", with_algorithm=True),
            "coboost": rc.preset_overrides("oneshot_cifar10_coboost", with_algorithm=True),
            "fusefl": rc.preset_overrides("fusefl_cifar10", with_algorithm=True)}
    rows = [Row("fedavg", "One-shot FedAvg (and the ensemble, from the same runs)", "fedavg", [], SEEDS5),
            Row("fedavg_shuffle", "One-shot FedAvg, other minibatch orders (noise floor)", "fedavg",
                ["train.shuffle_offset=1"], SEEDS5),
            Row("fedavg_cal", "One-shot FedAvg + FuseFL's calibration", "fedavg",
                ["rounds=2", "algorithm.calibrate=true"], SEEDS5),
            Row("ensemble_cal", "Ensemble + FuseFL's calibration", "ensemble", ["rounds=2", "algorithm.calibrate=true"],
                SEEDS5),
            Row("feddf", "FedDF, distilled on CIFAR-100 (out of domain, as FedDF)", "feddf", [], SEEDS5),
            Row("dense", "DENSE", "dense", [], SEEDS5), Row("coboost", "Co-Boosting", "coboost", [], SEEDS5),
            Row("fusefl_k2", "FuseFL K=2", "fusefl", [], SEEDS5)]
    title = ("CIFAR-10, 5 clients, Dirichlet(0.5), ResNet-18; one-shot clients 200 local epochs, FuseFL width 20 and 100 "
             "epochs per block (conf/experiment/oneshot_cifar10*.yaml, fusefl_cifar10.yaml)")
    # preset_algorithm "-": every row runs in the preset's setting with its own algorithm block
    return [Setting("cifar10", title, [], 1, rows, algs, "oneshot_cifar10", "-")]


def settings_of(budget: str, preset: str) -> list[Setting]:
    return gpu_settings() if preset == "gpu" else cpu_settings(budget)


# ----------------------------------------------------------------------------- measures


@dataclass(frozen=True)
class Measure:
    """One number per run: the last metrics row's ``key`` of the runs of row ``tag``."""

    name: str
    label: str
    tag: str
    key: str = "test_accuracy"


def setting_value(s: Setting, tag: str, key: str) -> int | None:
    """The number row ``tag`` of ``s`` runs with for ``key`` (None: ``s`` has no such row): its overrides, else
    its experiment preset's. Labels, the budget curve and the claims quote it, so a tiny check or a GPU preset
    never quotes another budget's numbers."""
    row = s.row(tag)
    if row is None:
        return None
    over = rc.resolved(s.overrides_of(row))
    if key not in over and "+experiment" in over:  # a CPU setting: its experiment preset's keys come next
        with contextlib.suppress(KeyError):
            return int(float(rc.preset_value(over["+experiment"], key)))
    if key not in over:  # then the algorithm's own defaults (a GPU row's overrides hold its preset's keys)
        conf = yaml.safe_load((REPO / "conf" / "algorithm" / f"{over['algorithm']}.yaml").read_text())
        return int(float(conf[key.removeprefix("algorithm.")]))
    return int(float(over[key]))


def at_card(ours: int | None, card: int) -> str:
    """``ours`` beside the card's value: "the card's 200" when they agree, "20 (card 200)" when not."""
    if ours is None:
        return f"no such row (card {card:,})"
    return f"the card's {card:,}" if ours == card else f"{ours:,} (card {card:,})"


CARD_STEPS, CARD_GEN, CARD_NGF, DI_PAPER = 10_000, 200, 64, 2_000  # FedDF's steps, the generators' epochs and width, DeepInversion's steps
# The clients' local epochs in the papers (specs/oneshot.md, specs/fusefl.md): DENSE's README 400, Co-Boosting 100,
# FuseFL 100 per block; a claim of several papers (the survey's order) takes the least, the fraction in our favour.
LOCAL_DENSE, LOCAL_LEAST, LOCAL_FUSEFL_BLOCK = 400, 100, 100


def measures(s: Setting) -> dict[str, Measure]:
    """name -> the models ``s``'s runs report, in table order (every name, whether or not ``s`` has its row)."""
    v = lambda tag, key: setting_value(s, tag, key)  # noqa: E731
    feddf = s.row("feddf").label if s.row("feddf") else "FedDF"
    ood = s.row("feddf_ood").label if s.row("feddf_ood") else "FedDF (out of domain)"
    out = [
        Measure("clients", f"Clients' own models (mean of the {CLIENTS})", "fedavg", "client_test_accuracy_mean"),
        Measure("fedavg", "One-shot FedAvg", "fedavg"),
        Measure("fedavg_cal", "One-shot FedAvg + FuseFL's calibration", "fedavg_cal"),
        Measure("ensemble", f"Ensemble ({CLIENTS} models)", "fedavg", "ensemble_test_accuracy"),
        Measure("ensemble_cal", "Ensemble + FuseFL's calibration", "ensemble_cal"),
        Measure("feddf", feddf, "feddf"),
        Measure("feddf_ood", ood, "feddf_ood"),
        Measure("dense", "DENSE", "dense"),
        Measure("coboost", "Co-Boosting", "coboost"),
        Measure("adi", "Fed-ADI", "adi"),
        Measure("coboost_weighted", "Co-Boosting's reweighted ensemble (its teacher)", "coboost",
                "weighted_ensemble_test_accuracy"),
        Measure("feddf_card", f"{feddf}, {at_card(v('feddf_card', 'algorithm.steps'), CARD_STEPS)} steps", "feddf_card"),
        Measure("dense_card", f"DENSE, {at_card(v('dense_card', 'algorithm.epochs'), CARD_GEN)} generator epochs",
                "dense_card"),
        Measure("coboost_card", f"Co-Boosting, {at_card(v('coboost_card', 'algorithm.epochs'), CARD_GEN)} generator "
                "epochs", "coboost_card"),
        Measure("adi_card", f"Fed-ADI, {v('adi_card', 'algorithm.epochs')} epochs", "adi_card"),
        Measure("coboost_weighted_card", f"Co-Boosting's reweighted ensemble, {v('coboost_card', 'algorithm.epochs')} "
                "generator epochs", "coboost_card", "weighted_ensemble_test_accuracy"),
        Measure("fusefl_k2", "FuseFL K=2", "fusefl_k2"),
        Measure("fusefl_k2_uncal", "FuseFL K=2 before its calibration", "fusefl_k2", "uncalibrated_test_accuracy"),
        Measure("fusefl_k4", "FuseFL K=4", "fusefl_k4"),
        Measure("fusefl_k4_uncal", "FuseFL K=4 before its calibration", "fusefl_k4", "uncalibrated_test_accuracy"),
        Measure("fedavg_multi", "Multi-round FedAvg, same local epochs", "fedavg_multi"),
        Measure("noise_fedavg", "One-shot FedAvg, other minibatch orders (noise floor)", "fedavg_shuffle"),
        Measure("noise_ensemble", "Ensemble, other minibatch orders (noise floor)", "fedavg_shuffle",
                "ensemble_test_accuracy"),
        # the budget curve's larger budgets (compared below as well)
        Measure("fedavg_e2", "", "fedavg_e2"), Measure("ensemble_e2", "", "fedavg_e2", "ensemble_test_accuracy"),
        Measure("feddf_e2", "", "feddf_e2"), Measure("fusefl_k2_e2", "", "fusefl_k2_e2"),
        Measure("fedavg_multi_e2", "", "fedavg_multi_e2"),
        Measure("dense_g2", "DENSE, twice the generator epochs", "dense_g2"),
        Measure("coboost_g2", "Co-Boosting, twice the generator epochs", "coboost_g2"),
        Measure("dense_w", f"DENSE, generator width ngf {v('dense_w', 'algorithm.ngf')}", "dense_w"),
        Measure("coboost_w", f"Co-Boosting, generator width ngf {v('coboost_w', 'algorithm.ngf')}", "coboost_w"),
    ]
    return {m.name: m for m in out}


# The accuracy table's and its plot's models: every measure but the budget curve's larger budgets.
LARGER = ("fedavg_e2", "ensemble_e2", "feddf_e2", "fusefl_k2_e2", "fedavg_multi_e2", "dense_g2", "coboost_g2",
          "dense_w", "coboost_w")


def budget_pairs(s: Setting) -> list[tuple[str, str, str, str]]:
    """(method, measure at the main budget, measure at the larger budget, what grows), numbers as the rows ran."""
    v = lambda tag, key: setting_value(s, tag, key)  # noqa: E731
    gen = lambda tag: v(tag, "algorithm.epochs")  # noqa: E731
    return [
        ("One-shot FedAvg", "fedavg", "fedavg_e2", "local epochs"),
        ("Ensemble", "ensemble", "ensemble_e2", "local epochs"),
        ("FedDF (held-out)", "feddf", "feddf_e2", "local epochs"),
        ("FuseFL K=2", "fusefl_k2", "fusefl_k2_e2", "local epochs per block"),
        ("Multi-round FedAvg", "fedavg_multi", "fedavg_multi_e2", "rounds of 1 local epoch"),
        ("DENSE", "dense", "dense_g2", "generator epochs"),
        ("Co-Boosting", "coboost", "coboost_g2", "generator epochs"),
        ("DENSE (width)", "dense", "dense_w",
         f"generator width (ngf {v('dense', 'algorithm.ngf')} -> {at_card(v('dense_w', 'algorithm.ngf'), CARD_NGF)})"),
        ("Co-Boosting (width)", "coboost", "coboost_w",
         f"generator width (ngf {v('coboost', 'algorithm.ngf')} -> {at_card(v('coboost_w', 'algorithm.ngf'), CARD_NGF)})"),
        ("FedDF (the card's budget row)", "feddf", "feddf_card", f"distillation steps ({v('feddf', 'algorithm.steps')} -> "
         f"{at_card(v('feddf_card', 'algorithm.steps'), CARD_STEPS)})"),
        ("DENSE (the card's budget row)", "dense", "dense_card",
         f"generator epochs ({gen('dense')} -> {at_card(gen('dense_card'), CARD_GEN)})"),
        ("Co-Boosting (the card's budget row)", "coboost", "coboost_card",
         f"generator epochs ({gen('coboost')} -> {at_card(gen('coboost_card'), CARD_GEN)})"),
        ("Fed-ADI (DENSE's card budget row)", "adi", "adi_card", f"epochs ({gen('adi')} -> {gen('adi_card')})"),
    ]


# (measure, against, what the comparison tests)
COMPARISONS = [
    ("noise_fedavg", "fedavg", "noise floor: shuffling alone, one-shot FedAvg"),
    ("noise_ensemble", "ensemble", "noise floor: shuffling alone, ensemble"),
    ("ensemble", "fedavg", "the ensemble over parameter averaging"),
    ("fedavg_cal", "fedavg", "calibration's effect on one-shot FedAvg"),
    ("ensemble_cal", "ensemble", "calibration's effect on the ensemble"),
    ("fusefl_k2", "fusefl_k2_uncal", "calibration's effect on FuseFL K=2"),
    ("fusefl_k2_uncal", "ensemble", "FuseFL K=2 without its calibration vs the ensemble"),
    ("fusefl_k2", "ensemble", "FuseFL K=2 vs the ensemble (the paper's claim)"),
    ("fusefl_k2", "ensemble_cal", "FuseFL K=2 vs the ensemble, both calibrated"),
    ("fusefl_k2", "fedavg_cal", "FuseFL K=2 vs one-shot FedAvg, both calibrated"),
    ("fusefl_k2", "fedavg_multi", "FuseFL K=2 vs multi-round FedAvg, same local epochs"),
    ("fusefl_k4", "fusefl_k2", "K=4 vs K=2 (same total local epochs)"),
    ("fedavg_multi", "fedavg", "multi-round over one-shot FedAvg"),
    ("feddf", "fedavg", "FedDF over its starting point, one-shot FedAvg"),
    ("feddf_ood", "feddf", "out-of-domain (FEMNIST) vs in-domain distillation set"),
    ("feddf_ood", "fedavg", "FedDF on FEMNIST over one-shot FedAvg"),
    ("dense", "fedavg", "DENSE vs one-shot FedAvg"),
    ("coboost", "fedavg", "Co-Boosting vs one-shot FedAvg"),
    ("coboost", "dense", "Co-Boosting vs DENSE"),
    ("adi", "fedavg", "Fed-ADI vs one-shot FedAvg"),
    ("dense", "adi", "DENSE vs Fed-ADI (DENSE's best baseline, same generator epochs and distillation)"),
    ("coboost_weighted", "ensemble", "Co-Boosting's reweighted ensemble vs the plain ensemble"),
    ("dense_g2", "fedavg", "DENSE at twice the generator budget vs one-shot FedAvg"),
    ("coboost_g2", "fedavg", "Co-Boosting at twice the generator budget vs one-shot FedAvg"),
    ("dense_w", "fedavg", "DENSE with the wider generator vs one-shot FedAvg"),
    ("coboost_w", "fedavg", "Co-Boosting with the wider generator vs one-shot FedAvg"),
    ("feddf_card", "fedavg", "FedDF, the card-budget row, vs one-shot FedAvg"),
    ("dense_card", "fedavg", "DENSE, the card-budget row, vs one-shot FedAvg"),
    ("coboost_card", "fedavg", "Co-Boosting, the card-budget row, vs one-shot FedAvg"),
    ("coboost_card", "dense_card", "Co-Boosting vs DENSE, both the card-budget rows"),
    ("dense_card", "adi_card", "DENSE vs Fed-ADI, both the card-budget rows"),
    ("coboost_weighted_card", "ensemble", "Co-Boosting's reweighted ensemble vs the plain ensemble, the card-budget row"),
]


def values(cells: dict[str, dict[int, rc.Run]], s: Setting, m: Measure) -> dict[int, float]:
    """seed -> the measure: the last metrics row holding ``m.key`` (one final model per run, evaluated once)."""
    out = {}
    for seed, run in sorted(rc.finished(cells.get(f"{s.name}/{m.tag}", {})).items()):
        rows = [r for r in run["rows"] if r.get(m.key) is not None]
        if rows:
            out[seed] = float(rows[-1][m.key])
    return out


# The rows that read the main client models of their seed from the cache (the others train their own: other
# minibatch orders, more local epochs, FuseFL's blocks, multi-round FedAvg).
MAIN_CLIENTS = ("fedavg", "fedavg_cal", "ensemble_cal", "feddf", "feddf_ood", "dense", "coboost", "adi", "dense_g2",
                "coboost_g2", "dense_w", "coboost_w", "feddf_card", "dense_card", "coboost_card", "adi_card")
FINGERPRINT = ("client_test_accuracy_mean", "ensemble_test_accuracy", "fedavg_test_accuracy")


def client_models(cells: dict[str, dict[int, rc.Run]], s: Setting, tag: str) -> dict[int, tuple[float, ...]]:
    """seed -> what row ``tag``'s runs logged of the client models they read (their mean accuracy, their
    ensemble's and their average's): two runs on the same client models log the same three numbers."""
    out = {}
    for seed, run in rc.finished(cells.get(f"{s.name}/{tag}", {})).items():
        last = {k: r[k] for r in run["rows"] for k in FINGERPRINT if r.get(k) is not None}
        if len(last) == len(FINGERPRINT):
            out[seed] = tuple(last[k] for k in FINGERPRINT)
    return out


def pair(cells: dict[str, dict[int, rc.Run]], s: Setting, a: Measure, b: Measure
         ) -> tuple[dict[int, float], dict[int, float], list[int]]:
    """The two measures over the seeds they can be paired on, and the seeds left out: a paired difference
    between two rows on the main client models holds only where both runs read the same client models (runs
    made at different commits may not: the cache is per code snapshot), never just the same seed."""
    va, vb = values(cells, s, a), values(cells, s, b)
    shared = sorted(set(va) & set(vb))
    other: list[int] = []
    if a.tag != b.tag and a.tag in MAIN_CLIENTS and b.tag in MAIN_CLIENTS:
        fa, fb = client_models(cells, s, a.tag), client_models(cells, s, b.tag)
        other = [k for k in shared if fa.get(k) is None or fa.get(k) != fb.get(k)]
    keep = [k for k in shared if k not in other]
    return {k: va[k] for k in keep}, {k: vb[k] for k in keep}, other


def left_out(other: list[int]) -> str:
    return f" ({rc.seed_list(other)} left out: other client models)" if other else ""


def accuracy_table(s: Setting, cells: dict[str, dict[int, rc.Run]]) -> str:
    """Each model's accuracy, and against one-shot FedAvg and the ensemble: the other's mean on the seeds of
    the pair (where the pair leaves seeds out, this row's mean there too), then the paired difference."""
    ms = measures(s)
    header = ["model", "seeds", "test accuracy (mean ± 95% CI)", "one-shot FedAvg on the same seeds",
              "minus one-shot FedAvg (paired, 95% CI)", "reading", "the ensemble on the same seeds",
              "minus the ensemble (paired, 95% CI)", "reading "]
    rows = []
    for m in (m for m in ms.values() if m.name not in LARGER):
        v = values(cells, s, m)
        if not v:
            continue
        row = [m.label, str(len(v)), rc.fmt_mean(rc.interval(list(v.values())))]
        for base in ("fedavg", "ensemble"):
            if m.name == base:
                row += ["-", "-", "-"]
                continue
            a, b, other = pair(cells, s, m, ms[base])
            d = rc.paired(a, b)
            there = f" (this row there: {rc.fmt_mean(rc.interval(list(a.values())))})" if len(a) < len(v) else ""
            row += [rc.fmt_mean(rc.interval(list(b.values()))) + there if b else "-", rc.fmt_diff(d) + left_out(other),
                    rc.reading(d)]
        rows.append(row)
    return rc.md_table(header, rows)


def comparison_table(s: Setting, cells: dict[str, dict[int, rc.Run]]) -> tuple[str, dict[tuple[str, str], rc.Interval]]:
    header = ["comparison", "what it tests", "seeds", "difference (paired, 95% CI)", "p", "reading"]
    rows, out, ms = [], {}, measures(s)
    for a, b, what in COMPARISONS:
        va, vb, other = pair(cells, s, ms[a], ms[b])
        d = rc.paired(va, vb)
        if d.n == 0 and not other:
            continue
        out[(a, b)] = d
        rows.append([f"{ms[a].label} minus {ms[b].label}", what, str(d.n) + left_out(other),
                     rc.fmt_diff(d) if d.n else "-", rc.fmt_p(d) if d.n else "-", rc.reading(d) if d.n else "-"])
    return rc.md_table(header, rows), out


def _kb(n: float) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def _steps(runs: dict[int, rc.Run]) -> str:
    """FedDF's distillation steps run and its best (kept) step, min-max over seeds: early stopping ends a run
    well before its step budget, so the budget alone does not say how long the server distilled."""
    last = [next((r for r in reversed(run["rows"]) if r.get("distill_steps") is not None), None) for run in runs.values()]
    if not all(last):
        return "-"
    span = lambda key: f"{min(r[key] for r in last):,.0f}-{max(r[key] for r in last):,.0f}"  # noqa: E731
    return f"{span('distill_steps')} (best {span('best_step')})"


def traffic_table(s: Setting, cells: dict[str, dict[int, rc.Run]]) -> str:
    """Rounds and bytes per client, counted alike for every row (the logged bytes); the calibration round's share;
    FedDF's distillation steps."""
    header = ["row", "rounds", "upload per client", "download per client", "of which the calibration round (up / down)",
              "final model parameters", "distillation steps run (best), min-max over seeds", "CPU s per run (mean)"]
    rows = []
    for row in s.rows:
        runs = rc.finished(cells.get(f"{s.name}/{row.tag}", {}))
        if not runs:
            continue
        run = runs[min(runs)]
        summ, last = run["summary"], run["rows"][-1]
        calibrated = any("calibration_samples" in r for r in run["rows"])
        params = next((r["model_params"] for r in reversed(run["rows"]) if r.get("model_params") is not None), None)
        rows.append([row.label, str(summ["rounds"]), _kb(summ["bytes_up_total"] / CLIENTS),
                     _kb(summ["bytes_down_total"] / CLIENTS),
                     f"{_kb(last['bytes_up'] / CLIENTS)} / {_kb(last['bytes_down'] / CLIENTS)}" if calibrated else "-",
                     f"{int(params):,}" if params is not None else "-", _steps(runs),
                     f"{statistics.fmean(r['stats']['cpu_s'] for r in runs.values()):.0f}"])
    return rc.md_table(header, rows)


def budget_section(s: Setting, cells: dict[str, dict[int, rc.Run]], plots: Path | None, name: str) -> str:
    header = ["method", "what grows", "seeds", "main budget", "larger budget", "larger minus main (paired, 95% CI)",
              "reading"]
    rows, curves = [], {}
    ms = measures(s)
    for method, m1, m2, what in budget_pairs(s):
        if not values(cells, s, ms[m2]):
            continue
        v2, v1, other = pair(cells, s, ms[m2], ms[m1])
        if not v2:  # both ran, on no seed with the same client models: the row says so
            rows.append([method, what, "0" + left_out(other), "-", "-", "-", "-"])
            continue
        d = rc.paired(v2, v1)
        i1, i2 = rc.interval(list(v1.values())), rc.interval(list(v2.values()))
        curves[method] = (i1, i2)
        rows.append([method, what, str(d.n) + left_out(other), rc.fmt_mean(i1), rc.fmt_mean(i2), rc.fmt_diff(d),
                     rc.reading(d)])
    if not rows:
        return ""
    if plots is not None:
        plot_budget(curves, plots / name)
    v = lambda tag, key: setting_value(s, tag, key)  # noqa: E731
    return ("### Budget curve\n\nEach method at its main budget and at a larger one (twice the local epochs, "
            f"{v('fedavg', 'train.epochs')} -> {v('fedavg_e2', 'train.epochs')}: the clients' models, FedDF's teachers, "
            f"FuseFL's {v('fusefl_k2', 'algorithm.local_epochs')} -> {v('fusefl_k2_e2', 'algorithm.local_epochs')} "
            "epochs per block, multi-round FedAvg's rounds; DENSE and Co-Boosting, on the main client models: twice "
            f"the generator epochs, {v('dense', 'algorithm.epochs')} -> {v('dense_g2', 'algorithm.epochs')}, and a "
            f"wider generator, ngf {v('dense', 'algorithm.ngf')} -> {at_card(v('dense_w', 'algorithm.ngf'), CARD_NGF)} "
            f"at {v('dense_w', 'algorithm.epochs')} epochs; the card-budget rows on the main client models: FedDF's "
            f"{at_card(v('feddf_card', 'algorithm.steps'), CARD_STEPS)} distillation steps, DENSE's and Co-Boosting's "
            f"{at_card(v('dense_card', 'algorithm.epochs'), CARD_GEN)} generator epochs, and Fed-ADI at the same "
            f"{v('adi_card', 'algorithm.epochs')}), paired by seed over the seeds both budgets ran.\n\n"
            + rc.md_table(header, rows) + f"\n![budget curve]({name})\n")


def plot_budget(curves: dict[str, tuple[rc.Interval, rc.Interval]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (method, (i1, i2)) in enumerate(curves.items()):
        xs = [1 + 0.02 * (k - len(curves) / 2), 2 + 0.02 * (k - len(curves) / 2)]
        ys = [100 * i1.mean, 100 * i2.mean]
        hs = [100 * (i.half if i.half == i.half else 0.0) for i in (i1, i2)]
        ax.errorbar(xs, ys, yerr=hs, marker="o", capsize=3, label=method)
    ax.set_xticks([1, 2], ["main budget", "larger budget"])
    ax.set_ylabel("test accuracy (%), mean and 95% CI over seeds")
    ax.set_title("One-shot methods: accuracy against their budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    rc.save_figure(fig, path)


def plot_accuracies(s: Setting, cells: dict[str, dict[int, rc.Run]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [(m, rc.interval(list(values(cells, s, m).values()))) for m in measures(s).values() if m.name not in LARGER]
    shown = [(m, iv) for m, iv in shown if iv.n]
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(shown) + 1.2))
    ys = list(range(len(shown)))[::-1]
    ax.errorbar([100 * iv.mean for _, iv in shown], ys, xerr=[100 * (iv.half if iv.half == iv.half else 0.0)
                                                              for _, iv in shown], fmt="o", capsize=3)
    ax.set_yticks(ys, [m.label for m, _ in shown], fontsize=7)
    ax.set_xlabel("test accuracy (%), mean and 95% CI over seeds")
    ax.grid(alpha=0.3)
    rc.save_figure(fig, path)


# ----------------------------------------------------------------------------- verdicts

SPEC = "specs/oneshot.md"


def claims(s: Setting) -> list[tuple[str, str, rc.PaperClaim]]:
    """(measure, against, the paper's claim) for ``s``; each claim's differences and budget quote what ``s``'s
    rows ran (a claim run below a card's budget is 'untested' unless it reproduces)."""
    v = lambda tag, key: setting_value(s, tag, key)  # noqa: E731
    gen, steps = (lambda tag: v(tag, "algorithm.epochs")), (lambda tag: v(tag, "algorithm.steps"))
    if s.preset is None:
        ours = (f"Fashion-MNIST, a 25k-parameter BatchNorm CNN, {CLIENTS} clients, Dirichlet(0.5), "
                f"{v('fedavg', 'train.epochs')} local epochs (the papers: CIFAR-10, ResNet-18 or a CNN, 100-400 local "
                "epochs)")
    else:
        ours = f"{s.title}; the preset's differences from each card: docs/results/README.md"
    order = ("the survey's expected order: one-shot FedAvg << FedDF <~ DENSE <~ Co-Boosting < Ensemble")
    local = v("fedavg", "train.epochs") or 0

    def budget(paper_local: int, *server: tuple[str, int, int], ours_local: int = local,
               what: str = "local epochs") -> dict[str, Any]:
        """The claim's budget: the least of the clients' local epochs against the paper's and each server-side
        budget (what, ours, the card's) as fractions; ``budget_of`` names every one that falls short."""
        parts = [(what, ours_local, paper_local), *server]
        return rc.claim_budget(*((o or 0, p, f"{w} {o or 0:,} of {p:,}") for w, o, p in parts))

    def feddf(tag: str, name: str, setting: str) -> rc.PaperClaim:
        data = s.row("feddf" if tag == "feddf_card" else tag)  # the card-budget row distils on the held-out split
        return rc.PaperClaim(name, setting, None, 1, f"{ours}; {data.label if data else tag}: "
                             f"{at_card(steps(tag), CARD_STEPS)} distillation steps, early stop after "
                             f"{v(tag, 'algorithm.patience') or 0:,}", SPEC,
                             **budget(LOCAL_LEAST, ("distillation steps", steps(tag), CARD_STEPS)))

    def width(tag: str) -> str:
        ngf = v(tag, "algorithm.ngf")
        return f"ngf {ngf}" + ("" if ngf == CARD_NGF else f" (card {CARD_NGF})")

    def generator(tag: str) -> str:
        return f"{at_card(gen(tag), CARD_GEN)} generator epochs, {width(tag)}"

    def dense(tag: str, adi: str) -> list[tuple[str, str, rc.PaperClaim]]:
        g = ("generator epochs", gen(tag), CARD_GEN)
        m = "dense" if tag == "dense" else "dense_card"
        return [
            (m, "fedavg", rc.PaperClaim("DENSE vs one-shot FedAvg", "the survey's expected order above (DENSE's own "
                                        "claim is over Fed-ADI: next row)", None, 1, f"{ours}; {generator(tag)}", SPEC,
                                        **budget(LOCAL_LEAST, g))),
            (m, adi, rc.PaperClaim(
                "DENSE vs Fed-ADI", "CIFAR-10, 5 clients: DENSE over its best baseline, Fed-ADI (DENSE abstract)",
                "+5.08 points", 1, f"{ours}; {at_card(gen(tag), CARD_GEN)} epochs for both; DENSE's "
                f"generator {width(tag)}; Fed-ADI {v(adi, 'algorithm.di_steps')} "
                f"DeepInversion steps per batch (DeepInversion: {DI_PAPER:,})", SPEC, **budget(LOCAL_DENSE, g)))]

    def coboost(tag: str, m: str, versus: str) -> list[tuple[str, str, rc.PaperClaim]]:
        b = budget(LOCAL_LEAST, ("generator epochs", gen(tag), CARD_GEN))
        return [
            (m, versus, rc.PaperClaim(
                "Co-Boosting vs DENSE", "expected order DENSE <~ Co-Boosting (Co-Boosting's CIFAR-10 tables not "
                "retrieved)", None, 1, f"{ours}; {generator(tag)} for both", SPEC, **b)),
            (f"coboost_weighted{m[len('coboost'):]}", "ensemble", rc.PaperClaim(
                "Co-Boosting's ensemble reweighting vs the plain ensemble", "Co-Boosting (ICLR 2024): boosting the "
                "ensemble improves the teacher", None, 1, f"{ours}; weights learnt on the synthetic pool of "
                f"{at_card(gen(tag), CARD_GEN)} generator epochs", SPEC, **b))]

    fusefl = ("CIFAR-10, Dirichlet(0.5), 5 clients, ResNet-18 (w 20 FuseFL, 64 baselines), 100 epochs per block: "
              "'beats ensemble FL by a significant margin' (abstract; tables not retrieved)")
    block = budget(LOCAL_FUSEFL_BLOCK, ours_local=v("fusefl_k2", "algorithm.local_epochs"),
                   what="local epochs per block")
    return [
        ("ensemble", "fedavg", rc.PaperClaim(
            "Ensemble vs one-shot FedAvg", "CIFAR-10, 5 clients, Dir(0.5), seed 1, CNN (DENSE README)",
            "71.81 vs 30.93 % (+40.9 points)", 1, ours, SPEC, **budget(LOCAL_DENSE))),
        ("feddf", "fedavg", feddf("feddf", "FedDF vs one-shot FedAvg", order)),
        ("feddf_ood", "fedavg", feddf("feddf_ood", "FedDF (out of domain) vs one-shot FedAvg",
                                      "FedDF distils CIFAR-10 ensembles on CIFAR-100 / ImageNet")),
        *dense("dense", "adi"),
        *coboost("coboost", "coboost", "dense"),
        ("fusefl_k2", "ensemble", rc.PaperClaim(
            "FuseFL K=2 vs the ensemble", fusefl, None, 1, f"{ours}; the model cut in 2 blocks of "
            f"{v('fusefl_k2', 'algorithm.local_epochs')} local epochs; FuseFL takes 3 rounds and {CLIENTS}x more "
            "download", "specs/fusefl.md", **block)),
        ("fusefl_k2", "ensemble_cal", rc.PaperClaim(
            "FuseFL K=2 vs the ensemble given FuseFL's calibration", "as above (the paper's ensemble is not "
            "calibrated; this is our fairness control)", None, 1, f"{ours}; both calibrated in one more round",
            "specs/fusefl.md", **block)),
        # the same claims at the cards' server-side budgets (the rows above run at a tenth or less of them)
        ("feddf_card", "fedavg", feddf("feddf_card", "FedDF vs one-shot FedAvg", order)),
        *dense("dense_card", "adi_card"),
        *coboost("coboost_card", "coboost_card", "dense_card"),
        ("fusefl_k2", "fedavg", rc.PaperClaim(
            "FuseFL K=2 vs one-shot FedAvg", "as above: 'beats existing one-shot FL'", None, 1, ours, "specs/fusefl.md",
            **block)),
    ]


def verdicts(s: Setting, cells: dict[str, dict[int, rc.Run]]) -> list[tuple]:
    """A verdict row per claim whose rows ran; a claim whose rows are planned but not run yet stays in the table
    as 'untested' (its 'ours' cell says so), so a missing baseline is visible, not silently dropped."""
    out: list[tuple] = []
    ms = measures(s)
    for a, b, claim in claims(s):
        va, vb, other = pair(cells, s, ms[a], ms[b])
        d = rc.paired(va, vb)
        if d.n:
            out.append((claim, d, ms[b].label, rc.fmt_diff(d) + left_out(other)) if other else (claim, d, ms[b].label))
        elif other:  # both ran, on no seed with the same client models
            out.append((claim, None, ms[b].label, f"none{left_out(other)}"))
        elif all(s.row(ms[m].tag) for m in (a, b)):
            out.append((claim, None, ms[b].label, "not run yet (the setting's missing runs)"))
    return out


def method_paragraph() -> str:
    return ("Every run ends with one final model after a fixed protocol (one-shot methods after their upload and "
            "server step; FuseFL, multi-round FedAvg and the calibrated rows after their fixed rounds), evaluated "
            "once on the 10,000 test images: that evaluation is the run's number, so nothing is selected on the test "
            "set (FedDF's early stopping reads a labelled validation part of the server's held-out training split, "
            "never the test set). ± is the half-width of the 95% Student-t interval over seeds; a difference is paired "
            "by seed (same partition, initial model, server split and client models) with its 95% interval in brackets "
            "and the paired t-test's p; two rows on the main client models pair only the seeds whose runs logged the "
            "same client models (their mean accuracy, their ensemble's and their average's), and a seed left out for "
            "that is named; 'reading' says higher or lower only when the interval excludes 0, else 'no "
            "detectable difference'. Accuracies in %, differences in points. The noise-floor row retrains the clients "
            "with only their minibatch orders changed (`train.shuffle_offset=1`): how large a paired difference of "
            "one-shot FedAvg or of the ensemble comes from nothing but shuffling. CPU s per run: the one-shot rows "
            "read the client models of their seed from a cache kept per commit, which the first run of that seed at "
            "that commit trained (its CPU time includes the clients' training, about 25 s; its metrics say "
            "`cache_hit: 0`), so their CPU time is mostly the server side's (plus start-up and evaluation); the "
            "noise floor, the 8-epoch rows, FuseFL and multi-round FedAvg train their own clients.")


def build(settings: list[Setting], cells: dict[str, dict[int, rc.Run]], plots: Path | None, command: str,
          artefacts: Path) -> str:
    suffix = rc.suffix_of(DOC, artefacts)
    sections, verdict_rows = [], []
    for s in settings:
        if not rc.finished(cells.get(f"{s.name}/fedavg", {})):
            sections.append(rc.setting_header(s) + "Not run yet.\n")
            continue
        verdict_rows += verdicts(s, cells)
        comparisons, _ = comparison_table(s, cells)
        name = f"{DOC}_{s.name}{suffix}.png"
        if plots is not None:
            plot_accuracies(s, cells, plots / name)
        missing_text = rc.missing_runs(s, cells)
        sections.append(
            rc.setting_header(s) + "Rows:\n" + rc.rows_list(s, [r.tag for r in s.rows]) + "\n" + missing_text
            + "### Accuracy\n\n" + accuracy_table(s, cells) + f"\n![accuracies]({name})\n\n"
            + "### Comparisons\n\n" + comparisons + "\n### Rounds, bytes and size\n\nBytes as logged by the runs, per "
            "client (5 clients), every round counted, the calibration round included; 'final model parameters' is "
            "what the method keeps for inference (the ensemble: 5 client models; FuseFL: every client's blocks and "
            "adaptors; seed " + "0); FedDF's distillation steps are over every seed (early stopping ends a run "
            "before its step budget).\n\n" + traffic_table(s, cells) + "\n"
            + budget_section(s, cells, plots, f"{DOC}_{s.name}_budget{suffix}.png"))
    gpu = any(s.preset for s in settings)
    return ("# One-shot FL: one-shot FedAvg, ensemble, FedDF, DENSE, Co-Boosting, Fed-ADI, FuseFL" + (" (GPU preset)" if gpu else "")
            + "\n\n" + f"{rc.provenance(DOC, artefacts, cells, command)}\n\n"
            "Methods: [docs/algorithms/oneshot.md](../algorithms/oneshot.md), "
            "[docs/algorithms/fusefl.md](../algorithms/fusefl.md). "
            f"{method_paragraph()}\n\n## Verdict against the papers\n\n" + rc.verdict_table(verdict_rows) + "\n"
            + "\n".join(sections))


def main(argv: list[str] | None = None) -> int:
    return rc.cli(DOC, argv, __doc__, settings_of, build, presets=("cpu", "gpu"))


if __name__ == "__main__":
    sys.exit(main())
