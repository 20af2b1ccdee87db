"""Training shaped like a real job, at the controller's default settings, past its periodic
mechanisms (the replicas' comparison every 100 steps): per-rank RNG consumed by dropout, a
DataLoader over a DistributedSampler whose position is in the state, AdamW, `TrainState`'s
defaults (`resilient_comm.testing.shaped`). Replicas whose state legitimately differs per
rank must never be rolled back; a SIGKILL and a flipped bit still recover bit for bit. The
same under FSDP2 (``shard_dp``), where no two ranks hold the same shard: the comparison is off
and says so once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from resilient_comm.testing.harness import same_state
from resilient_comm.testing.toy import read_events


def _run(tmp: str, *args: str, env: dict[str, str] | None = None, timeout_s: float = 150.0) -> tuple[float, list]:
    t0 = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "resilient_comm.elastic", "--nproc-per-node", "4", "-m", "resilient_comm.testing.shaped",
         "--events", os.path.join(tmp, "events"), "--dump", os.path.join(tmp, "dump"), *args],
        env={**os.environ, "RESILIENT_COMM_FINGERPRINT_EVERY": "", **(env or {})}, capture_output=True, text=True,
        timeout=timeout_s, check=False, cwd=tmp)
    assert run.returncode == 0, run.stderr[-4000:]
    return time.monotonic() - t0, read_events(os.path.join(tmp, "events"))


def _final(tmp: str, rank: int) -> dict[str, Any]:
    return torch.load(os.path.join(tmp, "dump", f"final-{rank}.pt"), weights_only=False)


def _commits(events: list, rank: int) -> list[int]:
    return [e["step"] for e in events if e["event"] == "commit" and e["rank"] == rank]


def _of(events: list, kind: str) -> list:
    return [e for e in events if e["event"] == kind]


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, float, list]:
    tmp = str(tmp_path_factory.mktemp("fault_free"))
    took, events = _run(tmp, "--steps", "300")
    return tmp, took, events


@pytest.mark.timeout(200)
def test_300_steps_with_per_rank_rng_and_data_positions_are_never_rolled_back(
        fault_free: tuple[str, float, list]) -> None:
    tmp, took, events = fault_free
    assert not _of(events, "mismatch"), _of(events, "mismatch")
    for r in range(4):
        assert _commits(events, r) == list(range(300)), f"rank {r}: every step committed once"
        assert [e["step"] for e in _of(events, "agreed") if e["rank"] == r] == [99, 199, 299]
    finals = [_final(tmp, r) for r in range(4)]
    for f in finals[1:]:
        assert same_state(f["params"], finals[0]["params"]) and same_state(f["optimizer"], finals[0]["optimizer"])
    assert finals[0]["data"] == {"epoch": 9, "batch": 12}, "32 batches an epoch per replica: 300 = 9 * 32 + 12"
    assert took < 120, took


@pytest.mark.timeout(300)
def test_a_sigkill_then_a_flipped_bit_recover_bit_for_bit_in_120_steps(tmp_path: Any) -> None:
    """Rank 2 SIGKILLed at step 60 (the others go on as 3 replicas), then rank 1's parameters
    corrupted after step 80: the comparison after step 99 finds it, every member goes back to
    the state agreed after the recovery, and the job ends equal to the same kill without the flip."""
    kill_only, flipped = str(tmp_path / "kill"), str(tmp_path / "flip")
    os.makedirs(kill_only)
    os.makedirs(flipped)
    _, ev_kill = _run(kill_only, "--steps", "120", "--kill", "2:60")
    _, ev_flip = _run(flipped, "--steps", "120", "--kill", "2:60", "--flip", "1:80")
    assert not _of(ev_kill, "mismatch"), "per-rank state never counts as a mismatch, across a recovery too"
    for r in (0, 1, 3):
        assert _commits(ev_kill, r) == list(range(120)), f"rank {r}: the kept step is not redone"
        assert [e["step"] for e in _of(ev_kill, "agreed") if e["rank"] == r] == [99, 119]
    mismatches = _of(ev_flip, "mismatch")
    assert sorted(e["rank"] for e in mismatches) == [0, 1, 3], mismatches
    for e in mismatches:
        assert (e["step"], e["diverged"], e["keys"]) == (99, [1], ["/'model'/'1.weight'"]), e
    for r in (0, 1, 3):
        a, b = _final(kill_only, r), _final(flipped, r)
        assert a["members"] == b["members"] == [0, 1, 3] and a["committed"] == b["committed"] == 119
        assert same_state(a["params"], b["params"]) and same_state(a["optimizer"], b["optimizer"]), f"rank {r}"
        assert a["data"] == b["data"], f"rank {r}: the data position went back with the state"


@pytest.mark.timeout(200)
def test_fsdp2_300_steps_at_a_short_interval_are_never_rolled_back(tmp_path: Any) -> None:
    """The FSDP2 job at RESILIENT_COMM_FINGERPRINT_EVERY=5 (a comparison would be due every 5
    steps and before every checkpoint): every step committed once."""
    took, events = _run(str(tmp_path), "--fsdp", "--ckpt", str(tmp_path / "ckpt"), "--steps", "300",
                        env={"RESILIENT_COMM_FINGERPRINT_EVERY": "5"})
    assert not _of(events, "mismatch") and not _of(events, "agreed"), "nothing is compared"
    off = _of(events, "off")
    assert sorted(e["rank"] for e in off) == [0, 1, 2, 3], "said once per rank"
    assert "no two ranks hold the same shard" in off[0]["why"]
    for r in range(4):
        assert _commits(events, r) == list(range(300)), f"rank {r}: every step committed once"
    assert took < 150, took


@pytest.mark.timeout(200)
def test_fsdp2_with_a_sigkill_and_a_flip_at_the_default_interval_ends_without_a_rollback(tmp_path: Any) -> None:
    """The SIGKILLed replica leaves, the survivors re-shard the newest checkpoint and finish;
    the flip is not seen (no replicas to compare: docs/elastic.md says so) and nothing goes back."""
    took, events = _run(str(tmp_path), "--fsdp", "--ckpt", str(tmp_path / "ckpt"), "--steps", "300",
                        "--kill", "3:150", "--flip", "0:100")
    assert not _of(events, "mismatch") and len(_of(events, "flip")) == 1
    assert [e["rank"] for e in _of(events, "evicted")] == [2], "the victim's replica leaves"
    for r in (0, 1):
        steps = _commits(events, r)
        assert steps[-1] == 299 and set(steps) == set(range(300)), f"rank {r}"
        assert len(steps) - 300 <= 25, f"rank {r}: at most a checkpoint interval redone ({len(steps) - 300})"
        assert _final(str(tmp_path), r)["members"] == [0, 1]
    assert took < 150, took
