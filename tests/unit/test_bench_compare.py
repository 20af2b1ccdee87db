"""`resilient-comm bench compare`: what it measures from the ranks' events, the stop file every
stack's loop reads, and one tiny run of the stacks that need nothing beyond this package."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch.distributed as dist

from resilient_comm.tools.bench import compare
from resilient_comm.tools.bench.compare_job import Stop


def _commit(rank: int, pid: int, step: int, t: float, world: int) -> dict:
    return {"event": "commit", "rank": rank, "pid": pid, "step": step, "t": t, "world": world}


def _events(world: int, victim_pid: int, kill_t: float) -> list[dict]:
    """Ranks 0..world-1 (pid 100+rank) commit steps 0..4 in full, the victim dies at kill_t,
    the survivors commit steps 5 (again: it was in flight) and 6 without it."""
    ev = [_commit(r, 100 + r, s, kill_t - 1 + 0.1 * s, world) for r in range(world) for s in range(5)]
    for r in range(world):
        if 100 + r != victim_pid:
            ev += [_commit(r, 100 + r, s, kill_t + 0.01 + 0.2 * r + (s - 5) * 0.05, world - 1) for s in (5, 6)]
            ev.append({"event": "final", "rank": r, "pid": 100 + r, "t": kill_t + 1, "digest": "d"})
    return ev


def test_recovery_is_the_last_survivors_first_commit_without_the_victim() -> None:
    ev = _events(4, victim_pid=102, kill_t=1000.0)
    run = compare._measure(compare.Run("ours", 4, 0), ev, 1000.0, 102, 2, restarts=False, world=4)
    assert run.ok and run.equal
    assert run.recovery_s == pytest.approx(0.61)  # rank 3's first commit at kill + 0.61
    assert run.redone == 0  # step 5 was not committed before the kill


def test_a_survivor_that_never_trained_again_and_unequal_parameters_are_reported() -> None:
    ev = [
        e
        for e in _events(4, 102, 1000.0)
        if not (e["rank"] == 3 and e["event"] == "commit" and e["step"] >= 5)
    ]
    run = compare._measure(compare.Run("x", 4, 0), ev, 1000.0, 102, 2, restarts=False, world=4)
    assert not run.ok and run.recovery_s is None
    assert "ranks [3] committed no step after the recovery" in run.note
    ev = _events(4, 102, 1000.0)
    next(e for e in ev if e["event"] == "final" and e["rank"] == 1)["digest"] = "other"
    run = compare._measure(compare.Run("x", 4, 0), ev, 1000.0, 102, 2, restarts=False, world=4)
    assert not run.ok and run.equal is False
    assert "3 of 3 survivors finished, 2 distinct final parameter sets" in run.note


def test_torchrun_counts_the_restarted_processes_of_every_rank() -> None:
    kill_t = 1000.0
    ev = [_commit(r, 100 + r, s, kill_t - 1 + 0.1 * s, 2) for r in range(2) for s in range(4)]
    ev += [{"event": "start", "rank": r, "pid": 200 + r, "t": kill_t + 3, "generation": 1} for r in range(2)]
    ev += [_commit(r, 200 + r, 2, kill_t + 5 + r, 2) for r in range(2)]  # from the step-1 checkpoint
    ev += [{"event": "final", "rank": r, "pid": 200 + r, "t": kill_t + 7, "digest": "d"} for r in range(2)]
    run = compare._measure(compare.Run("torchrun", 2, 0), ev, kill_t, 101, 1, restarts=True, world=2)
    assert run.ok and run.recovery_s == pytest.approx(6.0)
    assert run.redone == 2  # steps 2 and 3 again


def test_the_stop_file_is_read_once_written(tmp_path: pathlib.Path) -> None:
    stop = Stop(str(tmp_path / "stop"), cap=1000)
    assert not stop.reached(7)
    (tmp_path / "stop").write_text("")  # being written: not yet a step
    assert not stop.reached(7)
    (tmp_path / "stop").write_text("7")
    assert not stop.reached(7) and stop.reached(8)
    assert Stop("", cap=3).reached(3)


def test_unknown_stacks_are_refused_with_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        compare.main(["--stacks", "ours", "nccl-magic"])
    assert "unknown stacks ['nccl-magic']; choose from ['torchrun'" in capsys.readouterr().err


@pytest.mark.timeout(240)
@pytest.mark.skipif(not hasattr(dist, "_reconfigure"), reason="torch's reconfigure API (torch >= 2.14)")
def test_a_tiny_run_recovers_with_equal_parameters(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "compare.json"
    rc = compare.main(
        ["--world", "3", "--reps", "1", "--stacks", "ours", "reconfigure-ours", "--kill-after", "3",
         "--tail", "3", "--step-ms", "20", "--timeout", "90", "--json", str(out)]
    )  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(r["stack"], r["recovered"], r["equal"]) for r in rows] == [
        ("ours", 1, 1),
        ("reconfigure-ours", 1, 1),
    ]
    assert all(r["median_s"] < 30 for r in rows), rows  # a bound on a hang, not a benchmark
    assert rc == 0
