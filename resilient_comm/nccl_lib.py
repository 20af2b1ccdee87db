"""Where the library looks for libnccl besides RESILIENT_COMM_NCCL_LIB and the one torch
loaded: the nvidia-nccl wheels. Used when the backends register and by `resilient-comm doctor`."""

from __future__ import annotations

import glob
import os
import sys


def nccl_wheel_candidates() -> list[str]:
    """libnccl files of installed nvidia-nccl-cu12 / -cu13 wheels, in sys.path order."""
    found: list[str] = []
    for entry in sys.path:
        for path in sorted(glob.glob(os.path.join(entry, "nvidia", "nccl*", "lib", "libnccl.so*"))):
            if path not in found:
                found.append(path)
    return found
