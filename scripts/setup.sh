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
"$VPY" -m pip install --quiet --disable-pip-version-check "setuptools>=64" wheel cmake ninja "pytest>=7" "pytest-timeout>=2" numpy matplotlib nvidia-nccl-cu12 "etcd3gw>=2.4" "prometheus_client>=0.17"

# etcd (the multi-node membership) for the tests that run nodes in network namespaces; as
# root on Debian/Ubuntu it comes from the etcd-server package. Without it those tests skip.
if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing etcd-server (apt)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null; } ||
      echo "[setup] could not install etcd-server: the multi-node tests will skip"
  else
    echo "[setup] no etcd (apt install etcd-server as root): the multi-node tests will skip"
  fi
fi

echo "[setup] building resilient_comm (CMake against the installed torch)"
"$VPY" -m pip install --quiet --disable-pip-version-check --no-build-isolation --no-deps -e .
"$VPY" -c 'import resilient_comm; print("[setup] ok: resilient_comm", resilient_comm.__version__)'
