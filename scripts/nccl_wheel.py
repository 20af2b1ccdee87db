#!/usr/bin/env python3
"""Which nvidia-nccl wheel scripts/setup.sh installs next to the venv's torch, and which it removes.

resilient_nccl loads libnccl at run time (resilient_comm/nccl_lib.py: the one torch loaded, else
an nvidia-nccl wheel's). Every nvidia-nccl-cuXX wheel writes the same file,
nvidia/nccl/lib/libnccl.so.2, so the last one installed replaces the others': a second wheel
must never go next to torch's own.

- A CUDA torch that requires its NCCL wheel (torch 2.14.1+cu130: nvidia-nccl-cu13==2.30.7): pip
  installed it with torch, nothing is added. Any other nvidia-nccl wheel next to it is removed
  and torch's installed again (the removal took the file they share).
- A CUDA torch that requires none: the wheel of its CUDA major (the [cu12]/[cu13] extras), unless
  one is installed.
- The CPU torch (torch.version.cuda is None), unless one is installed: nvidia-nccl-cu12, whose
  libnccl the loader tests load (tests/transport/test_nccl_loader.py; no GPU is needed to load
  it) and whose nccl.h the NCCL ABI test compiles against (tests/cpp/test_nccl_abi.cpp). The NCCL
  emulator tests need neither. cu12 also is the extra tests/system/test_packaging.py installs
  with that torch.

    python scripts/nccl_wheel.py   # two lines: the wheels to remove, the requirement to install
"""

from __future__ import annotations

import importlib.metadata as md
import re

CPU_WHEEL = "nvidia-nccl-cu12"
_WHEEL = re.compile(r"nvidia-nccl-cu\d+")


def _name(text: str) -> str:
    return text.strip().lower().replace("_", "-")


def plan(torch_requires: list[str], cuda: str | None, installed: list[str]) -> tuple[list[str], str]:
    """(the nvidia-nccl wheels to remove, the requirement to install, "" for none) for a torch
    with these Requires-Dist lines and CUDA version (None: the CPU build), next to the
    nvidia-nccl wheels `installed`."""
    pins = [r.split(";")[0].replace(" ", "") for r in torch_requires if _WHEEL.match(_name(r))]
    if pins:
        own = _WHEEL.match(_name(pins[0]))
        assert own is not None
        foreign = sorted(n for n in installed if n != own.group(0))
        return foreign, pins[0] if foreign or own.group(0) not in installed else ""
    if installed:
        return [], ""
    return [], f"nvidia-nccl-cu{cuda.split('.')[0]}" if cuda else CPU_WHEEL


def main() -> int:
    import torch

    installed = sorted({_name(d.metadata["Name"] or "") for d in md.distributions()})
    remove, install = plan(
        md.requires("torch") or [], torch.version.cuda, [n for n in installed if _WHEEL.fullmatch(n)]
    )
    print(" ".join(remove))
    print(install)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
