"""The layout is the architecture: the runtimes (simulation engine, Flower, S-SGD) are siblings that
share the round loop and the algorithms without importing each other (DESIGN.md, "Runtimes are
siblings")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# folder -> packages it must never import
FORBIDDEN = {
    "fl_platform/flower": ("fl_platform.engine", "fl_platform.ssgd"),
    "fl_platform/ssgd": ("fl_platform.engine", "fl_platform.flower"),
    "fl_platform/engine": ("fl_platform.flower", "fl_platform.ssgd"),
    "fl_platform/rounds": ("fl_platform.engine", "fl_platform.flower", "fl_platform.ssgd"),
    "algorithms": ("fl_platform.engine", "fl_platform.flower", "fl_platform.ssgd"),
}


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_runtimes_do_not_import_each_other(folder):
    bad = [f"{path.relative_to(REPO)} imports {name}"
           for path in sorted((REPO / folder).rglob("*.py"))
           for name in sorted(imported_modules(path))
           if any(name == p or name.startswith(p + ".") for p in FORBIDDEN[folder])]
    assert not bad, "\n".join(bad)
