#!/usr/bin/env python
"""Global vs personalised client accuracy on digits, Dirichlet(0.1) -> docs/results/personalised.md.

    nice -n 19 python scripts/results_personalised.py --jobs 2     # run what is missing (minutes), write the document
    python scripts/results_personalised.py --from-artefacts         # rebuild it from docs/results/data/personalised/
    python scripts/results_personalised.py --budget tiny --out /tmp/pers   # a check of the pipeline

FedAvg, FedBN, FedPer, FedRep and Ditto on one strongly label-skewed partition, every client evaluated
on its local test split every other round (eval.clients=all, docs/personalisation.md): the global
model, each client's personalised model, and the model after 5 local fine-tuning steps. Method and
statistics: scripts/results_common.py, docs/results/README.md; a run's number is the mean of its last
5 evaluations of the row's mean client accuracy.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import results_common as rc  # noqa: E402

DOC = "personalised"
LABELS = {"fedavg": "FedAvg", "fedbn": "FedBN", "fedper": "FedPer", "fedrep": "FedRep", "ditto": "Ditto"}
GLOBAL, PERSONAL, FINETUNED = "client_accuracy_mean", "personal_accuracy_mean", "finetuned_accuracy_mean"


def settings_of(budget: str, preset: str) -> list[rc.Setting]:
    tiny = budget == "tiny"
    seeds = [0, 1] if tiny else list(range(5))
    rounds = 4 if tiny else 30
    common = ["dataset=digits", "model=cnn", "model.channels=[16,32]", "model.hidden=64", "model.norm=batch",
              "num_clients=20", "clients_per_round=5", "partition=dirichlet", "partition.alpha=0.1",
              "eval_every=2", "train.epochs=1" if tiny else "train.epochs=2", "train.batch_size=10", "train.lr=0.05",
              "eval.clients=all", "eval.local_test_fraction=0.2", "eval.finetune_steps=5"]
    algs = {"fedavg": ["algorithm=fedavg"], "fedbn": ["algorithm=fedbn"], "fedper": ["algorithm=fedper"],
            "fedrep": ["algorithm=fedrep", "algorithm.head_epochs=2"], "ditto": ["algorithm=ditto", "algorithm.lam=0.1"]}
    rows = [rc.Row(a, LABELS[a], a, [], seeds) for a in LABELS] + [rc.noise_row(seeds)]
    return [rc.Setting("dirichlet01", "digits, Dirichlet(0.1) label skew, 20 clients", common, rounds, rows, algs)]


def _acc(runs: dict[int, rc.Run], metric: str) -> dict[int, float]:
    return rc.accuracies(runs, metric=metric)


def table(s: rc.Setting, cells: dict[str, dict[int, rc.Run]]) -> str:
    runs = rc.setting_runs(s, cells)
    base = _acc(runs["fedavg"], GLOBAL)
    header = ["algorithm", "seeds", "global model", "personalised", "personalised minus global (paired)", "p",
              "reading", "personalised minus FedAvg's global (paired)", "p", "reading", "worst 10% (personalised)",
              "fine-tuned 5 steps", "CPU s per run"]
    out = []
    for tag in [*LABELS, rc.NOISE]:
        r, row = runs.get(tag), s.row(tag)
        if not r or row is None:
            continue
        glob = _acc(r, GLOBAL)
        has_personal = all(PERSONAL in run["rows"][-1] for run in r.values())
        cells_row = [row.label, str(len(glob)), rc.fmt_mean(rc.interval(list(glob.values())))]
        if tag == rc.NOISE:  # what shuffling alone moves FedAvg's global model by
            d = rc.paired(glob, base)
            worst = _acc(r, GLOBAL.replace("mean", "worst10"))
            cells_row += ["-"] * 4 + [rc.fmt_diff(d) + " (global)", rc.fmt_p(d), rc.reading(d),
                                      rc.fmt_mean(rc.interval(list(worst.values()))) + " (global)"]
        elif has_personal:
            pers = _acc(r, PERSONAL)
            own, vs = rc.paired(pers, glob), rc.paired(pers, base)
            worst = _acc(r, PERSONAL.replace("mean", "worst10"))
            cells_row += [rc.fmt_mean(rc.interval(list(pers.values()))), rc.fmt_diff(own), rc.fmt_p(own),
                          rc.reading(own), rc.fmt_diff(vs), rc.fmt_p(vs), rc.reading(vs),
                          rc.fmt_mean(rc.interval(list(worst.values())))]
        else:
            worst = _acc(r, GLOBAL.replace("mean", "worst10"))
            cells_row += ["-"] * 7 + [rc.fmt_mean(rc.interval(list(worst.values()))) + " (global)"]
        cells_row += [rc.fmt_mean(rc.interval(list(_acc(r, FINETUNED).values()))),
                      f"{statistics.fmean(run['stats']['cpu_s'] for run in r.values()):.0f}"]
        out.append(cells_row)
    return rc.md_table(header, out)


def build(settings: list[rc.Setting], cells: dict[str, dict[int, rc.Run]], plots: Path | None, command: str,
          artefacts: Path) -> str:
    sections = []
    for s in settings:
        if not rc.setting_runs(s, cells)["fedavg"]:
            sections.append(rc.setting_header(s) + "Not run yet.\n")
            continue
        sections.append(rc.setting_header(s) + "Rows:\n" + rc.rows_list(s, [*LABELS, rc.NOISE]) + "\n" + table(s, cells))
    return ("# Personalised FL: global vs personalised client accuracy on digits\n\n"
            f"{rc.provenance(DOC, artefacts, cells, command)}\n\n"
            "Setting: scikit-learn digits (1,438 train / 359 test images), a small CNN with BatchNorm (16 and 32 "
            "channels, 64 hidden), 20 clients with Dirichlet(0.1) label skew, 5 sampled per round, 2 local epochs of "
            "batch 10, SGD lr 0.05; each client's rows split 80/20 (stratified) into local train and test "
            "(`eval.local_test_fraction=0.2`). Every other round every client is scored on its own local test split "
            "with the global model, its personalised model (FedBN: own BatchNorm; FedPer/FedRep: own head; Ditto: "
            "its v, lam 0.1; FedRep: 2 head epochs first) and after 5 local fine-tuning steps from that model. A "
            "run's number is the mean of its last 5 evaluations of the mean client accuracy (`client_accuracy_mean`, "
            "`personal_accuracy_mean`, `finetuned_accuracy_mean`); 'worst 10%' is the mean accuracy of the worst "
            "two clients. ± is the half-width of the 95% Student-t interval over seeds; differences are paired by "
            "seed, within a run (personalised minus global) or against FedAvg's global model of the same seed "
            "(same partition, split, initial model and client sampling), with the 95% interval in brackets and "
            "the paired t-test's p; 'reading' says higher or lower only when the interval excludes 0. Accuracies "
            "in %, differences in points. The noise-floor row reruns FedAvg with only its clients' minibatch orders "
            "changed: how far shuffling alone moves the global model. digits is none of the papers' datasets, so "
            "there is no verdict table against their numbers.\n\n" + "\n".join(sections))


def main(argv: list[str] | None = None) -> int:
    return rc.cli(DOC, argv, __doc__, settings_of, build)


if __name__ == "__main__":
    sys.exit(main())
