"""Unit tests of the elastic pieces that need no worker processes: the mesh policy, the
membership protocol on a real TCPStore (port 0), the dead-vs-slow bounds and the timeline."""

from __future__ import annotations

import datetime
import json
import threading
import time
from dataclasses import asdict
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from resilient_comm.elastic import (
    Controller,
    Decision,
    Gone,
    JoinRecord,
    Membership,
    Mesh,
    RecoveryError,
    Timeline,
    plan_shrink,
    prometheus,
)
from resilient_comm.elastic.model.bounds import (
    DetectorConfig,
    PeerView,
    StepTimes,
    assess,
    comm_cost_s,
    slow_bound_s,
)
from resilient_comm.elastic.worker.checkpoints import Checkpoints
from resilient_comm.elastic.worker.commits import Commits


def test_mesh_layout_tp_fastest_then_pp_then_dp() -> None:
    m = Mesh(tp=2, pp=2, dp=2)
    assert m.size == 8 and m.replica_size == 4
    assert m.coords(5) == {"tp": 1, "pp": 0, "dp": 1}
    assert m.group_ranks(5, "tp") == [4, 5]
    assert m.group_ranks(5, "pp") == [5, 7]
    assert m.group_ranks(5, "dp") == [1, 5]
    assert [m.replica_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert Mesh.for_world(12, tp=2, pp=3) == Mesh(tp=2, pp=3, dp=2)
    with pytest.raises(ValueError, match="not a multiple of tp"):
        Mesh.for_world(6, tp=4)
    with pytest.raises(ValueError, match="positive int"):
        Mesh(tp=0)
    with pytest.raises(ValueError, match="unknown mesh dimension"):
        m.group_index(0, "ep")


def test_policy_dp_only_evicts_exactly_the_lost() -> None:
    p = plan_shrink(Mesh(dp=5), {1, 3})
    assert (p.stay, p.lost, p.evicted, p.mesh) == ((0, 2, 4), (1, 3), (), Mesh(dp=3))


def test_policy_tp2_dp2_one_death_evicts_its_replica() -> None:
    p = plan_shrink(Mesh(tp=2, dp=2), [1])
    assert (p.stay, p.lost, p.evicted, p.mesh) == ((2, 3), (1,), (0,), Mesh(tp=2, dp=1))
    assert p.leaves == (0, 1)


def test_policy_pp_and_tp_groups_are_atomic() -> None:
    m = Mesh(tp=2, pp=2, dp=3)
    p = plan_shrink(m, [5])  # replica 1 = ranks 4..7
    assert p.stay == (0, 1, 2, 3, 8, 9, 10, 11) and p.evicted == (4, 6, 7) and p.mesh == Mesh(tp=2, pp=2, dp=2)
    # The survivors, renumbered in order, are again laid out tp-fastest: replica k is 4k..4k+3.
    assert [p.mesh.replica_of(i) for i in range(len(p.stay))] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_policy_without_a_whole_replica_nobody_goes_on() -> None:
    p = plan_shrink(Mesh(tp=2, dp=2), [0, 3])
    assert p.stay == () and p.mesh is None and p.evicted == (1, 2)
    with pytest.raises(ValueError, match="outside a mesh of 4"):
        plan_shrink(Mesh(tp=2, dp=2), [4])


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)


def _decision(epoch: int, members: list[int], by: int = 0) -> Decision:
    return Decision(epoch, members, Mesh(dp=len(members)).as_dict(), "shrink", 7, by=by)


@pytest.mark.timeout(30)
def test_epochs_are_proposed_by_compare_and_set_and_decided_once(store: dist.TCPStore) -> None:
    a, b = Membership(store, "rc/t"), Membership(store.clone(), "rc/t")  # type: ignore[attr-defined]
    first = a.start(_decision(0, [0, 1, 2, 3]))
    assert b.start(_decision(0, [9], by=5)) == first, "epoch 0 is written once"
    assert a.epoch() == 0
    assert (a.propose(0), b.propose(0)) == (1, 1), "concurrent proposers of epoch 1 agree"
    assert b.decision(1) is None
    winner = a.decide(_decision(1, [0, 2, 3], by=0))
    assert b.decide(_decision(1, [2, 3], by=2)) == winner == b.decision(1), "exactly one decision"
    assert b.propose(1) == 2 and a.propose(0) == 2, "a stale proposer learns the current epoch"
    a.join(2, JoinRecord(0, 1, True, 5, 6))
    b.join(2, JoinRecord(2, 1, False, 6, None))
    assert a.joined(2, [0, 2, 3]) == {0: JoinRecord(0, 1, True, 5, 6), 2: JoinRecord(2, 1, False, 6, None)}


