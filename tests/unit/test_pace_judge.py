"""Fail-slow ranks, the judge alone (`elastic/model/pace.py`): relative speed, the streaks
and their hysteresis, and what the cost model does with a slow rank."""

from __future__ import annotations

from resilient_comm.elastic.model.pace import Pace, PaceConfig

CFG = PaceConfig(window=20, slow_below=0.9, clear_above=0.95, patience=2, evict_margin=0.05)
DP4 = {r: r for r in range(4)}


def _times(slow_rank: int | None, speed: float) -> dict[int, float]:
    return {r: (0.010 / speed if r == slow_rank else 0.010) for r in range(4)}


def test_a_rank_slow_for_patience_windows_is_reported_and_one_window_is_not() -> None:
    p = Pace(CFG)
    v = p.judge(19, _times(2, 0.5))
    assert v.speeds[2] == 0.5 and v.slow == {} and v.newly_slow == [], "one window is noise"
    v = p.judge(39, _times(2, 0.5))
    assert v.newly_slow == [2] and v.slow == {2: 0.5}
    v = p.judge(59, _times(2, 0.5))
    assert v.newly_slow == [] and v.slow == {2: 0.5}, "reported once, still slow"


def test_a_window_in_the_band_breaks_a_streak_and_clearing_needs_patience_too() -> None:
    p = Pace(CFG)
    p.judge(19, _times(1, 0.8))
    p.judge(39, _times(1, 0.92))  # between the thresholds: the streak starts again
    assert p.judge(59, _times(1, 0.8)).slow == {}
    assert p.judge(79, _times(1, 0.8)).newly_slow == [1]
    assert p.judge(99, _times(None, 1.0)).cleared == [], "one fast window does not clear it"
    v = p.judge(119, _times(None, 1.0))
    assert v.cleared == [1] and v.slow == {}


def test_without_a_spare_the_replica_goes_only_when_the_job_is_faster_without_it() -> None:
    for speed, leaves in ((0.5, True), (0.68, True), (0.72, False), (0.85, False)):
        p = Pace(CFG)
        p.judge(19, _times(3, speed))
        v = p.judge(39, _times(3, speed))
        p.act(v, DP4, dp=4, spares=0)
        assert v.slow == {3: speed}, v
        assert v.leave == ([3] if leaves else []), (speed, v.why)
        assert ("faster without it" if leaves else "kept, and reported") in v.why


def test_with_a_spare_the_slowest_hands_over_one_per_spare() -> None:
    p = Pace(CFG)
    times = {0: 0.010, 1: 0.010 / 0.85, 2: 0.010 / 0.6, 3: 0.010, 4: 0.010, 5: 0.010}
    p.judge(19, times)
    v = p.judge(39, times)
    p.act(v, {r: r for r in range(6)}, dp=6, spares=1)
    assert set(v.slow) == {1, 2} and v.leave == [2], v
    assert "hot spare" in v.why


def test_tensor_parallel_partners_count_as_one_replica() -> None:
    # tp=2, dp=2: launch ranks 0, 1 are replica 0; 2, 3 replica 1. Rank 3 at 0.4 slows replica 1.
    p = Pace(CFG)
    times = {0: 0.010, 1: 0.010, 2: 0.010, 3: 0.025}
    p.judge(19, times)
    v = p.judge(39, times)
    p.act(v, {0: 0, 1: 0, 2: 1, 3: 1}, dp=2, spares=0)
    assert v.leave == [3], "0.4 < (2-1)/2 - 0.05"


def test_a_single_replica_is_never_dropped() -> None:
    p = Pace(CFG)
    times = {0: 0.010, 1: 0.040}
    p.judge(19, times)
    v = p.judge(39, times)
    p.act(v, {0: 0, 1: 0}, dp=1, spares=0)
    assert v.slow and v.leave == []


def test_forget_keeps_only_the_new_members() -> None:
    p = Pace(CFG)
    p.judge(19, _times(2, 0.5))
    p.judge(39, _times(2, 0.5))
    p.forget([0, 1, 3])
    assert p.slow == set()
    assert p.judge(59, {0: 0.01, 1: 0.01, 3: 0.01}).slow == {}
