"""Fail-slow ranks end to end: a rank held to a tenth of a core by a CPU quota on its own cgroup
(from outside its code) from step 20 is found slow by its peers within two windows (20 steps),
and leaves in a planned recovery (no step fails, none is redone, every member judges it
itself): its replica is dropped where the job is faster without it, or a hot spare takes its
place (and the job runs at 90% of its unthrottled rate or more); these two need root and a
cgroup cpu controller (v1 or v2), and are skipped without. A rank at 0.85 is reported and
kept; 500 fault-free steps report nobody.

The quota's job steps mostly wait (10 ms of a step's ~17 ms: `--step-ms`, standing for a
device's compute) so that four ranks do not saturate this machine's two cores: a CPU-bound
step's rate here wanders by +-10% over seconds (measured), as wide as the 90% the spare must
restore. The victim is slowed where it is CPU-bound (its ~3 ms of CPU a step at a tenth of a
core: ~0.4 of its peers' speed, measured).
"""

from __future__ import annotations

import datetime
import itertools
import os
import statistics
from typing import Any

import pytest
import torch

from resilient_comm.elastic import EXIT_EVICTED, Membership
from resilient_comm.testing.cgroup import CpuQuota, available
from resilient_comm.testing.harness import same_state, wait_for
from resilient_comm.testing.toy import ToyJob

WHY = available()
needs_quota = pytest.mark.skipif(WHY is not None, reason=f"needs a CPU quota: {WHY}")
STEPS, WINDOW, SLOW_FROM, VICTIM = 160, 10, 20, 2


def _rate(commits: list[float]) -> float:
    """Steps per second: the median gap between consecutive commits."""
    return 1.0 / statistics.median(b - a for a, b in itertools.pairwise(commits))


def _run(tmp: str, spares: int) -> tuple[int, ToyJob]:
    # The judge's thresholds (PaceConfig): a window under 0.6 twice in a row is a slow rank.
    # The victim holds at the start of step SLOW_FROM while its quota is set: it is slow from
    # that step on, whatever the machine's load makes of this process's reaction time.
    args = ["--steps", str(STEPS), "--burn-ms", "2", "--step-ms", "10", "--pace-window", str(WINDOW), "--hold",
            f"{VICTIM}:{SLOW_FROM}", "--dump", os.path.join(tmp, "dump")]
    if spares:
        args += ["--hold", "0:1"]
    job = ToyJob(4, args, tmp, quiet=True, spares=spares).start()
    store = job.launcher.client()
    if spares:
        m = Membership(store, job.launcher.namespace)
        wait_for(lambda: len(m.spares()) >= spares, "the spare to register")
        store.set("toy/go/1", "1")
    store.wait([f"toy/held/{VICTIM}/{SLOW_FROM}"], datetime.timedelta(seconds=120))
    with CpuQuota(job.pid(VICTIM), 0.1):
        store.set(f"toy/go/{SLOW_FROM}", "1")
        status = job.wait(240.0)
    return status, job


def _toy(tmp: str, args: list[str]) -> ToyJob:
    job = ToyJob(4, ["--burn-ms", "5", "--dump", os.path.join(tmp, "dump"), *args], tmp, quiet=True).start()
    assert job.wait(240.0) == 0, job.events()[-5:]
    return job


@pytest.mark.timeout(300)
def test_a_rank_at_085_of_its_peers_speed_is_reported_and_kept(tmp_path: Any) -> None:
    """dp=4 and a rank at ~0.85 of its peers' speed from step 20 (a quota's effect on this
    loaded machine depends on the load, so the toy gives it 1/0.75 of its peers' CPU work per
    step, measured at 0.84-0.86 of their speed: on shared cores it gets more of the CPU while
    they wait): within a window's noise, so found over the horizon, and kept: 0.85 > 3/4."""
    job = _toy(str(tmp_path), ["--steps", "300", "--pace-window", "20", "--slow", f"{VICTIM}:0.75:20"])
    events = job.events()
    slow = [e for e in events if e["event"] == "slow" and e["rank"] == 0]
    assert slow and slow[0]["slow"] == [VICTIM] and slow[0]["leave"] == [], slow
    assert "kept, and reported" in slow[0]["why"], slow[0]["why"]
    judged = float(slow[0]["why"].split("slowest replica at ")[1].split(",")[0])
    assert 0.75 < judged < 0.9, f"a rank at ~0.85 was judged at {judged}"
    print(f"[pace] a rank at 0.85 from step 20: reported after step {slow[0]['step']}: {slow[0]['why']}")
    assert not [e for e in events if e["event"] == "evicted"]
    finals = [torch.load(os.path.join(tmp_path, "dump", f"final-{r}.pt"), weights_only=False) for r in range(4)]
    assert all(f["members"] == [0, 1, 2, 3] and same_state(f["state"], finals[0]["state"]) for f in finals)


