"""docs/tutorial-algorithm.md stays true: every command in its ``<!-- tutorial: run -->`` blocks runs.

The first command runs as typed, in a shell (with ``hydra.run.dir`` added so nothing lands in the
repository); the others run in this process through ``fl_platform.api.run`` (what the CLI runs,
tests/test_api.py) and ``fl_platform.flower.local.run_local``, so they share one Ray instance.
``pip install -e examples/my_algorithm`` is done as pip does it for an editable install: a
``.dist-info`` with the entry points of that pyproject.toml, and the folder on the path. Then the
tutorial's claims are checked: the numbers it quotes, the installed plug-in equal to the one named
by import path, Ray equal to inline, Flower equal to the simulator, the error listing ``fedadam``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fl_platform import api
from fl_platform.config import register_configs, unregister_algorithm_option
from fl_platform.flower.local import run_local

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "tutorial-algorithm.md"
PLUGIN_DIR = REPO / "examples" / "my_algorithm"


def tutorial_commands() -> list[str]:
    text = DOC.read_text()
    blocks = re.findall(r"<!-- tutorial: run -->\n```bash\n(.*?)```", text, flags=re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def install_editable(site: Path) -> None:
    """What ``pip install -e examples/my_algorithm`` leaves behind: its dist-info with the entry points
    of its pyproject.toml (the caller puts ``site`` and the project's folder on the path, as pip's
    .pth file does)."""
    project = tomllib.loads((PLUGIN_DIR / "pyproject.toml").read_text())["project"]
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    lines = []
    for group, entries in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {ref}" for name, ref in entries.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


@pytest.mark.ray
def test_the_tutorial_commands_run_and_its_claims_hold(tmp_path, monkeypatch, ray_session):
    commands = tutorial_commands()
    assert len(commands) == 8, commands
    site = tmp_path / "site"
    results: dict[int, dict] = {}
    try:
        for i, line in enumerate(commands):
            words = shlex.split(line)
            env = dict(w.split("=", 1) for w in words if re.fullmatch(r"[A-Z_]+=.*", w))
            words = [w for w in words if not re.fullmatch(r"[A-Z_]+=.*", w)]
            if words[:3] == ["pip", "install", "-e"]:
                assert words[3] == "examples/my_algorithm"
                install_editable(site)
                monkeypatch.syspath_prepend(str(site))
                monkeypatch.syspath_prepend(str(PLUGIN_DIR))  # an editable install's .pth entry
                register_configs()
                continue
            assert words[:2] == ["python", "-m"], line
            module, overrides = words[2], [*words[3:], "logger.progress=false"]
            if i == 0:  # as typed, in a shell
                run_dir = tmp_path / "cli"
                shell = line.replace("python ", f"{shlex.quote(sys.executable)} ", 1)
                proc = subprocess.run(["bash", "-c", f"{shell} logger.progress=false hydra.run.dir={run_dir}"],
                                      cwd=REPO, capture_output=True, text=True, timeout=300,
                                      env={**os.environ, "HYDRA_FULL_ERROR": "0"})
                assert proc.returncode == 0, proc.stderr[-3000:]
                results[i] = json.loads((run_dir / "summary.json").read_text())
                continue
            for key, value in env.items():
                assert key == "PYTHONPATH"
                monkeypatch.syspath_prepend(str(REPO / value))
            if module == "fl_platform.flower.local":
                results[i] = run_local(overrides, tmp_path / f"flower{i}")
            elif "algorithm=fedadm" in overrides:  # the tutorial's misspelt name: an error listing the choices
                with pytest.raises(Exception, match=r"Could not find 'algorithm/fedadm'") as err:
                    api.run(overrides)
                assert "\tfedadam\n" in str(err.value)
            else:
                assert module == "fl_platform.run"
                results[i] = api.run(overrides).summary
    finally:
        unregister_algorithm_option("fedadam")
    accuracy = {i: round(s["final_test_accuracy"], 6) for i, s in results.items()}
    # step 2: the numbers the page quotes (FedAdam by import path, FedAvg)
    assert results[0]["algorithm"] == "fedadam" and accuracy[0] == pytest.approx(0.96, abs=0.005)
    assert results[1]["algorithm"] == "fedavg" and accuracy[1] == pytest.approx(0.87, abs=0.005)
    # step 3: installed = by import path; step 4: Ray = inline; step 5: Flower = simulator
    assert accuracy[3] == accuracy[0] and results[3]["engine"] == "inline"
    assert accuracy[5] == accuracy[3] and results[5]["engine"] == "ray"
    assert results[6]["engine"] == "flower" and accuracy[6] == accuracy[7]
    assert results[6]["final_test_loss"] == pytest.approx(results[7]["final_test_loss"], rel=1e-5)
