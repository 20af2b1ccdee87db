"""Silent data corruption end to end: a bit flipped in one replica's parameter memory (by the
toy, in its own process) is found at the next comparison of the replicas' fingerprints (the
periodic one, or the run's last at the default interval), every member goes back to the last
agreed state and redoes the steps since, and the final state is bit-identical to a fault-free
run. A replica named twice leaves the job; a per-rank value compared as replicated stops the
job with its key named instead of going back forever."""

from __future__ import annotations

import os
import random
import time
from typing import Any

import pytest
import torch

from resilient_comm.elastic import EXIT_EVICTED
from resilient_comm.testing.harness import same_state
from resilient_comm.testing.toy import ToyJob

STEPS = 60
EVERY = 10


def _run(tmp: str, nproc: int, *args: str, timeout_s: float = 120.0) -> tuple[int, ToyJob]:
    job = ToyJob(nproc, ["--steps", str(STEPS), "--fingerprint-every", str(EVERY), "--dump",
                         os.path.join(tmp, "dump"), *args], tmp).start()
    return job.wait(timeout_s), job


def _final(job: ToyJob, ranks: list[int]) -> dict[int, dict[str, Any]]:
    return {r: torch.load(os.path.join(job.workdir, "dump", f"final-{r}.pt"), weights_only=False) for r in ranks}


def _commits(job: ToyJob, rank: int) -> list[int]:
    return [e["step"] for e in job.events() if e["event"] == "commit" and e["rank"] == rank]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    """Final states of fault-free runs of 2, 3 and 4 replicas (no comparison at all)."""
    out = {}
    for n in (2, 3, 4):
        tmp = str(tmp_path_factory.mktemp(f"fault_free{n}"))
        job = ToyJob(n, ["--steps", str(STEPS), "--fingerprint-every", "0", "--dump", os.path.join(tmp, "dump")],
                     tmp).start()
        assert job.wait(120.0) == 0, job.events()
        out[n] = _final(job, [0])[0]["state"]
    return out


@pytest.mark.timeout(200)
def test_a_flipped_bit_is_found_every_member_goes_back_and_the_result_is_bit_identical(
        tmp_path: Any, fault_free: dict[int, Any]) -> None:
    replicas = 3
    status, job = _run(str(tmp_path), replicas, "--flip", "1:30")
    assert status == 0, job.events()
    flips = [e for e in job.events() if e["event"] == "flip"]
    assert [(e["rank"], e["step"]) for e in flips] == [(1, 30)], "flipped once: the redone step does not"
    mismatches = [e for e in job.events() if e["event"] == "mismatch"]
    assert sorted(e["rank"] for e in mismatches) == list(range(replicas)), "every member saw it"
    for e in mismatches:
        # Found at the next comparison (after step 39), back to the last agreed state (step 29).
        assert (e["step"], e["back_to"]) == (39, 29), e
        assert e["diverged"] == [1], "a majority names it"
        assert e["keys"] == ["/'model'/'w1'"], "the key that differs is named"
    final = _final(job, list(range(replicas)))
    for r in range(replicas):
        assert final[r]["recoveries"] == [], "no process failed: nothing to recover"
        assert final[r]["committed"] == STEPS - 1
        assert _commits(job, r) == list(range(40)) + list(range(30, STEPS)), "steps 30-39 redone once"
        assert same_state(final[r]["state"], fault_free[replicas]), f"rank {r} differs from the fault-free run"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_at_the_default_interval_a_bit_flipped_in_a_short_job_is_caught_by_the_last_comparison(
        tmp_path: Any, fault_free: dict[int, Any], replicas: int) -> None:
    """60 steps, the default interval (100): only the run's last comparison sees the flip; every
    member goes back to the start and the job still ends bit-identical to the fault-free run."""
    at = random.randrange(STEPS)
    job = ToyJob(replicas, ["--steps", str(STEPS), "--flip", f"1:{at}", "--dump", os.path.join(str(tmp_path), "dump")],
                 str(tmp_path), env={"RESILIENT_COMM_FINGERPRINT_EVERY": ""}).start()
    assert job.wait(120.0) == 0, (at, job.events())
    mismatches = [e for e in job.events() if e["event"] == "mismatch"]
    assert [(e["step"], e["back_to"]) for e in mismatches] == [(STEPS - 1, -1)] * replicas, (at, mismatches)
    assert mismatches[0]["diverged"] == ([] if replicas == 2 else [1]), (at, mismatches)
    final = _final(job, list(range(replicas)))
    for r in range(replicas):
        assert _commits(job, r) == list(range(STEPS)) * 2, f"flip after step {at}: the whole run redone once"
        assert same_state(final[r]["state"], fault_free[replicas]), f"flip after step {at}: rank {r} differs"


@pytest.mark.timeout(120)
def test_a_per_rank_value_compared_as_replicated_stops_the_job_naming_its_key_within_two_comparisons(
        tmp_path: Any) -> None:
    t0 = time.monotonic()
    status, job = _run(str(tmp_path), 3, "--per-rank-marked")
    assert status != 0 and time.monotonic() - t0 < 60, "stopped, never looping"
    events = job.events()
    assert {(e["back_to"], tuple(e["keys"])) for e in events if e["event"] == "mismatch"} == {(-1, ("/'per_rank'",))}
    mismatches = sorted((e["rank"], e["step"]) for e in events if e["event"] == "mismatch")
    assert mismatches == sorted([(r, EVERY - 1) for r in range(3)] * 2), "two comparisons, then the stop"
    failed = [e for e in events if e["event"] == "failed"]
    assert sorted(e["rank"] for e in failed) == [0, 1, 2], events
    for e in failed:
        assert "differs again after going back to step -1" in e["why"] and "/'per_rank'" in e["why"], e["why"]
    assert max(e["step"] for e in events if e["event"] == "commit") == EVERY - 1


@pytest.mark.timeout(200)
def test_a_replica_that_diverges_twice_leaves_and_the_others_go_on(tmp_path: Any) -> None:
    status, job = _run(str(tmp_path), 3, "--flip", "1:12", "--flip", "1:25")
    assert status == 0, job.events()
    events = job.events()
    named = [(e["step"], e["diverged"]) for e in events if e["event"] == "mismatch" and e["rank"] == 0]
    assert named == [(19, [1]), (29, [1])], named
    evicted = [e for e in events if e["event"] == "evicted"]
    assert [e["rank"] for e in evicted] == [1] and "diverged from its peers 2 times" in evicted[0]["why"], evicted
    assert job.launcher.workers[1].status == EXIT_EVICTED
    final = _final(job, [0, 2])
    assert final[0]["members"] == [0, 2] and final[0]["committed"] == STEPS - 1
    assert same_state(final[0]["state"], final[2]["state"])
    assert len(final[0]["recoveries"]) == 1, "its leaving is a lost rank, recovered like any"