@pytest.mark.timeout(30)
def test_failure_reports_are_recorded_once_and_events_have_no_holes(store: dist.TCPStore) -> None:
    m = Membership(store, "rc/t")
    assert m.report_gone(Gone(1, "exit", "killed by SIGKILL", 10.0, "launcher"))
    assert not m.report_gone(Gone(1, "suspect", "heartbeat silent", 9.0, "rank 0")), "first evidence wins"
    assert m.gone([0, 1, 2]) == {1: Gone(1, "exit", "killed by SIGKILL", 10.0, "launcher")}

    posters = [Membership(store.clone(), "rc/t") for _ in range(4)]  # type: ignore[attr-defined]
    got: list[int] = []
    threads = [threading.Thread(target=lambda p=p, i=i: got.append(p.post_event({"kind": "x", "i": i})))
               for i, p in enumerate(posters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == [1, 2, 3, 4], "slots 1..4 claimed once each (slot 0 is the gone event)"
    exit1 = asdict(Gone(1, "exit", "killed by SIGKILL", 10.0, "launcher"))
    assert m.event(0) == {"kind": "gone", "ranks": [1], "gone": [exit1]} and m.event(5) is None
    lost = [Gone(r, "suspect", "node 2 silent", 11.0, "agent 1") for r in (1, 4, 5)]
    assert m.report_gone_many(lost, node=2) == [4, 5], "rank 1's first evidence stands"
    assert m.event(5) == {"kind": "gone", "ranks": [4, 5], "gone": [asdict(g) for g in lost[1:]], "node": 2}, \
        "one event for a lost node, with the evidence that was recorded"
    assert sorted((m.event(i) or {})["i"] for i in range(1, 5)) == [0, 1, 2, 3]


@pytest.mark.timeout(30)
def test_a_malformed_store_value_is_ignored_or_a_clear_error_never_a_crash(
        store: dist.TCPStore, caplog: pytest.LogCaptureFixture) -> None:
    """Anyone who reaches the store can write garbage (issue #16, item 4). Records that can be
    skipped are (logged once); the two that cannot -- the epoch and a decision, the authority on
    membership -- are a DistStoreError naming the key (the controller's RecoveryError)."""
    m = Membership(store, "rc/bad")
    good = Gone(1, "exit", "killed", 1.0, "launcher")
    store.set(m.key("gone", 0), "{not json")
    store.set(m.key("gone", 1), good.to_json())
    store.set(m.key("gone", 2), json.dumps({"rank": "2", "kind": "exit", "detail": "", "t": 0, "by": "x"}))
    store.set(m.key("gone", 3), json.dumps([1, 2]))
    with caplog.at_level("WARNING", logger="resilient_comm.membership"):
        assert m.gone([0, 1, 2, 3]) == {1: good}
    assert "ignoring the malformed gone record at 'rc/bad/gone/0'" in caplog.text
    assert "Gone.rank: '2' is not int" in caplog.text and "Gone: not a JSON object" in caplog.text
    m.join(1, JoinRecord(0, 0, True, 5, None))
    joins = m.key("e", 1, "joins", 0)  # ranks 0-7 append their entries here
    store.append(joins, "\x1e" + json.dumps({"rank": 1, "applied": 0, "ready": "yes", "committed": 5,
                                             "pending": None}) + "\x1f")
    store.append(joins, "\xff\xfe garbage, not an entry")
    store.append(joins, "\x1e" + JoinRecord(9, 0, True, 5, None).to_entry() + "\x1f")  # rank 9 is of group 1
    store.append(joins, "\x1e{\"rank\": 3")  # a partial entry, then a whole one: only it counts
    m.join(1, JoinRecord(2, 0, True, 5, None))
    with caplog.at_level("WARNING", logger="resilient_comm.membership"):
        assert m.joined(1, [0, 1, 2, 3, 9]) == {0: JoinRecord(0, 0, True, 5, None), 2: JoinRecord(2, 0, True, 5, None)}
    assert "ignoring the malformed join entry at 'rc/bad/e/1/joins/0'" in caplog.text
    m.join(1, JoinRecord(1, 0, True, 5, None))
    assert m.joined(1, [1]) == {1: JoinRecord(1, 0, True, 5, None)}, "a rank's own entry counts after garbage"
    store.set(m.key("events", 0), "]]")  # readers go past a malformed event
    m.post_event({"kind": "finished"})
    assert m.event(0) is not None and m.event(0)["kind"] == "malformed" and m.event(1) == {"kind": "finished"}
    store.set(m.key("spare", "n"), "3")
    store.set(m.key("spare", 0), "not-an-int")
    store.set(m.key("spare", 1), "17")
    assert m.spares() == [17], "a malformed spare id is skipped (it crashed the launcher)"
    store.add(m.key("spare", "n"), 20000)  # a counter far ahead of the registrations
    t0 = time.monotonic()
    assert m.spares() == [17]
    assert time.monotonic() - t0 < 1.0, "one chunk of reads, not one check per counted key"
    store.add(m.key("done", "n"), 1)
    store.set(m.key("done", 0), "12")
    store.set(m.key("done", 1), "1e99")
    assert m.done([0, 1]) == {0: 12}
    store.set(m.key("e", 2, "decision"), "not a decision")
    with pytest.raises(dist.DistStoreError, match="the decision at 'rc/bad/e/2/decision' is malformed"):
        m.decision(2)
    store.set(m.key("e", 3, "decision"), json.dumps({"epoch": 3, "members": "0-1", "mesh": {"dp": "2"},
                                                     "mode": "init", "resume_step": 0}))
    with pytest.raises(dist.DistStoreError, match=r"Decision\.mesh"):
        m.decision(3)
    store.set(m.key("epoch"), "two")
    with pytest.raises(dist.DistStoreError, match="the membership's epoch at 'rc/bad/epoch' is malformed"):
        m.propose(1)


@pytest.mark.timeout(30)
def test_with_a_job_token_forged_records_are_refused_and_a_forged_gone_record_is_replaced(
        store: dist.TCPStore, caplog: pytest.LogCaptureFixture) -> None:
    """Issue #16, item 5: a process that reaches the store but lacks the job token writes
    well-formed records (a gone record, an event, a decision, a join record, a spare id, a
    finished step). The job's readers refuse each, like a malformed one; the real report on a
    rank replaces a forged gone record (first-writer-wins would have kept it and dropped the
    real report's event); sealed records read back through a reader without a token."""
    m = Membership(store, "rc/mac", token="job-secret")
    stranger = Membership(store, "rc/mac", token="")  # writes what an attacker would
    other_job = Membership(store, "rc/mac", token="another-secret")
    forged_gone = Gone(2, "suspect", "forged", 1.0, "rank 0")
    stranger.report_gone(forged_gone)
    with caplog.at_level("WARNING", logger="resilient_comm.membership"):
        assert m.gone([2]) == {}
        assert "does not carry this job's MAC" in caplog.text
        real = Gone(2, "exit", "killed by SIGKILL", 2.0, "launcher")
        assert m.report_gone(real), "the real report must replace the forgery and post its event"
    assert m.gone([2]) == {2: real} and other_job.gone([2]) == {}
    kinds = [(m.event(i) or {}).get("kind") for i in range(2)]
    assert kinds == ["malformed", "gone"], kinds  # the stranger's event, then the real one
    assert stranger.event(1) == {"kind": "gone", "ranks": [2], "gone": [asdict(real)]}, "no token: seals are stripped"
    d = Decision(1, [0, 1], Mesh(dp=2).as_dict(), "fail", 0, note="forged")
    stranger.decide(d)
    with pytest.raises(dist.DistStoreError, match="the decision at 'rc/mac/e/1/decision' is malformed: it does not"):
        m.decision(1)
    good = Decision(2, [0, 1], Mesh(dp=2).as_dict(), "shrink", 3)
    assert m.decide(good) == good and m.decision(2) == good and stranger.decision(2) == good
    with pytest.raises(dist.DistStoreError, match="does not carry"):
        other_job.decision(2)
    stranger.join(2, JoinRecord(0, 1, True, 99, None))
    m.join(2, JoinRecord(1, 1, True, 3, None))
    assert m.joined(2, [0, 1]) == {1: JoinRecord(1, 1, True, 3, None)}
    stranger.register_spare(40)
    m.register_spare(41)
    assert m.spares() == [41]
    stranger.set_done(0, 99)
    m.set_done(1, 7)
    assert m.done([0, 1]) == {1: 7}
    store.set(m.key("e", 3, "decision"), good.to_json() + "\n#mac:" + "0" * 32)  # a guessed MAC
    with pytest.raises(dist.DistStoreError, match="does not carry"):
        m.decision(3)


def test_decision_and_records_round_trip_through_json() -> None:
    d = Decision(3, [0, 2], {"tp": 1, "pp": 1, "dp": 2}, "init", 11, [1], [], 0, 1.5, 1.25)
    assert Decision.from_json(d.to_json()) == d and d.mesh_obj() == Mesh(dp=2)
    assert json.loads(d.to_json())["resume_step"] == 11


def test_a_decision_at_16k_ranks_is_small_and_a_malformed_run_is_refused() -> None:
    members = list(range(16384))
    members[100:108] = range(16384, 16392)  # spares in a lost node's places
    d = Decision(4, members, {"dp": 16384}, "shrink", 9, lost=list(range(100, 108)), slots=list(range(16384)),
                 used_spares=list(range(16384, 16392)), joiners=list(range(16384, 16392)))
    text = d.to_json()
    assert len(text) < 400, f"{len(text)} bytes: rank lists are written as runs"
    assert json.loads(text)["members"] == "0-99,16384-16391,108-16383"
    assert Decision.from_json(text) == d
    assert Decision.from_json(Decision(1, [], {"dp": 1}, "fail", 0).to_json()).members == []
    for bad in ("5-3", "0-99999999", "a-b", "-1"):
        with pytest.raises(ValueError):
            Decision.from_json(text.replace("0-99,16384", bad + ",16384"))


class _Calls:
    """A store that counts the calls made through it."""

    def __init__(self, store: dist.Store) -> None:
        self._s, self.n = store, 0

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._s, name)

        def call(*a: Any) -> Any:
            self.n += 1
            return fn(*a)

        return call


@pytest.mark.timeout(30)
def test_one_write_wakes_every_agent_waiting_for_the_next_event(store: dist.TCPStore) -> None:
    """The agents of every node wait for the next event's key; posting is one write, however
    many wait (the poster used to push a wake-up to each node's queue: 2,048 calls at 16K ranks)."""
    waiters = [Membership(store.clone(), "rc/w") for _ in range(16)]  # type: ignore[attr-defined]
    woke: list[float] = []
    threads = [threading.Thread(target=lambda w=w: (w.wait_event(0), woke.append(time.monotonic())))
               for w in waiters]
    for t in threads:
        t.start()
    counted = _Calls(store)
    posted_at = time.monotonic()
    assert Membership(cast(Any, counted), "rc/w").post_event({"kind": "x"}) == 0
    for t in threads:
        t.join(10)
    assert counted.n == 1, f"posting took {counted.n} store calls"
    assert len(woke) == 16 and max(woke) - posted_at < 2.0, f"{len(woke)} of 16 woke"
    # A stopping agent wakes its events thread out of the store's wait, writing no event.
    waiter = threading.Thread(target=waiters[0].wait_event, args=(1,))
    waiter.start()
    for _ in range(100):  # a wake before the wait began is lost: as the agent does, again
        Membership(store, "rc/w").wake_event_waiters(1)
        waiter.join(0.1)
        if not waiter.is_alive():
            break
    assert not waiter.is_alive() and waiters[0].event(1) is None


class _KeysPerCall:
    """A store that records how many keys each many-key call carries."""

    def __init__(self, store: dist.Store) -> None:
        self._s, self.sizes = store, []

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._s, name)
        if name not in ("wait", "check", "multi_get"):
            return fn

        def call(keys: list[str], *a: Any) -> Any:
            self.sizes.append(len(keys))
            return fn(keys, *a)

        return call


