#!/usr/bin/env bash
# Idempotent set-up of a development environment on a fresh machine: a venv, an exactly pinned
# torch, the test tools, and resilient_comm built in place against that torch (CMake, no build
# isolation). Re-running it only rebuilds what changed.
#
#   bash scripts/setup.sh                                  # .venv, torch 2.14.1 (the default)
#   RESILIENT_COMM_TORCH=2.13.0 bash scripts/setup.sh      # .venv-torch2.13.0, torch 2.13.0
#
# RESILIENT_COMM_TORCH picks the torch: 2.14.1 (PyPI's default Linux wheel, cu130, ~5.5 GB with
# its CUDA libraries; it imports and runs on CPU) or 2.13.0 (the CPU wheel). RESILIENT_COMM_VENV
# names the venv (default: .venv for the default torch, .venv-torch<version> for another).
# The extension is built in place (resilient_comm/_C*.so), so the last venv set up is the one
# whose build the source tree holds: re-run this script to switch back.
set -euo pipefail
cd "$(dirname "$0")/.."

DEFAULT_TORCH=2.14.1
TORCH_VERSION=${RESILIENT_COMM_TORCH:-$DEFAULT_TORCH}
case "$TORCH_VERSION" in
  2.14.1 | 2.13.0) ;;
  *) echo "[setup] RESILIENT_COMM_TORCH=$TORCH_VERSION: supported are 2.14.1 (default) and 2.13.0" >&2; exit 2 ;;
esac
if [ "$TORCH_VERSION" = "$DEFAULT_TORCH" ]; then VENV=${RESILIENT_COMM_VENV:-.venv}; else VENV=${RESILIENT_COMM_VENV:-.venv-torch$TORCH_VERSION}; fi

PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
VPY=$VENV/bin/python
PIP=("$VPY" -m pip install --quiet --disable-pip-version-check)

# Pin torch exactly: a bare `torch` lets pip pick any version (and a multi-GB download).
if ! "$VPY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  if [ "$TORCH_VERSION" = 2.14.1 ]; then size=" (~5.5 GB with its CUDA libraries, a few minutes)"; else size=""; fi
  echo "[setup] installing torch==$TORCH_VERSION into $VENV$size"
  "${PIP[@]}" "torch==$TORCH_VERSION"
fi
# ruff and mypy pinned: CI fails on their findings, so a new release must not move the bar.
"${PIP[@]}" "setuptools>=64" wheel cmake ninja "pytest>=7" "pytest-timeout>=2" expecttest pyyaml numpy matplotlib "etcd3gw>=2.4" "prometheus_client>=0.17" ruff==0.17.6 mypy==2.4.1
# torchft (the pin of pyproject's `bench` extra) for the suite's tests of `bench compare`'s
# torchft row and of torchft's own native-group test on our backends (which needs its test
# dependency parameterized), on the suite's torch; pure Python, it leaves torch as it is.
if [ "$TORCH_VERSION" = "$DEFAULT_TORCH" ]; then "${PIP[@]}" "torchft-nightly==2026.10.26" parameterized; fi
# Lightning and Accelerate (pyproject's `frameworks` extra, pinned here) for the suite's tests
# of their scripts under `resilient-run --in-process` (tests/elastic/test_frameworks.py); they
# leave torch as it is.
if [ "$TORCH_VERSION" = "$DEFAULT_TORCH" ]; then "${PIP[@]}" "lightning==2.6.6" "accelerate==1.16.0"; fi

# NCCL for resilient_nccl (loaded at run time; its nccl.h for the ABI test): the nvidia-nccl wheel
# that goes with this torch, never a second one over torch's own -- they all write the same
# libnccl.so.2 (scripts/nccl_wheel.py says which, and why).
{ read -r -a NCCL_REMOVE; read -r NCCL_INSTALL; } < <("$VPY" scripts/nccl_wheel.py)
if [ ${#NCCL_REMOVE[@]} -gt 0 ]; then
  echo "[setup] removing ${NCCL_REMOVE[*]}: it replaced torch's libnccl"
  "$VPY" -m pip uninstall --quiet --yes "${NCCL_REMOVE[@]}"
fi
if [ -n "$NCCL_INSTALL" ]; then
  echo "[setup] installing $NCCL_INSTALL (NCCL for resilient_nccl)"
  "${PIP[@]}" --no-deps --force-reinstall "$NCCL_INSTALL"  # (a removed wheel took torch's file)
fi

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
# Slurm (slurmctld, slurmd, srun) and munge for the test that runs resilient-run under srun on
# those nodes (tests/system/test_slurm.py starts its own daemons; no service is enabled here).
# Without them that test skips.
if ! command -v slurmd >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing slurm-wlm and munge (apt)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null; } ||
      echo "[setup] could not install slurm-wlm and munge: the Slurm test will skip"
  else
    echo "[setup] no Slurm (apt install slurm-wlm munge as root): the Slurm test will skip"
  fi
fi

echo "[setup] building resilient_comm (CMake against torch $TORCH_VERSION)"
# The in-place extension may be another venv's build (same file name for every torch): drop it,
# so that this torch's build tree relinks it (seconds when its objects are current).
rm -f resilient_comm/_C.*.so
"${PIP[@]}" --no-build-isolation --no-deps -e .
"$VPY" -c 'import resilient_comm, torch; print("[setup] ok: resilient_comm", resilient_comm.__version__, "on torch", torch.__version__)'
