"""The results documents follow from their committed artefacts alone, and the statistics and run
plumbing behind them (scripts/results_common.py) do what docs/results/README.md says."""

from __future__ import annotations

import gzip
import importlib
import json
import math
import re
import shutil
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from scipy import stats

from .conftest import compose_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import results_common as rc  # scripts/ is not a package

# Most tests read the documents as rebuilt from their artefacts: every document is rebuilt once per module
# (the ``rebuilt`` fixture, about 20 s), so the module runs on one pytest-xdist worker.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("results_docs")]

# ----------------------------------------------------------------------------- the documents


@pytest.fixture(scope="module")
def rebuilt(tmp_path_factory) -> dict[str, str]:
    """The generated part of every registered document as ``--from-artefacts --no-plots`` writes it."""
    out = {}
    for doc in sorted(rc.DOCUMENTS):
        folder = tmp_path_factory.mktemp(doc)
        script, *args = rc.DOCUMENTS[doc]
        assert importlib.import_module(script).main([*args, "--from-artefacts", "--no-plots", "--out", str(folder)]) == 0, doc
        out[doc] = rc.generated_part((folder / f"{doc}.md").read_text())
    return out


@pytest.mark.parametrize("doc", sorted(rc.DOCUMENTS))
def test_document_rebuilds_from_its_artefacts_unchanged(doc, rebuilt):
    committed = (rc.DOCS / f"{doc}.md").read_text()
    assert rebuilt[doc] == rc.generated_part(committed)
    assert rc.MARKER in committed  # the hand-written findings follow the generated part
    for png in re.findall(r"\]\(([^)]+\.png)\)", committed):  # every linked plot is committed
        assert (rc.DOCS / png).is_file(), png


def test_artefacts_stay_small_and_name_no_machine_path():
    assert rc.artefact_bytes() < rc.MAX_ARTEFACT_BYTES
    for path in rc.DATA.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".gz"):
            text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
            assert str(rc.REPO) not in text and "/tmp/" not in text, path


# ----------------------------------------------------------------------------- statistics

A = {0: 0.70, 1: 0.64, 2: 0.69, 3: 0.73, 4: 0.66}
B = {1: 0.60, 2: 0.66, 3: 0.65, 4: 0.63, 5: 0.99}  # seed 5 has no partner in A, seed 0 none in B


def test_paired_interval_is_the_paired_t_test_over_common_seeds():
    iv = rc.paired(A, B)
    seeds = [1, 2, 3, 4]
    a, b = [A[s] for s in seeds], [B[s] for s in seeds]
    lo, hi = stats.t.interval(0.95, 3, loc=statistics.fmean(a) - statistics.fmean(b),
                              scale=stats.sem([x - y for x, y in zip(a, b)]))
    assert iv.n == 4
    assert iv.lo == pytest.approx(lo, abs=1e-12) and iv.hi == pytest.approx(hi, abs=1e-12)
    assert iv.p == pytest.approx(stats.ttest_rel(a, b).pvalue, abs=1e-12)


def test_reading_claims_a_direction_only_when_the_interval_excludes_zero():
    up = rc.interval([0.02, 0.03, 0.025, 0.028])
    down = rc.interval([-0.02, -0.03, -0.025])
    across = rc.interval([0.05, -0.01, 0.02])
    assert (up.sign, down.sign, across.sign) == (1, -1, 0)
    assert rc.reading(up) == "higher" and rc.reading(down) == "lower"
    assert rc.reading(across) == "no detectable difference"
    assert rc.reading(rc.interval([0.3])) == "too few seeds"
    assert rc.fmt_diff(across).startswith("+2.00 [") and rc.fmt_mean(rc.interval([0.5, 0.7])).startswith("60.00 ± ")


def _run(accs, every=2, name="r"):
    rows = []
    for i, a in enumerate(accs, 1):
        rows.append({"round": 2 * i - 1, "round_time_s": 1.0})
        rows.append({"round": 2 * i, "round_time_s": 3.0, "test_accuracy": a} if every == 2 else {"round": 2 * i})
    return {"name": name, "rows": rows}


def test_final_accuracy_is_the_mean_of_the_last_k_evaluations_never_the_best():
    run = _run([0.1, 0.9, 0.2, 0.3, 0.4, 0.5, 0.6])
    assert rc.final_accuracy(run) == pytest.approx((0.2 + 0.3 + 0.4 + 0.5 + 0.6) / 5)
    assert rc.final_accuracy(run, upto_round=10) == pytest.approx((0.1 + 0.9 + 0.2 + 0.3 + 0.4) / 5)
    assert rc.final_accuracy(run, k=2, upto_round=9) == pytest.approx((0.2 + 0.3) / 2)  # rounds 6 and 8
    with pytest.raises(ValueError, match="no test_accuracy"):
        rc.final_accuracy({"name": "x", "rows": [{"round": 1}]})


def test_equal_compute_round_and_cpu_per_round():
    def run(cpu, evaluated):
        rows = [{"round": i + 1, **({"test_accuracy": 0.5} if i in evaluated else {})} for i in range(len(cpu))]
        return {"rows": rows, "stats": {"row_cpu_s": cpu}}

    # increments 4 (start-up, skipped), 1, 5 (evaluated), 2 | 9 (evaluated), 3, 7: median of 1, 2, 3, 7
    runs = [run([10, 11, 16, 18], {2}), run([5, 14, 17, 24], {1})]
    assert rc.cpu_per_round(runs) == 2.5
    assert rc.cpu_per_round([run([0, 1, 5, 6], {0, 1, 2, 3})]) == 1  # every round evaluated: all increments
    with pytest.raises(ValueError, match="row_cpu_s"):
        rc.cpu_per_round([{"rows": [{}], "stats": {}}])
    evals = list(range(2, 101, 2))
    assert rc.equal_compute_round(1.6, 30, evals) == 48
    assert rc.equal_compute_round(1.75, 30, evals) == 52  # 52.5: a tie of 52 and 54 goes to the earlier
    assert rc.equal_compute_round(1.0, 30, evals) == 30
    assert rc.equal_compute_round(5.0, 30, evals) == 100


def _ten(centre: float) -> rc.Interval:
    return rc.interval([centre + 0.001 * (i - 4.5) for i in range(10)])


def test_verdicts():
    claim = rc.PaperClaim("X", "setting", None, 1, "smaller model")
    up, flat, down = _ten(0.02), _ten(0.0), _ten(-0.02)
    assert rc.verdict(claim, up)[0] == "direction only"
    assert rc.verdict(claim, flat) == ("not reproduced", "no detectable difference in our setting (the interval "
                                       "includes 0)")
    assert rc.verdict(claim, down)[0] == "not reproduced" and "opposite" in rc.verdict(claim, down)[1]
    assert rc.verdict(rc.PaperClaim("B", "s", None, None, ""), up)[0] == "not comparable"


def test_a_verdict_rests_on_ten_seeds_the_papers_comparison_and_its_budget():
    """Fewer than 10 paired seeds, a comparison the paper does not make, or a null result at a fraction of
    the paper's budget: 'untested' with the reason, never a verdict."""
    claim = rc.PaperClaim("X", "setting", None, 1, "", baselines=("FedAvg", "FedProx"))
    nine = rc.interval([0.02 + 0.001 * i for i in range(9)])
    assert nine.sign == 1 and rc.verdict(claim, nine, "FedAvg") == ("untested", "9 paired seeds; a verdict needs >= 10")
    v, why = rc.verdict(claim, _ten(0.02), "Top-k at equal bytes")
    assert v == "untested" and "FedAvg / FedProx" in why and "Top-k at equal bytes" in why
    v, why = rc.verdict(claim, _ten(0.02), "FedAvg")
    assert v == "direction only" and why.endswith("against FedAvg only: FedProx untested")
    short = replace(claim, budget=0.1)
    assert rc.verdict(short, _ten(-0.02), "FedAvg")[0] == rc.verdict(short, _ten(0.0), "FedAvg")[0] == "untested"
    assert "10% of the paper's budget:" in rc.verdict(short, _ten(0.0), "FedAvg")[1]
    assert rc.verdict(short, _ten(0.02), "FedAvg")[0] == "direction only"
    named = replace(short, budget_of="local epochs 4 of 40")  # the reason says which budget fell short
    assert "10% of the paper's budget (local epochs 4 of 40): no detectable" in rc.verdict(named, _ten(0.0), "FedAvg")[1]
    # a direction found short of the paper's budget says at what budget (and none is said at the full one)
    assert rc.verdict(named, _ten(0.02), "FedAvg")[1].startswith(
        "our interval excludes 0 on the paper's side at 10% of the paper's budget (local epochs 4 of 40);")
    assert "budget" not in rc.verdict(claim, _ten(0.02), "FedAvg")[1]


