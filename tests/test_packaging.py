"""The built wheel says which torch it needs and offers the NCCL extras."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import zipfile

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


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
