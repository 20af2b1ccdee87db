"""A CPU quota on one process, through the cgroup cpu controller (root only): a rank made slow
from outside its code, as a throttled clock or a noisy neighbour would make it.

Either cgroup version, whichever holds the cpu controller here: v1 (a hierarchy of its own,
``cpu.cfs_period_us`` and ``cpu.cfs_quota_us``) or v2 (the unified hierarchy, ``cpu.max``
holding "<quota> <period>", the controller enabled for children through the parent's
``cgroup.subtree_control``). The quota's group is made under the hierarchy's root, and the
process goes back to the root when it is released.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import TracebackType

MOUNTS = "/proc/self/mounts"
# The scheduler's accounting period. A throttled clock slows every instruction alike; a quota
# over CFS's default 100 ms period instead lets a process run at full speed for its share of
# each period and then stops it for the rest, so of steps a few ms long some run at full speed
# and some wait ~90 ms (a 10-step window's median then flips between the two: measured). Over
# 10 ms every step of a few ms spans several periods and is slowed alike.
PERIOD_US = 10_000
MIN_QUOTA_US = 1_000  # the kernel's floor


@dataclass(frozen=True)
class Hierarchy:
    """A cgroup hierarchy that holds the cpu controller: its root directory and version."""

    root: str
    version: int  # 1 or 2


def hierarchy_at(root: str) -> Hierarchy | None:
    """The hierarchy rooted at `root`, told by its files; None where it has no cpu controller."""
    if os.path.isfile(os.path.join(root, "cpu.cfs_quota_us")):
        return Hierarchy(root, 1)
    try:
        with open(os.path.join(root, "cgroup.controllers")) as f:
            controllers = f.read().split()
    except OSError:
        return None
    return Hierarchy(root, 2) if "cpu" in controllers else None


def find_hierarchy(mounts: str = MOUNTS) -> Hierarchy | None:
    """The mounted hierarchy that holds the cpu controller (the controller is in one only: a
    v1 hierarchy mounted with it, such as ``cpu`` or ``cpu,cpuacct``, else the v2 one)."""
    try:
        with open(mounts) as f:
            lines = [line.split() for line in f]
    except OSError:
        return None
    v1 = [m[1] for m in lines if len(m) > 3 and m[2] == "cgroup" and "cpu" in m[3].split(",")]
    v2 = [m[1] for m in lines if len(m) > 2 and m[2] == "cgroup2"]
    for root in v1 + v2:
        found = hierarchy_at(root)
        if found is not None:
            return found
    return None


def available(root: str | None = None) -> str | None:
    """None where a quota can be set here (or under `root`), else why not."""
    where = hierarchy_at(root) if root is not None else find_hierarchy()
    if where is None:
        return (
            f"no cgroup cpu controller at {root}" if root is not None else "no cgroup cpu controller mounted"
        )
    if os.geteuid() != 0:
        return "setting a cgroup's CPU quota needs root"
    return None


def quota_us(cores: float) -> tuple[int, int]:
    """(quota, period) in microseconds for `cores` of CPU time per wall-clock second."""
    period = min(1_000_000, max(PERIOD_US, int(MIN_QUOTA_US / cores)))  # under 0.1 core: a longer period
    return max(MIN_QUOTA_US, int(cores * period)), period


class CpuQuota:
    """Holds process `pid` (all its threads) to `cores` of CPU time per wall-clock second
    (0.25: a quarter of one core) until `release` (or the end of a with block). `root`: the
    hierarchy's root (default: the mounted one that holds the cpu controller). Not thread-safe;
    quotas on several processes at once are several objects."""

    def __init__(self, pid: int, cores: float, root: str | None = None) -> None:
        if not cores > 0:
            raise ValueError(f"a CPU quota must be positive, got {cores}")
        where = hierarchy_at(root) if root is not None else find_hierarchy()
        if where is None:
            raise RuntimeError(f"a CPU quota needs the cgroup cpu controller: {available(root)}")
        self.pid, self.hierarchy = pid, where
        self.path = os.path.join(where.root, f"resilient-comm-{os.getpid()}-{pid}")
        self._enabled_cpu = False  # whether this quota enabled the controller for the root's children
        quota, period = quota_us(cores)
        if where.version == 1:
            os.makedirs(self.path, exist_ok=True)
            _write(self.path, "cpu.cfs_period_us", str(period))
            _write(self.path, "cpu.cfs_quota_us", str(quota))
        else:
            if "cpu" not in _read(where.root, "cgroup.subtree_control"):
                try:
                    _write(where.root, "cgroup.subtree_control", "+cpu")
                except OSError as e:  # EBUSY: a non-root group with processes of its own
                    raise RuntimeError(f"cannot enable the cpu controller under {where.root}: {e}") from e
                self._enabled_cpu = True
            os.makedirs(self.path, exist_ok=True)
            _write(self.path, "cpu.max", f"{quota} {period}")
        _write(self.path, "cgroup.procs", str(pid))

    def release(self) -> None:
        """The process back in the root group (if it still lives), the group removed, and the
        cpu controller disabled for the root's children where this quota enabled it and no
        other quota of this module still needs it."""
        if not os.path.isdir(self.path):
            return
        for p in _read(self.path, "cgroup.procs"):
            try:
                _write(self.hierarchy.root, "cgroup.procs", p)
            except OSError:
                pass  # it ended meanwhile
        os.rmdir(self.path)
        if self._enabled_cpu:
            self._enabled_cpu = False
            if not any(e.startswith("resilient-comm-") for e in os.listdir(self.hierarchy.root)):
                _write(self.hierarchy.root, "cgroup.subtree_control", "-cpu")

    def __enter__(self) -> CpuQuota:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def _read(folder: str, name: str) -> list[str]:
    with open(os.path.join(folder, name)) as f:
        return f.read().split()


def _write(folder: str, name: str, value: str) -> None:
    with open(os.path.join(folder, name), "w") as f:
        f.write(value)


__all__ = ["CpuQuota", "Hierarchy", "available", "find_hierarchy", "hierarchy_at", "quota_us"]
