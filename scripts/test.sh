#!/usr/bin/env bash
# Set up .venv, check style with ruff, and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh --dev
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -n 3 --dist loadgroup --durations=25 "$@"
