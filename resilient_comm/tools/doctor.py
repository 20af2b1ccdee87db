"""`resilient-comm doctor`: what this machine offers resilient_comm."""

from __future__ import annotations

import os
import platform
import select
import signal
import time

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
        "liveness": liveness_self_test(),
        "nccl": nccl,
        "hccl": _C.probe_hccl(),
        "device_transports": _C.device_transports(),
        "knobs": [
            (k.name, "<set, not shown>" if k.name in SECRET_KNOBS and k.value else k.value, k.default)
            for k in knobs()
        ],
    }


SECRET_KNOBS = ("RESILIENT_COMM_TOKEN",)  # never printed


def liveness_self_test() -> str:
    """A forked child holds a liveness slot and is SIGKILLed: how soon its lock said so, and how
    soon its exit did ([Note: the liveness lock]); or why the lock is not available."""
    from resilient_comm.api import liveness_slot

    slot = liveness_slot()
    if slot is None:
        return "off (RESILIENT_COMM_LIVENESS=0, or no memfd): deaths are known from the exit"
    fd, env = slot
    said_r, said_w = os.pipe()  # the child says whether it holds the lock
    hold_r, hold_w = os.pipe()  # never written: the child waits on it until it is killed
    pid = os.fork()
    if pid == 0:  # the child: holds the slot, says so, waits to be killed
        try:
            os.close(said_r)
            os.close(hold_w)
            os.environ.update(env)
            os.write(said_w, b"1" if _C.liveness_hold() else b"0")
            os.read(hold_r, 1)
        finally:
            os._exit(0)
    os.close(said_w)
    os.close(hold_r)
    try:
        watch = _C.LivenessWatch(fd, pid)
        if os.read(said_r, 1) != b"1":  # (b"": the child died first)
            return "not available: the child could not take its lock (see the log)"
        pidfd = os.pidfd_open(pid)
        t0 = time.monotonic_ns()
        os.kill(pid, signal.SIGKILL)
        select.select([watch.fileno()], [], [], 5)
        select.select([pidfd], [], [], 5)
        exited = time.monotonic_ns()
        os.close(pidfd)
        if watch.verdict != "died":
            return f"not working: the lock said {watch.verdict!r} of a SIGKILLed child"
        return (
            f"a SIGKILLed child noticed {(watch.noticed_ns - t0) / 1e6:.2f} ms after the kill "
            f"(its exit: {(exited - t0) / 1e6:.2f} ms)"
        )
    finally:
        os.kill(pid, signal.SIGKILL)  # (gone already, unless something above failed)
        os.waitpid(pid, 0)
        for f in (fd, said_r, hold_w):
            os.close(f)


def main(argv: list[str] | None = None) -> int:
    r = report()
    print(
        f"python {r['python']}  torch {r['torch']}  cpus {r['cpus']}  cuda available: {r['cuda_available']}"
    )
    print("liveness lock (a death known before the kernel's teardown): " + r["liveness"])
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
    print("torch's reconfigure API (docs/reconfigure.md):")
    if hasattr(torch.distributed.ProcessGroup, "reconfigure"):
        print(
            '  supported: init_process_group("resilient_tcp" or "resilient_nccl", enable_reconfigure=True),\n'
            "  one backend per group (never cpu:gloo,cuda:...: torch refuses to reconfigure several);\n"
            '  torchft\'s FT-FSDP membership names "nccl2": name "resilient_nccl" in its init_process_group'
        )
    else:
        print(f"  not in torch {torch.__version__} (2.14 and later have it)")
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
