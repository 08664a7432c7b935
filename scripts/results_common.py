"""Shared machinery of the results documents (docs/results/README.md explains the method).

* Running: every run is one ``python -m fl_platform.run`` process (the CLI path) with one torch
  thread, from a snapshot of a git commit (``git archive``) so that a long sweep in a shared,
  changing checkout uses one code version; its CPU time is measured with ``wait4``.
* Artefacts: per run, ``summary.json``, ``metrics.jsonl.gz``, ``config.yaml.gz`` and ``run.json`` (CPU
  time, commit, overrides) under ``docs/results/data/<document>/<cell>/s<seed>/``. A document is
  always built from these files (also right after running), so ``--from-artefacts`` rebuilds it
  byte for byte without the datasets, and ``tests/test_results_docs.py`` checks that it does.
* Statistics: a run's accuracy is the mean of its last ``K_LAST`` test evaluations (never the best
  one, which would select on the test set); a comparison is the paired difference over the seeds
  both cells ran (same partition, initial model and client sampling), reported with its 95%
  Student-t interval and two-sided p; prose claims a difference only when the interval excludes 0.
* Documents: the text above ``MARKER`` is generated; what follows it is hand-written and kept.
"""

from __future__ import annotations

import contextlib
import fnmatch
import gzip
import importlib.metadata
import io
import itertools
import json
import math
import os
import platform
import queue
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from fl_platform.gpu_slots import slot_gpu, visible_gpus

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "results"
DATA = DOCS / "data"
RUNS = REPO / "outputs" / "results"
MARKER = "<!-- findings -->"
K_LAST = 5  # evaluations averaged into a run's accuracy
LEVEL = 0.95
MAX_ARTEFACT_BYTES = 20 * 2**20  # all documents' artefacts together (issue 17)

# Every results document -> (its script, the arguments that select it): each script has main(argv) with
# --from-artefacts and --no-plots, and tests/test_results_docs.py rebuilds every document from its committed
# artefacts. A document is registered once its first runs are committed; rows still missing runs say so
# (missing_runs), and a verdict on fewer than MIN_SEEDS paired seeds reads "untested".
DOCUMENTS = {"baselines": ("results_baselines",), "privacy": ("results_privacy",),
             "compression": ("results_compression",), "heterogeneity": ("results_heterogeneity",),
             "heterogeneity_long": ("results_heterogeneity", "--preset", "long"), "oneshot": ("results_oneshot",),
             "personalised": ("results_personalised",)}

Run = dict[str, Any]  # {"name", "config" (flattened), "summary", "rows", "stats"}


# ----------------------------------------------------------------------------- running


@dataclass
class Job:
    """One run: its cell (a table row, e.g. ``fashion_mnist/fedavg``), seed and CLI overrides."""

    cell: str
    seed: int
    overrides: list[str]
    # the metrics columns its artefact keeps (None: all): a tuning run's TUNING_METRICS, a long run's
    # what its document reads (Setting.metrics), so hundreds of them fit the artefacts' size limit
    metrics: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        return f"{self.cell}/s{self.seed}"


def code_snapshot(rev: str) -> tuple[Path, str]:
    """(folder to run from, commit) for ``rev``: a ``git archive`` of the commit under
    outputs/results/_code/, made once; ``worktree`` runs the live checkout (for development only:
    its artefacts record ``<commit>+worktree``)."""
    head = subprocess.run(["git", "rev-parse", "HEAD" if rev == "worktree" else rev], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout.strip()
    if rev == "worktree":
        return REPO, head + "+worktree"
    folder = RUNS / "_code" / head
    if not (folder / ".complete").exists():
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", head], cwd=REPO, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
        (folder / ".complete").write_text(head + "\n")
    return folder, head


def _data_root() -> str:
    """The data root the live checkout would use, passed on to runs made from a snapshot."""
    return os.environ.get("FL_DATA_ROOT") or str(REPO.parent / "shared" / "data")


def run_job(job: Job, runs: Path, artefacts: Path, code: tuple[Path, str], threads: int = 1,
            gpu: str | None = None) -> dict[str, Any]:
    """Run ``job`` (unless its artefact exists) and store its artefact; returns its run.json. ``gpu``:
    the one GPU id the run sees (``CUDA_VISIBLE_DEVICES``; None: what this process sees)."""
    dest = artefacts / job.name
    if (dest / "run.json").exists():
        return json.loads((dest / "run.json").read_text())
    run_dir = runs / job.name
    if not _finished_at(run_dir, code[1]):
        shutil.rmtree(run_dir, ignore_errors=True)  # a partial run, or one of other code, starts over
        run_dir.mkdir(parents=True)
        cmd = [sys.executable, "-m", "fl_platform.run", *job.overrides, f"hydra.run.dir={run_dir}"]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "FL_DATA_ROOT": _data_root(), "PYTHONPATH": str(code[0]),
               **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {})}
        t0 = time.perf_counter()
        with open(run_dir / "stdout.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=code[0], env=env, stdout=log, stderr=subprocess.STDOUT)
            status, usage, row_cpu = _wait_sampling_cpu(proc.pid, run_dir / "metrics.jsonl")
        failed = os.waitstatus_to_exitcode(status) != 0
        error = _diverged(run_dir / "stdout.log") if failed else None
        # a run the platform stops because training diverged (NonFiniteError) is a result, recorded as such: a
        # grid point never chosen, a row's seed without a number (``finished``, ``missing_runs``); any other
        # failure is the harness's and stops here
        if failed and not error:
            raise RuntimeError(f"run {job.name} failed: {' '.join(cmd)}; see {run_dir / 'stdout.log'}")
        stats = {"cpu_s": round(usage.ru_utime + usage.ru_stime, 2), "wall_s": round(time.perf_counter() - t0, 2),
                 "commit": code[1], "machine": machine(), "overrides": job.overrides, "row_cpu_s": row_cpu,
                 **({"diverged": error} if error else {})}
        if error:  # the platform writes no summary for a stopped run: the runner's says why it stopped
            (run_dir / "summary.json").write_text(json.dumps({"diverged": error}, indent=2) + "\n")
        (run_dir / "run.json").write_text(json.dumps(stats, indent=1) + "\n")
    export_artefact(run_dir, dest, job.metrics)
    return json.loads((dest / "run.json").read_text())


def machine() -> dict[str, str]:
    """The CPU model and torch build a run was made with: the same code on another CPU (other vector
    kernels) or torch gives other floating-point results, so runs of one seed agree bit for bit only on one
    machine (oneshot.md's client models showed it). run.json keeps it; ``provenance`` lists the machines."""
    cpu = "unknown"
    with contextlib.suppress(OSError):
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = "not installed"
    return {"cpu": cpu if cpu != "unknown" else (platform.processor() or cpu), "torch": torch}


def _diverged(log: Path) -> str | None:
    """The platform's error line when a run stopped because training became non-finite, else None."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    last = next((x for x in reversed(lines) if x.startswith("error: ")), "")
    return last.removeprefix("error: ") if last.startswith("error: NonFiniteError:") else None


def _finished_at(run_dir: Path, commit: str) -> bool:
    """Whether ``run_dir`` holds a finished run of this commit's code (a run of another commit is not
    reused: its artefact would carry results the requested code may not give)."""
    try:
        return (run_dir / "summary.json").exists() and json.loads((run_dir / "run.json").read_text())["commit"] == commit
    except (OSError, ValueError, KeyError):
        return False


def _wait_sampling_cpu(pid: int, metrics: Path, poll_s: float = 0.05) -> tuple[int, Any, list[float]]:
    """Wait for process ``pid``; returns (wait status, rusage, the process's CPU seconds when each row
    of ``metrics`` appeared). The per-row CPU times give a round's compute free of the waiting a
    shared machine adds to wall-clock ``round_time_s``."""
    import psutil

    child = psutil.Process(pid)
    row_cpu: list[float] = []
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        try:
            rows = metrics.read_bytes().count(b"\n") if metrics.exists() else 0
            if rows > len(row_cpu):
                t = child.cpu_times()
                row_cpu += [round(t.user + t.system, 3)] * (rows - len(row_cpu))
        except (psutil.Error, OSError):
            pass  # exiting between the two calls: wait4 reaps it next
        time.sleep(poll_s)
    return status, usage, row_cpu


def run_jobs(jobs: Sequence[Job], runs: Path, artefacts: Path, code: tuple[Path, str], n_jobs: int,
             threads: int = 1) -> None:
    """Run ``jobs`` (in list order, ``n_jobs`` at a time); a failed run is reported, the rest go on. With
    GPUs visible, each of the ``n_jobs`` slots has its own GPU (round-robin: fl_platform/gpu_slots.py) and
    a job sees only its slot's."""
    todo = [j for j in jobs if not (artefacts / j.name / "run.json").exists()]
    print(f"{len(jobs) - len(todo)} of {len(jobs)} runs have artefacts; running {len(todo)}", flush=True)
    failed = []
    gpus = visible_gpus()
    free: queue.SimpleQueue[int] = queue.SimpleQueue()
    for slot in range(max(1, n_jobs)):
        free.put(slot)

    def in_a_slot(job: Job) -> dict[str, Any]:
        slot = free.get()
        try:
            return run_job(job, runs, artefacts, code, threads, slot_gpu(slot, gpus) if gpus else None)
        finally:
            free.put(slot)

    with ThreadPoolExecutor(max_workers=max(1, n_jobs)) as pool:
        futures = [(j, pool.submit(in_a_slot, j)) for j in todo]
        for i, (job, fut) in enumerate(futures, 1):
            try:
                stats = fut.result()
                print(f"[{i}/{len(todo)}] {job.name}: cpu {stats['cpu_s']:.0f} s", flush=True)
            except RuntimeError as err:
                failed.append(job.name)
                print(f"[{i}/{len(todo)}] FAILED {err}", flush=True)
    if failed:
        raise SystemExit(f"{len(failed)} runs failed: {', '.join(failed)}")


