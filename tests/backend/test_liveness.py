"""The liveness lock ([Note: the liveness lock], csrc/common/liveness.h): a SIGKILLed process's
death is known to its node agent and to its same-host peers before the kernel has torn the
process down, and nothing but a death is taken for one.

The test process plays the node agent: it makes a slot, hands it to the worker it starts (as
resilient-run does) and watches it; the worker's pidfd says when the kernel is done.
"""

from __future__ import annotations

import mmap
import os
import select
import signal
import statistics
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from resilient_comm import _C
from resilient_comm.api import liveness_slot

# The victim holds its lock, touches 1 GiB (its teardown takes as long as a real worker's) and
# joins the peer's group; it never joins the all_reduce the peer waits in.
VICTIM = """
import sys, torch, torch.distributed as dist, resilient_comm
x = torch.ones(1 << 28)
dist.init_process_group("resilient_tcp", store=dist.TCPStore("localhost", int(sys.argv[1]), is_master=False),
                        rank=1, world_size=2)
dist.barrier()
print("ready", flush=True)
sys.stdin.read()
"""
PEER = """
import sys, time, torch, torch.distributed as dist, resilient_comm
dist.init_process_group("resilient_tcp", store=dist.TCPStore("localhost", int(sys.argv[1]), is_master=False),
                        rank=0, world_size=2)
dist.barrier()
print("waiting", flush=True)
try:
    dist.all_reduce(torch.ones(4))
except Exception as e:
    print(time.monotonic_ns(), type(e).__name__, str(e).replace(chr(10), " "), flush=True)
"""


def _wait(fd: int, timeout_s: float) -> int | None:
    """CLOCK_MONOTONIC ns when `fd` became readable, or None after `timeout_s`."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return time.monotonic_ns() if p.poll(timeout_s * 1e3) else None


def _holding(program: str, *args: str) -> tuple[subprocess.Popen, _C.LivenessWatch, int]:
    """`program` started as resilient-run starts a worker: with a slot to hold, watched here;
    the slot's fd is the caller's to close."""
    slot = liveness_slot()
    assert slot is not None
    fd, env = slot
    p = subprocess.Popen(
        [sys.executable, "-c", program, *args],
        env=os.environ | env,
        pass_fds=(fd,),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    return p, _C.LivenessWatch(fd, p.pid), fd


def _kill_once(port: int) -> dict:
    victim, watch, fd = _holding(VICTIM, str(port))
    os.close(fd)
    pidfd = os.pidfd_open(victim.pid)
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout.readline().strip() == "ready"
        assert peer.stdout.readline().strip() == "waiting"
        assert watch.verdict == "watching"
        killed = time.monotonic_ns()
        victim.kill()
        noticed = _wait(watch.fileno(), 10)
        exited = _wait(pidfd, 10)
        line = peer.stdout.readline().split(" ", 2)
        assert peer.wait(timeout=30) == 0
    finally:
        for p in (victim, peer):
            p.kill()
            p.wait()
        os.close(pidfd)
    assert noticed is not None and exited is not None
    assert watch.verdict == "died", watch.why
    assert line[1] == "PeerFailureError", line
    assert "rank 1 died while rank 0 waited on it" in line[2] and "liveness lock" in line[2], line[2]
    return {
        "notice": (watch.noticed_ns - killed) / 1e6,
        "op error": (int(line[0]) - killed) / 1e6,
        "waitpid": (exited - killed) / 1e6,
    }


@pytest.mark.timeout(180)
def test_a_sigkilled_workers_agent_and_same_host_peer_know_before_its_teardown_ends() -> None:
    runs = []
    for i in range(3):
        store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        runs.append(_kill_once(store.port))
        print(f"kill {i}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in runs[-1].items()))
    for r in runs:
        # The kernel walks the robust list before it unmaps the process (its 1 GiB here).
        assert r["notice"] < r["waitpid"] and r["op error"] < r["waitpid"], r
        assert r["notice"] < 50 and r["op error"] < 50, r
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print("median: " + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items()))
    # On a quiet machine the op error's median is 2.5-4.5 ms (benchmarks/README.md): the notice,
    # the transport's 0.5 ms grace, the exception in Python. A loaded 2-core CI machine, whose
    # other core the victim's teardown takes, has been seen at 5.7 ms.
    assert med["notice"] <= 5 and med["op error"] <= 10, med


# Each program holds a slot handed to it, then does one thing a live process may do.
HOLDER = """
import os, sys, threading, time, resilient_comm
from resilient_comm import _C
assert _C.liveness_hold() is not None
what = sys.argv[1]
if what == "thread":
    t = threading.Thread(target=lambda: None); t.start(); t.join()