def test_the_decider_reads_16k_join_records_in_2048_keys_512_a_call(store: dist.TCPStore) -> None:
    """c10d's TCPStore serves one call of N keys in time superlinear in N (16,384 keys: a wait
    127 ms idle, more than the decider's 100 ms slice, so under load it kept timing out with
    every record there; multi_get 347 ms): eight ranks' join entries share a key and the
    decider's reads go 512 keys a call. All records are returned, and a live rank's missing
    record still makes it wait, also when the rest of its group is there."""
    n = 16384
    m = Membership(cast(Any, _KeysPerCall(store)), "rc/u")
    for at in range(0, n, 1024):
        m.join_many(1, [JoinRecord(r, 0, True, 10, None, 1.0) for r in range(at, at + 1024)])
    m.report_gone(Gone(n, "exit", "killed", 1.0, "launcher"))
    base, live = list(range(n + 1)), list(range(n))  # rank 16384 is gone
    got = m.complete(1, base, live, wait_s=0.1)
    assert got is not None, "the decider's wait timed out with every record there"
    joined, gone = got
    assert len(joined) == n and joined[12345] == JoinRecord(12345, 0, True, 10, None, 1.0) and list(gone) == [n]
    assert max(m.store.sizes) <= 512, f"a call of {max(m.store.sizes)} keys"
    assert sum(m.store.sizes) <= n // 4 + 16, f"{sum(m.store.sizes)} keys sent to read {n} records"
    assert m.complete(1, base, [*live, n], wait_s=0.1) is None, "a live rank's missing record must be waited for"
    assert m.complete(1, base, [*live, n]) is None
    m.join(2, JoinRecord(0, 1, True, 10, None))  # rank 1 of the same group not yet
    t0 = time.monotonic()
    assert m.complete(2, [0, 1], [0, 1], wait_s=0.05) is None
    assert 0.04 < time.monotonic() - t0 < 1.0, "the wait for rank 1's entry is bounded by wait_s"


