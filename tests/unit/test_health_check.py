"""Node health checks (node/health.py): a command's verdict with its status and the tail of its
output, a timeout that kills the check's whole process group within its bound, the built-in
accelerator check on a CPU machine, the periodic monitor, and ``resilient-run`` refusing to join
when the check fails (nothing started)."""

from __future__ import annotations

import os
import pathlib
import threading
import time

import pytest

from resilient_comm.elastic.node import cli, launcher
from resilient_comm.elastic.node.health import (
    ACCELERATOR,
    ENV_HEALTH_CHECK,
    EXIT_UNHEALTHY,
    NOTHING_TO_CHECK,
    HealthCheck,
    HealthMonitor,
    from_flags,
)


@pytest.mark.timeout(30)
def test_a_check_that_exits_0_passes_with_its_output() -> None:
    assert HealthCheck("echo gpu ok").run() == (True, "gpu ok")
    assert HealthCheck(["sh", "-c", "exit 0"]).run() == (True, "")


@pytest.mark.timeout(30)
def test_a_failing_check_says_its_status_and_the_tail_of_its_output() -> None:
    ok, why = HealthCheck("for i in $(seq 1 5000); do echo line $i; done; echo disk full >&2; exit 3").run()
    assert not ok
    assert why.startswith("health check `for i in") and "failed (exit code 3)" in why, why
    assert why.endswith("line 4999 | line 5000 | disk full"), why
    assert "line 1 |" not in why and len(why) < 400, why  # the tail only
    ok, why = HealthCheck("kill -SEGV $$").run()
    assert not ok and "failed (killed by SIGSEGV); it printed nothing" in why, why
    ok, why = HealthCheck(["/nonexistent/check"]).run()
    assert not ok and "could not start" in why and "/nonexistent/check" in why, why


@pytest.mark.timeout(30)
def test_a_check_that_does_not_answer_is_killed_with_its_process_group_within_its_timeout(
    tmp_path: pathlib.Path,
) -> None:
    pidfile = tmp_path / "child"
    check = HealthCheck(f"sleep 60 & echo $! > {pidfile}; echo waiting on the driver; wait", timeout_s=0.5)
    t0 = time.monotonic()
    ok, why = check.run()
    took = time.monotonic() - t0
    assert not ok and took < 0.5 + 1.0, took
    assert why.startswith(f"health check `{check.name}` did not answer in 0.5 s (its process group was killed)")
    assert why.endswith("its output ended: waiting on the driver"), why
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 5.0  # killed; reaped by whoever inherited it (not us): a bounded poll
    while _alive(child):
        assert time.monotonic() < deadline, f"the check's child {child} outlived the check"
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(30)
def test_a_stopped_check_is_killed_at_once() -> None:
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    ok, why = HealthCheck("sleep 60", timeout_s=20).run(stop)
    assert not ok and "was stopped" in why and time.monotonic() - t0 < 2.0, why


@pytest.mark.timeout(120)
def test_the_builtin_accelerator_check_is_a_noop_on_a_cpu_machine() -> None:
    import torch

    if torch.cuda.device_count() or any(p.startswith("nvidia") for p in os.listdir("/dev")):
        pytest.skip("this machine has an NVIDIA device: the built-in check has something to check")
    ok, why = HealthCheck(ACCELERATOR, timeout_s=100).run()
    assert ok, why
    assert why.endswith(NOTHING_TO_CHECK), why


def test_bad_checks_are_refused_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown health check 'builtin:gpu': the built-in one is 'builtin:accelerator'"):
        HealthCheck("builtin:gpu")
    with pytest.raises(ValueError, match=r"period .0 s. and timeout .30 s. must be positive"):
        HealthCheck("true", period_s=0)
    monkeypatch.delenv(ENV_HEALTH_CHECK, raising=False)
    assert from_flags(None, 60, 30) is None
    monkeypatch.setenv(ENV_HEALTH_CHECK, "nvidia-smi")
    assert from_flags(None, 5, 2) == HealthCheck("nvidia-smi", 5, 2)
    assert from_flags("", 5, 2) is None  # --health-check "" turns the environment's off
    assert from_flags("true", 5, 2) == HealthCheck("true", 5, 2)


@pytest.mark.timeout(30)
def test_the_monitor_keeps_the_first_failure_within_its_period(tmp_path: pathlib.Path) -> None:
    sick = tmp_path / "sick"
    monitor = HealthMonitor(HealthCheck(f"test ! -e {sick} || {{ echo ECC errors; exit 1; }}", period_s=0.2))
    monitor.start()
    monitor.start()  # once
    try:
        time.sleep(0.5)  # healthy meanwhile: the fault starts later on purpose
        assert monitor.failed is None
        sick.touch()
        t0 = time.monotonic()
        deadline = t0 + 5.0
        while monitor.failed is None:
            assert time.monotonic() < deadline, "the monitor never saw the failure"
            time.sleep(0.01)  # pacing a bounded poll of the monitor
        assert time.monotonic() - t0 < 0.2 + 1.0
        assert "failed (exit code 1); its output ended: ECC errors" in monitor.failed, monitor.failed
    finally:
        monitor.stop()


@pytest.mark.timeout(30)
def test_a_node_that_fails_its_check_does_not_join_and_starts_nothing(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "started"
    status = cli.main(
        ["--health-check", "echo no GPU 3; exit 1", "--no-python", "touch", str(marker)]
    )
    assert status == EXIT_UNHEALTHY and not marker.exists()
    text = caplog.text
    assert "health check `echo no GPU 3; exit 1` failed (exit code 1); its output ended: no GPU 3" in text, text
    assert "This node does not join the job and started nothing (exit status 69)" in text, text


@pytest.mark.timeout(60)
def test_a_node_whose_check_starts_failing_leaves_reported_gone_and_exits_unhealthy(tmp_path: pathlib.Path) -> None:
    """One node, its worker a plain program (it never hears the agent's ``fence``): the check
    fails mid-run, the node reports its process gone at once (kind "unhealthy", the check's
    output as the reason) and kills it after the leave grace; resilient-run's status says why."""
    sick = tmp_path / "sick"
    period = 0.3
    node = launcher.Launcher(
        ["sleep", "60"], 1, health_check=HealthCheck(f"test ! -e {sick} || {{ echo fan failed; exit 1; }}", period)
    )
    out: list[int] = []
    runner = threading.Thread(target=lambda: out.append(node.run()))
    runner.start()
    deadline = time.monotonic() + 20
    while not node.workers:
        assert time.monotonic() < deadline, "the worker never started"
        time.sleep(0.01)  # pacing a bounded poll of the launcher's start
    sick.touch()
    t0, sick_at = time.monotonic(), time.time()
    runner.join(period + launcher.LEAVE_GRACE_S + 10)
    assert out == [EXIT_UNHEALTHY], out
    took = time.monotonic() - t0
    assert launcher.LEAVE_GRACE_S <= took < period + launcher.LEAVE_GRACE_S + 3.0, took
    gone = node.membership().gone([0])[0]
    assert gone.kind == "unhealthy" and gone.by == "agent 0", gone
    assert gone.detail.startswith("node 0 is unhealthy: health check `test ! -e"), gone
    assert gone.detail.endswith("failed (exit code 1); its output ended: fan failed"), gone
    assert gone.t - sick_at < period + 1.0, f"reported gone {gone.t - sick_at:.2f} s after the check turned"
    assert node.workers[0].status == 128 + 9  # SIGKILLed after the grace
