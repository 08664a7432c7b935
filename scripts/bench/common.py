"""Benchmark helpers: run a measurement in a fresh child process, sample the peak RSS of its whole
process tree (Ray's raylet, GCS and workers included), compose run configs exactly as the CLI
does, and write a section of ``docs/benchmarks.md`` between markers without touching the others.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Ray processes of the benchmarks (and of their child processes) bind 127.0.0.1 only.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

REPO = Path(__file__).resolve().parents[2]
BENCH_DIR = Path(__file__).resolve().parent


def compose(*overrides: str):
    """The config ``python -m fl_platform.run <overrides>`` would run (progress bar off)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from fl_platform.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=["logger.progress=false", *overrides])


def tree_rss(pid: int) -> int:
    """Resident set size of ``pid`` and all its descendants, in bytes (0 once it is gone)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


class PeakRSS:
    """Samples ``tree_rss(pid)`` every ``interval`` seconds in a thread; ``peak`` is the maximum seen."""

    def __init__(self, pid: int, interval: float = 0.05) -> None:
        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def sample(self) -> None:
        self.peak = max(self.peak, tree_rss(self.pid))

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class ChildResult:
    ok: bool
    data: dict[str, Any] = field(default_factory=dict)
    peak_rss: int = 0
    wall_s: float = 0.0
    error: str = ""
    monitor: Any = None  # the PeakRSS that sampled the child


def run_child(args: list[str], timeout: float, env: dict[str, str] | None = None,
              monitor: Callable[[int], PeakRSS] | None = None, checkout: Path = REPO) -> ChildResult:
    """Run ``python -c 'import engine; engine.child_main()' <args>`` style commands: the child writes
    its result as JSON to the file named by ``--out``; the parent samples its process tree's RSS
    (with ``monitor(pid)``, a ``PeakRSS`` or a subclass, when given; ``ChildResult.monitor`` is it).
    The child runs in ``checkout`` (another copy of the platform, for an A/B), importing from it."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as fh:
        out = Path(fh.name)
    child_env = {**os.environ, **(env or {})}
    bench_dir = checkout / BENCH_DIR.relative_to(REPO)
    child_env["PYTHONPATH"] = os.pathsep.join([str(bench_dir), str(checkout), child_env.get("PYTHONPATH", "")])
    t0 = time.perf_counter()
    proc = subprocess.Popen([*args, "--out", str(out)], env=child_env, cwd=checkout, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    with (monitor or PeakRSS)(proc.pid) as rss:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.wait()
    reader.join(timeout=5)
    wall = time.perf_counter() - t0
    _kill_tree(proc.pid)  # leftovers (Ray processes) of a child that exited without cleaning up
    try:
        data = json.loads(out.read_text()) if out.stat().st_size else {}
    finally:
        out.unlink(missing_ok=True)
    if proc.returncode != 0 or not data:
        tail = "".join(log)[-3000:]
        return ChildResult(False, data, rss.peak, wall, f"exit code {proc.returncode}: {tail}", rss)
    return ChildResult(True, data, rss.peak, wall, monitor=rss)


def _kill_tree(pid: int) -> None:
    """Stop the child's process group (it was started in its own session) and its descendants."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        procs = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(procs, timeout=10)


def process_age_s() -> float:
    """Seconds since this process was created (interpreter start and imports included)."""
    import psutil

    return time.time() - psutil.Process().create_time()


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def combine_repeats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from repeated runs of the same (configuration, system): the median of each timing
    (per-run medians of the round time, start-up, ...), the largest peak RSS, and every run's
    median round time under ``repeat_round_s`` (their spread shows the machine's noise). A failed
    run makes the row fail."""
    failed = [r for r in runs if not r["ok"]]
    if failed:
        return failed[0]
    row = dict(runs[-1])
    for key in ("median_round_s", "startup_s", "first_round_s", "wall_s"):
        if all(key in r for r in runs):
            row[key] = statistics.median(r[key] for r in runs)
    row["peak_rss_mb"] = max(r["peak_rss_mb"] for r in runs)
    row["repeat_round_s"] = [r["median_round_s"] for r in runs]
    row["repeats"] = len(runs)
    return row


def measure_interleaved(label: str, systems: list[str], runs_of: Callable[[str], int],
                        measure: Callable[[str], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each system's combined row (``combine_repeats``) from ``runs_of(system)`` runs of
    ``measure(system)``, the systems interleaved run by run (a, b, c, a, b, c, ...) so that the
    machine's drifts fall on every system alike. Prints one line per run, prefixed with ``label``."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for rep in range(max((runs_of(s) for s in systems), default=0)):
        for system in systems:
            if rep >= runs_of(system):
                continue
            print(f"[bench] {label} {system} (run {rep + 1}) ...", flush=True)
            row = measure(system)
            runs.setdefault(system, []).append(row)
            brief = (f"round {fmt(row.get('median_round_s'), 4)} s, start-up {fmt(row.get('startup_s'), 2)} s, "
                     f"RSS {row['peak_rss_mb']:.0f} MB, acc {fmt(row.get('accuracy'), 4)}") if row["ok"] \
                else row["error"]
            print(f"[bench] {label} {system}: {brief}", flush=True)
    return {system: combine_repeats(done) for system, done in runs.items()}


def spread(row: dict[str, Any]) -> str:
    """The per-run median round times of a combined row as 'min-max' (ms), or '' for one run."""
    runs = row.get("repeat_round_s") or []
    if len(runs) < 2:
        return ""
    return f"{min(runs) * 1e3:.1f}-{max(runs) * 1e3:.1f}"


def add_output_args(p: argparse.ArgumentParser, name: str) -> None:
    """``--results`` (raw rows, ``docs/results/bench_<name>.json``), ``--doc`` and ``--no-write``."""
    p.add_argument("--results", type=Path, default=REPO / "docs" / "results" / f"bench_{name}.json")
    p.add_argument("--doc", type=Path, default=REPO / "docs" / "benchmarks.md")
    p.add_argument("--no-write", action="store_true", help="print the table, do not touch the results or the doc")


def parse_systems(p: argparse.ArgumentParser, value: str, known: Any) -> list[str]:
    """The comma list ``value`` of systems, each one of ``known`` (else the parser's usage error)."""
    systems = [s for s in value.split(",") if s]
    for s in systems:
        if s not in known:
            p.error(f"--systems: unknown {s!r}; choose from {', '.join(known)}")
    return systems


def write_section(path: Path, name: str, body: str, title: str = "# Benchmarks") -> None:
    """Replace (or append) the text between ``<!-- name:start -->`` and ``<!-- name:end -->``."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else f"{title}\n\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def hardware_line() -> str:
    import psutil
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = psutil.virtual_memory().total / 2**30
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()} CPU cores ({cpu}), {mem:.0f} GiB RAM, {gpu}; Python {sys.version.split()[0]}, "
            f"torch {torch.__version__}")


def fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}f}"


def write_cifar_like(root: Path, train: int = 2000, test: int = 500, seed: int = 0) -> None:
    """CIFAR-shaped synthetic images (class-dependent colours plus noise) in CIFAR-10's own
    python-pickle batches under ``root``, for ``dataset=cifar10 dataset.root=<root>`` (the real loader)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    means = rng.integers(40, 216, (10, 3, 1, 1))

    def images(n: int) -> tuple[np.ndarray, list[int]]:
        y = rng.integers(0, 10, n)
        x = np.clip(means[y] + rng.normal(0, 40, (n, 3, 32, 32)), 0, 255).astype(np.uint8)
        return x.reshape(n, -1), y.tolist()

    def dump(path: Path, n: int) -> None:
        x, y = images(n)
        with open(path, "wb") as fh:
            pickle.dump({b"data": x, b"labels": y, b"batch_label": b"smoke", b"filenames": [b"x"] * n}, fh, protocol=2)

    for i in range(1, 6):
        dump(folder / f"data_batch_{i}", train // 5)
    dump(folder / "test_batch", test)
    with open(folder / "batches.meta", "wb") as fh:
        pickle.dump({b"label_names": [f"c{i}".encode() for i in range(10)]}, fh, protocol=2)