def _peer(**kw: float | str) -> PeerView:
    v = PeerView(seq=3, step=10, phase="sync", changed_at=100.0, unchanged_reads=10)
    for k, x in kw.items():
        setattr(v, k, x)
    return v


def test_a_live_heartbeat_is_never_dead_and_silence_needs_the_adaptive_bound() -> None:
    cfg = DetectorConfig()
    assert assess(_peer(), 10, "sync", 100.9, cfg) is None, "0.9 s of silence < 1 s floor"
    why = assess(_peer(), 10, "sync", 101.2, cfg)
    assert why is not None and why.startswith("heartbeat silent for 1.20 s > bound 1.00 s")
    assert assess(_peer(unchanged_reads=2), 10, "sync", 105.0, cfg) is None, "too few own reads: no evidence"
    assert assess(_peer(seq=-1), 10, "sync", 200.0, cfg) is None, "a rank still starting is never suspected"
    slow = _peer(p99_s=0.4, comm_s=0.05)  # bound = 10 * 0.4 + 0.05 = 4.05 s
    assert assess(slow, 10, "sync", 104.0, cfg) is None
    assert "bound 4.05 s" in (assess(slow, 10, "sync", 104.1, cfg) or "")
    # Before its first step (its imports and state factory may starve it of CPU): ten floors.
    starting = _peer(step=-1, phase="start")
    assert assess(starting, 0, "sync", 101.5, cfg) is None, "1.5 s silent at start-up is no evidence"
    assert "bound 10.00 s" in (assess(starting, 0, "sync", 110.1, cfg) or ""), "a wedged start is found"


