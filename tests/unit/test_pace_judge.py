"""Fail-slow ranks, the judge alone (`elastic/model/pace.py`): relative speed, a big slowdown
found in two windows and a mild one over the horizon (never the measured noise), the
hysteresis, what the cost model does with a slow rank, and a slow link told by its node."""

from __future__ import annotations

import pytest

from resilient_comm.config import knobs
from resilient_comm.elastic.model.pace import WINDOW_KNOB, Pace, PaceConfig, PaceVerdict, link_speeds

CFG = PaceConfig(window=20, slow_below=0.9, clear_above=0.95, patience=2, evict_margin=0.05, sure_below=0.6, horizon=12)
DP4 = {r: r for r in range(4)}


def _times(slow_rank: int | None, speed: float) -> dict[int, float]:
    return {r: (0.010 / speed if r == slow_rank else 0.010) for r in range(4)}


def _judge(p: Pace, times: dict[int, float], windows: int, first: int = 19) -> PaceVerdict:
    for k in range(windows):
        v = p.judge(first + 20 * k, times)
    return v


# A healthy rank's 20-step windows on this 2-core machine with a test suite alongside (4 ranks,
# 5 ms of CPU per step; measured: docs/elastic.md): the noise the rules must ride out.
NOISY = [0.87, 0.95, 1.07, 1.03, 0.93, 1.10, 1.00, 0.76, 1.05, 1.07, 0.98, 1.02, 1.03, 1.00, 1.09, 1.02,
         1.01, 1.06, 0.89, 0.88, 1.17, 1.04, 1.23, 0.99, 1.04, 0.96, 0.79, 1.00, 0.91, 0.94, 1.16, 0.88]


def test_the_window_has_one_default_the_knobs_off(monkeypatch: pytest.MonkeyPatch) -> None:
    (knob,) = [k for k in knobs() if k.name == WINDOW_KNOB]
    assert knob.default == "0" and PaceConfig().window == 0
    monkeypatch.setenv(WINDOW_KNOB, "20")
    assert PaceConfig().window == 0, "the default is the declared one, not the environment's"
    assert PaceConfig.from_env().window == 20


def test_a_big_slowdown_counts_after_patience_windows_and_one_window_is_not_enough() -> None:
    p = Pace(CFG)
    v = p.judge(19, _times(2, 0.5))
    assert v.speeds[2] == 0.5 and v.slow == {} and v.newly_slow == [], "one window is noise"
    v = p.judge(39, _times(2, 0.5))
    assert v.newly_slow == [2] and v.slow == {2: 0.5}
    v = p.judge(59, _times(2, 0.5))
    assert v.newly_slow == [] and v.slow == {2: 0.5}, "reported once, still slow"


def test_a_mild_slowdown_counts_over_the_horizon_and_noise_never_does() -> None:
    p = Pace(CFG)
    v = _judge(p, _times(1, 0.85), CFG.horizon - 1)
    assert v.slow == {}, "0.85 is within a window's noise: it takes the horizon"
    v = p.judge(999, _times(1, 0.85))
    assert v.newly_slow == [1] and v.slow == {1: 0.85}
    p = Pace(CFG)
    for k, s in enumerate(NOISY):
        v = p.judge(19 + 20 * k, {0: 0.010 / s, 1: 0.010, 2: 0.010, 3: 0.010})
        assert v.slow == {}, (k, s)


def test_clearing_takes_patience_fast_windows_and_the_horizon_starts_again() -> None:
    p = Pace(CFG)
    _judge(p, _times(1, 0.5), 2)
    assert p.judge(59, _times(1, 0.97)).cleared == [], "one fast window does not clear it"
    v = p.judge(79, _times(1, 0.96))
    assert v.cleared == [1] and v.slow == {}
    v = _judge(p, _times(1, 0.85), CFG.horizon - 1, first=99)
    assert v.slow == {}, "the windows that named it no longer count"


def test_without_a_spare_the_replica_goes_only_when_the_job_is_faster_without_it() -> None:
    for speed, leaves in ((0.5, True), (0.68, True), (0.72, False), (0.85, False)):
        p = Pace(CFG)
        v = _judge(p, _times(3, speed), CFG.horizon)
        p.act(v, DP4, dp=4, spares=0)
        assert v.slow == {3: speed}, v
        assert v.leave == ([3] if leaves else []), (speed, v.why)
        assert ("faster without it" if leaves else "kept, and reported") in v.why