# ----------------------------------------------------------------------------- presets and data


def _preset(name: str) -> dict[str, Any]:
    path = REPO / "conf" / "experiment" / f"{name}.yaml"
    if not path.exists():
        raise FileNotFoundError(f"no preset conf/experiment/{name}.yaml")
    return yaml.safe_load(path.read_text()) or {}


def _override_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, list):
        return "[" + ",".join(_override_value(x) for x in v) + "]"
    return str(v)


def preset_overrides(name: str, with_algorithm: bool = False) -> list[str]:
    """``conf/experiment/<name>.yaml`` as command-line overrides (its group choices, then its keys), without
    its ``algorithm`` block unless asked: another algorithm runs in the preset's setting this way (a
    preset's algorithm keys would not fit the other algorithm's schema)."""
    conf = _preset(name)
    out = []
    for entry in conf.get("defaults", []):
        for key, value in (entry.items() if isinstance(entry, dict) else ()):
            group = key.removeprefix("override ").strip().lstrip("/")
            if group != "algorithm" or with_algorithm:
                out.append(f"{group}={value}")
    flat = _flatten({k: v for k, v in conf.items() if k != "defaults" and (with_algorithm or k != "algorithm")})
    return out + [f"{k}={_override_value(v)}" for k, v in flat.items()]


def preset_value(name: str, key: str) -> str:
    """A preset's value of ``key`` (a group such as ``dataset``, or a dotted key), as an override writes it."""
    for o in reversed(preset_overrides(name, with_algorithm=True)):
        k, v = o.split("=", 1)
        if k == key:
            return v
    raise KeyError(f"preset {name} does not set {key}")


def check_data(datasets: Iterable[str], min_clients: dict[str, int] | None = None) -> list[str]:
    """One line per dataset that cannot be loaded from the data root (or has fewer natural groups
    than a setting's clients): what is missing and where it was looked for."""
    os.environ.setdefault("FL_DATA_ROOT", _data_root())
    from fl_platform.datasets.registry import GROUPED_SOURCES, load_source

    missing = []
    for name in datasets:
        try:
            src = load_source(name)
        except FileNotFoundError as err:
            missing.append(f"{name}: {err}")
            continue
        need = (min_clients or {}).get(name, 0)
        if name in GROUPED_SOURCES and src.has_groups and src.num_groups < need:
            missing.append(f"{name}: the data root holds {src.num_groups} writers, the setting needs {need} "
                           f"(the full LEAF {name}, not a sample)")
    return missing


# ----------------------------------------------------------------------------- artefacts


def _gzip_bytes(data: bytes) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as gz:
        gz.write(data)
    return buf.getvalue()


def keep_columns(metrics: bytes, keep: Sequence[str]) -> bytes:
    """A metrics.jsonl with only the columns ``keep`` of each row (in the row's order)."""
    rows = (json.loads(line) for line in metrics.decode().splitlines() if line.strip())
    return "".join(json.dumps({k: v for k, v in row.items() if k in keep}) + "\n" for row in rows).encode()


def export_artefact(run_dir: Path, dest: Path, metrics: Sequence[str] | None = None) -> None:
    """Copy a finished run's summary and run.json, and its config and metrics gzip-compressed (fixed
    header, so the bytes depend on the content only; the config is 2.6 KB as text, 1.1 KB compressed,
    which keeps every document's artefacts under ``MAX_ARTEFACT_BYTES``), the metrics with only the
    columns ``metrics`` if given (a tuning run's artefact keeps what the choice reads: TUNING_METRICS).
    Refuses files that name a machine path."""
    files = {"summary.json": (run_dir / "summary.json").read_bytes(), "config.yaml": (run_dir / "config.yaml").read_bytes(),
             "run.json": (run_dir / "run.json").read_bytes()}
    for name, data in files.items():
        text = data.decode()
        for root in {str(REPO), str(RUNS), str(Path.home()), "/tmp/"}:
            if root in text:
                raise ValueError(f"{run_dir / name} names the machine path {root!r}; not committing it")
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("summary.json", "run.json"):
        (dest / name).write_bytes(files[name])
    (dest / "config.yaml.gz").write_bytes(_gzip_bytes(files["config.yaml"]))
    metrics_file = run_dir / "metrics.jsonl"  # (a run stopped in its first round has written no row)
    rows = metrics_file.read_bytes() if metrics_file.exists() else b""
    (dest / "metrics.jsonl.gz").write_bytes(_gzip_bytes(rows if metrics is None else keep_columns(rows, metrics)))


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def load_artefact(folder: Path) -> Run:
    rows = [json.loads(line) for line in gzip.decompress((folder / "metrics.jsonl.gz").read_bytes()).decode().splitlines()
            if line.strip()]
    # libyaml's safe loader (in PyYAML's wheels): the same documents as yaml.safe_load, ~9x faster over
    # the hundreds of artefacts a document reads
    config = yaml.load(gzip.decompress((folder / "config.yaml.gz").read_bytes()).decode(), Loader=yaml.CSafeLoader) or {}
    return {"name": folder.name, "config": _flatten(config),
            "summary": json.loads((folder / "summary.json").read_text()),
            "stats": json.loads((folder / "run.json").read_text()), "rows": rows}


def load_cells(artefacts: Path) -> dict[str, dict[int, Run]]:
    """cell -> seed -> run, for every artefact under ``artefacts`` (``<cell>/s<seed>/run.json``)."""
    cells: dict[str, dict[int, Run]] = {}
    for path in sorted(artefacts.rglob("run.json")):
        folder = path.parent
        cell = folder.parent.relative_to(artefacts).as_posix()
        cells.setdefault(cell, {})[int(folder.name[1:])] = load_artefact(folder)
    return cells


def artefact_bytes(root: Path = DATA) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# ----------------------------------------------------------------------------- statistics


def evaluations(run: Run, metric: str = "test_accuracy", upto_round: int | None = None) -> list[tuple[int, float]]:
    return [(row["round"], float(row[metric])) for row in run["rows"]
            if row.get(metric) is not None and (upto_round is None or row["round"] <= upto_round)]


def final_accuracy(run: Run, metric: str = "test_accuracy", k: int = K_LAST, upto_round: int | None = None) -> float:
    """Mean of the last ``k`` evaluations (up to ``upto_round``): the number every table reports."""
    values = [v for _, v in evaluations(run, metric, upto_round)][-k:]
    if not values:
        raise ValueError(f"run {run['name']} has no {metric} evaluations" + (f" up to round {upto_round}"
                                                                             if upto_round else ""))
    return statistics.fmean(values)


@dataclass(frozen=True)
class Interval:
    """Mean of ``n`` values with the half-width of its ``LEVEL`` Student-t interval and the two-sided
    p of the t-test of mean 0 (half and p are nan for n < 2)."""

    mean: float
    half: float
    n: int
    p: float

    @property
    def lo(self) -> float:
        return self.mean - self.half

    @property
    def hi(self) -> float:
        return self.mean + self.half

    @property
    def sign(self) -> int:
        """+1 / -1 when the interval excludes 0 above / below it, else 0."""
        if self.n < 2 or self.half != self.half:
            return 0
        return 1 if self.lo > 0 else -1 if self.hi < 0 else 0


def interval(values: Sequence[float], level: float = LEVEL) -> Interval:
    n = len(values)
    if n == 0:
        return Interval(float("nan"), float("nan"), 0, float("nan"))
    mean = statistics.fmean(values)
    if n < 2:
        return Interval(mean, float("nan"), n, float("nan"))
    from scipy.stats import t

    se = statistics.stdev(values) / math.sqrt(n)
    if se == 0:
        return Interval(mean, 0.0, n, 1.0 if mean == 0 else 0.0)
    return Interval(mean, float(t.ppf(0.5 + level / 2, n - 1)) * se, n, float(2 * t.sf(abs(mean) / se, n - 1)))