def test_a_straggler_is_evicted_only_past_its_own_bound_while_others_wait() -> None:
    cfg = DetectorConfig()
    computing = _peer(phase="compute", elapsed_s=6.0, p99_s=0.2, changed_at=100.0)  # bound max(5, 2.0) = 5 s
    why = assess(computing, 10, "sync", 100.05, cfg)
    assert why is not None and "straggler: computing step 10 for 6.05 s > bound 5.00 s" in why
    assert assess(computing, 10, "compute", 100.05, cfg) is None, "everyone computing: nobody waits on it"
    assert assess(computing, 11, "sync", 100.05, cfg) is None, "an earlier step: not the one we wait for"
    assert assess(computing, 10, "recovery", 100.05, cfg) is not None, "it holds up a recovery"
    assert assess(_peer(phase="compute", elapsed_s=4.0, p99_s=0.2), 10, "sync", 100.05, cfg) is None


def test_bounds_grow_with_step_time_and_message_cost() -> None:
    assert slow_bound_s(0.0, 0.0, 1.0, 10.0) == 1.0
    assert slow_bound_s(0.3, 0.5, 1.0, 10.0) == pytest.approx(3.5)
    assert comm_cost_s(0, 8) == 0.0 == comm_cost_s(1 << 20, 1)
    assert 0 < comm_cost_s(1 << 10, 4) < comm_cost_s(1 << 20, 4) < comm_cost_s(1 << 30, 4)
    t = StepTimes(100)
    for i in range(100):
        t.add(0.01 * (i + 1))
    assert t.p99() == pytest.approx(0.99) and StepTimes(5).p99() == 0.0