def test_with_a_spare_the_slowest_hands_over_one_per_spare() -> None:
    p = Pace(CFG)
    times = {0: 0.010, 1: 0.010 / 0.85, 2: 0.010 / 0.5, 3: 0.010, 4: 0.010, 5: 0.010}
    v = _judge(p, times, CFG.horizon)
    p.act(v, {r: r for r in range(6)}, dp=6, spares=1)
    assert set(v.slow) == {1, 2} and v.leave == [2], v
    assert "hot spare" in v.why


def test_tensor_parallel_partners_count_as_one_replica() -> None:
    # tp=2, dp=2: launch ranks 0, 1 are replica 0; 2, 3 replica 1. Rank 3 at 0.4 slows replica 1.
    p = Pace(CFG)
    v = _judge(p, {0: 0.010, 1: 0.010, 2: 0.010, 3: 0.025}, 2)
    p.act(v, {0: 0, 1: 0, 2: 1, 3: 1}, dp=2, spares=0)
    assert v.leave == [3], "0.4 < (2-1)/2 - 0.05"


def test_a_single_replica_is_never_dropped() -> None:
    p = Pace(CFG)
    v = _judge(p, {0: 0.010, 1: 0.040, 2: 0.010}, 2)
    p.act(v, {0: 0, 1: 0, 2: 0}, dp=1, spares=0)
    assert v.slow and v.leave == []


def test_forget_keeps_only_the_new_members() -> None:
    p = Pace(CFG)
    p.judge(19, _times(2, 0.5))
    p.judge(39, _times(2, 0.5))
    p.forget([0, 1, 3])
    assert p.slow == set()
    assert p.judge(59, {0: 0.01, 1: 0.01, 3: 0.01}).slow == {}


# Slow links: 4 nodes of 2 ranks; a ring's transfers between nodes (7->0, 1->2, 3->4, 5->6),
# as the rate each receiver saw.
NODE_OF = {r: r // 2 for r in range(8)}
RING = [(0, 7), (2, 1), (4, 3), (6, 5)]  # (receiver, sender)


def _ring(slow_node: int | None, factor: float) -> dict[tuple[int, int], float]:
    out = {(i, j): 1e9 * (factor if slow_node in (NODE_OF[i], NODE_OF[j]) else 1.0) for i, j in RING}
    out[(1, 0)] = 1e10  # within node 0: never counted
    return out


def test_link_speeds_name_the_node_every_one_of_whose_transfers_is_slow() -> None:
    speeds = link_speeds(NODE_OF, _ring(3, 0.05))
    assert speeds[3] == 0.05 and all(speeds[n] == 1.0 for n in (0, 2)), speeds
    assert speeds[1] > 1.0, "only fast transfers through node 1"
    assert link_speeds(NODE_OF, _ring(None, 1.0)) == {n: 1.0 for n in range(4)}
    # Two nodes: every transfer goes through both: nothing can be told.
    assert link_speeds({0: 0, 1: 1}, {(0, 1): 1e6, (1, 0): 1e9}) == {}


def test_a_slow_link_is_reported_as_its_node_with_patience_and_is_not_a_slow_rank() -> None:
    p = Pace(CFG)
    even = {r: 0.010 for r in range(8)}
    v = p.judge(19, even, _ring(3, 0.05), NODE_OF)
    assert v.links[3] == 0.05 and v.slow_links == {} and v.newly_slow_links == [], "one window is noise"
    v = p.judge(39, even, _ring(3, 0.05), NODE_OF)
    assert v.newly_slow_links == [3] and v.slow_links == {3: 0.05}
    assert v.slow == {} and v.newly_slow == [], "its ranks compute at full speed"
    p.act(v, {r: r for r in range(8)}, dp=8, spares=1)
    assert v.leave == [], "nobody leaves for a link"
    p.judge(59, even, _ring(None, 1.0), NODE_OF)
    assert p.judge(79, even, _ring(None, 1.0), NODE_OF).cleared_links == [3]
    # A rank slow from its compute, its link fine: a slow rank, no slow link.
    p = Pace(CFG)
    late = {**even, 6: 0.020}
    for step in (19, 39):
        v = p.judge(step, late, _ring(None, 1.0), NODE_OF)
    assert v.slow == {6: 0.5} and v.slow_links == {}
