#!/usr/bin/env python
"""FedAvg, FedProx, SCAFFOLD, FedNova and the catalogue (FedAdam, FedYogi, FedAdagrad, FedDyn, MOON) on digits
(100 clients, 10 per round) -> docs/results/baselines.md.

    nice -n 19 python scripts/results_baselines.py --jobs 2     # run what is missing (minutes), write the document
    python scripts/results_baselines.py --from-artefacts         # rebuild it from docs/results/data/baselines/
    python scripts/results_baselines.py --budget tiny --out /tmp/base   # a check of the pipeline

Two partitions of scikit-learn's digits: Dirichlet(0.5) label skew and the strongly non-IID
2-classes-per-client shards; 10 seeds per row and the noise-floor control (FedAvg with only its
minibatch orders changed). Method and statistics: scripts/results_common.py, docs/results/README.md.
FedAvg, FedProx, SCAFFOLD and FedNova have no card in ../shared/specs, so there is no paper number to
compare with; in the papers' large settings they run as the baselines of ``results_heterogeneity.py --preset gpu``.

Every row is tuned (issue 28 item 3): per setting and method, the client learning rate (with FedProx's mu, and
with the server optimisers' eta) is chosen from GRIDS on a validation split carved from the clients' training
rows, on seeds 100-101 that no table reports (results_common.Tuning); the test set is never read to choose.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import results_common as rc  # noqa: E402

DOC = "baselines"
LABELS = {"fedavg": "FedAvg", "fedprox": "FedProx", "scaffold": "SCAFFOLD", "fednova": "FedNova"}
#: The standard catalogue (docs/algorithms/catalogue.md): rows beside the baselines, paired with FedAvg.
CATALOGUE = {"fedadam": "FedAdam", "fedyogi": "FedYogi", "fedadagrad": "FedAdagrad", "feddyn": "FedDyn", "moon": "MOON"}
LRS = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0)  # client SGD learning rates every method is tuned over
SERVER_LRS = {"adam": (0.003, 0.01, 0.03, 0.1), "yogi": (0.003, 0.01, 0.03, 0.1), "adagrad": (0.03, 0.1, 0.3, 1.0)}  # eta
GRIDS = {"fedavg": {"train.lr": LRS}, "fedprox": {"train.lr": LRS, "algorithm.mu": (0.001, 0.01, 0.1, 1.0)},
         "scaffold": {"train.lr": LRS}, "fednova": {"train.lr": LRS}, "feddyn": {"train.lr": LRS},
         "moon": {"train.lr": LRS}, **{f"fed{o}": {"train.lr": LRS, "server_opt.lr": v} for o, v in SERVER_LRS.items()}}
TINY_GRIDS = {a: {k: v[1:3] if k == "train.lr" else v[1:2] for k, v in g.items()} for a, g in GRIDS.items()}
PARTITIONS = {"dirichlet": ("Dirichlet(0.5) label skew", ["partition=dirichlet", "partition.alpha=0.5"]),
              "shards": ("shards, 2 classes per client", ["partition=shards", "partition.classes_per_client=2"])}
NO_CARD = rc.PaperClaim("", "no card in ../shared/specs (FedAvg: McMahan et al. 2017; FedProx: Li et al. 2020; "
                        "SCAFFOLD: Karimireddy et al. 2020; FedNova: Wang et al. 2020)", None, None,
                        "digits and an MLP, not the papers' datasets and models")
_NOT_THEIRS = "digits and an MLP, not the paper's datasets and models"
_REDDI = rc.PaperClaim("", "Reddi et al. 2021: CIFAR-10/100, EMNIST, Shakespeare, Stack Overflow (no card in "
                       "../shared/specs)", None, None, _NOT_THEIRS)
CATALOGUE_CLAIMS = {
    "fedadam": _REDDI, "fedyogi": _REDDI, "fedadagrad": _REDDI,
    "feddyn": rc.PaperClaim("", "Acar et al. 2021: MNIST, EMNIST, CIFAR-10/100, Shakespeare (no card in ../shared/specs)",
                            None, None, _NOT_THEIRS),
    "moon": rc.PaperClaim("", "Li et al. 2021: CIFAR-10/100, Tiny-ImageNet with CNN/ResNet-50 encoders and a projection "
                          "head (no card in ../shared/specs)", None, None,
                          f"{_NOT_THEIRS}; no projection head (z is the MLP's hidden layer)"),
}


def settings_of(budget: str, preset: str) -> list[rc.Setting]:
    tiny = budget == "tiny"
    seeds = [0, 1] if tiny else list(range(10))
    rounds = 4 if tiny else 30
    common = ["dataset=digits", "model=mlp", "num_clients=100", "clients_per_round=10", "eval_every=1",
              "train.epochs=1" if tiny else "train.epochs=5", "train.batch_size=10", "train.lr=0.05"]
    algs = {"fedavg": ["algorithm=fedavg"], "fedprox": ["algorithm=fedprox", "algorithm.mu=0.01"],
            "scaffold": ["algorithm=scaffold"], "fednova": ["algorithm=fednova"], "feddyn": ["algorithm=feddyn", "algorithm.alpha=0.01"],
            "moon": ["algorithm=moon", "algorithm.mu=1.0", "algorithm.temperature=0.5"],
            **{f"fed{o}": ["algorithm=fedavg", f"server_opt={o}"] for o in SERVER_LRS}}
    tuning = rc.Tuning(TINY_GRIDS if tiny else GRIDS, (100,) if tiny else (100, 101))
    out = []
    for name, (title, part) in PARTITIONS.items():
        rows = ([rc.Row(a, LABELS[a], a, [], seeds, tuned=True) for a in LABELS] + [rc.noise_row(seeds, tuned=True)]
                + [rc.Row(a, CATALOGUE[a], a, [], seeds, priority=2, tuned=True) for a in CATALOGUE])
        out.append(rc.Setting(name, f"digits, {title}", [*common, *part], rounds, rows, algs,
                              paper={"baseline": NO_CARD, **CATALOGUE_CLAIMS}, tuning=tuning))
    return out


def build(settings: list[rc.Setting], cells: dict[str, dict[int, rc.Run]], plots: Path | None, command: str,
          artefacts: Path) -> str:
    suffix = rc.suffix_of(DOC, artefacts)
    sections, verdicts = [], []
    tags = [*LABELS, rc.NOISE, *CATALOGUE]
    for s in settings:
        if not rc.setting_runs(s, cells)["fedavg"]:
            sections.append(rc.setting_header(s) + "Not run yet.\n")
            continue
        sections.append(rc.setting_header(s) + rc.tuning_section(s, cells, {**LABELS, **CATALOGUE}) + "\n")
        table, diffs = rc.main_table(s, cells, tags,
                                     {"bytes up / FedAvg's": rc.upload_ratio(rc.setting_runs(s, cells)["fedavg"])})
        verdicts += rc.verdict_rows(s, cells, diffs, [*LABELS, *CATALOGUE])
        sections.append("Rows (each with its chosen values, on all of the clients' training rows):\n" + rc.rows_list(s, tags) + "\n" + table + "\n"
                        + rc.fednova_note(rc.setting_runs(s, cells)) + rc.plot_rows(
            s, cells, list(LABELS), plots, f"{DOC}_{s.name}{suffix}.png", f"{s.title}: test accuracy, mean and 95% band"))
        if any(rc.setting_runs(s, cells).get(a) for a in CATALOGUE):
            sections.append(rc.plot_rows(s, cells, ["fedavg", *CATALOGUE], plots, f"{DOC}_{s.name}_catalogue{suffix}.png",
                                         f"{s.title}: the catalogue against FedAvg, mean and 95% band"))
    return ("# Baselines: FedAvg, FedProx, SCAFFOLD, FedNova and the catalogue on digits\n\n"
            f"{rc.provenance(DOC, artefacts, cells, command)}\n\n"
            "Setting: scikit-learn digits (1,438 train / 359 test images), MLP 64-128-10, 100 clients, 10 sampled per "
            "round, 5 local epochs of batch 10, plain SGD; every method's learning rate tuned per setting on a "
            "validation split over {" + ", ".join(f"{v:g}" for v in LRS) + "} (FedProx jointly with mu over "
            "{0.001, 0.01, 0.1, 1}, the server optimisers with eta), the grid and the choices in each setting's "
            "Tuning table; SCAFFOLD option II with "
            "sample-weighted model deltas; FedNova: plain SGD, each client's update divided by its tau_i = 5 "
            "ceil(n_i / 10) local steps before averaging (it differs from FedAvg only where the sampled clients' "
            "tau_i differ); FedAdam/FedYogi/FedAdagrad: FedAvg's clients with `server_opt` (tau 1e-3, "
            "betas 0.9/0.99, eta tuned over {" + ", ".join(f"{v:g}" for v in SERVER_LRS["adam"]) + "} for Adam and "
            "Yogi, {" + ", ".join(f"{v:g}" for v in SERVER_LRS["adagrad"]) + "} for Adagrad); FedDyn alpha = 0.01 and "
            "MOON mu = 1, tau = 0.5 on the MLP's hidden layer (docs/algorithms/catalogue.md), not tuned. "
            f"{rc.method_paragraph()}\n\n"
            "## Verdict against the papers\n\n" + rc.verdict_table(verdicts) + "\n" + "\n".join(sections))


def main(argv: list[str] | None = None) -> int:
    return rc.cli(DOC, argv, __doc__, settings_of, build)


if __name__ == "__main__":
    sys.exit(main())