def test_timeline_durations_log_line_and_metrics() -> None:
    tl = Timeline(rank=2, cause="PeerFailureError: x", epoch=1)
    for i, phase in enumerate(("failure", "detected", "aborted", "agreed", "rebuilt", "restored", "first_commit")):
        tl.mark(phase, 100.0 + 0.01 * i)
    ms = tl.durations_ms()
    assert ms["detected"] == pytest.approx(10.0) and ms["total"] == pytest.approx(60.0)
    line = tl.log_line()
    assert line.startswith("recovery {") and json.loads(line[len("recovery "):])["ms"] == ms
    text = prometheus([tl])
    assert "resilient_comm_recoveries_total 1" in text
    assert 'resilient_comm_recovery_phase_seconds{phase="total"} 0.060000' in text
    with pytest.raises(ValueError, match="unknown recovery phase"):
        tl.mark("restarted")


class _State:
    """A Stateful that records loads."""

    def __init__(self) -> None:
        self.loaded: list[dict] = []

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        self.loaded.append(sd)


def _bare(store: dist.TCPStore, *, committed: int = -1, pending: tuple | None = None, dirty: bool = False,
          snapshot: tuple | None = None, **fields: object) -> Controller:
    """A Controller with only the fields the commit protocol reads (no processes, no groups)."""
    c = object.__new__(Controller)
    defaults = {"rank": 0, "_hook": None, "_m": Membership(store, "rc/u"), "_state": None,
                "_ckpts": Checkpoints(None)}
    for k, v in {**defaults, **fields}.items():
        setattr(c, k, v)
    c._commits = Commits(0, False, c._ckpts, c._emit)
    c._commits.committed, c._commits.pending, c._commits.dirty, c._commits.snapshot = committed, pending, dirty, snapshot
    return c


def _join(rank: int, committed: int, pending: int | None = None, applied: int = 0, ready: bool = True) -> JoinRecord:
    return JoinRecord(rank, applied, ready, committed, pending)


def test_decision_resumes_after_the_highest_commit_and_checks_the_invariant(store: dist.TCPStore) -> None:
    c = _bare(store)
    base = Decision(0, [0, 1, 2, 3], Mesh(dp=4).as_dict(), "init", 0)
    gone = {2: Gone(2, "exit", "killed by SIGKILL", 5.0, "launcher")}
    d = c._decide(1, base, {0: _join(0, 7), 1: _join(1, 6, pending=7), 3: _join(3, 7)}, gone)
    assert (d.members, d.lost, d.resume_step, d.mode, d.failed_at) == ([0, 1, 3], [2], 8, "shrink", 5.0)
    fresh = c._decide(1, base, {0: _join(0, 7), 1: _join(1, 7, ready=False), 3: _join(3, 7)}, gone)
    assert fresh.mode == "init", "a member whose groups were not verified: build afresh"
    same = c._decide(1, base, {r: _join(r, 7) for r in range(4)}, {})
    assert (same.members, same.mode) == ([0, 1, 2, 3], "init"), "nobody left: a new group, same members"
    # A member behind the committed step (say a spare placed in an epoch whose copy failed)
    # gets the state of a member with the same shard.
    behind = c._decide(1, base, {0: _join(0, 7), 1: _join(1, -1), 3: _join(3, 7)}, gone)
    assert (behind.mode, behind.restore, behind.sources, behind.resume_step) == ("shrink", "peer", [[1, 0]], 8), behind
    # Without a member holding its shard (and no checkpoint): fail rather than diverge.
    tp_base = Decision(0, [0, 1, 2, 3], Mesh(tp=2, dp=2).as_dict(), "init", 0)
    bad = c._decide(1, tp_base, {0: _join(0, 7), 1: _join(1, 6), 2: _join(2, 7), 3: _join(3, 6)}, {})
    assert bad.mode == "fail" and bad.note.startswith("members [1, 3] are behind step 7"), bad


def test_decision_counts_a_finished_member_and_fails_without_a_whole_replica(store: dist.TCPStore) -> None:
    c = _bare(store)
    c._m.set_done(2, 9)  # rank 2 committed the last step, then exited
    base = Decision(0, [0, 1, 2, 3], Mesh(dp=4).as_dict(), "init", 0)
    d = c._decide(1, base, {0: _join(0, 8, pending=9), 1: _join(1, 9), 3: _join(3, 9)}, {})
    assert d.resume_step == 10 and d.members == [0, 1, 3]
    tp = Decision(0, [0, 1, 2, 3], Mesh(tp=2, dp=2).as_dict(), "init", 0)
    d = c._decide(1, tp, {1: _join(1, 3), 2: _join(2, 3)}, {})
    assert (d.mode, d.members, d.lost, d.evicted) == ("fail", [], [0, 3], [1, 2])
    assert d.note == "no replica survived (lost [0, 3])"


