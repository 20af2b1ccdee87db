#!/usr/bin/env bash
# Idempotent set-up of a development environment on a fresh machine: a venv in .venv, the
# CPU build of torch 2.13.0, the test tools, and resilient_comm built in place against that
# torch (CMake, no build isolation). Re-running it only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python

# Pin torch exactly: a bare `torch` would pull a multi-GB CUDA build.
if ! "$VPY" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null; then
  echo "[setup] installing torch==2.13.0"
  "$VPY" -m pip install --quiet --disable-pip-version-check torch==2.13.0
fi
"$VPY" -m pip install --quiet --disable-pip-version-check "setuptools>=64" wheel cmake ninja "pytest>=7" "pytest-timeout>=2" numpy matplotlib nvidia-nccl-cu12

echo "[setup] building resilient_comm (CMake against the installed torch)"
"$VPY" -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps -e .
"$VPY" -c 'import resilient_comm; print("[setup] ok: resilient_comm", resilient_comm.__version__)'
