"""The membership's layout on etcd (`Membership.ranged`), against a real one-member etcd: a
recovering member proposes the next epoch and joins it in one request, a node's join records
are one key, and the decider lists the keys written since its last poll while records are
missing and reads them once, in pages. Every request is counted at the HTTP layer
(`EtcdStore._post`)."""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any

import pytest

from resilient_comm.elastic.membership.protocol import Membership
from resilient_comm.elastic.model.policy import Mesh
from resilient_comm.elastic.model.records import Decision, Gone, JoinRecord
from resilient_comm.elastic.worker.errors import Evicted
from resilient_comm.elastic.worker.rejoin import catch_up


class Sent(list[str]):
    """The paths of the HTTP requests a store sent, and (`kvs`) how many keys each answer named."""

    kvs: list[int]

    def clear(self) -> None:
        super().clear()
        self.kvs.clear()


def _requests(store: Any) -> Sent:
    """The paths of the HTTP requests `store` sends from now on."""
    sent = Sent()
    sent.kvs = []
    post = store._post

    def counted(path: str, payload: dict[str, Any], what: str) -> dict[str, Any]:
        sent.append(path)
        r = post(path, payload, what)
        sent.kvs.append(len(r.get("kvs") or []))
        return r

    store._post = counted
    return sent


def _member(etcd: str, ns: str = "rc/m", token: str = "") -> tuple[Membership, Sent]:
    from resilient_comm.elastic.membership.etcd.store import EtcdStore

    store = EtcdStore(etcd, datetime.timedelta(seconds=10))
    return Membership(store, ns, token=token), _requests(store)


def _decision(epoch: int, members: list[int]) -> Decision:
    return Decision(epoch, members, Mesh(dp=len(members)).as_dict(), "init" if epoch == 0 else "shrink", 0)


@pytest.mark.timeout(60)
def test_a_recovering_member_proposes_and_joins_in_one_request(etcd: str) -> None:
    """Before, a member's first round trips after a failure were a compare-and-set of the
    epoch, then an append to its group's key (a read and a compare-and-set, again while the
    node's other workers raced on that key): three requests or more per rank, 16K ranks at
    once. Now one, whoever proposes first; a member whose epoch is stale is not joined to an
    epoch it has not caught up with."""
    a, sent_a = _member(etcd)
    b, sent_b = _member(etcd)
    a.start(_decision(0, [0, 1, 2, 3]))
    r0, r1 = JoinRecord(0, 0, True, 5, None, 1.0), JoinRecord(1, 0, True, 5, 6, 2.0)
    sent_a.clear()
    assert a.propose_join(0, [r0]) == 1 and sent_a == ["/kv/txn"], f"the proposer sent {sent_a}"
    assert b.propose_join(0, [r1]) == 1 and sent_b == ["/kv/txn"], f"a later proposer sent {sent_b}"
    assert a.joined(1, [0, 1, 2]) == {0: r0, 1: r1}
    keys = [k for k, _ in a.store.items("rc/m/e/1/")]  # type: ignore[attr-defined]
    assert keys == ["rc/m/e/1/join/0.1", "rc/m/e/1/join/1.1"], keys

    assert b.propose(1) == 2, "epoch 2 proposed (epoch 1 decided meanwhile)"
    late = JoinRecord(2, 0, True, 4, None, 3.0)
    assert a.propose_join(0, [late]) == 2, "a stale proposer learns the current epoch"
    assert 2 not in a.joined(1, [2]) and a.joined(2, [2]) == {}, "and has joined neither epoch"

    # catch_up joins the current epoch only after the missed decisions are read: a rank a
    # missed decision left out is evicted without a join record.
    a.decide(_decision(1, [0, 1, 3]))
    c, _ = _member(etcd)
    with pytest.raises(Evicted, match="rank 2 was evicted in epoch 1"):
        catch_up(c, 2, 0, _decision(0, [0, 1, 2, 3]), late)
    assert c.joined(2, [2]) == {}
    current, base = catch_up(c, 3, 0, _decision(0, [0, 1, 2, 3]), JoinRecord(3, 0, True, 5, None, 4.0))
    assert (current, base.members) == (2, [0, 1, 3]) and c.joined(2, [3])[3].committed == 5


@pytest.mark.timeout(60)
def test_a_nodes_batch_is_one_key_and_the_deciders_polls_list_only_what_is_new(etcd: str) -> None:
    """A node agent's batch of 8 records is one put of one key, `{first}.{n}` (a key per
    record cost etcd 1.34 ms of CPU per node's transaction, not 1.00). While one is missing,
    the decider's poll is one listing of key names, and a poll after one with nothing written
    meanwhile names no key (not the 2,048 a 16K-rank job has)."""
    m, sent = _member(etcd, "rc/b", token="job-secret")
    m.start(_decision(0, list(range(17))))
    sent.clear()
    assert m.propose_join(0, [JoinRecord(r, 0, True, 7, None, 1.0) for r in (7, 3, 0, 1, 2, 4, 5, 6)]) == 1
    assert sent == ["/kv/txn"], sent
    assert m.join_many(1, [JoinRecord(r, 0, True, 7, None, 1.0) for r in range(8, 16)]) is None
    assert [k for k, _ in m.store.items("rc/b/e/1/join/")] == ["rc/b/e/1/join/0.8", "rc/b/e/1/join/8.8"]  # type: ignore[attr-defined]
    base, live = list(range(17)), list(range(17))
    sent.clear()
    assert m.complete(1, base, live) is None and m.complete(1, base, live) is None, "rank 16 has not joined"
    assert sent == ["/kv/range"] * 2 and sent.kvs == [2, 0], (sent, sent.kvs)
    m.join(1, JoinRecord(16, 0, True, 7, None, 2.0))
    sent.clear()
    got = m.complete(1, base, live)
    assert got is not None and sorted(got[0]) == live and got[0][16].t == 2.0
    assert sent == ["/kv/range"] * 3 and sent.kvs[0] == 1, (sent, sent.kvs)  # the new key; the records; gone


