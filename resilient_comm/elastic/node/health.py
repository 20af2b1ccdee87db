"""Node health checks: ``resilient-run --health-check CMD`` (or ``RESILIENT_COMM_HEALTH_CHECK``).

The node's launcher runs the check once before the node joins -- before it takes a place or
starts anything: a node that fails it does not join and exits `EXIT_UNHEALTHY` -- and then
every ``--health-check-period`` seconds on a thread of its own (`HealthMonitor`) while the
node runs. A check that fails mid-job makes the node leave as a lost node does, at once
(`NodeAgent.leave`): its processes are told to stop and reported gone in one event, so the
others decide without it (a spare takes its ranks where one waits). docs/elastic.md, "Node
health checks".

A check is a command: exit status 0 is healthy, anything else is not, and the tail of its
output says why. It runs in a session of its own; past ``--health-check-timeout`` seconds its
whole process group is killed and the check counts as failed ("did not answer in T s"), so a
check stuck on a hung driver cannot hang the agent.

``builtin:accelerator`` is the check this module ships: the node's CUDA (or Ascend NPU)
devices are visible and each answers a tiny op, and NCCL (HCCL) loads. It runs in a child
process like any command (``python -m resilient_comm.elastic.node.health accelerator``); on a
node with no accelerator it passes, saying ``no accelerator on this node: nothing to check``.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import IO, NamedTuple

ENV_HEALTH_CHECK = "RESILIENT_COMM_HEALTH_CHECK"  # the command when --health-check is not given
# resilient-run's exit status when its node failed its health check, before joining or
# mid-job (sysexits' EX_UNAVAILABLE): a scheduler can tell a bad node from a failed job.
EXIT_UNHEALTHY = 69
DEFAULT_PERIOD_S = 60.0
DEFAULT_TIMEOUT_S = 30.0
ACCELERATOR = "builtin:accelerator"
NOTHING_TO_CHECK = "no accelerator on this node: nothing to check"
_TAIL_BYTES, _TAIL_LINES = 2048, 8  # how much of a check's output its verdict quotes


class Verdict(NamedTuple):
    """A check's outcome: `why` is the tail of its output, and on a failure its status too."""

    ok: bool
    why: str


