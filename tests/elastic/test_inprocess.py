"""In-process restart of scripts not written for the controller (elastic/worker/inprocess.py).

The tutorial's elastic_train.py with the ``@restartable`` line (resilient_comm.examples) and
the tutorial's script left as it is under ``resilient-run --in-process``, 4 workers: a worker
is SIGKILLed (or SIGSTOPped) once it passed a checkpoint; the survivors must resume in the
same processes from that checkpoint, with the new world, and finish. The test reads each
worker's log (``--log-dir``): its pid, every step with the world size and the time.
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest
import torch.distributed as dist

from resilient_comm.elastic import restartable

LAUNCHER = [sys.executable, "-m", "resilient_comm.elastic"]
STEPS = 30
# The tutorial's script (section 3.2) as it is, but for its backend (gloo cannot be aborted)
# and its constants (read from the environment, as in resilient_comm.examples.elastic_train).
TUTORIAL = '''
import os, time, torch, torch.distributed as dist

CKPT = os.environ["ELASTIC_CKPT"]

def setup():
    dist.init_process_group(backend="resilient_tcp")
    rank = dist.get_rank()
    world = dist.get_world_size()
    print(f"[rank {rank}] joined, world_size={world}, pid={os.getpid()}", flush=True)
    return rank, world

def load_step():
    if os.path.exists(CKPT):
        step = torch.load(CKPT)["step"]
        print(f"[resume] from checkpoint, step={step}", flush=True)
        return step
    return 0

def main():
    rank, world = setup()
    step = load_step()
    while step < int(os.environ["ELASTIC_STEPS"]):
        g = torch.ones(1) * (rank + 1)
        dist.all_reduce(g, op=dist.ReduceOp.SUM)
        print(f"[rank {rank}] step={step} world={world} sum={g.item():.0f} t={time.time():.6f}", flush=True)
        if rank == 0 and step % 5 == 0:
            torch.save({"step": step}, CKPT)
        step += 1
        time.sleep(float(os.environ["ELASTIC_SLEEP_S"]))
    print(f"[rank {rank}] DONE at step={step} pid={os.getpid()}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    main()
'''


@dataclass
class Log:
    text: str

    def pids(self) -> set[int]:
        return {int(p) for p in re.findall(r"pid=(\d+)", self.text)}

    def steps(self) -> list[tuple[int, int, int, float]]:
        """(step, world, sum, time) of every step, in order."""
        return [(int(s), int(w), int(g), float(t))
                for s, w, g, t in re.findall(r"step=(\d+) world=(\d+) sum=(\d+) t=([\d.]+)", self.text)]

    def resumes(self) -> list[int]:
        return [int(s) for s in re.findall(r"\[resume\] from checkpoint, step=(\d+)", self.text)]

    def around_resume(self) -> tuple[list[tuple[int, int, int, float]], list[tuple[int, int, int, float]]]:
        """The steps logged before the (first) resume line and after it. Split by the log's order,
        not by the time of the signal: a step every rank finished just before the kill can be
        printed a moment after it."""
        m = re.search(r"\[resume\] from checkpoint", self.text)
        cut = m.start() if m else len(self.text)
        return Log(self.text[:cut]).steps(), Log(self.text[cut:]).steps()


def logs(d: pathlib.Path) -> dict[int, Log]:
    return {int(p.stem): Log(p.read_text()) for p in (d / "0").glob("*.log")}


def wait_for(what: str, pred, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)  # polling a worker's log file for a condition, not a synchronisation sleep


def run_job(tmp: pathlib.Path, cmd: list[str], victim: int, sig: int, at_step: int = 7, extra: list[str] = (),
            nproc: int = 4) -> tuple[subprocess.CompletedProcess, dict[int, Log], float, int]:
    """Run the job, send `sig` to launch rank `victim` once it logged `at_step`; returns the
    launcher's result, the logs, the time of the signal and the victim's pid."""
    env = dict(os.environ, ELASTIC_CKPT=str(tmp / "ckpt.pt"), ELASTIC_STEPS=str(STEPS), ELASTIC_SLEEP_S="0.03")
    proc = subprocess.Popen([*LAUNCHER, "--nproc-per-node", str(nproc), *extra, "--log-dir", str(tmp / "logs"), *cmd],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    path = tmp / "logs" / "0" / f"{victim}.log"
    try:
        wait_for(f"rank {victim}'s step {at_step}", lambda: path.exists() and f"step={at_step} " in path.read_text(),
                 60)
        pid = Log(path.read_text()).pids().pop()
        t_sig = time.time()
        os.kill(pid, sig)
        if sig == signal.SIGSTOP:
            wait_for("the survivors to finish", lambda: sum("DONE" in lg.text for lg in logs(tmp / "logs").values())
                     >= nproc - 1, 60)
            os.kill(pid, signal.SIGCONT)  # it wakes up, finds itself evicted and leaves
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), logs(tmp / "logs"), t_sig, pid


def check_resumed(lg: dict[int, Log], survivors: list[int], world_after: int, t_fault: float,
                  bound_s: float) -> float:
    """Every survivor ran in one process, resumed once from a checkpoint step at most 5 before
    the fault, ran every later step in the new world and finished; returns fault -> the last
    survivor's first step after the restart."""
    firsts = []
    last = max(s[0] for r in survivors for s in lg[r].around_resume()[0])
    for r in survivors:
        text = lg[r].text
        assert len(lg[r].pids()) == 1, f"rank {r} ran in more than one process: {lg[r].pids()}\n{text}"
        assert len(lg[r].resumes()) == 1, text
        resume = lg[r].resumes()[0]
        after = lg[r].around_resume()[1]
        assert after and after[0][3] > t_fault, text
        assert resume % 5 == 0 and last - 5 <= resume <= last, text
        assert [s[0] for s in after] == list(range(resume, STEPS)), text
        assert {s[1] for s in after} == {world_after}, text
        assert f"DONE at step={STEPS}" in text, text
        firsts.append(after[0][3])
    took = max(firsts) - t_fault
    assert took < bound_s, f"fault -> first step after the restart took {took:.2f} s (bound {bound_s} s)"
    return took


