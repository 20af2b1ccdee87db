"""Runs the C++ unit tests (tests/cpp): the NCCL emulator's rules, the NCCL communicator on it, the NCCL
ABI against the wheel's real nccl.h, the HCCL communicator on its fake, the TCP shrink."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _binary() -> pathlib.Path:
    built = sorted(ROOT.glob("build/*/rc_cpp_tests"), key=lambda p: p.stat().st_mtime)
    if not built:
        pytest.fail("rc_cpp_tests is not built: run scripts/setup.sh (it builds every CMake target)")
    return built[-1]


@pytest.mark.timeout(120)
def test_cpp_unit_tests() -> None:
    out = subprocess.run([str(_binary())], check=False, capture_output=True, text=True, timeout=110)
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr
    assert out.returncode == 0, out.stdout + out.stderr
    assert lines[-1].endswith(" 0 failed") and int(lines[-1].split()[0]) >= 10, lines[-1]
    # setup.sh installs the nvidia-nccl wheel, so the ABI test must have been compiled in.
    assert "[ OK ] nccl_abi_matches_the_real_nccl_h" in lines, "the NCCL ABI test did not run (no nccl.h found?)"
