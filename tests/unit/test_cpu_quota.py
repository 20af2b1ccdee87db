"""The CPU quota of the fail-slow tests (`resilient_comm.testing.cgroup`) against faked cgroup
hierarchies (a folder of the files the kernel shows): what it writes under either version,
which one it finds mounted, and that it cleans up."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from resilient_comm.testing import cgroup
from resilient_comm.testing.cgroup import CpuQuota, Hierarchy, find_hierarchy, quota_us

PID = 4242  # only written: nothing in a fake hierarchy moves a process


def _v1(root: Path) -> Path:
    root.mkdir()
    for name in ("cpu.cfs_period_us", "cpu.cfs_quota_us", "cgroup.procs"):
        (root / name).write_text("")
    return root


def _v2(root: Path, subtree: str = "") -> Path:
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text(subtree)
    (root / "cgroup.procs").write_text("")
    return root


@pytest.fixture(autouse=True)
def cgroupfs_rmdir(monkeypatch: pytest.MonkeyPatch) -> None:
    """A group's interface files go with its folder, as in cgroupfs."""
    rmdir = os.rmdir

    def remove(path: str) -> None:
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        rmdir(path)

    monkeypatch.setattr(cgroup.os, "rmdir", remove)


def _group(root: Path) -> Path:
    (group,) = [p for p in root.iterdir() if p.is_dir()]
    assert group.name == f"resilient-comm-{os.getpid()}-{PID}"
    return group


@pytest.mark.timeout(10)
def test_the_period_is_10_ms_and_longer_only_under_a_tenth_of_a_core() -> None:
    assert quota_us(0.5) == (5_000, 10_000)
    assert quota_us(0.1) == (1_000, 10_000)
    assert quota_us(0.05) == (1_000, 20_000), "the kernel's 1 ms floor: a longer period"
    assert quota_us(0.0001) == (1_000, 1_000_000)
    assert quota_us(3.0) == (30_000, 10_000)


@pytest.mark.timeout(10)
def test_v2_enables_the_cpu_controller_writes_cpu_max_and_cleans_up(tmp_path: Path) -> None:
    root = _v2(tmp_path / "v2")
    with CpuQuota(PID, 0.05, root=str(root)) as q:
        assert q.hierarchy == Hierarchy(str(root), 2)
        group = _group(root)
        assert (root / "cgroup.subtree_control").read_text() == "+cpu"
        assert (group / "cpu.max").read_text() == "1000 20000"
        assert (group / "cgroup.procs").read_text() == str(PID)
        assert sorted(p.name for p in group.iterdir()) == ["cgroup.procs", "cpu.max"], "no v1 file"
    assert not group.exists()
    assert (root / "cgroup.procs").read_text() == str(PID), "the process is back in the root"
    assert (root / "cgroup.subtree_control").read_text() == "-cpu", "disabled again: it enabled it"
    q.release()  # a second release changes nothing
    assert {p.name for p in root.iterdir()} == {
        "cgroup.controllers",
        "cgroup.procs",
        "cgroup.subtree_control",
    }


@pytest.mark.timeout(10)
def test_v2_leaves_a_cpu_controller_it_found_enabled(tmp_path: Path) -> None:
    root = _v2(tmp_path / "v2", subtree="cpu memory\n")
    with CpuQuota(PID, 0.1, root=str(root)):
        assert (_group(root) / "cpu.max").read_text() == "1000 10000"
    assert (root / "cgroup.subtree_control").read_text() == "cpu memory\n"


@pytest.mark.timeout(10)
def test_v1_writes_the_period_and_the_quota(tmp_path: Path) -> None:
    root = _v1(tmp_path / "v1")
    with CpuQuota(PID, 0.1, root=str(root)) as q:
        assert q.hierarchy == Hierarchy(str(root), 1)
        group = _group(root)
        assert (group / "cpu.cfs_period_us").read_text() == "10000"
        assert (group / "cpu.cfs_quota_us").read_text() == "1000"
        assert (group / "cgroup.procs").read_text() == str(PID)
    assert not group.exists() and (root / "cgroup.procs").read_text() == str(PID)


@pytest.mark.timeout(10)
def test_the_hierarchy_that_holds_the_cpu_controller_is_found_in_the_mounts(tmp_path: Path) -> None:
    v1, v2 = _v1(tmp_path / "cpu,cpuacct"), _v2(tmp_path / "unified")
    other = _v1(tmp_path / "memory")
    mounts = tmp_path / "mounts"

    def found(*lines: str) -> Hierarchy | None:
        mounts.write_text("".join(f"{line}\n" for line in lines))
        return find_hierarchy(str(mounts))

    hybrid = (
        f"cgroup {other} cgroup rw,nosuid,memory 0 0",
        f"cgroup2 {v2} cgroup2 rw,nosuid 0 0",
        f"cgroup {v1} cgroup rw,nosuid,cpu,cpuacct 0 0",
    )
    assert found(*hybrid) == Hierarchy(str(v1), 1), "v1 holds the controller: v2 has not got it"
    assert found(f"cgroup2 {v2} cgroup2 rw,nosuid 0 0") == Hierarchy(str(v2), 2)
    (v2 / "cgroup.controllers").write_text("memory pids\n")
    assert found(f"cgroup2 {v2} cgroup2 rw 0 0", f"cgroup {other} cgroup rw,memory 0 0") is None
    assert find_hierarchy(str(tmp_path / "absent")) is None
    with pytest.raises(RuntimeError, match="needs the cgroup cpu controller: no cgroup cpu controller at"):
        CpuQuota(PID, 0.1, root=str(v2))
    with pytest.raises(ValueError, match="must be positive"):
        CpuQuota(PID, 0.0, root=str(v1))
