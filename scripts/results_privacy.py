#!/usr/bin/env python
"""Accuracy vs epsilon for DP-FedAvg on Fashion-MNIST, fixed vs adaptive clipping -> docs/results/privacy.md.

    nice -n 19 python scripts/results_privacy.py --jobs 2      # run what is missing (~1 CPU-hour), write the document
    python scripts/results_privacy.py --from-artefacts          # rebuild it from docs/results/data/privacy/
    python scripts/results_privacy.py --budget tiny --out /tmp/dp   # a check of the pipeline (minutes)

Settings: Fashion-MNIST split IID over 2,000 clients (30 images each) or 6,000 (10 each), Poisson
sampling with q = 0.1 (200 or 600 clients per round on average), an MLP 784-32-10, 1 local epoch of
batch 10, 100 rounds. Central DP (``privacy=central``): each update clipped to L2 norm C, Gaussian noise on the
sum, the sum divided by the expected 200 clients; the noise multiplier for each target epsilon in
{1, 2, 4, 8} at delta = 1e-5 after 100 rounds is picked by ``privacy.noise_multiplier=null``
(dp-accounting's RDP accountant, Poisson-subsampled Gaussian); epsilon = inf is clipping without
noise. Fixed clipping C = 0.5 (about the median update norm of a non-private run) against adaptive
clipping (Andrew et al. 2021: target quantile 0.5, lr 0.2, count noise std = clients per round / 20,
from C = 0.5).
The baseline is the platform's non-private FedAvg (sample-weighted, clients drawn without
replacement), and the noise-floor control reruns it with other minibatch orders. An ablation at
epsilon = 2 sets C 10x below and above (0.05, 5): adaptive clipping should not need C tuned. Method and
statistics: scripts/results_common.py, docs/results/README.md.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import results_common as rc  # noqa: E402

DOC = "privacy"
EPSILONS = (1, 2, 4, 8, math.inf)
CLIP = 0.5
DELTA = 1e-5
MODES = {"fixed": "fixed clipping", "adaptive": "adaptive clipping"}
NOT_A_PAPER = rc.PaperClaim("DP-FedAvg, fixed and adaptive clipping", "DP-FedAvg (McMahan et al. 2018), adaptive clipping (Andrew et al. 2021): no card "
                            "in ../shared/specs", None, None,
                            "Fashion-MNIST, 2,000 clients and an MLP, not the papers' StackOverflow/EMNIST settings")


MISSET = (0.05, 5.0)  # clip norms 10x below and above the median update norm (the ablation at epsilon = 2)


def tag_of(mode: str, eps: float, clip: float = CLIP) -> str:
    return f"{mode}_eps{'inf' if math.isinf(eps) else int(eps)}" + ("" if clip == CLIP else f"_c{clip:g}")


def label_of(mode: str, eps: float, clip: float = CLIP) -> str:
    c = "" if clip == CLIP else f", C = {clip:g}" + (" at the start" if mode == "adaptive" else "")
    return f"{MODES[mode]}, epsilon = {'inf (no noise)' if math.isinf(eps) else int(eps)}{c}"


def privacy_overrides(mode: str, eps: float, clip: float = CLIP) -> list[str]:
    out = ["privacy=central", f"privacy.clip={clip}", f"privacy.delta={DELTA}", "privacy.sampling=poisson",
           "privacy.accountant=rdp"]
    if math.isinf(eps):
        out.append("privacy.noise_multiplier=0")
    else:
        out += ["privacy.noise_multiplier=null", f"privacy.target_epsilon={eps:g}"]
    if mode == "adaptive":
        out += ["privacy.adaptive.enabled=true", "privacy.adaptive.quantile=0.5", "privacy.adaptive.lr=0.2"]
    return out


SETTINGS = {  # name -> (clients, title): q = 0.1 in both, so a target epsilon needs the same z
    "fmnist": (2000, "Fashion-MNIST, 2,000 clients (30 images each), 200 per round"),
    "fmnist_large": (6000, "Fashion-MNIST, 6,000 clients (10 images each), 600 per round"),
}


def settings_of(budget: str, preset: str) -> list[rc.Setting]:
    tiny = budget == "tiny"
    seeds = [0, 1] if tiny else list(range(5))
    rounds = 6 if tiny else 100
    out = []
    for k, (name, (n, title)) in enumerate(SETTINGS.items()):
        common = ["dataset=fashion_mnist", "partition=iid", f"num_clients={n}", f"clients_per_round={n // 10}",
                  "eval_every=2" if tiny else "eval_every=5", "model=mlp", "model.hidden=[32]", "train.epochs=1",
                  "train.batch_size=10", "train.lr=0.1", "engine.cohort_size=50"]
        rows = [rc.Row("fedavg", "FedAvg, not private (sample-weighted)", "fedavg", [], seeds, priority=1 + 2 * k)]
        for eps in EPSILONS:
            for mode in MODES:
                rows.append(rc.Row(tag_of(mode, eps), label_of(mode, eps), "fedavg", privacy_overrides(mode, eps),
                                   seeds, priority=(1 if eps in (1, 8, math.inf) else 2) + 2 * k))
        if k == 0:
            rows.append(rc.noise_row(seeds))
            for clip in MISSET:  # adaptive clipping's point: no clip norm to tune
                rows += [rc.Row(tag_of(mode, 2, clip), label_of(mode, 2, clip), "fedavg",
                                privacy_overrides(mode, 2, clip), seeds, f"C = {clip:g} instead of {CLIP}", priority=5)
                         for mode in MODES]
        out.append(rc.Setting(name, title, common, rounds, rows, {"fedavg": ["algorithm=fedavg"]},
                              paper={"baseline": NOT_A_PAPER}))
    return out


def _last(runs: dict[int, rc.Run], key: str) -> list[float]:
    return [float(run["summary"][key]) for run in runs.values() if run["summary"].get(key) is not None]


def _mean_of(key: str, digits: int = 3):
    def cell(_tag: str, runs: dict[int, rc.Run]) -> str:
        values = _last(runs, key)
        return f"{statistics.fmean(values):.{digits}g}" if values else "-"
    return cell


def _epsilon(tag: str, runs: dict[int, rc.Run]) -> str:
    """The epsilon the runs' accountant logged after their last round (inf without noise: JSON has no inf)."""
    if any(run["summary"].get("dp_noise_multiplier") == 0 for run in runs.values()):
        return "inf"
    return _mean_of("dp_epsilon")(tag, runs)


