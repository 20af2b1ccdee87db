"""`resilient-comm doctor`: what this machine offers resilient_comm."""

from __future__ import annotations

import os
import platform

import torch

from resilient_comm import _C
from resilient_comm.config import knobs
from resilient_comm.nccl_lib import nccl_wheel_candidates


def report() -> dict:
    caps = _C.tcp_caps()
    nccl = _C.probe_nccl(nccl_wheel_candidates())
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cpus": os.cpu_count(),
        "transports": {"tcp": {"available": True, "caps": caps, "shm": _C.shm_self_test()}},
        "nccl": nccl,
        "hccl": _C.probe_hccl(),
        "device_transports": _C.device_transports(),
        "knobs": [
            (k.name, "<set, not shown>" if k.name in SECRET_KNOBS and k.value else k.value, k.default)
            for k in knobs()
        ],
    }


SECRET_KNOBS = ("RESILIENT_COMM_TOKEN",)  # never printed


def main(argv: list[str] | None = None) -> int:
    r = report()
    print(
        f"python {r['python']}  torch {r['torch']}  cpus {r['cpus']}  cuda available: {r['cuda_available']}"
    )
    print("transports:")
    caps = r["transports"]["tcp"]["caps"]
    print("  tcp   available  " + " ".join(f"{k}={'yes' if v else 'no'}" for k, v in caps.items()))
    shm = r["transports"]["tcp"]["shm"]
    print(
        "        same-host payloads: "
        + ("through shared memory" if not shm else "through the socket: " + shm)
    )
    n = r["nccl"]
    if n["found"]:
        print(f"  nccl  libnccl {n['version']} at {n['path']}")
        print("        " + " ".join(f"{k}={'yes' if v else 'no'}" for k, v in n["caps"].items()))
    else:
        print("  nccl  not available: " + n["error"].replace("\n", "\n        "))
    h = r["hccl"]
    if h["found"]:
        print(f"  hccl  libhccl at {h['path']}")
        print("        " + " ".join(f"{k}={'yes' if v else 'no'}" for k, v in h["caps"].items()))
    else:
        print("  hccl  not available: " + h["error"])
    print("device transports (which library carries a backend's device tensors):")
    for t in r["device_transports"]:
        state = "" if t["enabled"] else "   (off: RESILIENT_COMM_NCCL_EMULATE=1 turns it on)"
        grows = "grows with its group" if t["grows"] else "made afresh on a grow"
        print(f"  {t['backend']:15s} {t['device']:14s} {t['library']:5s} {grows}{state}")
    print("knobs (RESILIENT_COMM_*):")
    for name, value, default in r["knobs"]:
        mark = "" if value == default else "   (set)"
        print(f"  {name:32s} {value!r}{mark}")
    return 0