@pytest.mark.timeout(120)
def test_the_decider_reads_the_records_once_they_add_up_in_pages_and_skips_stray_and_forged_keys(
        etcd: str, caplog: pytest.LogCaptureFixture) -> None:
    """5,000 members that each joined by itself (no agent: a key per record, two pages of
    4,096): once the keys' names add up to the live members, one read in pages. A stray key
    under the prefix, and a record under another rank's key, are logged and ignored; the
    rank's own record counts when it lands. With the job token, a record without its seal
    does not count. A rank in two keys: the later write counts."""
    n = 5000
    m, sent = _member(etcd, "rc/d", token="job-secret")
    puts = [p for r in range(n - 1) for p in m.joins.batch_puts(1, [JoinRecord(r, 0, True, 10, None, 1.0)])]
    m.store.multi_set([k for k, _ in puts], [v for _, v in puts])
    m.report_gone(Gone(n, "exit", "killed", 1.0, "launcher"))
    base, live = list(range(n + 1)), list(range(n))
    sent.clear()
    assert m.complete(1, base, live) is None, "rank 4999 has not joined"
    assert sent == ["/kv/range"], f"a poll with a record missing sent {sent}"

    m.store.set("rc/d/e/1/join/x", b"garbage")  # a stray key: listed, not parsed as a rank's
    forged = Membership(m.store, "rc/d", token="")  # no token: writes unsealed records
    forged.join(1, JoinRecord(4999, 0, True, 99, None))
    with caplog.at_level(logging.WARNING, logger="resilient_comm.membership"):
        assert m.complete(1, base, live) is None, "an unsealed record must not count"
        sent.clear()
        assert m.complete(1, base, live) is None and sent == ["/kv/range"], \
            f"with nothing written since, a poll is one listing, not another read: {sent}"
    assert "'rc/d/e/1/join/x'" in caplog.text and "'rc/d/e/1/join/4999.1'" in caplog.text, caplog.text

    m.join_many(1, [JoinRecord(4997, 0, True, 11, None, 2.0), JoinRecord(4998, 0, True, 11, None, 2.0)])
    m.store.set("rc/d/e/1/join/4999.1", m.joins.batch_puts(1, [JoinRecord(4998, 0, True, 99, None)])[0][1])
    assert m.complete(1, base, live) is None, "a record under another rank's key does not count"
    m.join(1, JoinRecord(4999, 0, True, 10, None, 3.0))
    sent.clear()
    got = m.complete(1, base, live)
    assert got is not None
    joined, gone = got
    assert len(joined) == n and joined[4999].t == 3.0 and list(gone) == [n]
    assert joined[4997].committed == joined[4998].committed == 11, "the later key counts, not the one after it in order"
    # The listing, two pages of records, and one read of every gone record.
    assert sent == ["/kv/range"] * 4, f"the decider's read sent {sent}"


@pytest.mark.timeout(60)
def test_an_event_or_a_decision_is_read_in_one_request_and_a_streamed_event_in_none(etcd: str) -> None:
    """On etcd a `get` was a watch's read, then the read (2 requests), and an event or a
    decision a check first (3): every node's agent read each event so, 6,000 requests per
    event at 16K ranks. Now a read is one request, and an event whose value a watch streamed
    is not read at all."""
    m, sent = _member(etcd, "rc/e")
    m.start(_decision(0, [0, 1]))
    m.post_event({"kind": "finished"})
    sent.clear()
    assert m.event(0) == {"kind": "finished"} and m.event(1) is None
    assert m.decision(0) is not None and m.decision(1) is None
    assert m.store.get("rc/e/epoch") == b"0"
    assert sent == ["/kv/range"] * 5, sent
    sent.clear()
    assert m.event(0, b'{"kind": "finished"}') == {"kind": "finished"} and sent == []


@pytest.mark.timeout(60)
def test_a_request_waiting_for_its_turn_in_the_process_is_not_a_lost_cluster(
        etcd: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most `INFLIGHT_PER_MEMBER` requests of a process are in flight to a member; a request
    that waits for its turn longer than the unreachable budget (here 1 s) is still sent and
    answered: its wait in the process is not counted as the cluster's silence (at 16,384
    emulated ranks, 17 agents' calls ran out of their 10 s budget in that queue and raised
    "etcd unreachable", so their joins never landed)."""
    from resilient_comm.elastic.membership.etcd import store as etcd_mod
    from resilient_comm.elastic.membership.etcd.store import INFLIGHT_PER_MEMBER, EtcdStore

    monkeypatch.setattr(etcd_mod, "UNREACHABLE_S", 1.0)
    store = EtcdStore(etcd, datetime.timedelta(seconds=20))
    store.set("rc/turn/k", "v")
    host, port = store.endpoints[0]
    turns = etcd_mod._turns(host, port)
    for _ in range(INFLIGHT_PER_MEMBER):
        assert turns.acquire(timeout=1)  # the process's other requests, all in flight
    freed = threading.Timer(2.0, lambda: [turns.release() for _ in range(INFLIGHT_PER_MEMBER)])
    freed.start()
    try:
        t0 = time.monotonic()
        assert store.value("rc/turn/k")[0] == b"v"
        took = time.monotonic() - t0
        assert 1.9 < took < 4.0, f"answered after {took:.1f} s: not after its turn came"
    finally:
        freed.join()
