#!/usr/bin/env bash
# Set up .venv and run the default experiment (FedAvg, digits, 100 non-IID clients).
# Extra arguments are Hydra overrides, e.g. ./scripts/quickstart.sh algorithm=scaffold rounds=10
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m fl_platform.run "$@"
