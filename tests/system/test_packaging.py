"""The built wheel says which torch it needs and offers the NCCL extras; installed into a fresh
venv, pip check is clean and the NCCL extra of torch's CUDA major brings an NCCL that
`resilient-comm doctor` finds."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_the_wheel_requires_the_torch_it_was_built_against_and_has_the_nccl_extras(tmp_path: pathlib.Path) -> None:
    """`pip wheel --no-build-isolation .` (incremental: the build tree of the editable install)."""
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-build-isolation", "--no-deps",
                          str(ROOT), "-w", str(tmp_path)], capture_output=True, text=True, timeout=580, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = tmp_path.glob("resilient_comm-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert any(n.startswith("resilient_comm/_C.") and n.endswith(".so") for n in names), names
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    assert f"torch=={major}.{minor}.*" in requires, requires
    assert 'nvidia-nccl-cu12; extra == "cu12"' in requires and 'nvidia-nccl-cu13; extra == "cu13"' in requires
    assert 'prometheus_client>=0.17; extra == "metrics"' in requires, requires

    # Installed into a fresh venv with the torch it names (torch==2.13.0 is on this machine's
    # disk; setup.sh already fetched nvidia-nccl-cu12): pip check clean, the extra of torch's
    # CUDA major ([cu12] with the CPU torch; with a CUDA torch it is torch's own NCCL wheel, which
    # no other may replace) brings NCCL and `resilient-comm doctor` finds it.
    venv = tmp_path / "venv"
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    torch_version = torch.__version__.split("+")[0]
    extra = f"cu{torch.version.cuda.split('.')[0]}" if torch.version.cuda else "cu12"
    for args in ([f"torch=={torch_version}"], [f"{wheel}[{extra}]"]):
        out = subprocess.run([*pip, *args], capture_output=True, text=True, timeout=580, check=False)
        assert out.returncode == 0, out.stderr[-3000:]
    check = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "check"], capture_output=True, text=True,
                           timeout=120, check=False)
    assert check.returncode == 0 and "No broken requirements" in check.stdout, check.stdout + check.stderr
    doctor = subprocess.run([str(venv / "bin" / "resilient-comm"), "doctor"], capture_output=True, text=True,
                            timeout=120, check=False, cwd=tmp_path)
    assert doctor.returncode == 0, doctor.stderr[-3000:]
    nccl = next(line for line in doctor.stdout.splitlines() if line.strip().startswith("nccl"))
    assert "libnccl 2." in nccl and str(venv) in nccl, doctor.stdout[:2000]