@pytest.mark.timeout(120)
def test_the_tutorial_script_with_the_decorator_restarts_in_the_same_processes_after_a_sigkill(
        tmp_path: pathlib.Path) -> None:
    out, lg, t_kill, pid = run_job(tmp_path, ["-m", "resilient_comm.examples.elastic_train"], victim=2,
                                   sig=signal.SIGKILL)
    assert out.returncode == 0, out.stderr
    assert f"worker 2 (pid {pid}): killed by SIGKILL" in out.stderr, out.stderr
    check_resumed(lg, [0, 1, 3], 3, t_kill, bound_s=2.0)
    sums = {s[2] for r in (0, 1, 3) for s in lg[r].around_resume()[1]}
    assert sums == {1 + 2 + 3}, f"after the restart the world is ranks 0-2: all_reduce(SUM) of rank+1 is 6: {sums}"
    assert "in-process restart 1: epoch 1, world 3 (was rank 3 of the launch)" in lg[3].text, lg[3].text


@pytest.mark.timeout(120)
def test_an_unmodified_script_under_in_process_restarts_after_a_sigstop(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "elastic_train.py"
    script.write_text(TUTORIAL)
    out, lg, t_stop, _ = run_job(tmp_path, ["--in-process", str(script)], victim=1, sig=signal.SIGSTOP)
    assert out.returncode == 0, out.stderr
    # Only its heartbeat's silence tells (no exit, no socket error): the silence bound, then
    # the restart.
    check_resumed(lg, [0, 2, 3], 3, t_stop, bound_s=5.0)
    assert "rank 1 was reported gone: heartbeat silent" in lg[1].text, \
        f"the stopped rank, resumed, finds itself evicted:\n{lg[1].text}"
    assert re.search(r"worker 1 \(pid \d+\): exit code 3", out.stderr), "evicted: EXIT_EVICTED"


@pytest.mark.timeout(120)
def test_a_hot_spare_takes_the_dead_ranks_place_and_the_world_stays_4(tmp_path: pathlib.Path) -> None:
    out, lg, t_kill, _ = run_job(tmp_path, ["-m", "resilient_comm.examples.elastic_train"], victim=1,
                                 sig=signal.SIGKILL, extra=["--spares", "1"])
    assert out.returncode == 0, out.stderr
    assert set(lg) == {0, 1, 2, 3, 4, 5}, "the spare has its own log, id 4; 5 is the refill started after the death"
    assert not lg[5].steps(), lg[5].text
    check_resumed(lg, [0, 2, 3, 4], 4, t_kill, bound_s=3.0)
    assert not lg[4].around_resume()[0], "the spare ran no step before it was placed"
    assert "in-process restart 1: epoch 1, world 4 (was rank 4 of the launch)" not in lg[4].text
    assert "[rank 1] joined, world_size=4" in lg[4].text, "the spare holds the dead rank's place"


FAILS = '''
import os, sys, torch.distributed as dist
import resilient_comm
from resilient_comm.elastic import restartable

@restartable(max_restarts=2)
def main():
    print("entered", os.environ["RANK"], os.environ["WORLD_SIZE"], flush=True)
    raise dist.DistBackendError("boom: a fault that every restart meets again")

main()
'''


@pytest.mark.timeout(60)
def test_restarts_are_bounded_and_the_last_error_says_why(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text(FAILS)
    t0 = time.monotonic()
    out = subprocess.run([*LAUNCHER, "--nproc-per-node", "2", "--log-dir", str(tmp_path / "logs"), str(script)],
                         capture_output=True, text=True, timeout=50, check=False)
    assert out.returncode == 1, out.stderr
    for r in (0, 1):
        text = (tmp_path / "logs" / "0" / f"{r}.log").read_text()
        assert text.count("entered") == 3, text
        assert "RecoveryError: rank" in text and "2 in-process restarts and the job has not finished" in text, text
        assert "boom" in text, text
    assert time.monotonic() - t0 < 30


def test_outside_resilient_run_a_restartable_function_runs_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RESILIENT_COMM_AGENT", raising=False)
    calls = []

    @restartable
    def f(x: int) -> int:
        calls.append(x)
        if len(calls) == 1:
            raise dist.DistBackendError("no restart without resilient-run")
        return x

    with pytest.raises(dist.DistBackendError, match="no restart"):
        f(1)
    assert f(2) == 2 and calls == [1, 2]
    with pytest.raises(ValueError, match="max_restarts must be >= 0"):
        restartable(max_restarts=-1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ignore", [False, True])
def test_a_workers_own_error_is_the_jobs_status_though_the_others_finished(tmp_path: pathlib.Path,
                                                                           ignore: bool) -> None:
    """Issue #53: rank 2's script raises at step 10 (an error of its own, not a fault): the
    others restart in-process without it and finish, and resilient-run's status is rank 2's
    (its last line says so), not 0; ``--ignore-worker-errors`` keeps the old behaviour."""
    script = tmp_path / "own_error.py"
    script.write_text(TUTORIAL.replace(
        "        g = torch.ones(1) * (rank + 1)\n",
        "        if rank == 2 and world == 4 and step == 10:\n"
        "            raise ValueError('a bug of its own at step 10')\n"
        "        g = torch.ones(1) * (rank + 1)\n"))
    env = dict(os.environ, ELASTIC_CKPT=str(tmp_path / "ckpt.pt"), ELASTIC_STEPS="20", ELASTIC_SLEEP_S="0.02")
    flags = ["--ignore-worker-errors"] if ignore else []
    out = subprocess.run([*LAUNCHER, "--nproc-per-node", "4", *flags, "--log-dir", str(tmp_path / "logs"),
                          "--in-process", str(script)], env=env, capture_output=True, text=True, timeout=100,
                         check=False)
    lg = logs(tmp_path / "logs")
    assert "ValueError: a bug of its own at step 10" in lg[2].text, lg[2].text
    for r in (0, 1, 3):
        assert "DONE at step=20" in lg[r].text and "world=3" in lg[r].text, lg[r].text
    last = out.stderr.strip().splitlines()[-2:]
    if ignore:
        assert out.returncode == 0, out.stderr
    else:
        assert out.returncode == 1, out.stderr
        assert re.search(r"worker 2 \(pid \d+\) ended with an error of its own \(exit code 1\) and the job went on "
                         r"without it: exit status 1", "\n".join(last)), out.stderr
