"""fl_platform: a federated learning research platform.

The shared pieces (training loop, algorithms, data layer, state, compression) are used by
three runtimes: the simulation engine, the Flower deployment and the S-SGD baseline.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from pathlib import Path

__version__ = "0.1.0"

_PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = _PACKAGE_DIR.parent


def _mount_root_folder(name: str) -> None:
    """Expose the repository's top-level ``name/`` folder as ``fl_platform.<name>``.

    ``datasets/`` and ``algorithms/`` live at the repository root (the layout shows the
    architecture) but carry no ``__init__.py``: a regular top-level ``datasets`` package
    would shadow Hugging Face's ``datasets`` whenever Python runs from the repository root.
    A wheel install copies the folders inside the package, where normal import finds them.
    """
    full = f"{__name__}.{name}"
    folder = REPO_ROOT / name
    if full in sys.modules or (_PACKAGE_DIR / name).is_dir() or not folder.is_dir():
        return
    spec = importlib.machinery.ModuleSpec(full, None, is_package=True)
    spec.submodule_search_locations = [str(folder)]
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    setattr(sys.modules[__name__], name, module)


for _folder in ("datasets", "algorithms"):
    _mount_root_folder(_folder)