def paired(values: dict[int, float], baseline: dict[int, float]) -> Interval:
    """The paired difference ``values - baseline`` over the seeds both have."""
    seeds = sorted(set(values) & set(baseline))
    return interval([values[s] - baseline[s] for s in seeds])


def per_seed(runs: dict[int, Run], fn: Callable[[Run], float] = final_accuracy) -> dict[int, float]:
    return {seed: fn(run) for seed, run in sorted(runs.items())}


def reading(iv: Interval, higher: str = "higher", lower: str = "lower") -> str:
    """What the prose may say about a paired difference: its direction only if the interval excludes 0."""
    if iv.n < 2:
        return "too few seeds"
    return {1: higher, -1: lower, 0: "no detectable difference"}[iv.sign]


def pct(x: float, signed: bool = False, digits: int = 2) -> str:
    if x != x:
        return "-"
    return f"{100 * x:+.{digits}f}" if signed else f"{100 * x:.{digits}f}"


def fmt_mean(iv: Interval) -> str:
    """``mean ± half-width`` in % (mean alone for one seed)."""
    return "-" if iv.n == 0 else pct(iv.mean) if iv.n < 2 else f"{pct(iv.mean)} ± {pct(iv.half)}"


def fmt_diff(iv: Interval) -> str:
    """``+d [lo, hi]`` in percentage points."""
    if iv.n == 0:
        return "-"
    if iv.n < 2:
        return pct(iv.mean, True)
    return f"{pct(iv.mean, True)} [{pct(iv.lo, True)}, {pct(iv.hi, True)}]"


def fmt_p(iv: Interval) -> str:
    if iv.p != iv.p:
        return "-"
    return "<0.001" if iv.p < 0.001 else f"{iv.p:.3f}"


# ----------------------------------------------------------------------------- equal compute


def cpu_per_round(runs: Iterable[Run]) -> float:
    """Median CPU seconds of a round: the increase of the run's process CPU time between consecutive
    metrics rows (run.json's ``row_cpu_s``), over the rounds of ``runs`` without an evaluation (all
    rounds where every round has one), the first round excepted (it also holds the start-up). Local
    training and aggregation in one torch thread, measured in CPU time, so the waiting on a shared
    machine (which wall-clock ``round_time_s`` includes) does not count."""
    plain, every = [], []
    for run in runs:
        cpu, rows = run["stats"].get("row_cpu_s") or [], run["rows"]
        for i in range(1, min(len(cpu), len(rows))):
            every.append(cpu[i] - cpu[i - 1])
            if rows[i].get("test_accuracy") is None:
                plain.append(cpu[i] - cpu[i - 1])
    if not every:
        raise ValueError("no per-row CPU samples (run.json's row_cpu_s) in these runs")
    return statistics.median(plain or every)


def equal_compute_round(ratio: float, rounds: int, eval_rounds: Sequence[int]) -> int:
    """The evaluated round nearest ``ratio * rounds``: where a run ``ratio`` times cheaper per round
    has spent the same compute as ``rounds`` rounds of the dearer one."""
    target = ratio * rounds
    return min(eval_rounds, key=lambda r: (abs(r - target), r))


# ----------------------------------------------------------------------------- paper verdicts


@dataclass(frozen=True)
class PaperClaim:
    """What a paper reports for one algorithm in its closest setting to ours.

    ``number``: the paper's accuracy (or gain) as text, or None when the specs do not have it;
    ``direction``: +1 when the paper reports a gain over the baseline, None when it makes no claim
    about this comparison (a baseline, or a setting it does not run)."""

    algorithm: str
    paper_setting: str
    number: str | None
    direction: int | None
    differences: str
    source: str = ""
    # The comparisons (row labels of ours) the paper's claim is about: a verdict may rest only on one of
    # them; empty = any. More than one: a verdict on one of them says which of the others are untested.
    baselines: tuple[str, ...] = ()
    # Our training budget (rounds, epochs, steps) as a fraction of the paper's: below 1 a null or opposite
    # result does not contradict the paper at its budget ("untested", never "not reproduced").
    budget: float = 1.0
    # Which budget that fraction is, as the reason quotes it (e.g. "local epochs 4 of 100"); "" = not said.
    budget_of: str = ""
    # Why the rows compared are not each tuned on a validation split ("": they are): a verdict compares tuned
    # against tuned, so such a comparison is "untested" (issue 28 item 3; filled by untuned_reason).
    untuned: str = ""
    # Which rows compared diverged on some seed ("": none; filled by diverged_reason): their numbers are over
    # the seeds that finished, so the comparison is "untested".
    diverged: str = ""


def claim_budget(*fracs: tuple[float, float, str]) -> dict[str, float | str]:
    """A claim's ``budget``, the least of its fractions (ours, the paper's, what: README.md "Verdicts"),
    and ``budget_of``, every one that falls short, named: PaperClaim's two fields as keyword arguments."""
    short = [(ours / paper, what) for ours, paper, what in fracs if ours < paper]
    return {"budget": min((f for f, _ in short), default=1.0), "budget_of": "; ".join(w for _, w in short)}


MIN_SEEDS = 10  # rows a verdict rests on have at least this many paired seeds (README.md, "Verdicts")


def verdict(claim: PaperClaim, ours: Interval | None, against: str | None = None,
            elsewhere: Iterable[str] = ()) -> tuple[str, str]:
    """(verdict, reason): direction only / not reproduced / untested / not comparable.

    ``against``: what our paired difference is measured against (its null); ``elsewhere``: the claim's other
    baselines that have verdict rows of their own on >= MIN_SEEDS seeds (the reason names only the rest as
    untested). Without a paper number the
    magnitude cannot be compared: the best a direction claim can get is 'direction only', when our paired
    interval over >= MIN_SEEDS seeds excludes 0 on the paper's side, against a comparison the paper makes."""
    if claim.direction is None:
        why = "no paper number in the specs" if claim.number is None else "the paper makes no claim here"
        lost = f"; {claim.diverged} (training became non-finite at the chosen values)" if claim.diverged else ""
        return "not comparable", (f"{why}; {claim.differences}" if claim.differences else why) + lost
    if claim.baselines and against not in claim.baselines:
        return "untested", (f"the paper's claim is against {' / '.join(claim.baselines)}; this row is against "
                            f"{against}, a comparison the paper does not make")
    if claim.diverged:
        return "untested", (f"{claim.diverged} (training became non-finite at the chosen values); a verdict "
                            "needs every seed to finish")
    if ours is None or ours.n < MIN_SEEDS:
        return "untested", f"{0 if ours is None else ours.n} paired seeds; a verdict needs >= {MIN_SEEDS}"
    if claim.untuned:  # and where the result is not the paper's, the budget would keep it untested too
        short = (f"; run at {claim.budget:.0%} of the paper's budget as well" if claim.budget < 1
                 and ours.sign != claim.direction else "")
        return "untested", f"{claim.untuned}; a verdict compares tuned against tuned{short}"
    others = [b for b in claim.baselines if b != against]
    beside, untested = [b for b in others if b in set(elsewhere)], [b for b in others if b not in set(elsewhere)]
    if beside:
        only = f"; against {', '.join(beside)}: the rows beside it" + (f"; {', '.join(untested)} untested" if untested
                                                                       else "")
    else:
        only = f"; against {against} only: {', '.join(others)} untested" if others else ""
    if ours.sign == claim.direction:
        at = (f" at {claim.budget:.0%} of the paper's budget" + (f" ({claim.budget_of})" if claim.budget_of else "")
              if claim.budget < 1 else "")
        return "direction only", f"our interval excludes 0 on the paper's side{at}" + (
            "; the paper's number is not in the specs, so the magnitude cannot be compared" if claim.number is None
            else "; the settings differ too much to compare magnitudes") + only
    if claim.budget < 1:
        of = f" ({claim.budget_of})" if claim.budget_of else ""
        return "untested", (f"run at {claim.budget:.0%} of the paper's budget{of}: "
                            + ("no detectable difference" if ours.sign == 0 else "the opposite direction")
                            + " there does not test the claim at its budget" + only)
    if ours.sign == 0:
        return "not reproduced", "no detectable difference in our setting (the interval includes 0)" + only
    return "not reproduced", "the opposite direction in our setting (the interval excludes 0 on the other side)" + only


