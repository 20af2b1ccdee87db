"""A CPU quota on one process, through the cgroup v1 cpu controller (root only): a rank made
slow from outside its code, as a throttled clock or a noisy neighbour would make it."""

from __future__ import annotations

import os
from types import TracebackType

ROOT = "/sys/fs/cgroup/cpu"
# The scheduler's accounting period. A throttled clock slows every instruction alike; a quota
# over CFS's default 100 ms period instead lets a process run at full speed for its share of
# each period and then stops it for the rest, so of steps a few ms long some run at full speed
# and some wait ~90 ms (a 10-step window's median then flips between the two: measured). Over
# 10 ms every step of a few ms spans several periods and is slowed alike.
PERIOD_US = 10_000
MIN_QUOTA_US = 1_000  # the kernel's floor


def available() -> str | None:
    """None where a quota can be set here, else why not."""
    if not os.path.isfile(os.path.join(ROOT, "cpu.cfs_quota_us")):
        return f"no cgroup v1 cpu controller at {ROOT}"
    if os.geteuid() != 0:
        return "setting a cgroup's CPU quota needs root"
    return None


class CpuQuota:
    """Holds process `pid` (all its threads) to `cores` of CPU time per wall-clock second
    (0.25: a quarter of one core) until `release` (or the end of a with block)."""

    def __init__(self, pid: int, cores: float) -> None:
        if not cores > 0:
            raise ValueError(f"a CPU quota must be positive, got {cores}")
        self.pid = pid
        self.path = os.path.join(ROOT, f"resilient-comm-{os.getpid()}-{pid}")
        os.makedirs(self.path, exist_ok=True)
        period = min(1_000_000, max(PERIOD_US, int(MIN_QUOTA_US / cores)))  # under 0.1 core: a longer period
        self._write("cpu.cfs_period_us", str(period))
        self._write("cpu.cfs_quota_us", str(max(MIN_QUOTA_US, int(cores * period))))
        self._write("cgroup.procs", str(pid))

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def release(self) -> None:
        """The process back in the root group (if it still lives) and the group removed."""
        if not os.path.isdir(self.path):
            return
        with open(os.path.join(self.path, "cgroup.procs")) as f:
            pids = [p for p in f.read().split() if p]
        for p in pids:
            try:
                with open(os.path.join(ROOT, "cgroup.procs"), "w") as f:
                    f.write(p)
            except OSError:
                pass  # it ended meanwhile
        os.rmdir(self.path)

    def __enter__(self) -> CpuQuota:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


__all__ = ["CpuQuota", "available"]
