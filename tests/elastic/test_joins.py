"""A node's join records go through its agent: one store request per node, not per rank
(`joins.JoinBatcher`). Real agents on a real socket and store, real `Detector` clients; the
agent's event loop is a selector on a thread, as in resilient-run."""

from __future__ import annotations

import datetime
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch.distributed as dist

from resilient_comm.elastic import DetectorConfig, Membership
from resilient_comm.elastic.model.policy import Mesh
from resilient_comm.elastic.model.records import Decision, Gone, JoinRecord
from resilient_comm.elastic.node.agent import NodeAgent
from resilient_comm.elastic.worker.detector import Detector
from resilient_comm.elastic.worker.errors import Evicted
from resilient_comm.elastic.worker.rejoin import catch_up

CFG = DetectorConfig(heartbeat_s=0.05, silence_floor_s=5.0, straggler_floor_s=5.0)


class _Counting:
    """A store that counts the calls made through it and its clones (the agent's joins thread
    has a clone of its own)."""

    def __init__(self, store: Any, calls: list[str], threads: list[str] | None = None) -> None:
        self._s, self.calls = store, calls
        self.threads: list[str] = [] if threads is None else threads  # the calling thread's name, each call

    def clone(self) -> _Counting:
        return _Counting(self._s.clone(), self.calls, self.threads)

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._s, name)
        if not callable(fn) or name == "set_timeout":
            return fn

        def call(*a: Any, **k: Any) -> Any:
            self.calls.append(name)
            self.threads.append(threading.current_thread().name)
            return fn(*a, **k)
        return call


class _Node:
    """A started agent of `ranks` (all this process's: the socket's trust rule holds) with its
    loop on a thread, and a `Detector` per rank that is connected."""

    def __init__(self, ranks: list[int], window_s: float) -> None:
        self.tcp = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10),
                                 wait_for_workers=False)
        self.calls: list[str] = []
        self.threads: list[str] = []
        self.m = Membership(self.tcp, "rc/j")
        self.m.start(Decision(0, ranks, Mesh(dp=len(ranks)).as_dict(), "init", 0))
        self.sel = selectors.DefaultSelector()
        counted = _Counting(self.tcp.clone(), self.calls, self.threads)
        self.agent = NodeAgent(Membership(counted, "rc/j"), 0, 1, nproc=len(ranks),
                               config=CFG, register=lambda f, cb: self.sel.register(f, selectors.EVENT_READ, cb),
                               unregister=self.sel.unregister)
        for r in ranks:
            self.agent.add(r, os.getpid())
        self.agent.start()
        assert self.agent.joins is not None
        self.agent.joins.window_s = window_s
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._run, daemon=True)
        self._loop.start()
        self.dets: dict[int, Detector] = {}

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self.sel.select(timeout=0.05):
                key.data()

    def connect(self, r: int, on_gone: Any = None) -> Detector:
        d = Detector(self.agent.path, r, CFG, on_gone or (lambda g: None), lambda why: None)
        d.start()
        self.dets[r] = d
        deadline = time.monotonic() + 10
        while self.agent.procs[r].cfg is None:  # its hello reached the agent
            assert time.monotonic() < deadline, f"rank {r}'s hello never reached the agent"
            time.sleep(0.01)  # polling the agent's loop thread
        return d

    def close(self) -> None:
        for d in self.dets.values():
            d.stop()
        self._stop.set()
        self._loop.join(5)
        self.agent.stop()


@pytest.fixture
def node(request: pytest.FixtureRequest) -> Iterator[_Node]:
    ranks, window_s = request.param
    n = _Node(ranks, window_s)
    try:
        yield n
    finally:
        n.close()


def _rec(r: int, applied: int = 0) -> JoinRecord:
    return JoinRecord(r, applied, True, 7, None, time.time())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("node", [([0, 1, 2, 3], 30.0)], indirect=True)
def test_a_nodes_workers_join_in_one_store_request_as_soon_as_all_have_sent(node: _Node) -> None:
    dets = [node.connect(r) for r in range(4)]
    node.calls.clear()
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:  # (a 30 s window: only the last record's arrival sends the batch)
        answers = list(pool.map(lambda d: d.join(_rec(d.rank), 10.0), dets))
    took = time.monotonic() - t0
    assert answers == [("joined", "1")] * 4, answers
    assert took < 5.0, f"the batch waited {took:.1f} s for records that were all there"
    assert node.agent.joins is not None and node.agent.joins.written == 1
    # One proposal and one append of the node's four records (the TCPStore's join group).
    assert node.calls.count("compare_set") == 1 and node.calls.count("append") == 1, node.calls
    assert node.m.epoch() == 1
    assert sorted(node.m.joined(1, [0, 1, 2, 3])) == [0, 1, 2, 3]
    base = node.m.decision(0)
    assert base is not None
    # catch_up through the agent: the next failure's join, with no direct store call by the rank.
    direct: list[str] = []
    m = Membership(_Counting(node.tcp.clone(), direct), "rc/j")
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda d: catch_up(m, d.rank, 0, base, _rec(d.rank), lambda rec: d.join(rec, 10.0)), dets))
    assert [e for e, _ in got] == [1] * 4 and direct == [], direct