def verdict_table(rows: Sequence[tuple[PaperClaim, Interval | None, str] | tuple[PaperClaim, Interval | None, str, str]]
                  ) -> str:
    """One row per (claim, our paired difference, what 'ours' is measured against[, the 'ours' cell when the
    interval is not a difference in points, e.g. a speedup's log ratio]). Rows of one claim (same paper
    setting and baselines) against different baselines name each other instead of calling them untested."""
    def key(c: PaperClaim) -> tuple[str, str, tuple[str, ...]]:
        return c.paper_setting, c.differences, c.baselines

    tested: dict[tuple[str, str, tuple[str, ...]], set[str]] = {}
    for claim, ours, against, *_ in rows:
        if ours is not None and ours.n >= MIN_SEEDS:
            tested.setdefault(key(claim), set()).add(against)
    lines = ["| algorithm | paper (closest setting) | paper's number | ours (paired, 95% CI) | seeds | null (0 = equal to) |"
             " differences in setting | verdict | reason |", "|---|---|---|---|---|---|---|---|---|"]
    for claim, ours, against, *text in rows:
        v, why = verdict(claim, ours, against, tested.get(key(claim), set()) - {against})
        ours_cell = text[0] if text else fmt_diff(ours) if ours is not None and ours.n else "none (the baseline row)"
        number = claim.number if claim.number is not None else "not in the specs"
        src = f" ({claim.source})" if claim.source else ""
        seeds = str(ours.n) if ours is not None else "-"
        lines.append(f"| {claim.algorithm} | {claim.paper_setting}{src} | {number} | {ours_cell} | {seeds} | {against if ours is not None else '-'} | "
                     f"{claim.differences or 'none listed'} | **{v}** | {why} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- documents


def md_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out) + "\n"


def generated_part(text: str) -> str:
    """The part of a document that its script writes (everything above ``MARKER``)."""
    return text.split(MARKER, 1)[0]


