"""A CPU quota on one process, through the cgroup v1 cpu controller (root only): a rank made
slow from outside its code, as a throttled clock or a noisy neighbour would make it."""

from __future__ import annotations

import os
from types import TracebackType

ROOT = "/sys/fs/cgroup/cpu"
PERIOD_US = 100_000


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
        self._write("cpu.cfs_period_us", str(PERIOD_US))
        self._write("cpu.cfs_quota_us", str(max(1000, int(cores * PERIOD_US))))
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