elif what == "fork":
    pid = os.fork()
    if pid == 0:
        os._exit(0)  # a child without the holder thread: its end releases nothing
    os.waitpid(pid, 0)
elif what == "exec":
    print("exec", flush=True)
    os.execv(sys.executable, [sys.executable, "-c", "import sys; print('after', flush=True); sys.stdin.read()"])
print("done", flush=True)
sys.stdin.read()
"""


def _holder(what: str) -> tuple[subprocess.Popen, _C.LivenessWatch]:
    p, watch, fd = _holding(HOLDER, what)
    os.close(fd)
    return p, watch


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["thread", "fork", "stop"])
def test_a_live_process_is_never_taken_for_dead(what: str) -> None:
    p, watch = _holder(what)
    try:
        assert p.stdout.readline().strip() == "done"
        if what == "stop":
            p.send_signal(signal.SIGSTOP)
        assert _wait(watch.fileno(), 0.5) is None, watch.why
        assert watch.verdict == "watching"
        if what == "stop":
            p.send_signal(signal.SIGCONT)
        p.stdin.close()  # a normal exit releases the lock: "released", not a death
        assert p.wait(timeout=30) == 0
        assert _wait(watch.fileno(), 10) is not None
        assert watch.verdict == "released", watch.why
    finally:
        p.kill()
        p.wait()


@pytest.mark.timeout(60)
def test_an_exec_is_not_a_death() -> None:
    p, watch = _holder("exec")
    try:
        assert p.stdout.readline().strip() == "exec"
        assert _wait(watch.fileno(), 10) is not None
        assert watch.verdict == "lost", watch.why
        assert p.stdout.readline().strip() == "after"  # the process lives on
        assert "lives on" in watch.why
    finally:
        p.kill()
        p.wait()


@pytest.mark.timeout(60)
def test_a_forged_release_is_not_a_death() -> None:
    """A process that can write a live holder's slot sets FUTEX_OWNER_DIED: the watcher finds the
    holder's process not exiting and says "lost", never "died" (docs/security.md)."""
    p, watch, fd = _holding(HOLDER, "thread")
    try:
        assert p.stdout.readline().strip() == "done"
        with mmap.mmap(fd, 4096) as m:
            word = int.from_bytes(m[8:12], "little")
            assert word & 0x3FFFFFFF, "the holder's tid is in the word"
            m[8:12] = (word | 0x40000000).to_bytes(4, "little")  # FUTEX_OWNER_DIED
        waker = _C.LivenessWatch(fd, p.pid)
        del waker  # a watch's end wakes every watcher of the slot
        assert _wait(watch.fileno(), 10) is not None
        assert watch.verdict == "lost", watch.why
        assert p.poll() is None
    finally:
        os.close(fd)
        p.kill()
        p.wait()


def test_bad_slots_are_refused(tmp_path) -> None:
    # A regular file, a pipe: not a slot (a sealed page); nothing is watched.
    f = tmp_path / "f"
    f.write_bytes(b"\0" * 4096)
    with open(f, "r+b") as fh, pytest.raises(ValueError, match="not a liveness slot"):
        _C.LivenessWatch(fh.fileno(), os.getpid())
    r, w = os.pipe()
    try:
        with pytest.raises(ValueError, match="not a liveness slot"):
            _C.LivenessWatch(r, os.getpid())
    finally:
        os.close(r)
        os.close(w)
    # A handed slot named with another inode (a stale or reused fd) is not taken: the process
    # holds a slot of its own.
    fd, env = liveness_slot()
    try:
        bad = {_C.LIVENESS_SLOT_ENV: env[_C.LIVENESS_SLOT_ENV] + "1"}
        out = subprocess.run(
            [sys.executable, "-c", "from resilient_comm import _C; print(_C.liveness_hold()[1])"],
            env=os.environ | bad,
            pass_fds=(fd,),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert int(out.stdout) != fd
        watch = _C.LivenessWatch(fd, os.getpid())
        assert watch.verdict == "watching"  # never taken
    finally:
        os.close(fd)