def test_a_verdict_compares_tuned_against_tuned():
    """A comparison with a row not tuned on a validation split is 'untested' naming the rows, whatever the
    interval; rows marked tuned get their verdict; a GPU preset runs the paper's own hyper-parameters."""
    claim = rc.PaperClaim("X", "setting", None, 1, "")
    rows = [rc.Row("fedavg", "FedAvg", "fedavg", [], [0]), rc.Row("x", "X", "fedavg", [], [0])]
    s = rc.Setting("d", "digits", ["dataset=digits", "train.lr=0.05"], 4, rows, {"fedavg": ["algorithm=fedavg"]},
                   paper={"baseline": claim})
    ((c, iv, against),) = [r for r in rc.verdict_rows(s, {}, {"x": _ten(0.02)}, ["x"])]
    v, why = rc.verdict(c, iv, against)
    assert v == "untested" and why.startswith("X and FedAvg not tuned (learning rate 0.05")
    assert "budget" not in why  # on the paper's side: the budget does not matter
    # untuned and short of the paper's budget with a result that is not the paper's: both reasons are given
    short = replace(c, budget=0.1)
    assert rc.verdict(short, _ten(0.0), against)[1].endswith("tuned against tuned; run at 10% of the paper's budget as well")
    assert "budget" not in rc.verdict(short, _ten(0.02), against)[1]
    assert "budget as well" in rc.verdict(short, _ten(-0.02), against)[1]
    tuned = replace(s, rows=[replace(r, tuned=True) for r in rows], chosen={"fedavg": ("train.lr=0.1",)},
                    tuning=rc.Tuning({"fedavg": {"train.lr": (0.1,)}}, (100,)))
    ((c, iv, against),) = rc.verdict_rows(tuned, {}, {"x": _ten(0.02)}, ["x"])
    assert rc.verdict(c, iv, against)[0] == "direction only"
    assert rc.untuned_reason(replace(s, preset="fedimpro_fmnist"), "x", "fedavg") == ""
    # a learning rate chosen at the grid's edge may not be the best: that row counts as not tuned; an edge in
    # another key (FedProx's fixed mu grid) does not
    grid = {"fedavg": {"train.lr": (0.01, 0.1, 1.0), "algorithm.mu": (0.001, 0.01)}}
    inside = replace(tuned, chosen={"fedavg": ("train.lr=0.1", "algorithm.mu=0.001")}, tuning=rc.Tuning(grid, (100,)))
    assert rc.untuned_reason(inside, "x", "fedavg") == ""
    assert rc.grid_edges(inside, "fedavg") == ["algorithm.mu"]
    edge = replace(inside, chosen={"fedavg": ("train.lr=0.01", "algorithm.mu=0.01")})
    ((c, iv, against),) = rc.verdict_rows(edge, {}, {"x": _ten(0.02)}, ["x"])
    v, why = rc.verdict(c, iv, against)
    assert v == "untested" and why.startswith("X's train.lr=0.01 algorithm.mu=0.01 (at the grid's edge in train.lr")


def test_a_main_table_row_is_over_the_seeds_it_shares_with_fedavg():
    """FedAvg with 10 seeds, FedProx with 5: FedProx's row sets its 5-seed mean against FedAvg's on the
    same 5 seeds (never FedAvg's 10-seed mean) and says 5 seeds."""
    def cell(accs):
        return {seed: {"name": f"s{seed}", "rows": [{"round": 1}, {"round": 2, "test_accuracy": a}], "stats": {"cpu_s": 1.0,
                "row_cpu_s": [0.0, 1.0]}} for seed, a in accs.items()}
    fedavg = {s: 0.5 + 0.01 * s for s in range(10)}
    fedprox = {s: fedavg[s] + 0.02 + 0.001 * s for s in range(5)}
    s = rc.Setting("x", "x", ["dataset=digits"], 1, [rc.Row("fedavg", "FedAvg", "fedavg", [], list(range(10))),
                                                    rc.Row("fedprox", "FedProx", "fedprox", [], list(range(5)))],
                   {"fedavg": [], "fedprox": []})
    table, diffs = rc.main_table(s, {"x/fedavg": cell(fedavg), "x/fedprox": cell(fedprox)}, ["fedavg", "fedprox"])
    row = next(line for line in table.splitlines() if line.startswith("| FedProx"))
    assert row.startswith(f"| FedProx | 5 | {rc.fmt_mean(rc.interval([fedprox[k] for k in range(5)]))} | "
                          f"{rc.fmt_mean(rc.interval([fedavg[k] for k in range(5)]))} | {rc.fmt_diff(diffs['fedprox'])} |")
    assert diffs["fedprox"].n == 5
    _check_tables("x", table)


# ----------------------------------------------------------------------------- the documents' claims


