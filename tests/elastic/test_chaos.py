"""`resilient-comm chaos`: the short CI run of the seeded fault trials, and its checks failing
where they must (a trial whose final state is not the reference's is divergent)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from resilient_comm.elastic.node.agent import node_lease_s
from resilient_comm.elastic.node.lease import tolerated_outage_s
from resilient_comm.testing import cgroup, cluster
from resilient_comm.testing.harness import same_state
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
        self.real, self.asked = real, []

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
    bad = chaos.run_trial(t, 4, 16, str(tmp_path / "bad"), 100.0, wrong)  # type: ignore[arg-type]
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