def test_restore_rolls_forward_exactly_once_or_back_to_the_snapshot(store: dist.TCPStore) -> None:
    applied: list[int] = []
    events: list[tuple[str, dict]] = []
    d = Decision(1, [0, 1], Mesh(dp=2).as_dict(), "shrink", 8)
    c = _bare(store, committed=6, pending=(7, lambda: applied.append(7)), dirty=True,
              _hook=lambda e, i: events.append((e, i)))
    c._restore(d)
    assert (applied, c.committed, c.next_step, c._commits.pending) == ([7], 7, 8, None)
    assert events == [("step.committed", {"step": 7, "rolled_forward": True})]
    state = _State()
    c = _bare(store, committed=7, pending=(8, lambda: applied.append(8)), dirty=True, _state=state,
              snapshot=(8, {"w": 1}))
    c._restore(d)
    assert (state.loaded, applied, c.committed, c.next_step) == ([{"w": 1}], [7], 7, 8), "step 8 undone"
    with pytest.raises(RecoveryError, match="committed 5, cannot resume at 8"):
        _bare(store, committed=5)._restore(d)


def test_restore_keeps_a_computed_step_only_where_the_decision_moves_no_state(store: dist.TCPStore) -> None:
    """[Note: keeping the computed step] The step in flight (8), computed and not synced: kept
    when the decision resumes at it as a shrink; rolled back to its snapshot when the decision
    loads a checkpoint or copies a state to a spare, or when no step is to be kept."""
    d = Decision(1, [0, 1], Mesh(dp=2).as_dict(), "shrink", 8)
    state = _State()
    c = _bare(store, committed=7, dirty=True, _state=state, snapshot=(8, {"w": 1}), _keep=8)
    c._restore(d)
    assert (state.loaded, c._commits.kept, c._commits.dirty, c.next_step) == ([], True, True, 8)
    c = _bare(store, committed=7, dirty=True, _state=state, snapshot=(8, {"w": 1}))
    c._restore(d)
    assert (state.loaded, c._commits.kept, c.next_step) == ([{"w": 1}], False, 8), "nothing to keep: rolled back"
    spare = Decision(1, [0, 1, 2], Mesh(dp=3).as_dict(), "shrink", 8, sources=[[2, 1]], restore="peer")
    state = _State()
    c = _bare(store, committed=7, dirty=True, _state=state, snapshot=(8, {"w": 1}), _keep=8)
    c._commits.restore(spare, 0, state, c._m, lambda: None, lambda: None, keep=8)  # 0: neither side
    assert (state.loaded, c._commits.kept) == ([{"w": 1}], False), "a spare computes step 8: all redo it"


def test_detector_config_comes_from_the_knobs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert DetectorConfig.from_env() == DetectorConfig()
    monkeypatch.setenv("RESILIENT_COMM_HEARTBEAT_MS", "50")
    monkeypatch.setenv("RESILIENT_COMM_SILENCE_FLOOR_MS", "300")
    monkeypatch.setenv("RESILIENT_COMM_SLOW_FACTOR", "4")
    cfg = DetectorConfig.from_env()
    assert (cfg.heartbeat_s, cfg.silence_floor_s, cfg.straggler_floor_s, cfg.slow_factor) == (0.05, 0.3, 5.0, 4.0)
    monkeypatch.setenv("RESILIENT_COMM_SLOW_FACTOR", "fast")
    with pytest.raises(ValueError, match="RESILIENT_COMM_SLOW_FACTOR='fast' is not a number"):
        DetectorConfig.from_env()
    with pytest.raises(ValueError, match="heartbeat_s must be a positive number"):
        DetectorConfig(heartbeat_s=0)