@pytest.mark.timeout(300)
def test_500_fault_free_steps_report_nobody(tmp_path: Any) -> None:
    """The judge's thresholds and the window the docs advise (20) over 500 healthy steps: every
    window's speeds wander (printed), nobody is reported."""
    job = _toy(str(tmp_path), ["--steps", "500", "--pace-window", "20"])
    events = job.events()
    speeds = sorted(x for e in events if e["event"] == "pace" and e["rank"] == 0 for x in e["speeds"].values())
    print(f"[pace] 500 fault-free steps: {len(speeds) // 4} windows, speeds {speeds[0]:.2f} to {speeds[-1]:.2f}")
    assert len(speeds) == 4 * 25
    assert not [e for e in events if e["event"] in ("slow", "evicted")]


def _check_planned(job: ToyJob, members: list[int]) -> dict[int, Any]:
    events = job.events()
    slow = [e for e in events if e["event"] == "slow" and e["rank"] == 0 and e["leave"]]
    assert slow and slow[0]["leave"] == [VICTIM], [e for e in events if e["event"] == "slow"]
    found = slow[0]["step"]
    judged = sorted(e["rank"] for e in events if e["event"] == "slow" and e["leave"] == [VICTIM])
    assert judged == [0, 1, 2, 3], f"every member judged the leave itself (none aborted out of its judgement): {judged}"
    print(f"[pace] slowed from step {SLOW_FROM}, made to leave after step {found}: {slow[0]['why']}")
    finals0 = torch.load(os.path.join(job.workdir, "dump", f"final-{members[0]}.pt"), weights_only=False)
    print(f"[pace] planned recovery: {finals0['recoveries'][0]['ms']}")
    assert found < SLOW_FROM + 2 * WINDOW, "found slow within two windows (20 steps)"
    evicted = [e for e in events if e["event"] == "evicted"]
    assert [e["rank"] for e in evicted] == [VICTIM] and "is slow" in evicted[0]["why"], evicted
    assert job.launcher.workers[VICTIM].status == EXIT_EVICTED
    finals = {r: torch.load(os.path.join(job.workdir, "dump", f"final-{r}.pt"), weights_only=False) for r in members}
    for r in members:
        assert finals[r]["members"] == members and finals[r]["committed"] == STEPS - 1, finals[r]["members"]
        assert same_state(finals[r]["state"], finals[members[0]]["state"])
    for r in (0, 1, 3):
        tls = finals[r]["recoveries"]
        assert len(tls) == 1 and "planned" in tls[0]["cause"], tls
        # The members record the leaver gone themselves: nobody waits for its (throttled) exit.
        assert tls[0]["ms"]["total"] < 3000, f"rank {r}: the planned handover took {tls[0]['ms']}"
        steps = [e["step"] for e in events if e["event"] == "commit" and e["rank"] == r]
        assert steps == list(range(STEPS)), f"rank {r}: a step failed or was redone: {steps}"
    return finals


@needs_quota
@pytest.mark.timeout(300)
def test_a_rank_at_a_tenth_of_a_core_is_dropped_when_the_job_is_faster_without_it(tmp_path: Any) -> None:
    status, job = _run(str(tmp_path), spares=0)
    assert status == 0, job.events()[-5:]
    _check_planned(job, [0, 1, 3])
    commits = sorted(e["t"] for e in job.events() if e["event"] == "commit" and e["rank"] == 0)
    before, slowed, after = _rate(commits[5:SLOW_FROM]), _rate(commits[SLOW_FROM + 5:SLOW_FROM + 15]), _rate(commits[-40:])
    print(f"[pace] steps/s before {before:.1f}, slowed {slowed:.1f}, after the slow replica left {after:.1f}")
    assert after > slowed, "the job is faster without the slow replica"


@needs_quota
@pytest.mark.timeout(300)
def test_with_a_hot_spare_the_spare_takes_the_slow_ranks_place(tmp_path: Any) -> None:
    status, job = _run(str(tmp_path), spares=1)
    assert status == 0, job.events()[-5:]
    _check_planned(job, [0, 1, 4, 3])  # the spare (launch rank 4) holds rank 2's place
    commits = sorted(e["t"] for e in job.events() if e["event"] == "commit" and e["rank"] == 0)
    before, slowed, after = _rate(commits[5:SLOW_FROM]), _rate(commits[SLOW_FROM + 5:SLOW_FROM + 15]), _rate(commits[-60:])
    print(f"[pace] steps/s before {before:.1f}, slowed {slowed:.1f}, after the spare took over {after:.1f} "
          f"({after / before:.2f} of before)")
    assert after > slowed, "the spare runs at full speed"
    assert after >= 0.9 * before, "back to 90% of the unthrottled rate, or more"
