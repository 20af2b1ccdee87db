"""The node agent (resilient-run's side of detection): node records watched around a ring,
one report for a lost node, stragglers on the next node, the socket's trust rule, and what a
worker does when its agent is gone. Unit tests drive `NodeAgent`s without sockets on a real
TCPStore; the others run real workers under a real launcher."""

from __future__ import annotations

import datetime
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from resilient_comm.elastic import DetectorConfig, Membership
from resilient_comm.elastic.model.records import Gone
from resilient_comm.elastic.node.agent import NodeAgent
from resilient_comm.elastic.node.view import Proc
from resilient_comm.testing.toy import ToyJob

CFG = DetectorConfig(heartbeat_s=0.02, silence_floor_s=0.3, straggler_floor_s=0.3, slow_factor=10.0)
_BEAT = lambda s, p: f"{s} 4 compute 1.0 10.0 0.1"  # noqa: E731 -- a worker's healthy beat


@pytest.fixture
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)


def _agents(store: dist.TCPStore, nodes: int, per_node: int = 2) -> list[NodeAgent]:
    agents = []
    for n in range(nodes):
        m = Membership(store.clone(), "rc/a")  # type: ignore[attr-defined]
        a = NodeAgent(m, n, nodes, nproc=per_node, config=CFG, node_heartbeat=0.04)
        for r in range(n * per_node, (n + 1) * per_node):
            a.add(r, 0)
            a.hello(r, CFG)
        agents.append(a)
    return agents


def _drive(agents: list[NodeAgent], beats: Callable[[int, Proc], str | None], until: Callable[[], bool],
           timeout_s: float) -> float:
    """Tick `agents` (each of its processes beating `beats(seq, proc)`, None: silent) until
    `until()`; returns the seconds it took."""
    t0, seq = time.monotonic(), 0
    while not until():
        assert time.monotonic() - t0 < timeout_s, "the condition was not reached in time"
        seq += 1
        for a in agents:
            for p in list(a.procs.values()):
                text = beats(seq, p)
                if text is not None:
                    a.on_beat(p, text, time.monotonic())
            a.tick()
        time.sleep(min(a.next_tick_in() for a in agents))  # pacing the fake workers' beats
    return time.monotonic() - t0


@pytest.mark.timeout(30)
def test_a_lost_node_is_reported_once_by_its_ring_predecessor(store: dist.TCPStore) -> None:
    agents = _agents(store, 3)
    m = Membership(store, "rc/a")
    lost: set[int] = set()
    _drive(agents, _BEAT, lambda: all(
        m.node_record(n) is not None for n in range(3)), 5)
    rec = json.loads(m.node_record(1) or "")
    assert sorted(rec["procs"]) == ["2", "3"] and rec["procs"]["2"][0].endswith(" 4 compute 1.0 10.0 0.1")
    # Node 2 stops: its agent and its workers (a whole-node SIGKILL, or a partition).
    lost.add(2)
    took = _drive([a for a in agents if a.node not in lost], _BEAT,
                  lambda: bool(m.gone([4, 5])), 5)
    assert 0.3 <= took < 1.5, f"node 2 reported {took:.2f} s after it stopped (bound 0.3 s)"
    gone = m.gone([0, 1, 2, 3, 4, 5])
    assert sorted(gone) == [4, 5], gone
    assert all(g.kind == "suspect" and g.by == "agent 1" and "node 2 silent for" in g.detail for g in gone.values())
    events = [m.event(i) for i in range(3)]
    assert events[0] is not None and events[1] is None, events
    assert {k: v for k, v in events[0].items() if k != "gone"} == {"kind": "gone", "ranks": [4, 5], "node": 2}
    assert [Gone(**g) for g in events[0]["gone"]] == [gone[4], gone[5]], "the event carries the evidence"
    # Node 1 now watches node 0: a node whose agent finished is skipped, not suspected.
    agents[0].finish()
    _drive([agents[1]], _BEAT, lambda: 0 in agents[1].gone_nodes, 5)
    assert agents[1].successor() is None and m.event(1) is None, "a finished node was reported"


