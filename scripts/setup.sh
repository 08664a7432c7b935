#!/usr/bin/env bash
# Create .venv (Python >= 3.11) and install fl_platform's runtime dependencies; `--dev` adds the
# test and development extras (ruff, pytest and its plugins, the Hugging Face extra that its tests
# cover), which only the test command needs.
# Where no NVIDIA GPU is visible, torch is installed first as a CPU build, so that nothing
# pulls a multi-GB CUDA build. Re-running is cheap: a stamp skips installs that are current.
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS=""
case "${1:-}" in
  "") ;;
  --dev) EXTRAS="dev,hf" ;;  # hf: dataset=hf, partition=flwr and their tests (docs/data.md)
  *) echo "error: unknown argument '$1' (usage: scripts/setup.sh [--dev])" >&2; exit 2 ;;
esac

TORCH_VERSION="${FL_TORCH_VERSION:-2.13.0}"
# A candidate must run, not just exist: a pyenv shim for a version that is not selected is on PATH
# but fails (printing several lines), so the probe runs each one silently.
py_ok() {
  command -v "$1" >/dev/null 2>&1 && "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1
}
PY=""
if [ -n "${PYTHON:-}" ]; then
  py_ok "$PYTHON" || { echo "error: PYTHON=$PYTHON does not run as Python >= 3.11" >&2; exit 1; }
  PY="$PYTHON"
else
  for cand in python3.13 python3.12 python3.11 python3; do
    if py_ok "$cand"; then PY="$cand"; break; fi
  done
fi
if [ -z "$PY" ]; then
  echo "error: Python >= 3.11 not found (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $("$PY" --version)" >&2
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python

# The stamp names what was installed: the dev set includes the runtime set, so a dev stamp also
# satisfies a runtime set-up, not the other way round.
digest="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
stamp_now="$digest:${EXTRAS:-runtime}"
if [ -f .venv/.setup-stamp ]; then
  stamp_was="$(cat .venv/.setup-stamp)"
  if [ "$stamp_was" = "$stamp_now" ] || { [ -z "$EXTRAS" ] && [ "$stamp_was" = "$digest:dev,hf" ]; }; then
    exit 0
  fi
fi

# pip's chatter (warnings about index locations from a machine-wide pip config, build-backend
# notices) goes to a log that is shown in full only when pip fails, so errors still surface.
pip_install() {
  local log rc=0
  log="$(mktemp)"
  "$VPY" -m pip install --quiet "$@" >"$log" 2>&1 || rc=$?
  if [ "$rc" -ne 0 ]; then
    cat "$log" >&2
    echo "error: pip install $* failed (exit $rc, pip's output above)" >&2
  fi
  rm -f "$log"
  return "$rc"
}

"$VPY" -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true

if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: GPU found, installing torch==$TORCH_VERSION (CUDA build)" >&2
    pip_install "torch==$TORCH_VERSION"
  else
    echo "setup: no GPU, installing the CPU build of torch==$TORCH_VERSION" >&2
    # A local/cached CPU wheel (as on our CI machines) is taken as is; otherwise use PyTorch's
    # CPU index when it is reachable, so PyPI's CUDA build is never pulled.
    if curl -fsS --max-time 5 -o /dev/null https://download.pytorch.org/whl/cpu/ 2>/dev/null \
       && ! "$VPY" -m pip download --quiet --no-deps --no-index -d /tmp/fl-torch-probe "torch==$TORCH_VERSION" >/dev/null 2>&1; then
      pip_install "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
    else
      pip_install "torch==$TORCH_VERSION"
    fi
  fi
fi

if [ -n "$EXTRAS" ]; then
  echo "setup: installing fl_platform with its dependencies and the extras [$EXTRAS]" >&2
  pip_install -e ".[$EXTRAS]"
else
  echo "setup: installing fl_platform and its dependencies" >&2
  pip_install -e .
fi
"$VPY" -c "import fl_platform, torch, flwr, ray, hydra" || { echo "error: installation failed" >&2; exit 1; }
if ! command -v nvidia-smi >/dev/null 2>&1 && "$VPY" -c "import torch,sys; sys.exit(torch.version.cuda is None)"; then
  echo "warning: a CUDA build of torch is installed on a machine without a GPU" >&2
fi
echo "$stamp_now" > .venv/.setup-stamp