@dataclasses.dataclass(frozen=True)
class HealthCheck:
    """A node's health check: `command` a shell string (run by ``/bin/sh -c``), an argv, or
    ``builtin:accelerator``; run every `period_s` seconds, each run killed after `timeout_s`.
    `run` may be called from any thread; each call runs the command once."""

    command: str | Sequence[str]
    period_s: float = DEFAULT_PERIOD_S
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("a health check needs a command")
        if (
            isinstance(self.command, str)
            and self.command.startswith("builtin:")
            and self.command != ACCELERATOR
        ):
            raise ValueError(f"unknown health check {self.command!r}: the built-in one is {ACCELERATOR!r}")
        if not self.period_s > 0 or not self.timeout_s > 0:
            raise ValueError(
                f"a health check's period ({self.period_s:g} s) and timeout ({self.timeout_s:g} s) must be positive"
            )

    @property
    def name(self) -> str:
        """The check as a user typed it (its messages name it so)."""
        return self.command if isinstance(self.command, str) else shlex.join(self.command)

    def argv(self) -> list[str]:
        if self.command == ACCELERATOR:
            return [sys.executable, "-m", "resilient_comm.elastic.node.health", "accelerator"]
        if isinstance(self.command, str):
            return ["/bin/sh", "-c", self.command]
        return list(self.command)

    def run(self, stop: threading.Event | None = None) -> Verdict:
        """Run the check once: healthy when it exits 0 within the timeout. A check that does not
        answer in time, or is still running when `stop` is set, is killed with its whole
        process group (and fails)."""
        with tempfile.TemporaryFile() as out:  # a file, not a pipe: a child it left behind cannot hold us
            try:
                proc = subprocess.Popen(
                    self.argv(),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as e:
                return Verdict(False, f"health check `{self.name}` could not start: {e}")
            deadline = time.monotonic() + self.timeout_s
            try:
                while proc.poll() is None:
                    left = deadline - time.monotonic()
                    if left <= 0 or (stop is not None and stop.is_set()):
                        _kill_group(proc)
                        what = "did not answer" if left <= 0 else "was stopped"
                        return Verdict(
                            False,
                            f"health check `{self.name}` {what} in {self.timeout_s:g} s (its process group "
                            f"was killed){_quote(_tail(out))}",
                        )
                    try:  # (stop is polled at 0.1 s: a monitor's stop ends a running check at once)
                        proc.wait(timeout=min(left, 0.1) if stop is not None else left)
                    except subprocess.TimeoutExpired:
                        pass
            except BaseException:  # interrupted (a signal handler's exception, Ctrl-C): no orphan check
                _kill_group(proc)
                raise
            tail = _tail(out)
        if proc.returncode == 0:
            return Verdict(True, tail)
        status = (
            f"killed by {signal.Signals(-proc.returncode).name}"
            if proc.returncode < 0
            else f"exit code {proc.returncode}"
        )
        return Verdict(False, f"health check `{self.name}` failed ({status}){_quote(tail)}")


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group is the check and its children
    except ProcessLookupError:
        pass  # it ended meanwhile
    proc.wait()


def _tail(out: IO[bytes]) -> str:
    """The last lines of what a check printed."""
    size = out.seek(0, os.SEEK_END)
    out.seek(max(0, size - _TAIL_BYTES))
    lines = [ln.strip() for ln in out.read().decode(errors="replace").splitlines() if ln.strip()]
    if size > _TAIL_BYTES and lines:
        lines = lines[1:]  # the first may be cut
    return " | ".join(lines[-_TAIL_LINES:])


def _quote(tail: str) -> str:
    return f"; its output ended: {tail}" if tail else "; it printed nothing"


def from_flags(command: str | None, period_s: float, timeout_s: float) -> HealthCheck | None:
    """The check ``resilient-run``'s flags ask for: `command` (``--health-check``), else
    ``RESILIENT_COMM_HEALTH_CHECK``; None when neither names one (``--health-check ""``
    turns the environment's off). A ValueError says what is wrong with the values."""
    if command is None:
        command = os.environ.get(ENV_HEALTH_CHECK, "")
    if not command.strip():
        return None
    return HealthCheck(command.strip(), period_s, timeout_s)


class HealthMonitor:
    """Runs `check` every `check.period_s` seconds (counted from the end of the last run) on a
    thread of its own. The first failure is kept in `failed` (the node's launcher polls it
    on its loop and leaves) and the thread ends: a node that failed is leaving. `stop` may be
    called from any thread; it kills a running check."""

    def __init__(self, check: HealthCheck) -> None:
        self.check = check
        self.failed: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rc-health-check", daemon=True)

    def start(self) -> None:
        """Start the checks (once: later calls do nothing)."""
        if self._thread.ident is None:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.check.period_s):
            ok, why = self.check.run(self._stop)
            if self._stop.is_set():
                return
            if not ok:
                self.failed = why
                return


# -- builtin:accelerator (in a child process: a hung driver hangs only the child) -----------


def _device_files(pattern: str) -> list[str]:
    return sorted(glob.glob(pattern))


def _probe(kind: str, count: int) -> list[str]:
    """Each device of `kind` answers a tiny op (a sum read back to the host); returns the
    failures. Each device is announced before its op, so that the output's tail names the
    one that hung when the parent's timeout kills this process."""
    import torch

    failures = []
    for i in range(count):
        print(f"{kind}:{i}: probing", flush=True)
        t0 = time.monotonic()
        try:
            got = torch.ones(1024, device=f"{kind}:{i}").mul(2).sum().item()
            if got != 2048:
                raise RuntimeError(f"a sum of 1024 twos gave {got}")
        except Exception as e:  # any error of a device is a finding to report
            failures.append(f"{kind}:{i} failed a tiny op: {e}")
            continue
        print(f"{kind}:{i}: answered in {1e3 * (time.monotonic() - t0):.0f} ms", flush=True)
    return failures