@pytest.mark.timeout(30)
def test_the_ring_judges_stragglers_on_the_next_node_and_ignores_a_malformed_record(
        store: dist.TCPStore, caplog: pytest.LogCaptureFixture) -> None:
    agents = _agents(store, 2, per_node=1)
    m = Membership(store, "rc/a")

    def beats(s: int, p: Proc) -> str:  # rank 0 waits at step 7's sync; rank 1 computes step 7
        return f"{s} 7 sync 5.0 10.0 0.1" if p.rank == 0 else f"{s} 7 compute {1e3 * 0.02 * s:.1f} 10.0 0.1"

    took = _drive(agents, beats, lambda: bool(m.gone([1])), 10)
    g = m.gone([1])[1]
    assert g.by == "agent 0" and "straggler: computing step 7" in g.detail and "seen by node 0" in g.detail, g
    assert took < 2.0, took
    m.node_beat(0, "{not json")
    with caplog.at_level(logging.WARNING, logger="resilient_comm.agent"):
        agents[1]._next_tick = agents[1]._next_node_beat = 0.0
        agents[1].tick()
    assert "node 0's record is malformed" in caplog.text and not m.gone([0])


def _connect(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    return s


def _closed_by_peer(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


@pytest.mark.timeout(120)
def test_stray_and_malformed_connections_to_the_agent_are_dropped_and_training_goes_on(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    hold = 5
    job = ToyJob(2, ["--steps", "12", "--hold", f"0:{hold}"], str(tmp_path), quiet=True)
    with caplog.at_level(logging.WARNING, logger="resilient_comm.agent"):
        job.start()
        store = job.launcher.client()
        path = job.launcher._agent().path
        try:
            store.wait([f"toy/held/0/{hold}"], datetime.timedelta(seconds=60))
            assert oct(os.stat(os.path.dirname(path)).st_mode & 0o777) == "0o700"
            idle = _connect(path)  # never says anything: costs nothing
            impostor = _connect(path)
            impostor.sendall(b"hello 0 100 1000 5000 10 5\n")  # this test is not rank 0's process
            garbage = _connect(path)
            garbage.sendall(b"\x00\xffGET / HTTP/1.1\r\n\r\n")
            flood = _connect(path)
            flood.sendall(b"x" * 4096)
            for s in (impostor, garbage, flood):
                assert _closed_by_peer(s), "a bad connection was kept"
        finally:
            store.set(f"toy/go/{hold}", "1")
        assert job.wait(60) == 0
    idle.close()
    assert "is not process 0 of this node" in caplog.text, caplog.text
    assert "not a protocol line" in caplog.text and "a line longer than 1024 bytes" in caplog.text, caplog.text
    m = Membership(store, job.launcher.namespace)
    assert m.epoch() == 0 and all(g.kind == "exit" for g in m.gone([0, 1]).values()), "training was disturbed"


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


@pytest.mark.timeout(120)
def test_workers_whose_agent_is_killed_fail_fast_with_a_recovery_error() -> None:
    cmd = [sys.executable, "-m", "resilient_comm.elastic", "--nproc-per-node", "2", "--rdzv-id", "lost",
           "-m", "resilient_comm.testing.toy", "--steps", "100000", "--step-ms", "5", "--mark", "0:3"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert launcher.stdout is not None
    lines: list[str] = []
    started = threading.Event()

    def read(out: Any) -> None:  # until every writer (the launcher and its orphaned workers) ends
        for line in out:
            lines.append(line)
            if "started 2 workers" in line:
                started.set()

    reader = threading.Thread(target=read, args=(launcher.stdout,), daemon=True)
    reader.start()
    pidfds: list[int] = []
    try:
        assert started.wait(60), "".join(lines)
        workers = _children(launcher.pid)
        assert len(workers) == 2, workers
        pidfds = [os.pidfd_open(p) for p in workers]
        port = int("".join(lines).split("store 127.0.0.1:")[1].split(",")[0])
        dist.TCPStore("127.0.0.1", port, None, False, timeout=datetime.timedelta(seconds=60)).wait(["toy/at/0/3"])
        launcher.kill()  # the agent (and, on one node, the store) with it
        killed = time.monotonic()
        launcher.wait()
        left = list(pidfds)
        while left:  # a pidfd is readable once its process has ended
            ready, _, _ = select.select(left, [], [], max(0.0, killed + 10 - time.monotonic()))
            assert ready, f"{len(left)} workers still run 10 s after their agent died"
            left = [fd for fd in left if fd not in ready]
        ended = time.monotonic() - killed
        reader.join(10)
    finally:
        for fd in pidfds:
            try:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.close(fd)
    text = "".join(lines)
    assert ended < 5.0, f"the workers took {ended:.1f} s to leave"
    assert text.count("cannot recover: the node agent (resilient-run) is gone") == 2, text[-3000:]


@pytest.mark.timeout(30)
def test_a_node_that_is_not_present_is_never_watched_and_the_ring_goes_round_it(store: dist.TCPStore) -> None:
    """--nnodes 2:4: nodes 0 and 1 are the job's, node 3 joins as spare capacity (its spares
    have ids W + j * 4 + 3), node 2 never starts. Watching node 2 would stop the ring there:
    node 1 must watch node 3 instead, and report node 3's loss."""
    world = 4  # nodes 0 and 1, two ranks each
    spares3 = [world + 3, world + 4 + 3]
    agents: dict[int, NodeAgent] = {}
    for n, ranks in ((0, [0, 1]), (1, [2, 3]), (3, spares3)):
        a = NodeAgent(Membership(store.clone(), "rc/a"), n, 4, nproc=2, config=CFG,  # type: ignore[attr-defined]
                      node_heartbeat=0.04, present=range(2))
        for r in ranks:
            a.add(r, 0)
            a.hello(r, CFG)
        agents[n] = a
    m = Membership(store, "rc/a")
    watched: list[int | None] = []

    def looking(cond: Callable[[], bool]) -> Callable[[], bool]:
        return lambda: bool(watched.append(agents[1].succ.watched)) or cond()

    def beats(s: int, p: Proc) -> str:
        return f"{s} 4 compute 1.0 10.0 0.1"

    try:
        for a in agents.values():
            a.start()
        assert agents[1].successor() == 0, "node 3 is on the ring before it announced itself"
        agents[3].announce()
        # Every agent's events thread adds node 3; node 1 then reads its record.
        _drive(list(agents.values()), beats, looking(lambda: all(3 in a.ring() for a in agents.values()) and
                                                     agents[1].succ.view.seq >= 0), 5)
        assert [a.successor() for a in agents.values()] == [1, 3, 0]
        # Node 3 stops whole (its agent and its processes).
        agents[3].stop()
        took = _drive([agents[0], agents[1]], beats, looking(lambda: bool(m.gone(spares3))), 5)
    finally:
        for a in agents.values():
            a.stop()
    assert 0.3 <= took < 1.5, f"node 3 reported {took:.2f} s after it stopped (bound 0.3 s)"
    assert 2 not in watched and watched[-1] == 3, f"node 1 watched {sorted(set(watched), key=str)}"
    gone = m.gone([0, 1, 2, 3, 4, 5, *spares3])
    assert sorted(gone) == spares3, gone
    assert all(g.by == "agent 1" and "node 3 silent for" in g.detail for g in gone.values()), gone
    events = [{k: v for k, v in e.items() if k != "gone"} for i in range(4) if (e := m.event(i)) is not None]
    assert events == [{"kind": "node", "node": 3}, {"kind": "gone", "node": 3, "ranks": spares3}], events
    assert agents[1].successor() == 0 and agents[1].ring() == {0, 1}


@pytest.mark.timeout(120)
def test_losing_the_store_in_a_recovery_ends_every_survivor_with_a_clear_error(
        etcd_proc: tuple[str, Any], tmp_path: Any) -> None:
    """Issue #16 item 6: the store gone while the survivors agree on a recovery. Each must leave
    with `RecoveryError` (the store failed) or `Evicted` (its agent fenced it: no store
    majority), within the lease and the store's retry budget; never a raw `DistNetworkError`
    out of the wait for a decision, never a hang."""
    endpoint, proc = etcd_proc
    job = ToyJob(3, ["--steps", "100000", "--step-ms", "5", "--mark", "0:5"], str(tmp_path / "job"), quiet=True,
                 rdzv_backend="etcd", endpoint=endpoint).start()
    try:
        job.launcher.client().wait(["toy/at/0/5"], datetime.timedelta(seconds=60))
        proc.kill()  # the whole store: a one-member etcd
        proc.wait()
        os.kill(job.pid(1), signal.SIGKILL)  # the survivors now need the store to agree
        t0 = time.monotonic()
        status = job.wait(40.0)
        ended = time.monotonic() - t0
    finally:
        job.launcher.forward(signal.SIGKILL)
    assert status != 0
    # The fence (~5 s) and the launcher's report of the kill, which had started before it and
    # waits out the store's retry budget (10 s). A fenced agent's last node record and the
    # agent's events thread, inside a call of its own, used to add 10-15 s more (24-31 s).
    assert ended < 20.0, f"the survivors took {ended:.1f} s to leave"
    outcomes = {e["rank"]: e for e in job.events() if e["event"] in ("failed", "evicted")}
    assert sorted(outcomes) == [0, 2], job.events()[-6:]
    for r, e in outcomes.items():
        assert "store" in e["why"] or "fenced" in e["why"], e
        with open(os.path.join(job.workdir, "logs", "0", f"{r}.log")) as f:
            log = f.read()
        assert "Traceback" not in log, log[-3000:]


def _etcd_agent(endpoint: str, ns: str, lease_s: float) -> tuple[Membership, NodeAgent]:
    """One node's agent, with one worker, on etcd (not started)."""
    from resilient_comm.elastic.membership.etcd.store import EtcdStore

    m = Membership(EtcdStore(endpoint, datetime.timedelta(seconds=10)), ns)
    a = NodeAgent(m, 0, 1, nproc=1, config=CFG, lease_s=lease_s)
    a.add(0, 0)
    a.hello(0, CFG)
    return m, a


@pytest.mark.timeout(60)
def test_a_successors_deleted_record_is_reported_at_once_not_at_the_next_read(etcd: str) -> None:
    """On etcd a lost node's record goes when its lease expires, and its ring predecessor
    read the record every third of the lease: up to 10 s late at a 30 s lease (1.7 s at 5 s).
    Now a watch of the record (puts filtered out at the member) wakes the predecessor's lease
    loop at the delete: its ranks are reported within a second, and the watch moves on."""
    from resilient_comm.elastic.membership.etcd.store import EtcdStore

    m = Membership(EtcdStore(etcd, datetime.timedelta(seconds=10)), "rc/w")
    agents = []
    for n in range(2):
        a = NodeAgent(m.clone(), n, 2, nproc=1, config=CFG, lease_s=30.0)
        a.add(n, 0)
        a.hello(n, CFG)
        agents.append(a)
    try:
        for a in agents:
            a.start()
        a0 = agents[0]
        deadline = time.monotonic() + 20
        while not (a0.succ.view.seq >= 0 and a0.lease is not None and a0.lease.succ_watch is not None and
               a0.lease.succ_watch.created.is_set()):
            assert time.monotonic() < deadline, "node 0 never read node 1's record and watched it"
            time.sleep(0.01)  # polling the agent's state with a deadline
        watch = a0.lease.succ_watch
        assert watch.key == "rc/w/node/1"
        agents[1]._stop.set()  # node 1's agent stops renewing (as a lost node's); the lease "expires":
        t0 = time.monotonic()
        assert m.store.delete_key("rc/w/node/1")  # type: ignore[attr-defined]
        reported = m.store.wait_for("rc/w/gone/1", 5.0)  # type: ignore[attr-defined]
        assert reported, "node 1's loss was not reported within 5 s of its record's delete"
        took = time.monotonic() - t0
        assert took < 1.0, f"reported {took:.2f} s after the record was deleted (the read every 10 s, not the watch)"
        g = m.gone([1])[1]
        assert g.by == "agent 0" and "node 1's lease (30 s) expired" in g.detail, g
        watch._thread.join(timeout=5)  # node 0 is alone on the ring now: it watches nothing
        assert not watch._thread.is_alive() and a0.lease.succ_watch is None, "the watch stayed on node 1's record"
    finally:
        for a in agents:
            a.stop()


@pytest.mark.timeout(60)
def test_a_slow_record_write_never_holds_up_the_lease_keepalive(etcd: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """During an etcd election a record's put can take seconds. The keepalive must not wait
    behind it: with a 2 s lease and every put after the first taking 3 s, the node stays
    unfenced and its lease (and so its record) alive. (With the keepalive on the record's
    thread, the agent fenced itself after 1.7 s.)"""
    from resilient_comm.elastic.membership.etcd.store import EtcdStore

    put = EtcdStore.put_with_lease
    calls = [0]

    def slow_put(self: EtcdStore, key: str, value: str, lease: int) -> None:
        calls[0] += 1
        put(self, key, value, lease)
        if calls[0] > 1:
            time.sleep(3.0)  # the record thread stuck in a store call (the thing simulated)

    monkeypatch.setattr(EtcdStore, "put_with_lease", slow_put)
    m, a = _etcd_agent(etcd, "rc/k", 2.0)
    try:
        a.start()
        _drive([a], _BEAT, lambda: calls[0] >= 2, 10)
        t0 = time.monotonic()
        _drive([a], _BEAT, lambda: time.monotonic() - t0 > 4.0, 10)
        assert a.fenced is None, a.fenced
        assert m.node_record(0) is not None, "the lease expired: the record is gone"
    finally:
        a.stop()


@pytest.mark.timeout(60)
def test_the_events_watch_is_one_stream_and_a_stale_one_is_caught_by_a_read(
        etcd: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent's events arrive on one long-lived etcd watch stream (`PrefixWatch`): keys put
    while a wait is on are seen within 0.5 s of the put, five waits in a row use one stream (each wait
    opened a watch of its own before), and a key put before the stream is found by a read. A
    stream that goes on without bringing anything (a member cut off sends no reset) is caught
    by the wait's read every `poll_s`: the key is found, and once the stream has not reached
    its revision for `poll_s` (not at once: a stream under load may only be behind, and
    reopening 1,024 of them was more load) the stream is reopened and the next key is
    streamed again. A set `stop` ends a wait within a second. The value a key was put
    with comes with it (`value`: an agent reads no event it was streamed)."""
    from resilient_comm.elastic.membership.etcd.store import EtcdStore
    from resilient_comm.elastic.membership.etcd.watch import PrefixWatch

    store = EtcdStore(etcd, datetime.timedelta(seconds=10))
    ns = "rc/watch/events/"
    store.set(ns + "0", "before the stream")
    w = PrefixWatch(store, ns, poll_s=1.0)

    def put_soon(i: int) -> float:
        threading.Timer(0.2, store.set, (ns + str(i), "x")).start()  # lands while the wait is on
        return time.monotonic()

    try:
        assert w.wait_for(ns + "0", 1.0) and w.value(ns + "0") == b"before the stream"
        for i in range(1, 6):
            t0 = put_soon(i)
            assert w.wait_for(ns + str(i), 5.0)
            assert time.monotonic() - t0 < 0.7, "not streamed: found by the wait's read"
            assert w.value(ns + str(i)) == b"x", "the streamed value is kept: the waiter reads nothing"
        assert (w.opened, w.missed) == (1, 0) and w.value(ns + "9") is None

        monkeypatch.setattr(w, "_chunk", lambda chunk: True)  # the stream brings nothing any more
        t0 = put_soon(6)
        assert w.wait_for(ns + "6", 5.0)
        assert 0.75 < time.monotonic() - t0 < 2.5, "a stale stream's key is found by the read after 0.8-1 poll_s"
        assert (w.missed, w.opened) == (0, 1), "a stream maybe only behind was reopened at once"
        t0 = put_soon(7)
        assert w.wait_for(ns + "7", 5.0)  # its first read: the stream has not reached key 6 in poll_s
        assert w.missed == 1 and time.monotonic() - t0 < 2.5
        monkeypatch.undo()
        deadline = time.monotonic() + 5
        while w.opened < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the watch's own count of streams
        assert w.opened == 2, "the stale stream was not reopened"
        t0 = put_soon(8)
        assert w.wait_for(ns + "8", 5.0)
        assert time.monotonic() - t0 < 0.7, "the reopened stream does not bring keys"
        assert w.missed == 1, "a stream that brings keys was found stale"

        stop = threading.Event()

        def stop_and_wake() -> None:
            stop.set()
            w.wake()

        threading.Timer(0.3, stop_and_wake).start()
        t0 = time.monotonic()
        assert not w.wait_for(ns + "99", 30.0, stop)
        assert time.monotonic() - t0 < 0.6, "a woken wait did not look at its stop"
    finally:
        w.close()


class _SlowProxy:
    """A TCP proxy in front of etcd that holds every chunk of each answer `delay_s` before
    passing it on: a cluster that answers, slowly (as 512 agents starting together made it)."""

    def __init__(self, upstream: str, delay_s: float) -> None:
        host, port = upstream.rsplit(":", 1)
        self._up, self.delay_s = (host, int(port)), delay_s
        self._server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._server.getsockname()[1]}"
        self.accepted = 0  # connections: a request abandoned on its timeout closes its own
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self._server.accept()
            except OSError:
                return  # closed
            self.accepted += 1
            up = socket.create_connection(self._up)
            threading.Thread(target=self._pump, args=(c, up, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, c, self.delay_s), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        try:
            while data := src.recv(65536):
                time.sleep(delay_s)  # the injected latency, not a synchronisation
                dst.sendall(data)
        except OSError:
            pass  # the client gave up on the request: its connection is closed
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self._server.close()


@pytest.mark.timeout(60)
def test_a_slow_etcd_is_waited_for_and_a_refusal_says_why(etcd: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An etcd that answers every request in 1.3 s (more than the first request's 1 s wait):
    calls succeed, since a request that timed out doubles the next one's wait, and the next
    call keeps that wait instead of abandoning a request again. (With a fixed 1 s wait every
    request was abandoned and sent again until the 10 s budget ran out: at 512 emulated
    agents every lease expired that way.) Another store of the same process (another agent
    thread) learns it too: its first request is waited for, not abandoned and sent again
    (at 8,192 emulated ranks each of 1,024 nodes' requests was sent three times). A refusal
    carries etcd's own words, not only the HTTP reason."""
    from resilient_comm.elastic.membership.etcd import store as etcd_mod
    from resilient_comm.elastic.membership.etcd.store import EtcdStore

    monkeypatch.setattr(etcd_mod, "_SLOWEST", etcd_mod._Slowest())  # no other test's answers
    proxy = _SlowProxy(etcd, 1.3)
    try:
        store = EtcdStore(proxy.endpoint, datetime.timedelta(seconds=10))
        t0 = time.monotonic()
        store.set("rc/slow/k", "v")  # its first request is abandoned after 1 s, the second waits 2
        took = time.monotonic() - t0
        assert 2.2 <= took < 5.0, f"a slow call took {took:.1f} s"
        t0 = time.monotonic()
        assert store.value("rc/slow/k")[0] == b"v"  # one round trip
        took = time.monotonic() - t0
        assert took < 2.2, f"the next call abandoned a request again ({took:.1f} s): its wait was not kept"
        before = proxy.accepted
        t0 = time.monotonic()
        assert EtcdStore(proxy.endpoint, datetime.timedelta(seconds=10)).value("rc/slow/k")[0] == b"v"
        took = time.monotonic() - t0
        assert took < 2.2 and proxy.accepted == before + 1, \
            f"a new store abandoned its first request ({took:.1f} s, {proxy.accepted - before} connections)"
        with pytest.raises(dist.DistStoreError, match="requested lease not found"):
            store.put_with_lease("rc/slow/leased", "v", 12345)
    finally:
        proxy.close()


@pytest.mark.timeout(60)
def test_an_agent_whose_lease_the_store_dropped_is_fenced_and_stops_renewing(etcd: str) -> None:
    """The store drops the node's lease (revoked here; expired after a long stall in the
    field): the agent is fenced within a keepalive period, and its lease thread ends rather
    than putting the record with a dead lease forever (it logged "no store majority" every
    third of the lease: the store had answered), and never grants itself a new lease, which
    would bring back a node the others may have decided without."""
    m, a = _etcd_agent(etcd, "rc/revoked", 3.0)
    store: Any = m.store
    try:
        a.start()
        _drive([a], _BEAT, lambda: m.node_record(0) is not None, 10)
        lease = store.kv_range(m.key("node", 0))["kvs"][0]["lease"]
        store._post("/lease/revoke", {"ID": lease}, "revoke the node's lease")
        t0 = time.monotonic()
        _drive([a], _BEAT, lambda: a.fenced is not None, 10)
        assert time.monotonic() - t0 < 1.5, f"fenced {time.monotonic() - t0:.1f} s after the lease was dropped"
        assert "lease expired" in (a.fenced or ""), a.fenced
        assert a.lease is not None and a.lease.thread is not None
        a.lease.thread.join(3.0)  # (a third of the lease, and the keepalive thread's end)
        assert not a.lease.thread.is_alive(), "the lease thread goes on with a dead lease"
        assert m.node_record(0) is None, "a new lease brought the record back"
    finally:
        a.stop()


@pytest.mark.timeout(30)
def test_the_events_thread_goes_past_malformed_events(store: dist.TCPStore) -> None:
    """Garbage in an event slot, an event whose evidence is malformed: the agent logs and skips
    them, and forwards the next good one (a JSONDecodeError used to end its events thread:
    the node heard nothing more)."""
    agents = _agents(store, 1, per_node=1)
    got: list[str] = []
    heard = threading.Event()

    def hear(line: str) -> None:  # what the workers would hear
        got.append(line)
        heard.set()

    agents[0].broadcast = hear  # type: ignore[method-assign]
    m = Membership(store, "rc/a")
    try:
        agents[0].start()
        store.set(m.key("events", 0), "{garbage")
        store.set(m.key("events", 1), json.dumps({"kind": "gone", "ranks": [0], "gone": [{"rank": "x"}]}))
        m.post_event({"kind": "finished"})
        assert heard.wait(5), f"nothing forwarded; the events thread read {agents[0].events_read} events"
    finally:
        agents[0].stop()
    assert agents[0].events_read == 3
    assert got == ['ev {"kind":"finished"}'], got
    assert not agents[0].procs[0].done, "a malformed gone event took a process out"