def _tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table of ``text``: (header, rows) with the cells stripped."""
    out, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---") and (
                i == 0 or not lines[i - 1].startswith("|")):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip().strip("|").split(" | ")])
            out.append(([c.strip() for c in line.strip().strip("|").split(" | ")], rows))
    return out


def _points(cell: str) -> float:
    return float(cell.split()[0])


def _check_tables(doc: str, text: str) -> None:
    for header, rows in _tables(text):
        for row in rows:
            assert len(row) == len(header) and all(row), f"{doc}: an empty cell in {row}"
        if "verdict" in header:  # a verdict rests on >= 10 paired seeds against a named null
            v, n, null = header.index("verdict"), header.index("seeds"), header.index("null (0 = equal to)")
            for row in rows:
                if row[v] in ("**direction only**", "**not reproduced**"):
                    assert int(row[n]) >= rc.MIN_SEEDS, f"{doc}: {row[0]} rests on {row[n]} seeds"
                    assert row[null] not in ("", "-"), f"{doc}: {row[0]} names no null"
        if any("minus" in h or "paired" in h for h in header):  # a paired difference says its seed count
            assert any("seeds" in h for h in header), f"{doc}: no seed count in {header}"
        if "epsilon reached" in header:  # a DP row's null is its clip-only row (same sampling, no noise)
            c, e = header.index("minus clip only (epsilon = inf, paired; seeds)"), header.index("epsilon reached")
            for row in rows:
                if row[e] not in ("inf", "-"):
                    assert row[c] != "-", f"{doc}: {row[0]} has no clip-only null"
        acc = [h for h in header if h.startswith(("accuracy (mean of the last", "test accuracy (mean"))]
        for d, h in enumerate(header):  # a row's mean against its null's on the same seeds, never a mixed pair
            if not (h.startswith("minus ") and h.endswith(" (paired, 95% CI)")):
                continue
            null = h[len("minus "):-len(" (paired, 95% CI)")]
            assert f"{null} on the same seeds" in header and acc, f"{doc}: {h} without '{null} on the same seeds'"
            a, b = header.index(acc[0]), header.index(f"{null} on the same seeds")
            for row in rows:
                if row[d] != "-":  # where the pair leaves seeds out, the row's own mean there is given
                    mine = row[b].split("(this row there: ")[1] if "(this row there: " in row[b] else row[a]
                    assert abs(_points(mine) - _points(row[b]) - _points(row[d])) <= 0.011, (
                        f"{doc}: {row[0]} mixes seed sets: {mine} - {row[b]} != {row[d]}")


@pytest.mark.parametrize("doc", sorted(rc.DOCUMENTS))
def test_document_claims_are_no_wider_than_their_data(doc, rebuilt):
    """Verdicts on >= 10 seeds against a named null, no empty cells, rows over shared seeds (the
    generators' output, so a defect in a generator shows here)."""
    _check_tables(doc, rebuilt[doc])


# ----------------------------------------------------------------------------- presets, data, documents


@pytest.mark.parametrize("preset", ["fedimpro_cifar10", "vhl_cifar10", "fedimpro_femnist"])
def test_preset_overrides_compose_the_preset_and_let_another_algorithm_run_in_it(preset):
    whole = OmegaConf.to_container(compose_config(f"+experiment={preset}"), resolve=True)
    assert OmegaConf.to_container(compose_config(*rc.preset_overrides(preset, with_algorithm=True)),
                                  resolve=True) == whole
    other = OmegaConf.to_container(compose_config(*rc.preset_overrides(preset), "algorithm=fedavg"), resolve=True)
    assert other["algorithm"]["name"] == "fedavg"
    assert {k: v for k, v in other.items() if k != "algorithm"} == {k: v for k, v in whole.items() if k != "algorithm"}


def test_gpu_plan_lists_the_papers_settings_and_stops_on_missing_data(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FL_DATA_ROOT", str(tmp_path))  # an empty data root
    het = importlib.import_module("results_heterogeneity")
    assert het.main(["--preset", "gpu", "--plan", "--artefacts", str(tmp_path / "art")]) == 2
    out = capsys.readouterr().out
    assert "cifar10_fedimpro/fedimpro/s0: python -m fl_platform.run +experiment=fedimpro_cifar10" in out
    baseline = next(line for line in out.splitlines() if line.startswith("cifar10_vhl/fedavg/s0:"))
    assert "dataset=cifar10" in baseline and "train.momentum=0.9" in baseline and "algorithm=fedavg" in baseline
    for setting in ("cifar10_vhl", "cifar10_fedimpro"):  # the papers' baselines, 10 seeds each
        assert all(f"{setting}/{tag}/s9:" in out for tag in ("fedprox", "scaffold", "fednova")), setting
    assert "MISSING" in out and "dataset 'cifar10' not found" in out
    assert het.main(["--preset", "gpu", "--artefacts", str(tmp_path / "art")]) == 2  # runs nothing
    assert not (tmp_path / "art").exists()


def test_check_data_wants_every_writer_a_setting_uses(monkeypatch):
    import fl_platform.datasets.registry as registry

    class Source:
        has_groups, num_groups = True, 105

    monkeypatch.setattr(registry, "load_source", lambda name: Source())
    assert rc.check_data(["femnist"], {"femnist": 105}) == []
    (msg,) = rc.check_data(["femnist"], {"femnist": 3400})
    assert "holds 105 writers" in msg and "needs 3400" in msg


def test_document_keeps_its_hand_written_findings(tmp_path):
    path = tmp_path / "doc.md"
    rc.write_document(path, "# generated 1\n", "default findings\n")
    assert path.read_text() == f"# generated 1\n\n{rc.MARKER}\ndefault findings\n"
    path.write_text(path.read_text().replace("default findings", "hand-written"))
    rc.write_document(path, "# generated 2\n")
    assert path.read_text() == f"# generated 2\n\n{rc.MARKER}\nhand-written\n"
    assert rc.generated_part(path.read_text()) == "# generated 2\n\n"


_QUOTED = re.compile(r"[+-]?\d+\.\d+ \[[+-]?\d+\.\d+, [+-]?\d+\.\d+\]|\d+\.\d+ ± \d+\.\d+")


def unsourced(findings: str, generated: dict[str, str], doc: str) -> list[str]:
    """The intervals and means the hand-written findings quote that no table gives: each must be in the
    document's generated part, or in that of a document its paragraph names (``<doc>.md``), or its
    paragraph must say where it comes from (``commit <hash>`` of an earlier version, or ``recomputed``
    from the artefacts). A number left over from superseded runs fails here."""
    out = []
    for para in re.split(r"\n\s*\n|\n- ", findings):
        named = [d for d in generated if f"{d}.md" in para]
        if re.search(r"commit [0-9a-f]{7}|recomputed", para):
            continue
        out += [m for m in _QUOTED.findall(para) if not any(m in generated[d] for d in [doc, *named])]
    return out


@pytest.mark.parametrize("doc", sorted(rc.DOCUMENTS))
def test_findings_quote_only_numbers_the_tables_give(doc, rebuilt):
    findings = (rc.DOCS / f"{doc}.md").read_text().split(rc.MARKER, 1)[1]
    assert unsourced(findings, rebuilt, doc) == [], f"{doc}: numbers quoted that no table gives"
    stale = findings.replace("-1.73 [-2.44, -1.02]", "-1.63 [-2.44, -1.02]")  # a number edited by hand ...
    if stale != findings:  # ... is caught, unless its paragraph names its source
        assert "-1.63 [-2.44, -1.02]" in unsourced(stale, rebuilt, doc)


# ----------------------------------------------------------------------------- runs and artefacts


def test_a_run_leaves_an_artefact_that_loads_back_and_is_not_rerun(tmp_path):
    job = rc.Job("digits/fedavg", 3, ["dataset=digits", "model=mlp", "model.hidden=[8]", "num_clients=5",
                                      "clients_per_round=5", "rounds=2", "train.epochs=1", *rc.TAIL, "seed=3"])
    runs, art = tmp_path / "runs", tmp_path / "art"
    stats_ = rc.run_job(job, runs, art, rc.code_snapshot("worktree"))
    assert stats_["cpu_s"] > 0 and stats_["commit"].endswith("+worktree") and stats_["overrides"] == job.overrides
    cpu = stats_["row_cpu_s"]  # the process's CPU time at each metrics row
    assert len(cpu) == 2 and 0 < cpu[0] <= cpu[1] <= stats_["cpu_s"]
    folder = art / "digits" / "fedavg" / "s3"
    assert sorted(p.name for p in folder.iterdir()) == ["config.yaml.gz", "metrics.jsonl.gz", "run.json", "summary.json"]
    first = (folder / "metrics.jsonl.gz").read_bytes()
    rows = [json.loads(x) for x in (runs / job.name / "metrics.jsonl").read_text().splitlines()]
    assert [json.loads(x) for x in gzip.decompress(first).decode().splitlines()] == rows
    (run,) = rc.load_cells(art)["digits/fedavg"].values()
    assert run["rows"] == rows and run["summary"]["seed"] == 3 and run["config"]["num_clients"] == 5
    rc.export_artefact(runs / job.name, folder)
    assert (folder / "metrics.jsonl.gz").read_bytes() == first  # no timestamp in the gzip header
    stamp = runs / job.name / "run.json"  # a finished run of other code is not reused: it runs again
    stamp.write_text(json.dumps({**json.loads(stamp.read_text()), "commit": "another"}))
    shutil.rmtree(folder)
    assert rc.run_job(job, runs, art, rc.code_snapshot("worktree"))["commit"] == stats_["commit"]
    shutil.rmtree(runs)
    rc.run_job(job, runs, art, rc.code_snapshot("worktree"))  # the artefact exists: nothing runs
    assert not runs.exists()
    (runs / "x").mkdir(parents=True)
    for name in ("summary.json", "metrics.jsonl"):
        shutil.copy(folder / name if name != "metrics.jsonl" else folder / "run.json", runs / "x" / name)
    (runs / "x" / "config.yaml").write_bytes(gzip.decompress((folder / "config.yaml.gz").read_bytes()))
    (runs / "x" / "run.json").write_text(json.dumps({"note": f"{tmp_path}/somewhere"}))
    with pytest.raises(ValueError, match="machine path"):
        rc.export_artefact(runs / "x", tmp_path / "refused")


def test_a_tuning_runs_artefact_keeps_the_validation_columns_only(tmp_path):
    """What the tuning choice reads and nothing else: no test metric reaches a tuning run's artefact (so no
    table can be built from one), and the artefacts stay small (a tuning run's metrics are ~0.5 KB, not ~6 KB)."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"round": 1, "bytes_up": 3, "test_accuracy": 0.5, "val_accuracy": 0.4, "val_loss": 1.5, "train_loss": 2.0},
            {"round": 2, "bytes_up": 3, "train_loss": 1.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name in ("summary.json", "run.json"):
        (run / name).write_text("{}")
    (run / "config.yaml").write_text("seed: 0\n")
    rc.export_artefact(run, tmp_path / "art" / "tune" / "s0", rc.TUNING_METRICS)
    rc.export_artefact(run, tmp_path / "art" / "row" / "s0")
    cells = rc.load_cells(tmp_path / "art")
    assert cells["tune"][0]["rows"] == [{"round": 1, "val_accuracy": 0.4, "val_loss": 1.5}, {"round": 2}]
    assert cells["row"][0]["rows"] == rows


def test_the_committed_tuning_artefacts_hold_no_test_metric():
    tuning = [p for p in rc.DATA.rglob("metrics.jsonl.gz") if "/tune/" in p.as_posix()]
    assert tuning
    for path in tuning:
        rows = [json.loads(x) for x in gzip.decompress(path.read_bytes()).decode().splitlines()]
        diverged = json.loads((path.parent / "run.json").read_text()).get("diverged")  # (may stop before evaluating)
        assert set().union(*rows) <= set(rc.TUNING_METRICS) and (diverged or any("val_accuracy" in r for r in rows)), path


def _fake_artefact(folder, accs, cpu_per_round, overrides=()):
    """A run's artefact with given evaluations (every other round), CPU cost per round and CLI overrides (the
    plan's: a document refuses an artefact made with other settings than its row plans)."""
    folder.mkdir(parents=True)
    rows = [{"round": r, **({"test_accuracy": accs[r // 2 - 1]} if r % 2 == 0 else {})} for r in range(1, 2 * len(accs) + 1)]
    (folder / "metrics.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in rows).encode()))
    (folder / "summary.json").write_text(json.dumps({"seed": int(folder.name[1:])}))
    (folder / "config.yaml.gz").write_bytes(gzip.compress(b"seed: 0\n"))
    cpu = [5 + cpu_per_round * (i + 1) for i in range(len(rows))]
    (folder / "run.json").write_text(json.dumps({"cpu_s": cpu[-1], "commit": "abc", "row_cpu_s": cpu,
                                                 "overrides": list(overrides)}))


def test_the_gpu_document_builds_with_the_same_sections(tmp_path):
    """The --preset gpu document from (synthetic) artefacts: verdicts follow the intervals."""
    het = importlib.import_module("results_heterogeneity")
    art = tmp_path / "art"
    plan = {j.name: j.overrides for j in rc.setting_jobs(het.settings_of("full", "gpu"))}
    for seed in range(10):
        for tag, gain in (("fedavg", 0.0), ("fedavg_shuffle", 0.001 * (seed - 2)), ("fedprox", 0.0),
                          ("scaffold", 0.0), ("fedimpro", 0.03 + 0.002 * seed)):
            name = f"cifar10_fedimpro/{tag}/s{seed}"
            _fake_artefact(art / name, [0.5 + 0.01 * seed + gain] * 6, 1.0, plan[name])
        for tag, gain in (("fedavg", 0.0), ("fedavg_shuffle", 0.0), ("vhl", 0.01 * (seed - 4.5))):
            name = f"cifar10_vhl/{tag}/s{seed}"
            _fake_artefact(art / name, [0.6 + 0.01 * seed + gain] * 6, 2.0, plan[name])
    assert het.main(["--preset", "gpu", "--from-artefacts", "--artefacts", str(art), "--out", str(tmp_path),
                     "--no-plots"]) == 0
    text = (tmp_path / "heterogeneity_gpu.md").read_text()
    verdicts = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if "**" in line}
    assert "**direction only**" in verdicts["FedImpro (cifar10_fedimpro)"]
    assert "**not reproduced**" in verdicts["VHL (cifar10_vhl)"]
    assert "**not comparable**" in verdicts["SCAFFOLD (cifar10_fedimpro)"]
    assert "| FedImpro | 10 | 58.40 ± 2.60 | 54.50 ± 2.17 | +3.90 [+3.47, +4.33] | <0.001 | higher |" in text  # paired
    assert "- FedProx: `algorithm=fedprox algorithm.mu=0.1`" in text and "- FedImpro: `+experiment=fedimpro_cifar10`" in text
    assert text.count("Not run yet.") == 3  # the FMNIST and FEMNIST presets


# ----------------------------------------------------------------------------- presets against their cards

PRESETS = sorted(p.stem for p in (rc.REPO / "conf" / "experiment").glob("*.yaml"))
DIFF_HEAD = "# Differences from the spec card ("


def _differences(text: str) -> tuple[str, list[str]]:
    """A preset's closing comment block: (its card, its items, continuation lines joined)."""
    assert DIFF_HEAD in text, "no 'Differences from the spec card' block"
    i = text.index(DIFF_HEAD)
    card, items = text[i + len(DIFF_HEAD):].split(")", 1)[0], []
    for line in text[i:].splitlines()[1:]:
        if line.startswith("#   - "):
            items.append(line[6:].strip())
        elif line.startswith("#     ") and items:
            items[-1] += " " + line[6:].strip()
    return card, items


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_composes_and_lists_its_differences_from_its_card(preset):
    """Every preset composes, names an existing spec card and lists its differences from it, and
    docs/results/README.md lists the same differences under the preset's name."""
    assert compose_config(f"+experiment={preset}").rounds >= 1
    card, items = _differences((rc.REPO / "conf" / "experiment" / f"{preset}.yaml").read_text())
    assert card.startswith("specs/") and card.endswith(".md") and items, (card, items)
    readme = (rc.DOCS / "README.md").read_text()
    head = f"### `{preset}` ({card})\n\n"
    assert head in readme, f"docs/results/README.md has no section {head.strip()}"
    section = readme.split(head, 1)[1].split("\n\n", 1)[0]
    assert section.splitlines() == [f"- {x}" for x in items]


def test_verdict_rows_of_one_claim_name_each_others_rows():
    """FedImpro's claim (above FedAvg, FedProx, SCAFFOLD, FedNova) with its own row per baseline: each row
    names the baselines with rows beside it and calls only the ones without (or under 10 seeds) untested."""
    claim = rc.PaperClaim("X", "setting", None, 1, "", baselines=("FedAvg", "FedProx", "SCAFFOLD", "FedNova"))
    nine = rc.interval([0.02 + 0.001 * i for i in range(9)])
    table = rc.verdict_table([(claim, _ten(0.02), "FedAvg"), (replace(claim, algorithm="X vs FedProx"), _ten(0.02),
                                                               "FedProx"),
                              (replace(claim, algorithm="X vs SCAFFOLD"), nine, "SCAFFOLD")])
    first, second, third = (line for line in table.splitlines()[2:])
    assert first.endswith("against FedProx: the rows beside it; SCAFFOLD, FedNova untested |")
    assert second.endswith("against FedAvg: the rows beside it; SCAFFOLD, FedNova untested |")
    assert "**untested** | 9 paired seeds" in third
    other = rc.PaperClaim("Y", "another setting", None, 1, "", baselines=claim.baselines)  # another claim: not beside
    assert rc.verdict_table([(claim, _ten(0.02), "FedAvg"), (other, _ten(0.02), "FedProx")]).splitlines()[2].endswith(
        "against FedAvg only: FedProx, SCAFFOLD, FedNova untested |")


def test_only_selects_the_missing_runs_matching_a_pattern(tmp_path, capsys):
    base = importlib.import_module("results_baselines")
    assert base.main(["--plan", "--only", "shards/tune/fednova/train.lr0.05/*", "dirichlet/tune/fedavg/*",
                      "dirichlet/fedavg/s3", "--artefacts", str(tmp_path / "art")]) == 0
    out = capsys.readouterr().out
    names = [line.split(":")[0] for line in out.splitlines() if ": python -m" in line]
    # the tuning runs only: dirichlet/fedavg/s3 waits for FedAvg's tuning runs
    assert names == [*(f"dirichlet/tune/fedavg/train.lr{lr:g}/s{k}" for lr in base.LRS for k in (100, 101)),
                     "shards/tune/fednova/train.lr0.05/s100", "shards/tune/fednova/train.lr0.05/s101"]
    assert "20 tuned rows wait for their tuning runs" in out


def test_only_refuses_a_pattern_that_matches_no_run_of_the_plan(tmp_path, capsys):
    """A mistyped row would otherwise plan nothing and read '0 runs missing', as if every run were made."""
    base = importlib.import_module("results_baselines")
    assert base.main(["--plan", "--only", "dirichlet/fedavg/s3", "dirichlet/fedavgg/*",
                      "--artefacts", str(tmp_path / "art")]) == 2
    out, err = capsys.readouterr()
    assert "runs missing" not in out and "--only 'dirichlet/fedavgg/*' matches no run of the plan" in err
    assert "dirichlet/fedavg/s3" not in err.split("its rows:")[0]  # a waiting tuned row's run is in the plan


# ----------------------------------------------------------------------------- tuning on a validation split


def _val_run(val, test):
    """A run whose last five evaluations are ``val`` on the validation split and ``test`` on the test set."""
    return {"name": "r", "rows": [{"round": r, "val_accuracy": val, "test_accuracy": test} for r in range(1, 6)],
            "stats": {}}


def _tuned_setting():
    tuning = rc.Tuning({"fedavg": {"train.lr": (0.05, 0.1)},
                        "fedprox": {"train.lr": (0.05, 0.1), "algorithm.mu": (0.01, 0.1)}}, (100, 101))
    rows = [rc.Row("fedavg", "FedAvg", "fedavg", [], [0, 1], tuned=True), rc.noise_row([0, 1], tuned=True),
            rc.Row("fedprox", "FedProx", "fedprox", [], [0, 1], tuned=True)]
    return rc.Setting("d", "digits", ["dataset=digits", "train.lr=0.05"], 4, rows,
                      {"fedavg": ["algorithm=fedavg"], "fedprox": ["algorithm=fedprox", "algorithm.mu=0.01"]},
                      tuning=tuning)


def _tuning_cells(scores):
    """Tuning runs of ``_tuned_setting`` with (val, test) accuracies per (algorithm, combination) and seed."""
    return {f"d/tune/{a}/{rc.combo_tag(combo)}": {seed: _val_run(*vt) for seed, vt in by_seed.items()}
            for (a, combo), by_seed in scores.items()}


def test_tuning_chooses_on_the_validation_split_never_the_test_set():
    s = _tuned_setting()
    lo, hi = ("train.lr=0.05",), ("train.lr=0.1",)
    prox = {c: {100: (0.5, 0.5), 101: (0.5, 0.5)} for c in s.tuning.combos("fedprox")}
    prox[("train.lr=0.1", "algorithm.mu=0.01")] = {100: (0.7, 0.1), 101: (0.6, 0.1)}  # best on val, worst on test
    # FedAvg: lr 0.1 better on validation (mean over both seeds: 0.75 vs 0.70), lr 0.05 far better on test
    scores = {("fedavg", lo): {100: (0.80, 0.99), 101: (0.60, 0.99)}, ("fedavg", hi): {100: (0.70, 0.10), 101: (0.80, 0.10)},
              **{("fedprox", c): v for c, v in prox.items()}}
    rc.choose_tuned([s], _tuning_cells(scores))
    assert s.chosen == {"fedavg": hi, "fedprox": ("train.lr=0.1", "algorithm.mu=0.01")}
    assert rc.tuning_scores(s, _tuning_cells(scores), "fedavg") == {lo: pytest.approx(0.70), hi: pytest.approx(0.75)}
    # the tuned rows run with the winner (the noise row with FedAvg's), last on the command line
    jobs = {j.name: j for j in rc.setting_jobs([s])}
    assert rc.resolved(jobs["d/fedavg/s0"].overrides)["train.lr"] == "0.1"
    assert rc.resolved(jobs[f"d/{rc.NOISE}/s1"].overrides)["train.lr"] == "0.1"
    assert rc.resolved(jobs["d/fedprox/s0"].overrides) | {} == {**rc.resolved(jobs["d/fedprox/s0"].overrides),
                                                                "train.lr": "0.1", "algorithm.mu": "0.01"}
    # the tuning runs carry the validation split and never stop early; every combination on every tuning seed
    tune = [j for j in jobs.values() if "/tune/" in j.name]
    assert len(tune) == (2 + 4) * 2 and all(rc.resolved(j.overrides)["early_stop.patience"] == "5" for j in tune)
    # they, and only they, are marked as tuning runs (their artefacts keep the validation columns only)
    assert all(j.metrics == (rc.TUNING_METRICS if "/tune/" in j.name else None) for j in jobs.values())
    # a tie goes to the first in grid order
    scores[("fedavg", hi)] = scores[("fedavg", lo)]
    rc.choose_tuned([s], _tuning_cells(scores))
    assert s.chosen["fedavg"] == lo


def test_a_grid_point_whose_training_diverged_is_never_chosen():
    s = _tuned_setting()
    lo, hi = ("train.lr=0.05",), ("train.lr=0.1",)
    prox = {c: {100: (0.5, 0.5), 101: (0.5, 0.5)} for c in s.tuning.combos("fedprox")}
    scores = {("fedavg", lo): {100: (0.6, 0.6), 101: (0.6, 0.6)}, ("fedavg", hi): {100: (0.9, 0.9), 101: (0.9, 0.9)},
              **{("fedprox", c): v for c, v in prox.items()}}
    cells = _tuning_cells(scores)
    cells["d/tune/fedavg/train.lr0.1"][101]["stats"] = {"diverged": "NonFiniteError: ..."}  # one seed diverged
    rc.choose_tuned([s], cells)
    assert s.chosen["fedavg"] == lo and rc.tuning_scores(s, cells, "fedavg")[hi] == -math.inf
    assert "| FedAvg | **60.00** | diverged |" in rc.tuning_table(s, cells, {"fedavg": "FedAvg"})
    cells["d/tune/fedavg/train.lr0.05"][100]["stats"] = {"diverged": "NonFiniteError: ..."}
    with pytest.raises(ValueError, match="diverged at every fedavg grid point"):
        rc.choose_tuned([s], cells)


def _fake_platform(code, error: str):
    """A stand-in for ``python -m fl_platform.run`` in ``code``: one metrics row, then ``error`` and exit 1."""
    (code / "fl_platform").mkdir(parents=True, exist_ok=True)
    (code / "fl_platform" / "__init__.py").write_text("")
    (code / "fl_platform" / "run.py").write_text(
        "import json, pathlib, sys\n"
        "out = pathlib.Path(next(a for a in sys.argv if a.startswith('hydra.run.dir=')).split('=', 1)[1])\n"
        "(out / 'config.yaml').write_text('seed: 0\\n')\n"
        "(out / 'metrics.jsonl').write_text(json.dumps({'round': 1, 'test_accuracy': 0.2, 'val_accuracy': 0.1}) + '\\n')\n"
        f"print({error!r}, file=sys.stderr)\n"
        "sys.exit(1)\n")


def test_a_diverged_run_is_recorded_any_other_failure_fails(tmp_path):
    code = (tmp_path / "code", "c0")
    _fake_platform(code[0], "error: NonFiniteError: client 2 in round 2: the training loss became nan")
    tune = rc.Job("d/tune/fedavg/train.lr0.2", 100, ["x=1"], rc.TUNING_METRICS)
    stats_ = rc.run_job(tune, tmp_path / "runs", tmp_path / "art", code)
    assert stats_["diverged"] == "NonFiniteError: client 2 in round 2: the training loss became nan"
    run = rc.load_cells(tmp_path / "art")["d/tune/fedavg/train.lr0.2"][100]
    assert run["rows"] == [{"round": 1, "val_accuracy": 0.1}] and run["summary"] == {"diverged": stats_["diverged"]}
    # a table row's diverged run is a result too: recorded with its metrics up to the divergence
    assert rc.run_job(rc.Job("d/fedavg", 0, ["x=1"]), tmp_path / "runs", tmp_path / "art", code)["diverged"]
    assert rc.load_cells(tmp_path / "art")["d/fedavg"][0]["rows"] == [
        {"round": 1, "test_accuracy": 0.2, "val_accuracy": 0.1}]
    # run.json keeps the machine (CPU model, torch build): the same code elsewhere may differ in its last digits
    cells = rc.load_cells(tmp_path / "art")
    here = f"{rc.machine()['cpu']} with torch {rc.machine()['torch']}"
    assert stats_["machine"] == rc.machine() and set(rc.machine()) == {"cpu", "torch"}
    assert rc.machines(cells) == f", on {here} (2 runs)"
    del cells["d/fedavg"][0]["stats"]["machine"]  # made before run.json kept it
    assert rc.machines(cells) == ", on " + ", ".join(sorted([f"{here} (1 run)", "a machine not recorded (1 run)"]))
    del cells["d/tune/fedavg/train.lr0.2"][100]["stats"]["machine"]
    assert rc.machines(cells) == ""  # no run records one: the provenance line is as before
    _fake_platform(code[0], "error: ValueError: train.lr: must be > 0")
    with pytest.raises(RuntimeError, match=re.escape("run d/tune/fedavg/train.lr0.2/s101 failed")):
        rc.run_job(replace(tune, seed=101), tmp_path / "runs", tmp_path / "art", code)
    with pytest.raises(RuntimeError, match=re.escape("run d/fedavg/s1 failed")):
        rc.run_job(rc.Job("d/fedavg", 1, ["x=1"]), tmp_path / "runs", tmp_path / "art", code)


def _ten_seed_setting() -> rc.Setting:
    """_tuned_setting with a claim per row and seeds 0-9 for every row."""
    s = _tuned_setting()
    s.paper = {"baseline": rc.PaperClaim("X", "setting", None, None, ""), "fedprox": rc.PaperClaim("P", "s", None, 1, "")}
    for row in s.rows:
        row.seeds = list(range(10))
    return s


def _five_rounds(acc: float, **stats: Any) -> rc.Run:
    """A run at accuracy ``acc`` in each of 5 rounds; ``stats`` e.g. diverged=... as run_job records it."""
    return {"name": "r", "rows": [{"round": r, "test_accuracy": acc} for r in range(1, 6)],
            "stats": {"cpu_s": 1.0, "row_cpu_s": [0.2, 0.4, 0.6, 0.8, 1.0], **stats}}


def test_a_rows_diverged_seed_is_named_never_averaged_and_its_verdicts_are_untested():
    s, seeds, run = _ten_seed_setting(), list(range(10)), _five_rounds
    cells = {"d/fedavg": {k: run(0.5 + 0.01 * k) for k in seeds},
             "d/fedprox": {k: run(0.6 + 0.01 * k) for k in seeds}}
    cells["d/fedprox"][7] = run(0.01, diverged="NonFiniteError: client 3 in round 9: the training loss became nan")
    runs = rc.setting_runs(s, cells)
    assert sorted(runs["fedprox"]) == [k for k in seeds if k != 7] and len(runs["fedavg"]) == 10
    text = rc.missing_runs(s, cells)
    # made (never run again): only the noise row, which has no runs here, is still to be made
    assert text.startswith("Planned runs not made yet: FedAvg, other minibatch orders (noise floor) (seeds 0-9).\n\n"
                           "Runs whose training diverged")
    assert "FedProx (seed 7: `NonFiniteError: client 3 in round 9" in text
    d = rc.paired(rc.accuracies(runs["fedprox"]), rc.accuracies(runs["fedavg"]))
    assert d.n == 9 and d.mean == pytest.approx(0.10)  # the diverged seed's 1% never enters the difference
    (claim, iv, null), = rc.verdict_rows(s, cells, {"fedprox": d}, ["fedprox"])
    assert iv is d and null == "FedAvg"
    assert claim.diverged == "FedProx diverged on 1 of 10 seeds"
    (header, rows), = _tables(rc.main_table(s, cells, ["fedavg", "fedprox"])[0])  # the seeds column says so too
    assert [r[header.index("seeds")] for r in rows] == ["10", "9 (+1 diverged)"]
    assert rc.verdict(claim, replace(d, n=10), null) == (
        "untested", "FedProx diverged on 1 of 10 seeds (training became non-finite at the chosen values); a verdict "
                    "needs every seed to finish")



def test_a_row_whose_every_seed_diverged_keeps_an_untested_verdict_row_and_not_comparable_names_divergence():
    s, seeds, run = _ten_seed_setting(), list(range(10)), _five_rounds
    cells = {"d/fedavg": {k: run(0.5 + 0.01 * k) for k in seeds},
             "d/fedprox": {k: run(0.01, diverged=f"NonFiniteError: round {20 + k}") for k in seeds}}
    table, diffs = rc.main_table(s, cells, ["fedavg", "fedprox"])
    assert "fedprox" not in diffs  # no seed finished: no difference to pair, and no main-table row
    assert [r[0] for r in _tables(table)[0][1]] == ["FedAvg"]
    rows = rc.verdict_rows(s, cells, diffs, ["fedavg", "fedprox"])
    assert [r[0].algorithm for r in rows] == ["X (d)", "P (d)"]  # the row stays in the verdict table
    claim, iv, null, cell = rows[1]
    assert iv is None and null == "FedAvg" and cell == "none: diverged on 10 of 10 seeds that ran"
    (header, lines), = _tables(rc.verdict_table(rows))
    line = lines[1]
    assert line[header.index("ours (paired, 95% CI)")] == cell and line[header.index("verdict")] == "**untested**"
    assert "FedProx diverged on 10 of 10 seeds" in line[header.index("reason")]
    # a claim without a paper number is "not comparable" whatever ran, and its reason still names the divergence
    v, why = rc.verdict(replace(claim, direction=None, number=None), None, null)
    assert v == "not comparable" and why.startswith("no paper number in the specs; ")
    assert "FedProx diverged on 10 of 10 seeds (training became non-finite" in why

def test_a_tuned_row_waits_for_every_tuning_run_and_an_artefact_made_otherwise_is_replaced():
    s = _tuned_setting()
    combos = {("fedavg", c) for c in s.tuning.combos("fedavg")} | {("fedprox", c) for c in s.tuning.combos("fedprox")}
    scores = {ac: {100: (0.5, 0.5), 101: (0.5, 0.5)} for ac in combos}
    del scores[("fedprox", ("train.lr=0.1", "algorithm.mu=0.1"))][101]  # one seed of one combination missing
    rc.choose_tuned([s], _tuning_cells(scores))
    assert s.chosen == {"fedavg": ("train.lr=0.05",)}
    assert rc.waiting_rows([s]) == ["d/fedprox"]
    assert not [j for j in rc.setting_jobs([s]) if j.name.startswith("d/fedprox/")]
    with pytest.raises(ValueError, match="tuning runs are not all in"):
        s.overrides_of(s.row("fedprox"))
    # a document built meanwhile lists the waiting row as such
    assert "- FedProx: waits for fedprox's tuning runs" in rc.rows_list(s, ["fedavg", "fedprox"])
    # an artefact of FedAvg's row made at another learning rate than the chosen one is stale; the chosen one is not
    job = next(j for j in rc.setting_jobs([s]) if j.name == "d/fedavg/s0")
    made = {"d/fedavg": {seed: {"stats": {"overrides": [*job.overrides[:-1], f"train.lr={lr}", f"seed={seed}"]}}
                         for seed, lr in ((0, "0.1"), (1, "0.05"))}}
    assert [j.name for j in rc.stale_artefacts(rc.setting_jobs([s]), made)] == ["d/fedavg/s0"]


def test_the_baselines_rows_are_all_tuned_with_the_issues_grid():
    base = importlib.import_module("results_baselines")
    for s in base.settings_of("full", "cpu"):
        assert all(row.tuned for row in s.rows) and s.tuning.seeds == (100, 101)
        assert set(s.tuning.grids) == {row.algorithm for row in s.rows}
        assert s.tuning.grids["fedprox"]["algorithm.mu"] == (0.001, 0.01, 0.1, 1.0)
        assert all(g["train.lr"] == base.LRS for g in s.tuning.grids.values())


def test_the_heterogeneity_rows_are_tuned_with_the_issues_grid_setting_by_setting():
    """A tuned setting tunes every row (the noise floor, FedAvg run longer and the ablations too) over the issue's
    grid; an untuned one tunes none, so no comparison mixes a tuned row with an untuned one."""
    het = importlib.import_module("results_heterogeneity")
    settings = {s.name: s for s in het.settings_of("full", "cpu")}
    assert het.TUNED and set(het.TUNED) <= set(settings)
    for name, s in settings.items():
        if name not in het.TUNED:
            assert s.tuning is None and not any(row.tuned for row in s.rows), name
            continue
        assert all(row.tuned for row in s.rows) and s.tuning.seeds == (100, 101)
        assert set(s.tuning.grids) == set(het.MAIN) == {row.algorithm for row in s.rows if row.priority == 1}
        assert s.tuning.grids["fedprox"]["algorithm.mu"] == (0.001, 0.01, 0.1, 1.0)
        assert all(g["train.lr"] == het.LRS for g in s.tuning.grids.values()) and min(het.LRS) <= 0.01
        assert {j.name.split("/")[2] for j in s.tuning_jobs()} == set(het.MAIN)
        assert len(s.tuning_jobs()) == 2 * (5 * len(het.LRS) + len(het.LRS) * 4)


def test_the_long_horizon_runs_at_the_values_its_own_200_round_grid_chose():
    """--preset long: 200 rounds (FedAvg to 500), evaluated every 10, no ablations; each setting has its own grid
    at 200 rounds (same rates, mu values, validation split and tuning seeds), its rows run at what that grid
    chooses and wait while it is incomplete: never at the hand-set 0.05, never at the 30-round choice."""
    het = importlib.import_module("results_heterogeneity")
    fm, fe = het.settings_of("full", "long")
    short = het.settings_of("full", "cpu")
    for s, s30 in zip((fm, fe), short):
        assert s.tuning is not None and s.tuning.seeds == s30.tuning.seeds == (100, 101)
        assert s.tuning.grids == s30.tuning.grids
    grid = {j.name: rc.resolved(j.overrides) for j in rc.setting_jobs([fm, fe])}  # nothing chosen: only the grids
    assert grid["fashion_mnist/tune/fedprox/train.lr0.2_algorithm.mu0.001/s101"]["rounds"] == "200"
    assert grid["fashion_mnist/tune/fedprox/train.lr0.2_algorithm.mu0.001/s101"]["eval_every"] == "10"
    assert {name.split("/")[1] for name in grid} == {"tune"}
    def run(seed, acc):
        return {"name": f"s{seed}", "config": {}, "summary": {}, "stats": {},
                "rows": [{"round": r, "val_accuracy": acc} for r in range(10, 201, 10)]}
    cells = {f"{fm.name}/tune/fedavg/{rc.combo_tag(c)}": {k: run(k, 0.5 + (0.1 if c == ("train.lr=0.1",) else 0))
                                                          for k in (100, 101)} for c in fm.tuning.combos("fedavg")}
    rc.choose_tuned([fm, fe], cells)
    assert fm.chosen == {"fedavg": ("train.lr=0.1",)} and not fe.chosen
    jobs = {j.name: rc.resolved(j.overrides) for j in rc.setting_jobs([fm, fe])}
    assert jobs["fashion_mnist/fedavg/s9"]["train.lr"] == "0.1" and jobs["fashion_mnist/fedavg/s9"]["rounds"] == "200"
    assert jobs["fashion_mnist/fedavg/s0"]["eval_every"] == "10"
    assert jobs[f"fashion_mnist/{rc.LONG}/s0"]["rounds"] == "500" and jobs[f"fashion_mnist/{rc.NOISE}/s0"]["train.lr"] == "0.1"
    assert {name.split("/")[1] for name in jobs} == {"tune", "fedavg", rc.NOISE, rc.LONG, rc.AGAIN}  # no ablations
    # FedAvg run again (the CPU time of rows run in a later sweep) is FedAvg's row: the same run of each seed
    assert all(jobs[f"fashion_mnist/{rc.AGAIN}/s{k}"] == jobs[f"fashion_mnist/fedavg/s{k}"] for k in range(10))
    assert rc.AGAIN not in {r.tag for r in short[0].rows}  # the 30-round rows ran in one sweep with FedAvg
    # their artefacts keep the columns the document reads (and the losses), not every logged metric
    assert {j.metrics for j in rc.setting_jobs([fm, fe]) if "/tune/" not in j.name} == {het.LONG_METRICS}
    assert {j.metrics for j in rc.setting_jobs([fm, fe]) if "/tune/" in j.name} == {rc.TUNING_METRICS}
    assert {"round", "test_accuracy", "test_accuracy_predshift", "bytes_up", "tau_eff"} <= set(het.LONG_METRICS)
    assert all(s.metrics is None for s in short)  # the 30-round rows keep every column
    assert set(rc.waiting_rows([fm, fe])) == {f"fashion_mnist/{a}" for a in ("fedprox", "scaffold", "fednova", "fedimpro",
                                                                              "vhl")} | {f"femnist/{r.tag}" for r in fe.rows}


def test_fednova_note_follows_the_logged_step_counts():
    """FedNova's row is called FedAvg only when every round's tau_eff is one value (equal local steps)."""
    def cell(taus, accs):
        return {k: {"name": f"s{k}", "rows": [{"round": 1, "tau_eff": t, "test_accuracy": a}]}
                for k, (t, a) in enumerate(zip(taus, accs))}
    avg = cell([None, None], [0.5, 0.6])
    assert "is FedAvg up to float rounding (largest per-seed difference 0.00 points)" in rc.fednova_note(
        {"fedavg": avg, "fednova": cell([10.0, 10.0], [0.5, 0.6])})
    assert "differ (tau_eff 8-12" in rc.fednova_note({"fedavg": avg, "fednova": cell([8.0, 12.0], [0.5, 0.6])})
    assert rc.fednova_note({"fedavg": avg}) == ""


def test_equal_compute_times_a_row_on_runs_of_fedavgs_sweeps():
    """CPU time measured on another machine or under another load is not comparable: a row's cost comes from its
    runs made in a sweep (commit and recorded machine) of FedAvg's runs or of FedAvg run again, over FedAvg's
    runs of that sweep; a row with none is left out and named, and the main table marks the CPU seconds of a
    row with runs outside FedAvg's own sweeps."""
    def cell(commit, cost, rounds=4, seeds=range(3), machine=None):
        rows = [{"round": r, "test_accuracy": 0.5 + 0.01 * r} for r in range(1, rounds + 1)]
        return {k: {"name": f"s{k}", "rows": rows, "stats": {"commit": commit, "cpu_s": 1.0, "row_cpu_s": [
            cost * i for i in range(rounds)], **({"machine": {"cpu": machine}} if machine else {})}} for k in seeds}
    rows = [rc.Row(t, t.upper(), "fedavg", [], [0, 1, 2]) for t in ("fedavg", rc.LONG, rc.AGAIN, "x", "y", "w")]
    s = rc.Setting("z", "z", ["dataset=digits"], 2, rows, {"fedavg": []})
    x = {**cell("a", 2.0, seeds=[0]), **cell("late", 9.0, seeds=[1, 2])}  # seeds 1-2 timed under load
    cells = {"z/fedavg": cell("a", 1.0), f"z/{rc.LONG}": cell("a", 1.0, rounds=8), "z/x": x, "z/y": cell("late", 1.0),
             "z/w": cell("a", 5.0, machine="M")}  # FedAvg's commit, another machine
    text = rc.equal_compute_table(s, cells, ["x", "y", "w"])
    assert "| X | FedAvg: 3 runs at a | 2.00 (1 runs) | 4 |" in text
    assert "Left out, no run timed in those sweeps: Y, W." in text and "| Y |" not in text
    # FedAvg run again in y's sweep (commit and machine) times y and w against its own runs of that sweep
    again = {**cell("late", 0.5, seeds=[0, 1]), **cell("a", 2.5, seeds=[2], machine="M")}
    text = rc.equal_compute_table(s, {**cells, f"z/{rc.AGAIN}": again}, ["x", "y", "w"])
    assert f"| Y | FedAvg run again (`{rc.AGAIN}`): 2 runs at late | 2.00 (3 runs) | 4 |" in text and "Left out" not in text
    assert f"| W | FedAvg run again (`{rc.AGAIN}`): 1 runs at a on M | 2.00 (3 runs) | 4 |" in text
    assert f"| X | FedAvg run again (`{rc.AGAIN}`): 2 runs at late | 18.00 (2 runs) | 8 (the long run's end" in text  # most of x's runs
    # a sweep both FedAvg rows ran in times against FedAvg's own row
    text = rc.equal_compute_table(s, {**cells, f"z/{rc.AGAIN}": cell("a", 7.0)}, ["x"])
    assert "| X | FedAvg: 3 runs at a | 2.00 (1 runs) | 4 |" in text
    # the main table's CPU columns mark the rows whose runs are not all in FedAvg's sweeps, and say why
    table, _ = rc.main_table(s, {**cells, "z/y": cell("a", 3.0)}, ["fedavg", "y", "x", "w"])
    lines = {line.split(" | ")[0]: line for line in table.splitlines() if line.startswith("| ")}
    assert lines["| Y"].endswith("| 3 | 1 |") and lines["| X"].endswith("| 9 † | 1 † |")
    assert lines["| W"].endswith("| 5 † | 1 † |")
    assert lines["| FEDAVG"].endswith("| 1 | 1 |") and table.count("†") == 5
    assert "\n\n† Some or all of the row's runs were made in none of FedAvg's sweeps (another commit" in table
    assert "†" not in rc.main_table(s, cells, ["fedavg"])[0]


def test_oneshot_labels_budgets_and_claims_quote_what_the_rows_ran():
    """A tiny check's document quotes its own budgets, never the full budget's (or the card's) as if run."""
    os_ = importlib.import_module("results_oneshot")
    for budget, gen, steps in (("full", "the card's 200", "the card's 10,000"), ("tiny", "4 (card 200)", "40 (card 10,000)")):
        s = os_.cpu_settings(budget)[0]
        ms = os_.measures(s)
        assert ms["dense_card"].label == f"DENSE, {gen} generator epochs", budget
        assert ms["feddf_card"].label.endswith(f", {steps} steps"), budget
        assert s.row("dense_card").label == f"DENSE, {gen} generator epochs", budget
        assert s.row("feddf_card").label.startswith(f"FedDF (held-out), {steps} distillation steps"), budget
        what = {method: w for method, *_, w in os_.budget_pairs(s)}
        assert what["DENSE (the card's budget row)"] == f"generator epochs ({20 if budget == 'full' else 2} -> {gen})"
        claims = {(a, b): c for a, b, c in os_.claims(s)}
        card = claims[("dense_card", "adi_card")]
        assert f"; {gen} epochs for both;" in card.differences
        # a claim's budget is the least of its fractions, each short one named: the clients' local epochs against
        # the paper's (DENSE's README 400; the survey's order the least of its papers, 100; FuseFL 100 per block)
        # and the server side's, which falls short only where the rows ran below the card
        local = 4 if budget == "full" else 1
        assert card.budget == local / 400
        assert card.budget_of == f"local epochs {local} of 400" + ("" if budget == "full" else "; generator epochs 4 of 200")
        feddf = claims[("feddf_card", "fedavg")]
        assert feddf.budget == (local / 100 if budget == "full" else 40 / 10_000)
        assert feddf.budget_of == f"local epochs {local} of 100" + ("" if budget == "full" else
                                                                     "; distillation steps 40 of 10,000")
        gen20 = 20 if budget == "full" else 2
        assert claims[("dense", "adi")].budget == min(local / 400, gen20 / 200)
        assert claims[("dense", "adi")].budget_of == f"local epochs {local} of 400; generator epochs {gen20} of 200"
        for against in ("ensemble", "ensemble_cal", "fedavg"):
            fusefl = claims[("fusefl_k2", against)]
            assert (fusefl.budget, fusefl.budget_of) == (max(1, local // 2) / 100,
                                                         f"local epochs per block {max(1, local // 2)} of 100")
        assert f"Dirichlet(0.5), {local} local epochs (the papers" in claims[("ensemble", "fedavg")].differences
        assert s.title.endswith(f"{local} local epochs")


def test_oneshot_reports_the_distillation_steps_feddf_ran_not_its_budget():
    os_ = importlib.import_module("results_oneshot")
    run = lambda steps, best: {"rows": [{"round": 1, "distill_steps": steps, "best_step": best, "test_accuracy": 0.5},  # noqa: E731
                                        {"round": 1, "calibration_samples": 10}]}
    assert os_._steps({0: run(1300.0, 300.0), 1: run(2500.0, 1500.0), 2: run(1000.0, 0.0)}) == "1,000-2,500 (best 0-1,500)"
    assert os_._steps({0: run(1300.0, 300.0), 1: {"rows": [{"round": 1, "test_accuracy": 0.5}]}}) == "-"


def test_oneshot_pairs_only_runs_that_read_the_same_client_models():
    """Same seed is not enough: a run made at another commit may have trained other client models (the cache
    is per code snapshot); such a seed is left out of the pair and named."""
    os_ = importlib.import_module("results_oneshot")
    s = os_.cpu_settings("full")[0]
    ms = os_.measures(s)

    def run(acc: float, clients: float) -> rc.Run:
        return {"stats": {"cpu_s": 1.0}, "rows": [{"round": 1, "test_accuracy": acc, "client_test_accuracy_mean": clients,
                                                   "ensemble_test_accuracy": 0.8, "fedavg_test_accuracy": 0.6}]}
    cells = {"alpha05/fedavg": {k: run(0.6, 0.5) for k in range(3)},
             "alpha05/dense": {0: run(0.7, 0.5), 1: run(0.9, 0.51), 2: run(0.7, 0.5)},
             "alpha05/fedavg_shuffle": {k: run(0.65, 0.52) for k in range(3)}}  # its own client models, by design
    va, vb, other = os_.pair(cells, s, ms["dense"], ms["fedavg"])
    assert sorted(va) == sorted(vb) == [0, 2] and other == [1]
    assert os_.left_out(other) == " (seed 1 left out: other client models)"
    va, vb, other = os_.pair(cells, s, ms["noise_fedavg"], ms["fedavg"])
    assert sorted(va) == [0, 1, 2] and other == []
    (header, rows), = _tables(os_.comparison_table(s, cells)[0])
    row = next(r for r in rows if r[0] == "DENSE minus One-shot FedAvg")
    assert row[header.index("seeds")] == "2 (seed 1 left out: other client models)"
    assert row[header.index("difference (paired, 95% CI)")] == "+10.00 [+10.00, +10.00]"
    # a claim whose rows share no seed's client models says so in its verdict row (not "not run yet")
    cells["alpha05/adi"] = {k: run(0.3, 0.49) for k in range(3)}
    row = next(r for r in os_.verdicts(s, cells) if r[0].algorithm == "DENSE vs Fed-ADI" and r[0].budget < 1)
    assert row[1] is None and row[3] == "none (seeds 0-2 left out: other client models)"