def _hidden(var: str) -> bool:
    """The devices were hidden on purpose (CUDA_VISIBLE_DEVICES="" or -1)."""
    return os.environ.get(var, None) in ("", "-1")


def accelerator_check() -> tuple[bool, list[str]]:
    """The built-in check, in this process: (healthy, what it found). CUDA devices visible
    (a device file ``/dev/nvidia<N>`` that CUDA does not see is a failure, unless
    CUDA_VISIBLE_DEVICES hides them) and each answering; NCCL loadable where there are any.
    The same for Ascend NPUs (``torch_npu``, ``/dev/davinci<N>``, HCCL)."""
    import torch

    from resilient_comm import _C
    from resilient_comm.nccl_lib import nccl_wheel_candidates

    failures: list[str] = []
    seen: list[str] = []
    cuda = torch.cuda.device_count()
    nvidia = _device_files("/dev/nvidia[0-9]*")
    if not cuda and nvidia and not _hidden("CUDA_VISIBLE_DEVICES"):
        try:
            torch.cuda.init()
            err = "torch.cuda.device_count() is 0"
        except Exception as e:  # the driver's error is the finding
            err = str(e)
        failures.append(f"{len(nvidia)} NVIDIA device file(s) ({' '.join(nvidia)}) but CUDA sees none: {err}")
    if cuda:
        seen.append(f"{cuda} CUDA device(s)")
        failures += _probe("cuda", cuda)
        nccl = _C.probe_nccl(nccl_wheel_candidates())
        if nccl["found"]:
            print(f"libnccl {nccl['version']} at {nccl['path']}", flush=True)
        else:
            failures.append(f"NCCL does not load: {nccl['error']}")
    npu = 0
    davinci = _device_files("/dev/davinci[0-9]*")
    try:
        import torch_npu  # noqa: F401 - registers torch.npu

        npu = torch.npu.device_count()  # type: ignore[attr-defined]
    except Exception as e:  # not installed, or its driver failed
        if davinci and not _hidden("ASCEND_RT_VISIBLE_DEVICES"):
            failures.append(f"{len(davinci)} Ascend device file(s) but torch_npu is unusable: {e}")
    if not npu and davinci and not failures and not _hidden("ASCEND_RT_VISIBLE_DEVICES"):
        failures.append(f"{len(davinci)} Ascend device file(s) ({' '.join(davinci)}) but torch_npu sees none")
    if npu:
        seen.append(f"{npu} NPU(s)")
        failures += _probe("npu", npu)
        hccl = _C.probe_hccl()
        if hccl["found"]:
            print(f"libhccl at {hccl['path']}", flush=True)
        else:
            failures.append(f"HCCL does not load: {hccl['error']}")
    if failures:
        return False, failures
    return True, [f"{' and '.join(seen)} answered" if seen else NOTHING_TO_CHECK]


def main(argv: list[str] | None = None) -> int:
    """``python -m resilient_comm.elastic.node.health accelerator``: the built-in check, exit 0
    when healthy, 1 with the findings otherwise."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["accelerator"]:
        print("usage: python -m resilient_comm.elastic.node.health accelerator", file=sys.stderr)
        return 2
    ok, found = accelerator_check()
    for line in found:
        print(line, flush=True)
    return 0 if ok else 1


__all__ = [
    "ACCELERATOR",
    "DEFAULT_PERIOD_S",
    "DEFAULT_TIMEOUT_S",
    "ENV_HEALTH_CHECK",
    "EXIT_UNHEALTHY",
    "NOTHING_TO_CHECK",
    "HealthCheck",
    "HealthMonitor",
    "Verdict",
    "accelerator_check",
    "from_flags",
]

if __name__ == "__main__":
    sys.exit(main())
