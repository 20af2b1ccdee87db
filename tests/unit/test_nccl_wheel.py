"""scripts/nccl_wheel.py: setup.sh installs the NCCL wheel that goes with torch and never a second
one over torch's own (every nvidia-nccl-cuXX wheel writes the same libnccl.so.2); and this venv
holds no such second wheel."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import pathlib
from types import ModuleType

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "nccl_wheel.py"
CU130 = ["filelock", 'nvidia-nccl-cu13==2.30.7; platform_system == "Linux"', "sympy>=1.13.3"]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nccl_wheel", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("requires", "cuda", "installed", "want"), [
    (CU130, "13.0", ["nvidia-nccl-cu13"], ([], "")),  # torch's own: nothing added
    (CU130, "13.0", ["nvidia-nccl-cu12", "nvidia-nccl-cu13"], (["nvidia-nccl-cu12"], "nvidia-nccl-cu13==2.30.7")),
    (CU130, "13.0", [], ([], "nvidia-nccl-cu13==2.30.7")),
    (["filelock"], "12.8", [], ([], "nvidia-nccl-cu12")),  # a CUDA torch with no NCCL wheel of its own
    (["filelock"], None, [], ([], "nvidia-nccl-cu12")),  # the CPU torch
    (["filelock"], None, ["nvidia-nccl-cu13"], ([], "")),
])
def test_the_wheel_goes_with_torch_and_never_over_its_own(requires: list[str], cuda: str | None,
                                                           installed: list[str],
                                                           want: tuple[list[str], str]) -> None:
    assert _script().plan(requires, cuda, installed) == want


def test_this_venv_has_only_the_nccl_wheel_that_goes_with_torch() -> None:
    installed = sorted({(d.metadata["Name"] or "").lower().replace("_", "-") for d in md.distributions()})
    wheels = [n for n in installed if n.startswith("nvidia-nccl-cu")]
    remove, install = _script().plan(md.requires("torch") or [], torch.version.cuda, wheels)
    assert (remove, install) == ([], ""), f"{wheels} next to torch {torch.__version__}: run scripts/setup.sh again"
