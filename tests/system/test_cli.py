"""The command line, the knob table and the NCCL loader's error path."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch.distributed as dist

import resilient_comm
from resilient_comm import _C
from resilient_comm.config import knobs


@pytest.mark.timeout(60)
def test_doctor_reports_transports_and_nccl() -> None:
    secret = "do-not-print-this-token"
    out = subprocess.run(
        [sys.executable, "-m", "resilient_comm.tools.cli", "doctor"], capture_output=True, text=True, timeout=50, check=False,
        env={**os.environ, "RESILIENT_COMM_TOKEN": secret},
    )
    assert out.returncode == 0, out.stderr
    assert "tcp   available" in out.stdout and "abort=yes" in out.stdout
    assert "liveness lock (a death known before the kernel's teardown): a SIGKILLed child noticed" in out.stdout
    assert "nccl" in out.stdout
    if hasattr(dist.ProcessGroup, "reconfigure"):
        assert "torchft's FT-FSDP membership names \"nccl2\": name \"resilient_nccl\"" in out.stdout
    assert "RESILIENT_COMM_ALGO" in out.stdout
    assert "RESILIENT_COMM_TOKEN" in out.stdout and "<set, not shown>" in out.stdout and secret not in out.stdout


def test_knob_value_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    algo = next(k for k in knobs() if k.name == "RESILIENT_COMM_ALGO")
    monkeypatch.setenv("RESILIENT_COMM_ALGO", "ring")
    assert algo.value == "ring"
    monkeypatch.setenv("RESILIENT_COMM_ALGO", "")
    assert algo.value == algo.default == "auto"


def test_nccl_probe_explains_why_nothing_loaded(tmp_path: pathlib.Path) -> None:
    bogus = tmp_path / "libnccl.so.2"
    bogus.write_text("not a library")
    res = _C.probe_nccl([str(bogus)])
    if res["found"]:  # a libnccl is already loaded in this process (a CUDA torch)
        assert res["version"].count(".") == 2
        return
    assert str(bogus) in res["error"], res["error"]
    assert "RESILIENT_COMM_NCCL_LIB" in res["error"]


def test_backends_are_registered() -> None:
    import torch.distributed as dist

    for name in resilient_comm.BACKENDS:
        assert name in dist.Backend.backend_list
    assert dist.Backend.backend_capability["resilient_tcp"] == ["cpu"]
    assert dist.Backend.backend_capability["resilient_nccl"] == ["cpu", "cuda"]


@pytest.mark.timeout(120)
def test_demo_recovers_on_the_nccl_code_path() -> None:
    """`resilient-comm demo --nccl-emulated`: the controller's whole recovery (the op error, the
    revokes, ncclCommShrink, the state copy) on resilient_nccl through the NCCL emulator."""
    out = subprocess.run([sys.executable, "-m", "resilient_comm.tools.cli", "demo", "--nccl-emulated", "--steps", "20",
                          "--kill-step", "12", "--ckpt-every", "5"], capture_output=True, text=True, timeout=110,
                         check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "resilient_nccl on the NCCL emulator" in out.stdout, out.stdout
    assert "finished all 20 steps in the same processes" in out.stdout, out.stdout
    line = next(x for x in out.stdout.splitlines() if x.startswith("NCCL code path:"))
    assert "the 3 survivors" in line and " 3 ncclCommShrink" in line and " 0 uses of a freed" in line, line
    first = next(x for x in out.stdout.splitlines() if x.startswith("SIGKILL -> first committed step"))
    assert float(first.split(":")[1].split()[0]) < 2000, first  # ms; tens of ms on an idle machine
