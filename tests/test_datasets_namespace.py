"""Our top-level datasets/ folder must never shadow Hugging Face's ``datasets`` package."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import fl_platform

REPO = fl_platform.REPO_ROOT


def run_python(code: str, extra_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter from the repository root (so '' / cwd is first on sys.path)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path is not None:
        env["PYTHONPATH"] = str(extra_path)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_datasets_folders_are_not_regular_packages():
    assert (REPO / "datasets").is_dir()
    assert not (REPO / "datasets" / "__init__.py").exists()
    assert not (REPO / "datasets" / "sources" / "__init__.py").exists()


def test_a_regular_datasets_package_later_on_the_path_wins(tmp_path):
    fake = tmp_path / "datasets"
    fake.mkdir()
    (fake / "__init__.py").write_text('MARKER = "hf"\n')
    result = run_python(
        """
        import os, sys
        assert sys.path[0] in ("", os.getcwd()), sys.path[:3]  # the repo root comes before PYTHONPATH
        import datasets
        print("marker", datasets.MARKER, datasets.__file__)
        import fl_platform.datasets.partition as p
        import fl_platform.datasets.sources.synthetic as s
        print("ours", p.__file__, s.__file__)
        """,
        extra_path=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert f"marker hf {fake / '__init__.py'}" in result.stdout
    assert f"ours {REPO / 'datasets' / 'partition.py'}" in result.stdout


def hugging_face_datasets_installed() -> bool:
    try:
        importlib.metadata.distribution("datasets")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(
    not hugging_face_datasets_installed(), reason="Hugging Face datasets is not installed here"
)
@pytest.mark.slow
def test_import_datasets_from_repo_root_is_hugging_face():
    result = run_python("import datasets, fl_platform.datasets.registry; print(datasets.__file__)")
    assert result.returncode == 0, result.stderr
    assert "site-packages" in result.stdout or "dist-packages" in result.stdout
