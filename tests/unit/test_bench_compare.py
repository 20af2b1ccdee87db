"""`resilient-comm bench compare`: what it measures from the ranks' events, the stop file every
stack's loop reads, and one tiny run of the stacks that need nothing beyond this package."""

from __future__ import annotations

import datetime
import json
import pathlib
import subprocess
import sys

import pytest
import torch.distributed as dist

from resilient_comm.tools.bench import compare
from resilient_comm.tools.bench.compare_job import Stop, dead_ranks


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


def test_the_event_log_reads_only_what_was_appended_and_waits_for_a_line_to_end(tmp_path: pathlib.Path) -> None:
    log = compare.EventLog(str(tmp_path / "events"))
    assert log.read() == []  # no rank has started
    (tmp_path / "events").mkdir()
    victim, other = tmp_path / "events" / "2-202.jsonl", tmp_path / "events" / "1-201.jsonl"
    victim.write_text('{"event": "start", "rank": 2}\n{"event": "commit", "ra')
    other.write_text('{"event": "start", "rank": 1}\n')
    assert log.read("2-") == [{"event": "start", "rank": 2, "pid": 202}]  # the victim's alone
    with victim.open("a") as f:
        f.write('nk": 2, "step": 7}\n')
    assert sorted(log.read(), key=lambda e: e["pid"]) == [
        {"event": "start", "rank": 1, "pid": 201},
        {"event": "commit", "rank": 2, "step": 7, "pid": 202},
    ]
    assert log.read() == [] and len(log.events) == 3
    log.close()


@pytest.mark.timeout(60)
def test_the_second_death_is_noticed_by_a_survivor_that_handled_the_first() -> None:
    """The launcher's k-th death notice is the key a reconfigure survivor that knew of k - 1 dead
    ranks waits on: a second failure is noticed, not waited out for 600 s."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # Ranks that exit when their stdin closes: 0 with status 0 (finished), 1 and 2 with 3.
    code = "import sys; sys.stdin.read(); sys.exit({})"
    procs = [
        subprocess.Popen([sys.executable, "-c", code.format(0 if r == 0 else 3)], stdin=subprocess.PIPE)
        for r in range(3)
    ]
    exits = compare._ExitReporter(store, procs)
    survivor = dist.TCPStore("127.0.0.1", store.port, is_master=False)  # the job's own client
    wait = datetime.timedelta(seconds=20)
    try:
        procs[0].stdin.close()
        procs[2].stdin.close()
        assert dead_ranks(survivor, 1, wait) == {2}  # a clean exit is no death
        procs[1].stdin.close()
        assert dead_ranks(survivor, 2, wait) == {1, 2}
    finally:
        exits.closing.set()
        for p in procs:
            p.kill()
            p.wait()


def _run(stack: str, world: int, rep: int, recovery_s: float | None) -> compare.Run:
    ok = recovery_s is not None
    return compare.Run(stack, world, rep, ok=ok, recovery_s=recovery_s, equal=True if ok else None)


def test_a_stack_that_never_recovered_meets_no_target() -> None:
    chosen = [s for s in compare.stacks(10.0, compare.TORCHFT_FAST) if s.name in ("torchft", "torchrun", "ours")]
    runs = [_run("ours", 8, i, 0.1) for i in range(3)]
    runs += [_run("torchft", 8, i, None) for i in range(3)]
    runs += [_run("torchrun", 8, i, t) for i, t in enumerate((12.0, None, 14.0))]
    rows, verdicts = compare.summarize(runs, chosen, {}, bound_s=150.0)
    assert [r["recovered"] for r in rows] == [2, 0, 3]  # chosen's order: torchrun, torchft, ours
    torchft = next(v for v in verdicts if "than torchft " in v)
    assert "MET" not in torchft and "NO FIGURE (torchft recovered in none of 3 runs" in torchft
    torchrun = next(v for v in verdicts if "than torchrun " in v)
    assert torchrun.endswith(": MET (130x; torchrun recovered in 2 of 3 runs)"), torchrun


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