def write_document(path: Path, generated: str, default_findings: str = "") -> None:
    """Write ``generated`` and keep the hand-written text after ``MARKER`` of an existing ``path``."""
    tail = default_findings
    if path.exists() and MARKER in path.read_text():
        tail = path.read_text().split(MARKER, 1)[1].lstrip("\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(generated.rstrip("\n") + "\n\n" + MARKER + "\n" + tail)


def commits(cells: dict[str, dict[int, Run]]) -> list[str]:
    return sorted({run["stats"].get("commit", "?") for runs in cells.values() for run in runs.values()})


def cpu_hours(cells: dict[str, dict[int, Run]]) -> float:
    return sum(run["stats"]["cpu_s"] for runs in cells.values() for run in runs.values()) / 3600


def save_figure(fig: Any, path: Path) -> None:
    """Lay out, write as a PNG without a timestamp (a rebuild leaves committed plots unchanged) and close."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, metadata={"Software": None})
    plt.close(fig)


def plot_cells(groups: dict[str, list[Run]], path: Path, title: str, x: str = "round",
               metric: str = "test_accuracy") -> None:
    """Accuracy curves with 95% bands over seeds (scripts/plot.py), PNG without a timestamp."""
    sys.path.insert(0, str(REPO / "scripts"))
    import plot

    plot.plot({k: v for k, v in groups.items() if v}, path, x, metric, title)


# ----------------------------------------------------------------------------- settings, rows and runs

NOISE = "fedavg_shuffle"  # the noise-floor row's tag: FedAvg with only its minibatch orders changed
LONG = "fedavg_long"  # FedAvg run longer, read at the round of equal compute
AGAIN = "fedavg_again"  # FedAvg's row run again in a later sweep: the CPU time rows run in that sweep are timed against
TAIL = ["engine=inline", "logger.progress=false", "save_model=false"]  # every run; CPU settings add one thread


@dataclass
class Row:
    """A table row: one algorithm configuration, run once per seed."""

    tag: str  # folder name: <document data>/<setting>/<tag>/s<seed>
    label: str
    algorithm: str  # key of Setting.algorithm_overrides
    extra: list[str]  # overrides on top of the setting's and the algorithm's
    seeds: list[int]
    what: str = ""  # what the row changes (ablations, controls)
    parent: str = "fedavg"  # the main row an ablation varies
    priority: int = 1  # run order (lower first); seeds >= 5 of any row come last
    tuned: bool = False  # runs with its algorithm's values chosen on the validation split (Setting.tuning)


def noise_row(seeds: list[int], tuned: bool = False) -> Row:
    return Row(NOISE, "FedAvg, other minibatch orders (noise floor)", "fedavg", ["train.shuffle_offset=1"], seeds,
               "only the clients' minibatch orders changed (train.shuffle_offset=1)", tuned=tuned)


@dataclass(frozen=True)
class Tuning:
    """What each algorithm is tuned over, chosen on a validation split, never on the test set (issue 28 item 3).

    Every combination of an algorithm's grid runs on ``seeds`` (no table reports them) with
    ``early_stop.patience`` above the run's evaluations: each client holds out a stratified tenth of its
    training rows (``early_stop.val_fraction``, fl_platform/rounds/callbacks.py), the global model is
    evaluated on them at every evaluation, and the run never stops early. The combination with the highest
    validation accuracy (a run's mean of its last ``K_LAST`` evaluations, then the mean over ``seeds``) wins; a
    tie goes to the first in grid order. The rows marked ``tuned`` then run with the winner on all of the
    clients' training rows and are scored on the test set as every other row."""

    grids: dict[str, dict[str, tuple[float, ...]]]  # algorithm (Setting.algorithm_overrides key) -> key -> values
    seeds: tuple[int, ...]

    def points(self, algorithm: str) -> list[tuple[tuple[float, ...], tuple[str, ...]]]:
        """Each combination of the grid as (its values, its override tuple), in grid order (the first key
        varies slowest)."""
        grid = self.grids[algorithm]
        return [(values, tuple(f"{k}={v:g}" for k, v in zip(grid, values)))
                for values in itertools.product(*grid.values())]

    def combos(self, algorithm: str) -> list[tuple[str, ...]]:
        """The grid's combinations as override tuples, in grid order."""
        return [combo for _, combo in self.points(algorithm)]


# What a tuning run's artefact keeps of its metrics: the validation columns the choice reads (no test
# metric, so no table can be built from a tuning run's test accuracy) and the round they belong to.
TUNING_METRICS = ("round", "val_accuracy", "val_loss")


def combo_tag(combo: Sequence[str]) -> str:
    """The folder of one combination's tuning runs: ``train.lr=0.05, algorithm.mu=0.1`` -> ``train.lr0.05_algorithm.mu0.1``."""
    return "_".join(o.replace("=", "") for o in combo)


@dataclass
class Setting:
    """One data/model/training setting of a document and its rows."""

    name: str  # folder and anchor
    title: str
    overrides: list[str]  # data, partition, model, training (CPU settings)
    rounds: int
    rows: list[Row]
    algorithm_overrides: dict[str, list[str]]
    preset: str | None = None  # GPU: conf/experiment/<preset>.yaml, the paper's setting ...
    preset_algorithm: str = ""  # ... of this algorithm (others run in it without its algorithm keys)
    paper: dict[str, PaperClaim] = field(default_factory=dict)  # row tag (or "baseline") -> the paper's claim
    tuning: Tuning | None = None  # what the ``tuned`` rows are tuned over
    metrics: tuple[str, ...] | None = None  # the columns its rows' artefacts keep (None: all)
    chosen: dict[str, tuple[str, ...]] = field(default_factory=dict)  # algorithm -> winner (choose_tuned fills it)

    def overrides_of(self, row: Row) -> list[str]:
        """The row's CLI overrides (without the seed); a ``tuned`` row's include its algorithm's winner, so
        they exist only once its tuning runs are all in (``ready``)."""
        extra = [*row.extra, *self.winner(row.algorithm)] if row.tuned else row.extra
        if self.preset is not None:
            base = ([f"+experiment={self.preset}"] if row.algorithm == self.preset_algorithm else
                    [*preset_overrides(self.preset), *self.algorithm_overrides[row.algorithm]])
            return [*base, *extra, *TAIL]  # engine.device=auto: the GPU where there is one
        return [*self.overrides, f"rounds={self.rounds}", *self.algorithm_overrides[row.algorithm], *extra, *TAIL[:1],
                "engine.threads_per_worker=1", *TAIL[1:]]

    def winner(self, algorithm: str) -> tuple[str, ...]:
        if algorithm not in self.chosen:
            raise ValueError(f"{self.name}: {algorithm}'s tuning runs are not all in; its tuned rows cannot run yet")
        return self.chosen[algorithm]

    def ready(self, row: Row) -> bool:
        return not row.tuned or row.algorithm in self.chosen

    def tuning_jobs(self) -> list[Job]:
        """Every tuning run: each combination of each tuned algorithm on each tuning seed, on the validation split."""
        if self.tuning is None:
            return []
        validation = [f"early_stop.patience={self.rounds + 1}"]  # more than the run's evaluations: never stops
        return [Job(f"{self.name}/tune/{a}/{combo_tag(c)}", seed,
                    [*self.overrides_of(Row(a, a, a, [], [])), *c, *validation, f"seed={seed}"], TUNING_METRICS)
                for a in self.tuning.grids for c in self.tuning.combos(a) for seed in self.tuning.seeds]

    def row(self, tag: str) -> Row | None:
        return next((r for r in self.rows if r.tag == tag), None)

    def dataset(self) -> str:
        return preset_value(self.preset, "dataset") if self.preset else _value_of(self.overrides, "dataset")

    def num_clients(self) -> int:
        return int(preset_value(self.preset, "num_clients") if self.preset else _value_of(self.overrides, "num_clients"))


def _value_of(overrides: Sequence[str], key: str) -> str:
    return next(o.split("=", 1)[1] for o in reversed(overrides) if o.startswith(key + "="))


def priority(row: Row, seed: int) -> int:
    return row.priority if seed < 5 else max(4, row.priority)


def setting_jobs(settings: Sequence[Setting], max_priority: int = 99) -> list[Job]:
    """Every run up to ``max_priority``, lowest priority first (stable): the tuning runs first, then the rows;
    a tuned row only once its algorithm's winner is known (``choose_tuned``)."""
    out = [(0, j) for s in settings for j in s.tuning_jobs()]
    out += [(priority(row, seed), Job(f"{s.name}/{row.tag}", seed, [*s.overrides_of(row), f"seed={seed}"], s.metrics))
            for s in settings for row in s.rows if s.ready(row) for seed in row.seeds]
    return [j for p, j in sorted(out, key=lambda pj: pj[0]) if p <= max_priority]


def unmatched_patterns(settings: Sequence[Setting], patterns: Sequence[str]) -> list[str]:
    """The ``--only`` patterns that match no run of the plan at any priority (a tuned row's runs too, before
    its tuning is in): a mistyped row would otherwise read as "0 runs missing", as if all were done."""
    names = [j.name for j in setting_jobs(settings)]
    names += [f"{s.name}/{row.tag}/s{seed}" for s in settings for row in s.rows if not s.ready(row) for seed in row.seeds]
    return [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in names)]


def waiting_rows(settings: Sequence[Setting]) -> list[str]:
    """The tuned rows whose algorithm's tuning runs are not all in (they cannot be planned yet)."""
    return [f"{s.name}/{row.tag}" for s in settings for row in s.rows if not s.ready(row)]


def tuning_scores(s: Setting, cells: dict[str, dict[int, Run]], algorithm: str) -> dict[tuple[str, ...], float | None]:
    """Each combination's validation accuracy (mean over the tuning seeds of each run's last ``K_LAST``
    ``val_accuracy`` evaluations; None while a seed is missing; -inf when training diverged on a seed, a
    point never chosen). Reads no test metric."""
    assert s.tuning is not None
    out: dict[tuple[str, ...], float | None] = {}
    for combo in s.tuning.combos(algorithm):
        runs = cells.get(f"{s.name}/tune/{algorithm}/{combo_tag(combo)}", {})
        if not all(seed in runs for seed in s.tuning.seeds):
            out[combo] = None
        elif any(diverged(runs[seed]) for seed in s.tuning.seeds):
            out[combo] = -math.inf
        else:
            out[combo] = statistics.fmean(final_accuracy(runs[seed], metric="val_accuracy") for seed in s.tuning.seeds)
    return out


def choose_tuned(settings: Sequence[Setting], cells: dict[str, dict[int, Run]]) -> None:
    """Fill each setting's ``chosen`` from its tuning runs: per algorithm, the combination with the highest
    validation accuracy (the first in grid order on a tie), once every combination has all its seeds. A
    setting without a grid keeps the values it was given."""
    for s in settings:
        if s.tuning is None:
            continue
        s.chosen.clear()
        for algorithm in s.tuning.grids:
            scores = tuning_scores(s, cells, algorithm)
            if all(v is not None for v in scores.values()):
                best = max(scores, key=lambda c: scores[c])  # max keeps the first of equals
                if scores[best] == -math.inf:
                    raise ValueError(f"{s.name}: training diverged at every {algorithm} grid point; widen the grid "
                                     "towards smaller learning rates")
                s.chosen[algorithm] = best


def resolved(overrides: Sequence[str]) -> dict[str, str]:
    """key -> value of ``overrides`` as Hydra applies them (the last of a key wins)."""
    return dict(o.split("=", 1) for o in last_wins(overrides))


def stale_artefacts(jobs: Sequence[Job], cells: dict[str, dict[int, Run]]) -> list[Job]:
    """The planned runs whose artefact (in ``cells``, as load_cells read them) was made with other settings than
    the plan's (e.g. a tuned row run before its tuning chose another learning rate): they are run again, never
    reported as the row."""
    return [job for job in jobs if (run := cells.get(job.cell, {}).get(job.seed)) is not None
            and resolved(run["stats"]["overrides"]) != resolved(job.overrides)]


def tuning_section(s: Setting, cells: dict[str, dict[int, Run]], labels: dict[str, str], then: str = "") -> str:
    """The paragraph that opens a tuned setting: how its grid was scored, ``then`` (what the document adds about
    its rows), and the grid (tuning_table)."""
    assert s.tuning is not None
    return ("Tuning: validation accuracy (%, mean of the last "
            f"{K_LAST} evaluations and of seeds {', '.join(map(str, s.tuning.seeds))}) of each grid point on the "
            "validation split (a stratified tenth of each client's training rows held out; the test set is not "
            f"read); the chosen point in bold{then}:\n\n" + tuning_table(s, cells, labels))


def tuning_table(s: Setting, cells: dict[str, dict[int, Run]], labels: dict[str, str]) -> str:
    """Per tuned algorithm and value of its second key (if any), the validation accuracy of each learning rate
    (mean over the tuning seeds, %), the winner in bold, and the winner named in the last column (with a note
    when it sits at the edge of the grid: the grid may not contain the best value)."""
    assert s.tuning is not None
    table = []
    first_keys = {next(iter(g)) for g in s.tuning.grids.values()}
    if len(first_keys) != 1:
        raise ValueError(f"{s.name}: the tuning table wants one first key for every algorithm, got {sorted(first_keys)}")
    key = first_keys.pop()
    columns = sorted({v for g in s.tuning.grids.values() for v in g[key]})
    for a, grid in s.tuning.grids.items():
        scores = tuning_scores(s, cells, a)
        win = s.chosen.get(a)
        combo_of = dict(s.tuning.points(a))  # values -> override tuple
        win_values = next((v for v, c in combo_of.items() if c == win), None)
        at_edge = grid_edges(s, a)
        others = list(grid)[1:]
        for rest in itertools.product(*(grid[k] for k in others)):
            cells_row = []
            for v in columns:
                combo = combo_of.get((v, *rest))
                if combo is None:
                    cells_row.append("-")  # not in this algorithm's grid
                    continue
                score = scores[combo]
                text = "-" if score is None else "diverged" if score == -math.inf else f"{100 * score:.2f}"
                cells_row.append(f"**{text}**" if combo == win else text)
            name = labels.get(a, a) + "".join(f", {k} = {x:g}" for k, x in zip(others, rest))
            edge = "-"
            if win_values is not None and tuple(rest) == win_values[1:]:
                edge = " ".join(win) + (f" (at the grid's edge in {', '.join(at_edge)})" if at_edge else "")
            table.append([name, *cells_row, edge])
    return md_table(["algorithm", *(f"{key} = {v:g}" for v in columns), "chosen"], table)


def upload_ratio(fedavg: dict[int, Run]) -> Callable[[str, dict[int, Run]], str]:
    """A main-table column: a row's mean uploaded bytes per run over FedAvg's on the same seeds, what a
    method's gain costs in communication (FedImpro uploads its feature statistics, SCAFFOLD its control
    variates)."""
    def mean_up(runs: dict[int, Run], seeds: list[int]) -> float:
        return statistics.fmean(sum(r.get("bytes_up", 0) for r in runs[k]["rows"]) for k in seeds) if seeds else 0.0

    def cell(_tag: str, runs: dict[int, Run]) -> str:
        seeds = sorted(set(runs) & set(fedavg))
        return f"{mean_up(runs, seeds) / base:.2f}x" if (base := mean_up(fedavg, seeds)) else "-"
    return cell


def grid_edges(s: Setting, algorithm: str) -> list[str]:
    """The keys of ``algorithm``'s grid (of more than one value) whose chosen value is the grid's least or
    greatest: the grid may not hold that key's best value, so the row counts as not tuned (untuned_reason)."""
    if s.tuning is None or algorithm not in s.tuning.grids or algorithm not in s.chosen:
        return []
    grid = s.tuning.grids[algorithm]
    values = next(v for v, c in s.tuning.points(algorithm) if c == s.chosen[algorithm])
    return [k for k, x in zip(grid, values) if len(grid[k]) > 1 and x in (min(grid[k]), max(grid[k]))]


# ----------------------------------------------------------------------------- document sections


def accuracies(runs: dict[int, Run], **kw: Any) -> dict[int, float]:
    return {seed: final_accuracy(run, **kw) for seed, run in sorted(runs.items())}


def diverged(run: Run) -> bool:
    """Whether the platform stopped ``run`` because training became non-finite (run_job records it in run.json)."""
    return bool(run["stats"].get("diverged"))


def finished(runs: dict[int, Run]) -> dict[int, Run]:
    """The runs that ran to their end: a diverged run (its run.json says so) has no final accuracy, and its
    metrics stop at the divergence, so no table or plot reads it (``missing_runs`` and ``diverged_reason`` name
    it instead)."""
    return {seed: run for seed, run in runs.items() if not diverged(run)}


def diverged_seeds(s: Setting, cells: dict[str, dict[int, Run]], tag: str) -> list[int]:
    return sorted(k for k, run in cells.get(f"{s.name}/{tag}", {}).items() if diverged(run))


def seed_count(s: Setting, cells: dict[str, dict[int, Run]], tag: str, n: int) -> str:
    """A table's seed count for row ``tag``, saying how many more seeds diverged: its numbers are then a
    survivors' mean, and the column says so where the eye reads the count."""
    lost = diverged_seeds(s, cells, tag)
    return f"{n} (+{len(lost)} diverged)" if lost else str(n)


def diverged_reason(s: Setting, cells: dict[str, dict[int, Run]], *tags: str) -> str:
    """Which of the rows ``tags`` diverged on some seed ("" when none did): their numbers are over the seeds
    that finished, a survivors' mean, so a verdict on them is "untested"."""
    out = [f"{s.row(t).label} diverged on {len(d)} of {len(s.row(t).seeds)} seeds" for t in tags
           if s.row(t) is not None and (d := diverged_seeds(s, cells, t))]
    return "; ".join(out)


def setting_runs(s: Setting, cells: dict[str, dict[int, Run]]) -> dict[str, dict[int, Run]]:
    """tag -> seed -> run of every row of ``s``, finished runs only."""
    return {row.tag: finished(cells.get(f"{s.name}/{row.tag}", {})) for row in s.rows}


def method_paragraph() -> str:
    return (f"Every number is a run's mean of its last {K_LAST} test evaluations (never the best evaluation, "
            "which would select on the test set); ± is the half-width of the 95% Student-t interval over seeds; "
            "a difference is paired by seed (same partition, initial model and client sampling) with its 95% "
            "interval in brackets and the paired t-test's p; 'reading' says higher or lower only when the "
            "interval excludes 0, else 'no detectable difference'. Accuracies in %, differences in points. The "
            "noise-floor row reruns FedAvg with only its clients' minibatch orders changed: how large a paired "
            "difference comes from nothing but shuffling.")


def provenance(doc: str, artefacts: Path, cells: dict[str, dict[int, Run]], command: str) -> str:
    n = sum(len(v) for v in cells.values())
    rel = artefacts.relative_to(REPO).as_posix() if artefacts.is_relative_to(REPO) else artefacts.name
    return (f"Produced by `{command}`; `{command} --from-artefacts` rebuilds this text from the committed "
            f"artefacts alone ({rel}/, {n} runs: summary.json, metrics.jsonl.gz, config.yaml.gz, run.json). Runs made "
            f"at commit {', '.join(c[:10] for c in commits(cells))}{machines(cells)}; {cpu_hours(cells):.2f} CPU-hours "
            "in all, one torch thread per run. Method and statistics: [README.md](README.md).")


def machines(cells: dict[str, dict[int, Run]]) -> str:
    """", on <cpu> with torch <version> (n runs), ..." for the runs whose run.json records its machine
    (``machine``; "" when none does): runs made on other machines may differ in their last digits."""
    count: dict[str, int] = {}
    for runs in cells.values():
        for run in runs.values():
            m = run["stats"].get("machine")
            key = f"{m['cpu']} with torch {m['torch']}" if m else "a machine not recorded"
            count[key] = count.get(key, 0) + 1
    if set(count) <= {"a machine not recorded"}:
        return ""
    return ", on " + ", ".join(f"{k} ({n} run{'s' if n > 1 else ''})" for k, n in sorted(count.items()))


def sweep(run: Run) -> tuple:
    """What two runs' CPU times compare under: the commit (the code, and the sweep of the shared machine it ran
    in) and the machine run.json records (none before it did); another load or another machine changes CPU time."""
    machine = run["stats"].get("machine") or {}
    return run["stats"].get("commit"), tuple(sorted(machine.items()))


def in_fedavg_sweeps(r: dict[int, Run], fedavg: dict[int, Run]) -> list[Run]:
    """A row's runs made in a sweep of FedAvg's runs (``sweep``): the only runs whose CPU time compares with
    FedAvg's."""
    sweeps = {sweep(run) for run in fedavg.values()}
    return [run for run in r.values() if sweep(run) in sweeps]


def main_table(s: Setting, cells: dict[str, dict[int, Run]], tags: Sequence[str],
               extra: dict[str, Callable[[str, dict[int, Run]], str]] | None = None) -> tuple[str, dict[str, Interval]]:
    """Rows ``tags`` (those with runs) against FedAvg: seeds, accuracy, FedAvg's accuracy on the same seeds,
    paired difference, p, reading, ``extra`` columns (each cell from the row's tag and its finished runs),
    CPU seconds per round and per run (marked where some of the row's runs are not in FedAvg's sweeps,
    ``in_fedavg_sweeps``: another commit or machine); returns the table and the differences. A row's numbers
    are all over the seeds it shares with FedAvg (never two seed sets in one row: a 5-seed row is not set
    against FedAvg's 10-seed mean)."""
    runs = setting_runs(s, cells)
    base = accuracies(runs["fedavg"])
    header = ["algorithm", "seeds", f"accuracy (mean of the last {K_LAST} evaluations)", "FedAvg on the same seeds",
              "minus FedAvg (paired, 95% CI)", "p", "reading", *(extra or {}), "CPU s per round", "CPU s per run"]
    rows, diffs, marked = [], {}, False
    for tag in tags:
        r, row = runs.get(tag), s.row(tag)
        if not r or row is None:
            continue
        other = " †" if len(in_fedavg_sweeps(r, runs["fedavg"])) < len(r) else ""
        marked |= bool(other)
        acc = accuracies(r)
        shared = sorted(set(acc) & set(base))
        d = paired(acc, base)
        if tag != "fedavg":
            diffs[tag] = d
        same = tag == "fedavg"
        rows.append([row.label, seed_count(s, cells, tag, len(shared)), fmt_mean(interval([acc[k] for k in shared])),
                     "-" if same else fmt_mean(interval([base[k] for k in shared])), "-" if same else fmt_diff(d),
                     "-" if same else fmt_p(d), "-" if same else reading(d), *(f(tag, r) for f in (extra or {}).values()),
                     f"{cpu_per_round(r.values()):.3g}{other}",
                     f"{statistics.fmean(run['stats']['cpu_s'] for run in r.values()):.0f}{other}"])
    note = ("\n† Some or all of the row's runs were made in none of FedAvg's sweeps (another commit, or another "
            "recorded machine): its CPU seconds do not compare with FedAvg's.\n") if marked else ""
    return md_table(header, rows) + note, diffs


def fednova_note(runs: dict[str, dict[int, Run]]) -> str:
    """What FedNova's row means in a setting, from its runs' logged tau_eff (the effective step count of each
    round): with one value in every round every sampled client took the same number of local steps, and FedNova's
    normalised average is FedAvg's (docs/algorithms/fednova.md), so its row is FedAvg up to float rounding."""
    nova, avg = runs.get("fednova"), runs.get("fedavg")
    if not nova or not avg:
        return ""
    taus = {row["tau_eff"] for run in nova.values() for row in run["rows"] if row.get("tau_eff") is not None}
    if len(taus) != 1:
        return (f"FedNova: the sampled clients' step counts differ (tau_eff {min(taus):.3g}-{max(taus):.3g} over the "
                "rounds), so its normalised average differs from FedAvg's.\n\n") if taus else ""
    a, b = accuracies(nova), accuracies(avg)
    gap = max(abs(a[k] - b[k]) for k in set(a) & set(b))
    return (f"FedNova: every sampled client took {next(iter(taus)):g} local steps in every round (tau_eff), so its "
            "normalised average is FedAvg's (tau_eff sum_i p_i Delta_i / tau_i = sum_i p_i Delta_i): its row is FedAvg "
            f"up to float rounding (largest per-seed difference {100 * gap:.2f} points), not a separate baseline "
            "here.\n\n")


def seed_list(seeds: Sequence[int]) -> str:
    """"seed 3", "seeds 0-9", "seeds 1, 4"."""
    run = len(seeds) > 1 and list(seeds) == list(range(seeds[0], seeds[-1] + 1))
    return (f"seeds {seeds[0]}-{seeds[-1]}" if run else ("seeds " if len(seeds) > 1 else "seed ")
            + ", ".join(map(str, seeds)))


def missing_runs(s: Setting, cells: dict[str, dict[int, Run]]) -> str:
    """The planned runs without a number, per row: those without an artefact (what a later run of this script
    adds) and those whose training diverged (made, and recorded as such: never run again)."""
    out, gone = [], []
    for r in s.rows:
        have = set(cells.get(f"{s.name}/{r.tag}", {}))
        todo = [k for k in r.seeds if k not in have]
        if todo:
            out.append(f"{r.label} ({seed_list(todo)})")
        if d := diverged_seeds(s, cells, r.tag):
            first = cells[f"{s.name}/{r.tag}"][d[0]]["stats"]["diverged"]
            gone.append(f"{r.label} ({seed_list(d)}" + (f"; seed {d[0]}: `{first}`)" if len(d) > 1 else f": `{first}`)"))
    text = ("Planned runs not made yet: " + "; ".join(out) + ".\n\n") if out else ""
    if gone:
        text += ("Runs whose training diverged (the loss became non-finite and the platform stopped the run, "
                 "which has no final accuracy): " + "; ".join(gone) + ". These rows' numbers, and every comparison "
                 "with them, are over the seeds that finished (a survivors' mean, which flatters the row); their "
                 "verdicts read \"untested\".\n\n")
    return text


def last_wins(overrides: Sequence[str]) -> list[str]:
    """``overrides`` as Hydra applies them: of several ``key=value`` for one key only the last counts."""
    last = {o.split("=", 1)[0]: i for i, o in enumerate(overrides)}
    return [o for i, o in enumerate(overrides) if last[o.split("=", 1)[0]] == i]


def rows_list(s: Setting, tags: Sequence[str]) -> str:
    """The overrides that tell the rows apart (the setting's own are printed once above), each key once
    with the value the run used."""
    common = {*s.overrides, f"rounds={s.rounds}", *TAIL, "engine.threads_per_worker=1",
              *(preset_overrides(s.preset) if s.preset else ())}
    out = []
    for tag in tags:
        row = s.row(tag)
        if row is not None and not s.ready(row):  # (a document built while tuning runs are still missing)
            out.append(f"- {row.label}: waits for {row.algorithm}'s tuning runs (its values are chosen on them)")
        elif row is not None:
            out.append(f"- {row.label}: `{' '.join(o for o in last_wins(s.overrides_of(row)) if o not in common)}`")
    return "\n".join(out) + "\n"


def setting_header(s: Setting) -> str:
    where = (f"`+experiment={s.preset}` (conf/experiment/{s.preset}.yaml)" if s.preset else
             f"`{' '.join(s.overrides)} rounds={s.rounds}`")
    return f"## {s.title}\n\nSetting: {where}\n\n"


def sweep_name(key: tuple) -> str:
    """A ``sweep`` key as the documents name it: the commit's first 10 characters and the recorded CPU."""
    commit, machine = key
    return f"{(commit or 'no commit')[:10]}" + (f" on {dict(machine)['cpu']}" if dict(machine).get("cpu") else "")


def equal_compute_table(s: Setting, cells: dict[str, dict[int, Run]], tags: Sequence[str]) -> str:
    """Each row of ``tags`` against FedAvg given the same compute: FedAvg's ``LONG`` run read at the
    evaluated round nearest (CPU seconds per round of the row / FedAvg's) x ``s.rounds``. A row's cost is
    read from its runs in a sweep (``sweep``: commit and machine) of FedAvg's own runs or of FedAvg run again
    (``AGAIN``, for rows run after FedAvg's sweep), over FedAvg's runs of that sweep: CPU time measured on
    another machine or under another load is not comparable. A row with runs in several of them is timed in
    the one holding most; a row with none is left out and named."""
    runs = setting_runs(s, cells)
    long, fedavg = runs.get(LONG), runs.get("fedavg")
    if not long or not fedavg:
        return ""
    refs = {tag: list(runs.get(tag, {}).values()) for tag in ("fedavg", AGAIN)}
    # each sweep's FedAvg runs: FedAvg's own row where FedAvg run again shares its sweep
    ref_sweeps = {sweep(run): AGAIN for run in refs[AGAIN]} | {sweep(run): "fedavg" for run in refs["fedavg"]}
    eval_rounds = [r for r, _ in evaluations(next(iter(long.values())))]
    rows, left_out = [], []
    for tag in tags:
        r = runs.get(tag)
        if not r:
            continue
        groups: dict[tuple, list[Run]] = {}
        for run in r.values():
            if (key := sweep(run)) in ref_sweeps:
                groups.setdefault(key, []).append(run)
        if not groups:
            left_out.append(s.row(tag).label)
            continue
        key, timed = max(groups.items(), key=lambda kv: len(kv[1]))
        base = [run for run in refs[ref_sweeps[key]] if sweep(run) == key]
        ratio = cpu_per_round(timed) / cpu_per_round(base)
        r_eq = equal_compute_round(ratio, s.rounds, eval_rounds)
        acc = accuracies(r)
        at_eq = {seed: final_accuracy(run, upto_round=r_eq) for seed, run in sorted(long.items())}
        short = " (the long run's end: FedAvg gets less than equal compute)" if ratio * s.rounds > max(eval_rounds) + 1 else ""
        d = paired(acc, at_eq)
        against = "FedAvg" if ref_sweeps[key] == "fedavg" else f"FedAvg run again (`{AGAIN}`)"
        there = interval([at_eq[k] for k in sorted(set(acc) & set(at_eq))])
        rows.append([s.row(tag).label, f"{against}: {len(base)} runs at {sweep_name(key)}",
                     f"{ratio:.2f} ({len(timed)} runs)", f"{r_eq}{short}", fmt_mean(there),
                     seed_count(s, cells, tag, d.n), fmt_diff(d), fmt_p(d), reading(d)])
    header = ["algorithm", "timed against", "CPU s per round / FedAvg's (runs timed)",
              "FedAvg's round of equal compute", f"FedAvg there (last {K_LAST} evaluations)", "seeds",
              "algorithm minus FedAvg at equal compute", "p", "reading"]
    again = (f" Rows run after FedAvg's sweep are timed against `{AGAIN}` ({s.row(AGAIN).label}: FedAvg's row at "
             "their commit, on their machine)." if s.row(AGAIN) is not None else "")
    return (f"### Equal compute\n\nCompute per round: the median CPU seconds of a round without evaluation over a "
            f"row's runs (the run process's CPU time sampled at every metrics row: local training and aggregation in "
            f"one torch thread; CPU time, unlike `round_time_s`, does not count the waiting on a shared machine). "
            f"FedAvg also runs {max(eval_rounds)} rounds (`{LONG}`, the same seeds); "
            f"a row that costs c times FedAvg per round is compared, seed by seed, with that run's mean of the last "
            f"{K_LAST} evaluations up to round c x {s.rounds} (the nearest evaluated round). {_prefix_check(fedavg, long)} "
            f"A row's cost is timed on its runs made in a sweep of FedAvg's runs, against FedAvg's runs of that sweep "
            f"(the same commit on the same recorded machine: another machine, or another load on the shared one, "
            f"changes CPU time).{again}"
            + (f" Left out, no run timed in those sweeps: {', '.join(left_out)}." if left_out else "") + "\n\n"
            + md_table(header, rows))


def _prefix_check(short: dict[int, Run], long: dict[int, Run]) -> str:
    """Whether the long runs begin with the short runs' evaluations (every draw depends on (seed, round,
    client) only, so they should), stated from the artefacts."""
    seeds = sorted(set(short) & set(long))
    same = [s for s in seeds if evaluations(short[s]) == evaluations(long[s])[: len(evaluations(short[s]))]]
    if len(same) == len(seeds):
        return f"The long runs' evaluations up to round {max(r for r, _ in evaluations(short[seeds[0]]))} equal FedAvg's own runs' for all {len(seeds)} seeds."
    return f"The long runs' first evaluations differ from FedAvg's own runs for seeds {sorted(set(seeds) - set(same))}."


def untuned_reason(s: Setting, *tags: str) -> str:
    """Why the rows ``tags`` are not all tuned on a validation split ("" when they are: ``Row.tuned``). A GPU
    preset's rows run the paper's own hyper-parameters, so their comparison is the paper's: "" too."""
    if s.preset is not None:
        return ""
    rows = [s.row(t) for t in tags if s.row(t) is not None]
    untuned = [r.label for r in rows if not r.tuned]
    # the learning rate only: FedProx's mu grid is the fixed {0.001, ..., 1}, and its least value sits
    # next to FedAvg (mu = 0), a tuned row of its own
    edges = [f"{r.label}'s {' '.join(s.winner(r.algorithm))} (at the grid's edge in train.lr: the grid may not "
             "hold its best)" for r in rows if r.tuned and "train.lr" in grid_edges(s, r.algorithm)]
    if untuned:
        lrs = sorted({resolved(s.overrides_of(r)).get("train.lr", "?") for r in rows if not r.tuned})
        edges.insert(0, f"{' and '.join(untuned)} not tuned (learning rate {', '.join(lrs)} set by hand, the same "
                     "for every method; no validation-split tuning)")
    return "; ".join(edges)


def verdict_rows(s: Setting, cells: dict[str, dict[int, Run]], diffs: dict[str, Interval], tags: Sequence[str]
                 ) -> list[tuple[PaperClaim, Interval | None, str] | tuple[PaperClaim, Interval | None, str, str]]:
    """(claim, our paired difference to FedAvg, 'FedAvg'[, the ours cell]) for the rows ``tags`` that ran; a
    row without its own claim takes the setting's ``baseline`` claim; a comparison with an untuned row, or with
    a row that diverged on some seed, says so. A row every seed of which diverged has no difference, and
    keeps its verdict row, saying so in the ours cell, rather than drop out of the table."""
    out: list[tuple[PaperClaim, Interval | None, str] | tuple[PaperClaim, Interval | None, str, str]] = []
    for tag in tags:
        row = s.row(tag)
        lost = diverged_seeds(s, cells, tag)
        if row is None or (tag != "fedavg" and tag not in diffs and not lost):
            continue
        claim = s.paper.get(tag) or s.paper["baseline"]
        claim = replace(claim, algorithm=f"{claim.algorithm or row.label} ({s.name})",
                        untuned=untuned_reason(s, tag, "fedavg"), diverged=diverged_reason(s, cells, tag, "fedavg"))
        if tag == "fedavg":
            out.append((claim, None, "FedAvg"))
        elif tag in diffs:
            out.append((claim, diffs[tag], "FedAvg"))
        else:
            out.append((claim, None, "FedAvg", f"none: diverged on {len(lost)} of {len(lost)} seeds that ran"))
    return out


def suffix_of(doc: str, artefacts: Path) -> str:
    """``_tiny``/``_gpu`` of a non-default artefacts folder (plots of a check never overwrite the document's)."""
    return artefacts.name[len(doc):] if artefacts.name.startswith(doc) else f"_{artefacts.name}"


def plot_rows(s: Setting, cells: dict[str, dict[int, Run]], tags: Sequence[str], out: Path | None, name: str,
              title: str) -> str:
    """A plot of the rows ``tags`` (written when ``out`` is given) and its markdown link."""
    runs = setting_runs(s, cells)
    if out is not None:
        plot_cells({s.row(t).label: list(runs[t].values()) for t in tags if runs.get(t)}, out / name, title)
    return f"![{title}]({name})\n"


# ----------------------------------------------------------------------------- command line


def cli(doc: str, argv: list[str] | None, description: str,
        settings_of: Callable[[str, str], list[Setting]],
        build: Callable[[list[Setting], dict[str, dict[int, Run]], Path | None, str, Path], str],
        presets: Sequence[str] = ("cpu",)) -> int:
    """The command line every results script shares: run what is missing (or ``--plan``, or only
    ``--from-artefacts``), then build the document from the artefacts.

    ``settings_of(budget, preset)`` lists the settings; ``build(settings, cells, plots folder or None,
    command, artefacts folder)`` returns the generated text."""
    import argparse

    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", choices=["full", "tiny"], default="full", help="tiny: a check of the pipeline")
    ap.add_argument("--preset", choices=list(presets), default=presets[0],
                    help="gpu: the papers' settings from conf/experiment/ (a GPU machine with the datasets)")
    ap.add_argument("--from-artefacts", action="store_true", help="only rebuild the document from the artefacts")
    ap.add_argument("--plan", action="store_true", help="list the runs still missing and check the data; run nothing")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--max-priority", type=int, default=99, help="run only rows up to this priority")
    ap.add_argument("--only", nargs="+", default=None, metavar="PATTERN",
                    help="run only the missing runs whose <setting>/<row>/s<seed> matches one of these shell "
                         "patterns (e.g. 'femnist/fednova/*'); the document is still built from every artefact")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--commit", default="HEAD", help="code to run: a git revision (snapshot) or 'worktree'")
    ap.add_argument("--runs", default=None, help="run directories (default outputs/results/<document>)")
    ap.add_argument("--artefacts", default=None, help="default docs/results/data/<document>[_tiny][_gpu]")
    ap.add_argument("--out", default=str(DOCS), help="folder of the document and its plots")
    args = ap.parse_args(argv)
    suffix = ("" if args.budget == "full" else f"_{args.budget}") + ("" if args.preset == "cpu" else f"_{args.preset}")
    artefacts = Path(args.artefacts) if args.artefacts else DATA / f"{doc}{suffix}"
    settings = settings_of(args.budget, args.preset)
    if args.only and not args.from_artefacts:
        unmatched = unmatched_patterns(settings, args.only)
        if unmatched:
            rows = sorted({f"{s.name}/{row.tag}" for s in settings for row in s.rows})
            print(f"--only {' '.join(repr(p) for p in unmatched)} matches no run of the plan (<setting>/<row>/s<seed>; "
                  f"tuning runs <setting>/tune/...); its rows: {', '.join(rows)}", file=sys.stderr)
            return 2
    code = None
    while not args.from_artefacts:  # twice where tuned rows wait for their tuning runs
        cells = load_cells(artefacts) if artefacts.exists() else {}
        choose_tuned(settings, cells)
        planned = [j for j in setting_jobs(settings, args.max_priority)
                   if args.only is None or any(fnmatch.fnmatchcase(j.name, p) for p in args.only)]
        stale = stale_artefacts(planned, cells)
        todo = [j for j in planned if j in stale or not (artefacts / j.name / "run.json").exists()]
        need: dict[str, int] = {}
        for s in settings:
            need[s.dataset()] = max(need.get(s.dataset(), 0), s.num_clients())
        missing = check_data(sorted(need), need) if todo else []
        waiting = waiting_rows(settings)
        if args.plan:
            for j in todo:
                print(f"{j.name}: python -m fl_platform.run {' '.join(j.overrides)}"
                      + ("  (its artefact was made with other settings: replaced)" if j in stale else ""))
            print(f"{len(todo)} runs missing" + (f"; {len(waiting)} tuned rows wait for their tuning runs" if waiting else "")
                  + "; data: " + ("present" if not missing else "MISSING\n" + "\n".join(missing)))
            return 2 if missing else 0
        if missing:
            print("cannot run: data missing\n" + "\n".join(missing), file=sys.stderr)
            return 2
        if not todo:
            break
        for j in stale:
            print(f"{j.name}: its artefact was made with other settings than the plan's; running it again", flush=True)
            shutil.rmtree(artefacts / j.name)
        code = code or code_snapshot(args.commit)
        run_jobs(todo, Path(args.runs) if args.runs else RUNS / f"{doc}{suffix}", artefacts, code, args.jobs, args.threads)
        if not waiting:
            break
    cells = load_cells(artefacts) if artefacts.exists() else {}
    choose_tuned(settings, cells)
    wrong = [j.name for j in stale_artefacts(setting_jobs(settings), cells)]
    wrong += [f"{row}/s{seed}" for row in waiting_rows(settings) for seed in cells.get(row, {})]
    if wrong:  # never a row from runs it does not plan (e.g. a learning rate its tuning did not choose)
        print(f"{len(wrong)} artefacts are not the runs their rows plan (made with other settings, or a tuned row's "
              f"before its tuning runs were all in), e.g. {wrong[0]}: run without --from-artefacts to replace them",
              file=sys.stderr)
        return 2
    command = f"python scripts/results_{doc}.py" + "".join(
        f" --{k} {v}" for k, v in (("budget", args.budget), ("preset", args.preset)) if v not in ("full", "cpu"))
    out = Path(args.out)
    text = build(settings, cells, None if args.no_plots else out, command, artefacts)
    path = out / f"{doc}{suffix}.md"
    write_document(path, text)
    print(f"wrote {path}")
    return 0
