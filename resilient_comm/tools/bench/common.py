"""Helpers shared by the benchmarks: sizes, timing blocks, and a description of the machine."""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import re
import socket
import subprocess
import time
from collections.abc import Callable


def parse_size(text: str) -> int:
    """'8', '4K', '4KiB', '1M', '64MiB', '1G' (binary units) -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmg]?)(i?b)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (examples: 8, 4K, 64MiB)")
    shift = {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]
    return int(m.group(1)) << shift


def human_bytes(n: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def iters_for(target_s: float, per_op_s: float, lo: int, hi: int) -> int:
    """Iterations that fill target_s at per_op_s each, in [lo, hi]."""
    return max(lo, min(hi, math.ceil(target_s / max(per_op_s, 1e-7))))


def free_port() -> int:
    """A TCP port free on loopback now (for a server started next)."""
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return int(sk.getsockname()[1])


def p90(xs: list[float]) -> float:
    """The 90th percentile of `xs` (nearest rank)."""
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]


def timed_block(fn: Callable[[], None], k: int) -> float:
    """Per-op seconds of k back-to-back synchronous ops on this rank."""
    t0 = time.perf_counter()
    for _ in range(k):
        fn()
    return (time.perf_counter() - t0) / k


def mtime(path: str | None) -> str | None:
    try:
        ts = os.path.getmtime(path)  # (None: TypeError, caught)
    except (OSError, TypeError):
        return None
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat(timespec="seconds")


def machine() -> dict:
    import torch

    import resilient_comm

    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    commit = None
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                check=False,
                cwd=here,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        pass
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30), 1)
    except (ValueError, OSError, AttributeError):
        pass
    return {
        "hostname": platform.node(),
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "memory_gib": mem_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "resilient_comm": resilient_comm.__version__,
        "git_commit": commit,
        "extension_mtime_utc": mtime(getattr(resilient_comm._C, "__file__", None)),
        "knobs": {k.name: k.value for k in resilient_comm.knobs()},
    }
