"""`resilient-comm chaos`: the short CI run of the seeded fault trials, and its checks failing
where they must (a trial whose final state is not the reference's is divergent)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from resilient_comm.elastic.node.agent import node_lease_s
from resilient_comm.elastic.node.lease import tolerated_outage_s
from resilient_comm.testing import cgroup, cluster
from resilient_comm.testing.harness import same_state
from resilient_comm.testing.toy import read_events
from resilient_comm.tools import chaos


@pytest.mark.timeout(300)
def test_a_short_chaos_run_passes_every_check(tmp_path: Any) -> None:
    out = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, "-m", "resilient_comm.tools.cli", "chaos", "--trials", "4", "--seed", "7",
                           "--kinds", "kill-decider,spare,stop-long,bitflip", "--steps", "16", "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout.splitlines()[-6:]
    assert table[0].split()[:3] == ["kind", "trials", "ok"] and table[-1].split()[:3] == ["all", "4", "4"], table
    trials = json.loads(out.read_text())["trials"]
    assert [t["kind"] for t in trials] == ["kill-decider", "spare", "stop-long", "bitflip"]
    for t in trials:
        assert t["ok"] and t["status"] == 0 and not t["hang"] and not t["false_evictions"], t
        if t["kind"] != "bitflip":  # nothing fails: found by the replicas' comparison, no recovery
            assert t["recovery_ms"], f"{t['kind']}: no recovery was timed"


class _WrongReference:
    """A reference whose final state is off by one bit of one weight (the segments it was
    asked for are kept)."""

    def __init__(self, real: Any) -> None:
        self.real, self.steps, self.asked = real, real.steps, []

    def final(self, segments: list[tuple[int, list[int]]]) -> Any:
        self.asked.append(segments)
        state = self.real.final(segments)
        wrong = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state["model"].items()}
        w = next(k for k, v in wrong.items() if isinstance(v, torch.Tensor) and v.is_floating_point())
        wrong[w].view(-1)[0] = torch.nextafter(wrong[w].view(-1)[0], torch.tensor(float("inf"), dtype=wrong[w].dtype))
        return {**state, "model": wrong}


@pytest.mark.timeout(180)
def test_a_trial_that_ends_away_from_the_reference_is_divergent(tmp_path: Any) -> None:
    ref = chaos.Reference(4, 16, str(tmp_path / "ref"), 100.0)
    t = chaos.draw(0, "kill", random.Random(3), 4, 16)
    wrong = _WrongReference(ref)
    bad = chaos.run_trial(t, 4, str(tmp_path / "bad"), 100.0, wrong)  # type: ignore[arg-type]
    assert not bad.ok and bad.divergent, bad
    assert bad.problems == ["the final state differs from the fault-free reference"], bad.problems
    # The same run against the true reference is not divergent: only the bit flipped made it so.
    (segments,) = wrong.asked
    finals = [torch.load(p, weights_only=False) for p in sorted((tmp_path / "bad" / "dump").glob("final-*.pt"))]
    assert finals and all(same_state(f["state"], ref.final(segments)) for f in finals)


@pytest.mark.timeout(180)
def test_a_reference_segment_is_cached_by_where_it_ends_too(tmp_path: Any) -> None:
    # Seen in a 200-trial run: one trial's segment (step 4, streams [0, 2]) to the end was
    # reused by a later trial whose same segment ended at step 8, when another recovery began.
    ref = chaos.Reference(3, 12, str(tmp_path / "ref"), 100.0)
    ref.final([(4, [0, 2])])
    two = [(4, [0, 2]), (8, [0])]
    after = ref.final(two)
    fresh = chaos.Reference.__new__(chaos.Reference)
    fresh.__dict__.update(ref.__dict__, _cache={}, workdir=str(tmp_path / "ref"))
    assert same_state(after, fresh.final(two))
    assert not same_state(after, ref.final([(4, [0, 2])]))
    with pytest.raises(ValueError, match="resumes at step 12"):
        ref.final([(12, [0])])


def test_draws_are_seeded_and_bad_arguments_are_refused(capsys: Any) -> None:
    a = [chaos.draw(i, k, random.Random(5), 4, 24) for i, k in enumerate(chaos.KINDS)]
    b = [chaos.draw(i, k, random.Random(5), 4, 24) for i, k in enumerate(chaos.KINDS)]
    assert a == b
    with pytest.raises(ValueError, match="unknown trial kind"):
        chaos.draw(0, "meteor", random.Random(1), 4, 24)
    for argv in (["--kinds", "kill,meteor"], ["--trials", "0"], ["--kinds", "tp2", "--world", "3"],
                 ["--kinds", "flap", "--nodes", "2"]):
        with pytest.raises(SystemExit) as e:
            chaos.main(argv)
        assert e.value.code == 2
    assert "unknown kinds ['meteor']" in capsys.readouterr().err


def test_the_new_kinds_draw_within_their_bounds() -> None:
    lease = node_lease_s()
    for seed in range(40):
        for steps in (10, 16, 24):
            rng = random.Random(seed)
            slow = chaos.draw(0, "slow-rank", rng, 4, steps)
            assert slow.slow is not None and slow.victims == [slow.slow[0]] and slow.slow[2] == chaos.SLOW_CORES
            window = chaos.pace_window(steps)
            # Two whole windows after the slowdown's start, one to spare (not in 10 steps), and a
            # step after the slow rank left.
            windows = 3 if steps >= 16 else 2
            assert slow.slow[1] >= 2 and (slow.slow[1] // window + 1) * window + windows * window - 1 < steps - 1, slow
            assert slow.args[:2] == ["--mark", f"{slow.slow[0]}:{slow.slow[1]}"]
            assert slow.args[slow.args.index("--pace-window") + 1] == str(window)
            flap = chaos.draw(1, "flap", rng, 4, steps)
            assert flap.link is not None and flap.link.mbit == 0 and 1 <= flap.link.node <= 3 and not flap.victims
            at = [s for s, _ in flap.link.at]
            assert len(at) in (1, 2) and at == sorted(at) and at[0] >= 2 and at[-1] < steps - 2, flap
            assert all(0.3 <= secs <= tolerated_outage_s(lease) - 0.5 for _, secs in flap.link.at), flap
            assert flap.args == [a for s in at for a in ("--hold", f"0:{s}")]
            link = chaos.draw(2, "slow-link", rng, 4, steps)
            assert link.link is not None and link.link.mbit in (20, 30, 40, 50) and 1 <= link.link.node <= 3
            ((step, secs),) = link.link.at
            assert 2 <= step < steps - 5 and 2.0 <= secs <= 4.0, link


def test_long_trials_reach_every_kind_and_draw_their_faults_over_the_whole_run() -> None:
    # Forty trials of the fourteen kinds lengthen every kind that may run long (a stride of 4
    # would only ever lengthen the kinds at odd places, never bitflip or kill-last-vote).
    n = len(chaos.KINDS)
    long = {chaos.KINDS[i % n] for i in range(40) if chaos.is_long(i, chaos.KINDS[i % n], n)}
    assert long == set(chaos.KINDS) - set(chaos.SHORT_ONLY) and "bitflip" in long, long
    flips = []
    for seed in range(40):
        rng = random.Random(seed)
        flip = chaos.draw(0, "bitflip", rng, 4, 24, long_steps=160)
        assert (flip.steps, flip.every, flip.interval) == (160, None, chaos.DEFAULT_EVERY), flip
        flips.append(int(flip.args[1].split(":")[1]))
        last = chaos.draw(1, "kill-last-vote", rng, 4, 24, long_steps=160)
        assert last.args == ["--kill", f"{last.victims[0]}:159:committed"], last
        kill2 = chaos.draw(2, "kill2", rng, 4, 24, long_steps=160)
        first, second = (int(k.split(":")[1]) for k in kill2.args[1::2])
        assert 3 <= first <= second < 156, kill2
        short = chaos.draw(3, "bitflip", rng, 4, 24)
        assert (short.steps, short.every) == (24, 5) and 1 <= int(short.args[1].split(":")[1]) < 15, short
    # Found by the comparison after step 99 or by the run's last one.
    assert chaos.DEFAULT_EVERY == 100 and min(flips) <= 99 < max(flips) < 160, flips
    with pytest.raises(ValueError, match="slow-rank trials are short only"):
        chaos.draw(0, "slow-rank", random.Random(1), 4, 24, long_steps=160)


def test_a_long_trial_that_skipped_a_comparison_fails_unless_a_recovery_replaced_it() -> None:
    t = chaos.draw(0, "kill-last-vote", random.Random(1), 4, 24, long_steps=160)
    start = SimpleNamespace(resume_step=0)

    def problems(compared: list[int], resumed: list[int]) -> list[str]:
        out = chaos.Outcome(0, t.kind, t.args, t.steps)
        events = [{"event": "agreed", "step": s} for s in compared]
        chaos._check_compared(out, t, [start, *(SimpleNamespace(resume_step=r) for r in resumed)], events)
        return out.problems

    assert problems([99, 159], []) == []
    assert problems([159], []) == ["the replicas never compared after step(s) [99] (compared after [159])"]
    assert problems([99], [160]) == []  # killed as it committed the last step: the last comparison's gather failed
    assert problems([159], [100]) == []
    assert problems([], [99]) == ["the replicas never compared after step(s) [99, 159] (compared after [])"]


@pytest.mark.timeout(90)
def test_a_long_trial_compares_at_the_default_interval_whatever_the_environment(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The caller's interval must not reach a long trial: its replicas compare after step 99 and
    # after the last step, nowhere else, and the comparison after step 99 finds the bit flipped.
    # Two ranks (no majority names the replica; every member goes back all the same): half the
    # time of four on two cores.
    monkeypatch.setenv("RESILIENT_COMM_FINGERPRINT_EVERY", "5")
    t = chaos.draw(0, "bitflip", random.Random(2), 2, 24, long_steps=chaos.LONG_STEPS)
    assert t.args[0] == "--flip" and int(t.args[1].split(":")[1]) < 99, t
    ref = chaos.Reference(2, t.steps, str(tmp_path / "ref"), 60.0)
    out = chaos.run_trial(t, 2, str(tmp_path / "trial"), 60.0, ref)
    assert out.ok and out.status == 0 and out.steps == 160 and not out.false_evictions, out
    events = read_events(str(tmp_path / "trial" / "events"))
    assert sorted({e["step"] for e in events if e["event"] in ("agreed", "mismatch")}) == [99, 159]
    assert {e["step"] for e in events if e["event"] == "mismatch"} == {99}
    assert out.seconds < 25, f"the trial took {out.seconds:.1f} s"


def test_a_kind_that_cannot_run_here_is_refused_when_named(capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cgroup, "available", lambda: "no cgroup v1 cpu controller at /nowhere")
    monkeypatch.setattr(cluster, "available", lambda: "cannot create network namespaces here")
    for argv, why in (
        (["--kinds", "kill,slow-rank"], "slow-rank trials cannot run here: no cgroup v1 cpu controller at /nowhere"),
        (["--kinds", "flap"], "flap trials cannot run here: needs root, network namespaces and etcd: "
                              "cannot create network namespaces here"),
    ):
        t0 = time.monotonic()
        with pytest.raises(SystemExit) as e:
            chaos.main(argv)
        assert e.value.code == 2 and time.monotonic() - t0 < 5.0
        assert why in capsys.readouterr().err


@pytest.mark.skipif(cgroup.available() is not None, reason=f"needs a CPU quota: {cgroup.available()}")
@pytest.mark.timeout(240)
def test_a_slow_rank_is_judged_slow_and_its_replica_dropped(tmp_path: Any) -> None:
    out = tmp_path / "chaos.json"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "resilient_comm.tools.cli", "chaos", "--trials", "1", "--seed", "2",
                           "--kinds", "slow-rank", "--steps", "16", "--out", str(out)],
                          check=False, capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].split()[:3] == ["all", "1", "1"], proc.stdout[-2000:]
    (t,) = json.loads(out.read_text())["trials"]
    assert t["kind"] == "slow-rank" and t["ok"] and t["status"] == 0 and not t["false_evictions"], t
    assert t["note"].startswith("judged slow after step ") and "the job is faster without it" in t["note"], t
    assert len(t["recovery_ms"]) == 3, "each of the three others recovered once, on purpose"
    assert t["seconds"] < 90 and time.monotonic() - t0 < 200, t["seconds"]