def _noise_multiplier(tag: str, runs: dict[int, rc.Run]) -> str:
    """The update's noise multiplier the runs used: with adaptive clipping part of the budget goes to the
    clipped-count query, so the update's (``dp_update_noise_multiplier``) is above the accountant's z."""
    key = "dp_update_noise_multiplier" if _last(runs, "dp_update_noise_multiplier") else "dp_noise_multiplier"
    return _mean_of(key, 4)(tag, runs)


def _minus_clip_only(s: rc.Setting, cells: dict[str, dict[int, rc.Run]]):
    """A DP row's paired difference to its mode's clip-only row (epsilon = inf: the same clipping and Poisson
    sampling, no noise): the null of what the noise costs. FedAvg samples clients differently, so its
    difference mixes sampling into the noise's cost."""
    runs = rc.setting_runs(s, cells)

    def cell(tag: str, r: dict[int, rc.Run]) -> str:
        mode = tag.split("_")[0]
        null = runs.get(tag_of(mode, math.inf)) if mode in MODES else None
        if not null or tag == tag_of(mode, math.inf):
            return "-"
        d = rc.paired(rc.accuracies(r), rc.accuracies(null))
        return f"{rc.fmt_diff(d)}; {d.n}"
    return cell


def _clipped(_tag: str, runs: dict[int, rc.Run]) -> str:
    values = [row["dp_clipped_fraction"] for run in runs.values() for row in run["rows"] if "dp_clipped_fraction" in row]
    return f"{statistics.fmean(values):.2f}" if values else "-"


