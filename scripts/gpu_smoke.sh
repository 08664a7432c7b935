#!/usr/bin/env bash
# GPU smoke test (the device check of issue 25): runs every GPU path of the engine once and prints one
# line per check (PASS/FAIL name: detail); exit code 0 only when all passed, 2 when no CUDA is visible.
# For a machine with a CUDA GPU; under 5 minutes on one GPU (docs/engine.md, GPUs).
# Sets up .venv first (scripts/setup.sh installs the CUDA build of torch when a GPU is visible);
# FL_SKIP_SETUP=1 uses .venv as it is (e.g. a machine without network); FL_PYTHON=<python> runs the checks
# with that interpreter instead of .venv's (a GPU image's own Python with CUDA torch and the project's
# dependencies importable, the checkout on PYTHONPATH: how the first device run went, docs/engine.md).
# Arguments go to scripts/gpu_smoke.py: --list, --only a,b, --cpu-dry-run (the checks' code on a CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${FL_SKIP_SETUP:-0}" != "1" ]; then
  ./scripts/setup.sh
fi
exec timeout 600 "${FL_PYTHON:-.venv/bin/python}" scripts/gpu_smoke.py "$@"
