"""The NCCL loader against the real libnccl of the nvidia-nccl wheel, on a machine with no GPU:
version, symbols, ncclGetUniqueId, and a clear error (not a crash) when init has no device."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from resilient_comm import _C
from resilient_comm.tools.doctor import nccl_wheel_candidates

pytestmark = pytest.mark.skipif(
    not nccl_wheel_candidates(), reason="no nvidia-nccl wheel is installed (scripts/setup.sh installs one)"
)


def test_loader_finds_the_wheel_and_gates_features_on_its_version() -> None:
    info = _C.probe_nccl([])
    assert info["found"], info.get("error")
    major, minor, _ = (int(x) for x in info["version"].split("."))
    assert (major, minor) >= (2, 14)
    assert info["path"].endswith("libnccl.so.2")
    assert all(info["symbols"].values()), [s for s, ok in info["symbols"].items() if not ok]
    caps = info["caps"]
    assert caps["non_blocking_init"] and caps["abort"]
    assert caps["split"] == ((major, minor) >= (2, 18))
    assert caps["shrink"] == ((major, minor) >= (2, 27))
    assert caps["grow"] == ((major, minor) >= (2, 29))


def test_get_unique_id_works_without_a_gpu() -> None:
    a, b = _C.nccl_unique_id(), _C.nccl_unique_id()
    assert len(a) == 128 and a != bytes(128) and a != b


@pytest.mark.timeout(60)
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: init would succeed")
def test_init_without_a_device_fails_clearly() -> None:
    text = _C.nccl_init_check(20.0)
    assert text.startswith("Internal: building group 'nccl_init_check'"), text
    assert "no usable CUDA device" in text or "ncclCommInitRankConfig failed" in text, text


@pytest.mark.timeout(60)
def test_a_bad_library_path_is_reported_not_fatal(tmp_path) -> None:
    bogus = tmp_path / "libnccl.so.2"
    bogus.write_text("not a library")
    code = (
        "import resilient_comm\n"
        "from resilient_comm import _C\n"
        "print(_C.probe_nccl([])['found'])\n"
    )
    env = {"RESILIENT_COMM_NCCL_LIB": str(bogus), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=env, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"  # the bad path is skipped, the wheel still found