def test_the_commit_vote_runs_on_the_jobs_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient_comm.elastic.worker.commit_vote import vote_device

    assert vote_device("resilient_tcp") == torch.device("cpu")
    assert vote_device("resilient_nccl", "cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert vote_device("resilient_nccl") == torch.device("cuda", 3), "a GPU job votes on NCCL, not TCP"
    assert vote_device("resilient_tcp") == torch.device("cpu")
    assert vote_device("resilient_nccl", "cuda:1") == torch.device("cuda", 1)


def test_a_planned_departure_aborts_nothing_at_once_and_only_a_member_that_did_not_recover() -> None:
    """[Note: a planned departure aborts nothing] A slow rank's leave (Gone kind "left") is
    recorded as evidence without aborting the member's groups: it may still be finishing the
    judgement's collectives with the leaver. Its guard aborts them after LEFT_GRACE_S only
    where the member has not recovered meanwhile; any other kind of report aborts at once."""
    from resilient_comm.elastic.worker.evidence import Evidence

    class Member(Evidence):
        LEFT_GRACE_S = 0.05

        def __init__(self) -> None:
            super().__init__(0, [0, 1, 2])
            self.aborted: list[tuple[list[Any], str]] = []
            self.done = threading.Event()

        def _abort(self, held: list[Any], reason: str) -> None:
            self.aborted.append((held, reason))
            self.done.set()

    group = object()
    left = Gone(2, "left", "slow: left after step 39", time.time(), "rank 1")
    m = Member()
    m._held = [group]
    m._on_gone(left)
    assert m.aborted == [] and m._evidence == {2: left}, "heard, recorded, nothing aborted"
    assert m.done.wait(5.0), "the guard fires for a member that never recovered"
    assert m.aborted[0][0] == [group] and "left (slow: left after step 39" in m.aborted[0][1], m.aborted

    recovered = Member()
    recovered._held = [group]
    recovered._on_gone(left)
    recovered._forget([0, 1, 3])  # the recovery that took the leaver out (and new groups)
    recovered._held = [object()]
    for t in threading.enumerate():  # the guard ran, and found the member recovered
        if isinstance(t, threading.Timer):
            t.join(5.0)
    assert recovered.aborted == []

    died = Member()
    died._held = [group]
    died._on_gone(Gone(2, "exit", "killed by SIGKILL", time.time(), "launcher"))
    assert len(died.aborted) == 1 and "is gone (exit: killed by SIGKILL" in died.aborted[0][1]


def test_a_report_of_a_death_does_not_abort_again_what_the_training_thread_aborted() -> None:
    """A gone report that lands after the training thread's own abort (its op failed first:
    the liveness lock makes that the usual order) aborts nothing again: that abort kept the
    detector thread from the join's answer for 2-5 ms under load. What was added since, and the
    training thread's own aborts (`again`), are aborted; a rebuild's groups start afresh."""
    from resilient_comm.elastic.worker.evidence import Evidence

    class Member(Evidence):
        def __init__(self) -> None:
            super().__init__(0, [0, 1, 2, 3])
            self.aborted: list[list[Any]] = []

        def _abort(self, held: list[Any], reason: str) -> None:
            self.aborted.append(held)

    a, b, c = object(), object(), object()
    m = Member()
    m._held = [a, b]
    m._abort_held([a, b], "recovering from PeerFailureError", again=True)
    m._held.append(c)
    m._on_gone(Gone(3, "exit", "died (its liveness lock)", time.time(), "launcher"))
    assert m.aborted == [[a, b], [c]], m.aborted
    m._abort_held([a, b, c], "rebuild of epoch 1 failed", again=True)
    assert m.aborted[-1] == [a, b, c], "the training thread aborts again what it asks"
    with m._lock:
        assert m._take_held() == [a, b, c] and m._held == []
    m._held = [a]  # (the same object again: aborted afresh after a rebuild)
    m._on_gone(Gone(2, "exit", "killed by SIGKILL", time.time(), "launcher"))
    assert m.aborted[-1] == [a], m.aborted


def test_a_spare_warms_up_the_scripts_top_level_imports_and_only_those() -> None:
    """`inprocess_main.warm_imports`: a spare under --in-process imports what the script imports
    at its top level (under if/try too) while it waits; not what a function imports, not a
    relative import; a module that fails to import is left for the script to report."""
    from resilient_comm.elastic.worker.inprocess_main import top_level_imports, warm_imports

    src = ("import os, json as j\ntry:\n    import numpy as np\nexcept ImportError:\n    import nothing_here\n"
           "if True:\n    from email.mime import text\nelse:\n    import zipfile\n"
           "def main():\n    import tarfile\nfrom . import sibling\nimport os\n")
    assert top_level_imports(src) == ["os", "json", "numpy", "email.mime", "zipfile"]
    warm_imports("/nonexistent/script.py", module=False)  # logged, nothing raised
    warm_imports("no_such_module_anywhere", module=True)
