#!/usr/bin/env bash
# GPU smoke test: runs every GPU path of the engine once and prints one line per check
# (PASS/FAIL name: detail). For a machine with a CUDA GPU; under 5 minutes on one GPU.
# Sets up .venv first (scripts/setup.sh installs the CUDA build of torch when a GPU is visible).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec timeout 600 .venv/bin/python scripts/gpu_smoke.py "$@"