def adaptive_vs_fixed(s: rc.Setting, cells: dict[str, dict[int, rc.Run]]) -> str:
    runs = rc.setting_runs(s, cells)
    rows = []
    for eps, clip in [*((e, CLIP) for e in EPSILONS), *((2, c) for c in MISSET)]:
        a, f = runs.get(tag_of("adaptive", eps, clip)), runs.get(tag_of("fixed", eps, clip))
        if not a or not f:
            continue
        d = rc.paired(rc.accuracies(a), rc.accuracies(f))
        rows.append(["inf" if math.isinf(eps) else f"{eps:g}", f"{clip:g}", str(d.n), rc.fmt_diff(d), rc.fmt_p(d),
                     rc.reading(d, "adaptive higher", "adaptive lower")])
    return rc.md_table(["epsilon", "C (fixed; adaptive's start)", "seeds", "adaptive minus fixed (paired, 95% CI)",
                        "p", "reading"], rows)


def plot_epsilon(s: rc.Setting, cells: dict[str, dict[int, rc.Run]], path: Path) -> None:
    """Accuracy (mean of the last evaluations, 95% interval over seeds) against epsilon, log scale; the
    non-private FedAvg and the no-noise runs as horizontal references."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = rc.setting_runs(s, cells)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    finite = [e for e in EPSILONS if not math.isinf(e)]
    for k, (mode, name) in enumerate(MODES.items()):
        xs, ys, hs = [], [], []
        for eps in finite:
            r = runs.get(tag_of(mode, eps))
            if r:
                iv = rc.interval(list(rc.accuracies(r).values()))
                xs.append(eps * (1 + 0.03 * (2 * k - 1)))  # side by side
                ys.append(100 * iv.mean)
                hs.append(100 * iv.half if iv.half == iv.half else 0.0)
        if xs:
            line = ax.errorbar(xs, ys, yerr=hs, marker="o", capsize=3, label=f"{name} (95% CI over seeds)")
            inf = runs.get(tag_of(mode, math.inf))
            if inf:
                ax.axhline(100 * rc.interval(list(rc.accuracies(inf).values())).mean, ls=":",
                           color=line[0].get_color(), label=f"{name}, no noise (epsilon = inf)")
    base = runs.get("fedavg")
    if base:
        ax.axhline(100 * rc.interval(list(rc.accuracies(base).values())).mean, ls="--", color="black",
                   label="FedAvg, not private")
    ax.set_xscale("log", base=2)
    ax.set_xticks(finite, [f"{e:g}" for e in finite])
    ax.set_xlabel(f"epsilon at delta = {DELTA:g} after {s.rounds} rounds")
    ax.set_ylabel(f"test accuracy (%, mean of the last {rc.K_LAST} evaluations)")
    ax.set_title(f"{s.title}:\naccuracy vs epsilon", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    rc.save_figure(fig, path)


def z_text(settings: list[rc.Setting], cells: dict[str, dict[int, rc.Run]], mode: str) -> str:
    """The update's noise multiplier ``mode`` ran at, per target epsilon, in each setting (from the artefacts):
    once where every setting used the same."""
    per = {}
    for s in settings:
        runs = rc.setting_runs(s, cells)
        eps = [e for e in EPSILONS if not math.isinf(e) and runs.get(tag_of(mode, e))]
        if eps:
            per[f"{SETTINGS[s.name][0]:,} clients"] = (", ".join(_noise_multiplier("", runs[tag_of(mode, e)]) for e in eps)
                                                       + " at epsilon = " + ", ".join(f"{e:g}" for e in eps))
    if not per:
        return "not run yet"
    if len(set(per.values())) == 1:
        return f"z = {next(iter(per.values()))}, in {'both settings' if len(per) == 2 else 'every setting'}"
    return "; ".join(f"{name}: z = {zs}" for name, zs in per.items())


def section(s: rc.Setting, cells: dict[str, dict[int, rc.Run]], plots: Path | None, suffix: str) -> str:
    if not rc.setting_runs(s, cells)["fedavg"]:
        return rc.setting_header(s) + "Not run yet.\n"
    tags = ["fedavg", *(tag_of(m, e) for e in EPSILONS for m in MODES), rc.NOISE,
            *(tag_of(m, 2, c) for c in MISSET for m in MODES)]
    extra = {"epsilon reached": _epsilon, "noise multiplier": _noise_multiplier,
             "clipped fraction": _clipped, "final clip norm": _mean_of("dp_final_clip"),
             "minus clip only (epsilon = inf, paired; seeds)": _minus_clip_only(s, cells)}
    table, _ = rc.main_table(s, cells, tags, extra)
    name = f"{DOC}_{s.name}_accuracy_vs_epsilon{suffix}.png"
    if plots is not None:
        plot_epsilon(s, cells, plots / name)
    curves = rc.plot_rows(s, cells, ["fedavg", *(tag_of(m, e) for e in (1, 8) for m in MODES)], plots,
                          f"{DOC}_{s.name}_rounds{suffix}.png", f"{s.title}: test accuracy by round, mean and 95% band")
    floor = "" if s.row(rc.NOISE) else (
        "This setting has no noise-floor row (FedAvg with other minibatch orders ran in the first setting only): "
        "its differences have no shuffling null of their own, and the first setting's floor is for another cohort "
        "and client data size, so read them against it only with care.\n\n")
    return (rc.setting_header(s) + "Rows:\n" + rc.rows_list(s, tags) + "\n" + table + "\n" + floor
            + "Adaptive minus fixed clipping, at each epsilon:\n\n" + adaptive_vs_fixed(s, cells) + "\n"
            f"![{s.title}: accuracy vs epsilon]({name})\n\n" + curves)


def build(settings: list[rc.Setting], cells: dict[str, dict[int, rc.Run]], plots: Path | None, command: str,
          artefacts: Path) -> str:
    suffix = rc.suffix_of(DOC, artefacts)
    rounds = settings[0].rounds
    return ("# Differential privacy: accuracy vs epsilon (DP-FedAvg, fixed vs adaptive clipping)\n\n"
            f"{rc.provenance(DOC, artefacts, cells, command)}\n\n"
            "Central client-level DP (docs/privacy.md): each sampled client's model delta is clipped to L2 norm C, "
            "N(0, (z C)^2) is added once to the sum, the sum is divided by the expected number of clients per round, "
            "and FedAvg's server step applies it. Each client is sampled independently with q = 0.1 (Poisson, "
            "`privacy.sampling=poisson`), so epsilon is the add/remove-one-client guarantee of dp-accounting's RDP "
            f"accountant for {rounds} Poisson-subsampled Gaussians, at delta = {DELTA:g} (below 1/num_clients). For "
            f"each target epsilon the run picks the smallest z that reaches it after {rounds} rounds "
            "(`privacy.noise_multiplier=null`); 'epsilon reached' is what the run's accountant logged after its last "
            f"round. Fixed clipping uses C = {CLIP} and that z (the tables' noise multiplier: "
            f"{z_text(settings, cells, 'fixed')}). Adaptive clipping starts there and moves C "
            "towards the median update norm with its own noised count (std: the expected clients per round / 20), and "
            "its z for the deltas is raised so that the two together spend the same epsilon; the raise depends on the "
            f"count's noise, so it differs between the settings ({z_text(settings, cells, 'adaptive')}). The two "
            "settings differ in the cohort: a sum of 3 times as many clients under about the same noise. In the "
            "first, an ablation at "
            f"epsilon = 2 sets C 10x below and above ({', '.join(f'{c:g}' for c in MISSET)}), for fixed clipping and as "
            "adaptive clipping's starting point. "
            f"{rc.method_paragraph()} Differences below are against the non-private FedAvg (sample-weighted "
            "average, clients drawn without replacement: the platform's default), paired by seed (same partition "
            "and initial model; the DP rows sample clients by Poisson draws, so their sampled clients differ).\n\n"
            "## Verdict against the papers\n\n"
            + rc.verdict_table([(NOT_A_PAPER, None, "FedAvg")]) + "\n"
            + "\n".join(section(s, cells, plots, suffix) for s in settings))


def main(argv: list[str] | None = None) -> int:
    return rc.cli(DOC, argv, __doc__, settings_of, build)


if __name__ == "__main__":
    sys.exit(main())