@pytest.mark.timeout(60)
@pytest.mark.parametrize("node", [([0, 1, 2], 0.3)], indirect=True)
def test_a_late_worker_does_not_hold_up_its_nodes_batch_past_the_window(node: _Node) -> None:
    dets = [node.connect(r) for r in range(3)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(2) as pool:  # rank 2 is still aborting its collective
        answers = list(pool.map(lambda d: d.join(_rec(d.rank), 10.0), dets[:2]))
    took = time.monotonic() - t0
    assert answers == [("joined", "1")] * 2
    assert 0.25 <= took < 3.0, f"the batch went after {took:.2f} s, not at its 0.3 s window"
    assert dets[2].join(_rec(2), 10.0) == ("joined", "1")  # its own batch, later
    assert node.agent.joins is not None and node.agent.joins.written == 2
    assert sorted(node.m.joined(1, [0, 1, 2])) == [0, 1, 2]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("node", [([0, 1], 0.05)], indirect=True)
def test_a_rank_its_agent_knows_gone_is_evicted_and_writes_nothing(node: _Node) -> None:
    dets = [node.connect(r) for r in range(2)]
    node.agent.procs[1].done = True  # as when the agent forwarded a gone event naming it
    base = node.m.decision(0)
    assert base is not None
    with pytest.raises(Evicted, match="rank 1 was reported gone"):
        catch_up(node.m, 1, 0, base, _rec(1), lambda rec: dets[1].join(rec, 10.0))
    assert node.m.epoch() == 0, "a gone rank proposed an epoch"
    assert dets[0].join(_rec(0), 10.0) == ("joined", "1")  # the others go on (rank 1 is not awaited)
    assert node.m.joined(1, [0, 1]).keys() == {0}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("node", [([0, 1], 60.0)], indirect=True)
def test_a_worker_whose_agent_does_not_answer_in_time_joins_by_itself(node: _Node,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    dets = [node.connect(r) for r in range(2)]  # rank 1 never joins: the 60 s window holds rank 0's
    base = node.m.decision(0)
    assert base is not None
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="resilient_comm.elastic"):
        epoch, _ = catch_up(node.m, 0, 0, base, _rec(0), lambda rec: dets[0].join(rec, 0.5))
    took = time.monotonic() - t0
    assert epoch == 1 and 0.5 <= took < 5.0, took
    assert "did not answer its join within 0.5 s: it joins by itself" in caplog.text, caplog.text
    assert node.m.joined(1, [0, 1]).keys() == {0}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("node", [([0, 1], 0.05)], indirect=True)
def test_a_join_record_for_another_rank_or_malformed_is_dropped_with_its_connection(
        node: _Node, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="resilient_comm.agent"):
        for line in (b"join [1,0,true,7,null,1.0]\n", b"join [0,0,\"x\",7,null,1.0]\n", b"join {}\n"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(node.agent.path)
            s.sendall(b"hello 0 50 5000 5000 10 5\n" + line)
            try:
                assert s.recv(1) == b"", "a bad join was answered"
            except ConnectionResetError:
                pass
            s.close()
    assert "a join record for rank 1 from rank 0" in caplog.text, caplog.text
    assert caplog.text.count("bad join") == 2, caplog.text
    assert node.m.epoch() == 0 and node.agent.joins is not None and node.agent.joins.written == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("node", [([0, 1, 2], 30.0)], indirect=True)
def test_after_a_gone_event_the_agents_events_thread_writes_its_workers_joins(node: _Node) -> None:
    """The workers' records follow the event the agent forwarded: the thread that forwarded it
    writes them (`JoinBatcher.help`), and the batcher's own thread is not woken for them."""
    answers: dict[int, Any] = {}

    def on_gone(r: int) -> Any:
        def joins(g: Gone) -> None:  # as a controller's recovery does, on its own thread
            threading.Thread(target=lambda: answers.__setitem__(r, node.dets[r].join(_rec(r), 10.0))).start()
        return joins

    for r in (0, 1):
        node.connect(r, on_gone(r))
    node.connect(2)
    node.threads.clear()
    node.m.report_gone(Gone(2, "exit", "killed by SIGKILL", time.time(), "launcher"))  # node 0's own rank 2
    node.agent.exited(2)
    deadline = time.monotonic() + 10
    while len(answers) < 2:
        assert time.monotonic() < deadline, f"the joins were not answered: {answers}"
        time.sleep(0.01)  # polling the workers' answers
    assert answers == {0: ("joined", "1"), 1: ("joined", "1")}
    calls = list(zip(node.calls, node.threads))
    # (Reading the event is a compare_set too: the proposal and the append are the last two.)
    assert calls[-2:] == [("compare_set", "rc-agent-events"), ("append", "rc-agent-events")], calls
    assert all(t != "rc-agent-joins" for _, t in calls), calls
