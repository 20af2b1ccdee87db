"""The node agent: each node's ``resilient-run`` watches its own processes and speaks for them.

Workers never touch the store per heartbeat. What each side does (docs/elastic.md, "Node
agents"):

- **Workers** (and waiting spares) beat over a node-local Unix socket every
  ``heartbeat_s`` (~100 ms). The agent applies the dead-vs-slow bounds of `detector` to
  them on its own monotonic clock (silence; a straggler is a member computing while another
  member of this node, or of the node before this one, waits) and reports a suspect once.
  Exits come from the pidfds, as before.
- **One liveness record per node**, ``{ns}/node/{n}``, rewritten every node heartbeat
  (``RESILIENT_COMM_NODE_HEARTBEAT_MS``, 200 ms): a sequence number and the last beat of each
  of its member processes. The agent of node n reads only its *ring successor*'s record
  (the next node present -- initial, or a capacity node that announced itself -- and not
  known gone), so the steady-state store load is two operations per node
  heartbeat per node (a set and a get), whatever the number of ranks. On a TCPStore, a record
  whose sequence stops for longer than the node bound (``max(silence floor, min_silent_reads x
  node heartbeat)``) means the node is lost; on etcd, the record is put with the node's lease
  (``RESILIENT_COMM_NODE_LEASE_MS``) and its deletion at the lease's expiry is the evidence.
  Either way its predecessor reports every process of the record gone in one event, and
  watches the next node. Stragglers on the successor are judged from its record.
- **Fencing** (etcd): an agent whose last keepalive the store answered is older than its lease
  (less a margin) tells its workers ``fence``; they raise ``Evicted`` before the others can
  see the lease expire and decide without them.
- **Events** (a rank gone, a decision published, the job finished) reach each agent once:
  every agent waits for the next event's key (on a TCPStore a wait the store answers for all
  its waiters when the poster writes the key, so posting costs one write whatever the number
  of nodes; on etcd a watch). It forwards each event to its processes, with the gone records
  it names.
- **Joins**: after a failure each worker sends its join record to its agent, which writes its
  node's records in one request (`joins.JoinBatcher`): one transaction per node per failure,
  not per rank.

The socket's lines and its trust rule: `wire`.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from resilient_comm.config import knob_s
from resilient_comm.elastic.detector import WAITING, DetectorConfig, PeerView, silence_why, straggler_why
from resilient_comm.elastic.etcd import jittered
from resilient_comm.elastic.watch import DeleteWatch, PrefixWatch
from resilient_comm.elastic.joins import JoinBatcher
from resilient_comm.elastic.membership import Gone, JoinRecord, Membership
from resilient_comm.elastic.wire import MAX_LINE, ancestors, hello_line, parse_hello, peer_cred

log = logging.getLogger("resilient_comm.agent")

ENV_AGENT = "RESILIENT_COMM_AGENT"  # path of the node agent's socket, in every worker's environment


def node_heartbeat_s() -> float:
    return knob_s("RESILIENT_COMM_NODE_HEARTBEAT_MS", 0)


def node_lease_s() -> float:
    return knob_s("RESILIENT_COMM_NODE_LEASE_MS", 2000)  # etcd's shortest lease is about 2 s


@dataclass
class Proc:
    """One process of this node (a worker or a spare), as its agent sees it."""

    rank: int
    pid: int
    cfg: DetectorConfig | None = None  # from its hello
    view: PeerView = field(default_factory=PeerView)
    beat: str = ""  # its last heartbeat line's fields
    placed: bool = False  # a spare that a decision placed (from then on it is judged like a member)
    done: bool = False  # exited or reported: never judged again
    gone_why: str = ""  # the evidence of a gone event that named it
    conn: socket.socket | None = None

    def judged(self) -> bool:
        """Whether its beats are held to the bounds: a member, not a spare still waiting."""
        return not self.done and self.cfg is not None and (self.view.phase != "spare" or self.placed)


@dataclass
class RemoteProc:
    """A process of the ring successor, from that node's record."""

    view: PeerView
    cfg: DetectorConfig


def _cfg_fields(c: DetectorConfig) -> list[float]:
    return [c.silence_floor_s, c.straggler_floor_s, c.slow_factor, c.min_silent_reads]


class _Conn:
    """A connection on the agent's socket, before and after its hello."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.proc: Proc | None = None


class NodeAgent:
    """Detection for one node. Threads: the launcher's loop calls `add`, `exited`, `tick` and
    the socket callbacks; the events thread (`start`) forwards events. `broadcast` may be
    called from either; `stop` from the launcher's loop."""

    def __init__(self, membership: Membership, node: int, nnodes: int, *, nproc: int,
                 config: DetectorConfig | None = None, node_heartbeat: float | None = None,
                 register: Callable[[Any, Callable[[], None]], object] | None = None,
                 unregister: Callable[[Any], object] | None = None, lease_s: float | None = None,
                 present: Iterable[int] | None = None) -> None:
        """`register(fileobj, callback)` / `unregister(fileobj)` put the socket and its
        connections in the caller's event loop (the launcher's selector); without them the
        agent has no socket (the benchmark feeds beats by `on_beat`). `nnodes` is the most
        nodes the job may have; `present` the nodes that are there from the start (default:
        all of them), the others join the ring when they `announce` themselves."""
        self.m, self.node, self.nnodes, self.nproc = membership, node, nnodes, nproc
        self.cfg = config or DetectorConfig.from_env()
        self.node_hb = node_heartbeat or node_heartbeat_s()
        # On etcd, node liveness is a lease (`_lease_loop`); on a TCPStore, a record rewritten
        # by `tick` whose silence is judged.
        self.lease_s = lease_s or node_lease_s() if membership.watches else 0.0
        self.fenced: str | None = None
        self._last_ok = time.monotonic()  # the last keepalive the store answered (its send time)
        self._observers: list[PeerView] = []
        self.procs: dict[int, Proc] = {}
        self.metrics: Any = None  # a metrics.NodeMetrics (resilient-run --metrics-port), or None
        self.gone_nodes: set[int] = set()  # lost, or finished (their agents said so)
        # The ring's nodes: the initial ones, and capacity nodes that announced themselves.
        self.present: set[int] = {node, *(range(nnodes) if present is None else present)}
        self._announced: set[int] = set()  # capacity nodes that said they started (they had a record)
        self._finished = False
        self._lock = threading.Lock()  # procs' connections, gone_nodes and present: both threads
        self._send_lock = threading.Lock()  # whole lines to a worker from the events and joins threads
        self.joins: JoinBatcher | None = None  # (`start`)
        self._seq = 0
        self._next_tick = time.monotonic()
        self._next_node_beat = self._next_tick
        self._next_judge = self._next_tick
        self._watched: int | None = None  # the ring successor
        self._succ_view = PeerView()
        self._succ_procs: dict[int, RemoteProc] = {}
        self._succ_ranks: list[int] = []
        self._next_event = 0
        self._stop = threading.Event()
        self._events_thread: threading.Thread | None = None
        self._events_watch: PrefixWatch | None = None  # etcd: the events thread's watch stream
        self._lease_thread: threading.Thread | None = None
        self._lease_wake = threading.Event()  # etcd: the lease loop's wait ends (stop, the successor's record deleted)
        self.succ_watch: DeleteWatch | None = None  # etcd: the lease loop's watch of the successor's record
        self._fence_thread: threading.Thread | None = None
        self._register, self._unregister = register, unregister
        self._dir: str | None = None
        self._listener: socket.socket | None = None
        self._conns: list[_Conn] = []
        self.store_lost: str | None = None
        if register is not None:
            self._dir = tempfile.mkdtemp(prefix="rc-agent-")  # mode 0700: only this user gets in
            self.path = os.path.join(self._dir, "agent.sock")
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(self.path)
            self._listener.listen(256)
            self._listener.setblocking(False)
            register(self._listener, self._accept)
        else:
            self.path = ""

    # -- processes ------------------------------------------------------------------------

    def add(self, rank: int, pid: int) -> None:
        with self._lock:
            self.procs[rank] = Proc(rank, pid)

    def exited(self, rank: int) -> None:
        """The process ended (its exit is reported by the launcher): it is judged no more."""
        with self._lock:
            p = self.procs.get(rank)
            if p is None:
                return
            p.done = True
            conn = p.conn
            if self.metrics is not None:
                self.metrics.forget(rank)  # its heartbeat lag goes with it
        if conn is not None:
            self._close(next((c for c in self._conns if c.sock is conn), None))

    def hello(self, rank: int, cfg: DetectorConfig) -> Proc:
        """A process said hello (the benchmark calls this directly)."""
        with self._lock:
            p = self.procs[rank]
            p.cfg, p.view = cfg, PeerView(changed_at=time.monotonic())
        return p

    def on_beat(self, p: Proc, text: str, t: float) -> None:
        p.beat = text
        p.view.update(text, t)

    # -- the socket -----------------------------------------------------------------------

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            c = _Conn(sock)
            sock.settimeout(1.0)  # a send to a wedged worker gives up (and drops it) after 1 s
            self._conns.append(c)
            assert self._register is not None
            self._register(sock, functools.partial(self._readable, c))

    def _close(self, c: _Conn | None, why: str = "") -> None:
        if c is None or c not in self._conns:
            return
        self._conns.remove(c)
        if why:
            log.warning("node %d: dropped a connection to its agent (%s)", self.node, why)
        if self._unregister is not None:
            self._unregister(c.sock)
        with self._lock:
            if c.proc is not None and c.proc.conn is c.sock:
                c.proc.conn = None
        c.sock.close()

    def _readable(self, c: _Conn) -> None:
        try:
            data = c.sock.recv(65536)
        except OSError as e:
            self._close(c, f"recv: {e}")
            return
        if not data:
            self._close(c)  # the process ended or closed it; its exit comes from the pidfd
            return
        c.buf += data
        t = time.monotonic()
        while (end := c.buf.find(b"\n")) >= 0:
            line, c.buf = bytes(c.buf[:end]), c.buf[end + 1:]
            why = self._line(c, line, t)
            if why:
                self._close(c, why)
                return
        if len(c.buf) > MAX_LINE:
            self._close(c, f"a line longer than {MAX_LINE} bytes")

    def _line(self, c: _Conn, line: bytes, t: float) -> str:
        """Handle one line; returns why the connection must be dropped ("" to keep it)."""
        try:
            word, *fields = line.decode("ascii").split()
        except (UnicodeDecodeError, ValueError):
            return f"not a protocol line: {line[:40]!r}"
        if c.proc is None:
            if word != "hello":
                return f"first line is not hello: {line[:40]!r}"
            try:
                rank, cfg = parse_hello(fields)
            except ValueError as e:
                return f"bad hello {line[:80]!r}: {e}"
            pid, uid = peer_cred(c.sock)
            with self._lock:
                p = self.procs.get(rank)
            if uid != os.getuid() or p is None or p.done or p.pid not in ancestors(pid):
                return f"pid {pid} (uid {uid}) is not process {rank} of this node"
            c.proc = self.hello(rank, cfg)
            with self._lock:
                c.proc.conn = c.sock
            return ""
        if word == "bye" and not fields:
            with self._lock:
                c.proc.done = True
            return ""
        if word == "rec":  # a finished recovery, for the metrics (metrics.recovery_line)
            if self.metrics is not None:
                try:
                    self.metrics.recovery(fields)
                except ValueError as e:
                    log.warning("node %d: ignoring a bad recovery report from rank %d: %s", self.node, c.proc.rank, e)
            return ""
        if word == "join" and len(fields) == 1 and self.joins is not None:
            try:
                rec = JoinRecord.from_entry(json.loads(fields[0]))
            except ValueError as e:
                return f"bad join {line[:80]!r}: {e}"
            if rec.rank != c.proc.rank:
                return f"a join record for rank {rec.rank} from rank {c.proc.rank}"
            reply = functools.partial(self._send_line, c.sock)
            if c.proc.done:  # a gone event named it (it said no bye: it is joining)
                self.joins.refuse(rec, reply, f"rank {rec.rank} was reported gone: {c.proc.gone_why or 'it ended'}")
            else:
                self.joins.submit(rec, reply)
            return ""
        if word != "hb" or len(fields) != 6:
            return f"unexpected line {line[:40]!r}"
        try:
            self.on_beat(c.proc, " ".join(fields), t)
        except ValueError as e:
            return f"bad heartbeat {line[:80]!r}: {e}"
        return ""

    def broadcast(self, line: str) -> None:
        """Send `line` to every connected process (a wedged one is dropped after 1 s)."""
        with self._lock:
            socks = [p.conn for p in self.procs.values() if p.conn is not None]
        for s in socks:
            try:
                self._send_line(s, line)
            except OSError as e:  # it closed or ended meanwhile (a wedged one: after 1 s)
                log.debug("node %d: could not send to a worker: %s", self.node, e)

    def _send_line(self, sock: socket.socket, line: str) -> None:
        with self._send_lock:
            sock.sendall((line + "\n").encode())

    def joining(self) -> int:
        """How many of this node's processes would join an epoch now: alive, past hello, not
        spares waiting (`joins.JoinBatcher` writes a batch once all of them sent theirs)."""
        with self._lock:
            return sum(1 for p in self.procs.values() if not p.done and p.cfg is not None and p.view.phase != "spare")

    # -- judging, the node record, the ring -----------------------------------------------

    def next_tick_in(self) -> float:
        return max(0.0, self._next_tick - time.monotonic())

    def tick(self) -> None:
        """Called by the loop when `next_tick_in()` is 0: at the workers' heartbeat, judge this
        node's processes; at the node heartbeat (TCPStore), write this node's record and read
        the successor's (on etcd the lease thread does that)."""
        t = time.monotonic()
        if t < self._next_tick:
            return
        node_beat = t >= self._next_node_beat and not self.lease_s
        if node_beat:
            self._next_node_beat = t + self.node_hb
        if t >= self._next_judge:
            self._judge(t)
        # Each on its own cadence: the workers' heartbeat may be slower than the node's.
        self._next_tick = self._next_judge if self.lease_s else min(self._next_judge, self._next_node_beat)
        if node_beat and not self.fenced:
            try:
                if not self._finished:
                    self.m.node_beat(self.node, self.record())
                with self._lock:
                    observers = list(self._observers)
                self._watch_successor(self.m, observers, t)
            except dist.DistError as e:
                self._lost(e)

    def _judge(self, t: float) -> None:
        """Judge this node's processes (at their heartbeat): silent ones, and stragglers that
        the others wait for."""
        self._next_judge = t + min([p.cfg.heartbeat_s for p in self.procs.values() if p.cfg] + [self.cfg.heartbeat_s])
        with self._lock:
            procs = [p for p in self.procs.values() if p.judged()]
        for p in procs:
            if p.view.seq >= 0 and p.view.changed_at < t:
                p.view.unchanged_reads += 1
        observers = [p.view for p in procs if p.view.phase in WAITING]
        with self._lock:
            self._observers = observers
        if self.metrics is not None:
            self._report_metrics(t, procs)
        if self.lease_s and not self.fenced:
            self._check_lease(t)
        if self.fenced:
            return  # cut off from the store: its view is stale and its reports could not land
        for p in procs:
            assert p.cfg is not None
            if p.view.phase == "done":
                continue  # finished: it leaves, and its exit is reported
            why = silence_why(p.view, t, p.cfg) or self._straggler(p.view, p.cfg, observers, t)
            if why:
                self._suspect([p.rank], why, time.time() - (t - p.view.changed_at))

    def _report_metrics(self, t: float, judged: list[Proc]) -> None:
        with self._lock:
            waiting = sum(1 for p in self.procs.values()
                          if not p.done and p.cfg is not None and p.view.phase == "spare" and not p.placed)
            lags = {p.rank: t - p.view.changed_at for p in judged if p.view.seq >= 0 and not p.done}
            self.metrics.heartbeats(lags, waiting)  # under the lock: `exited` forgets a rank's lag

    @staticmethod
    def _straggler(view: PeerView, cfg: DetectorConfig, observers: list[PeerView], t: float) -> str | None:
        return next((w for w in (straggler_why(view, o.step, o.phase, t, cfg) for o in observers if o is not view)
                     if w), None)

    def _suspect(self, ranks: list[int], why: str, failed_at: float, node: int | None = None,
                 m: Membership | None = None) -> None:
        with self._lock:
            for r in ranks:
                if r in self.procs:
                    self.procs[r].done = True
        gones = [Gone(r, "suspect", why, failed_at, f"agent {self.node}") for r in ranks]
        try:
            first = (m or self.m).report_gone_many(gones, node=node)
        except dist.DistError as e:
            self._lost(e)
            return
        if first:
            log.warning("node %d suspects %s %s: %s", self.node, "ranks" if len(first) > 1 else "rank",
                        ",".join(map(str, first)), why)

    def record(self) -> str:
        """This node's liveness record: a sequence number and, for every process it runs, the
        last beat of a judged one ("" for one not judged: it has not said hello yet, or is a
        spare still waiting). A lost node's report names them all."""
        self._seq += 1
        with self._lock:
            procs = {p.rank: [p.beat if p.judged() else "", *_cfg_fields(p.cfg or self.cfg)]
                     for p in self.procs.values() if not p.done}
        return json.dumps({"seq": self._seq, "procs": procs}, separators=(",", ":"))

    def finish(self) -> None:
        """Every process of this node has ended: a last record says so, so that the node's
        watcher moves on without suspecting it. The agent still watches its successor."""
        self._finished = True
        self._seq += 1
        if self.fenced or self.store_lost:
            return  # the call would only wait out the store's retry budget (10 s on etcd)
        try:
            self.m.node_beat(self.node, json.dumps({"seq": self._seq, "procs": {}, "done": True}))
        except dist.DistError as e:
            self._lost(e)

    def ring(self) -> set[int]:
        """The nodes on the ring: present (initial, or announced) and not gone."""
        with self._lock:
            return self.present - self.gone_nodes

    def successor(self) -> int | None:
        """The next node of the ring after this one. A node that is not present is never
        watched: it has no record, and the ring would stop at it."""
        ring = self.ring()
        for i in range(1, self.nnodes):
            n = (self.node + i) % self.nnodes
            if n in ring:
                return n
        return None

    def announce(self) -> None:
        """A capacity node joins the ring: once this node has a record (its predecessor, told
        by the event, must find one to watch), post a "node" event. Every agent's events
        thread adds the node to `present` (`_forward`), an agent that starts later too: each
        reads the events from the first."""
        if self.lease_s:  # etcd: the lease thread puts the first record, with the lease
            store: Any = self.m.store
            if not store.wait_for(self.m.key("node", self.node), self.lease_s, self._stop):
                log.warning("node %d: no record after %g s; announcing it anyway", self.node, self.lease_s)
        else:
            self.m.node_beat(self.node, self.record())
        self.m.announce_node(self.node)

    def _watch_successor(self, m: Membership, observers: list[PeerView], t: float) -> None:
        succ = self.successor()
        if succ != self._watched:
            self._watched, self._succ_view, self._succ_procs, self._succ_ranks = succ, PeerView(), {}, []
        if succ is None:
            return
        view = self._succ_view
        text = m.node_record(succ)
        # (A node that announced itself had a record: if its lease took it before this agent
        # read it once, the node is lost all the same, though which processes it ran is unknown.)
        if text is None and (view.seq >= 0 or succ in self._announced) and self.lease_s:
            why = (f"node {succ}'s lease ({self.lease_s:g} s) expired: its agent stopped renewing it "
                   "(the node is lost or cut off from the store)")
            if view.seq < 0:
                log.warning("node %d: %s before its record was read once: the ring goes on past it", self.node, why)
            self._suspect(self._succ_ranks, why, time.time() - self.lease_s, node=succ, m=m)
            with self._lock:
                self.gone_nodes.add(succ)
            return
        if text is not None:
            try:
                rec = json.loads(text)
                seq, procs = int(rec["seq"]), rec["procs"]
                if rec.get("done"):
                    with self._lock:
                        self.gone_nodes.add(succ)  # it ended: watch the next one
                    return
                if seq != view.seq:
                    view.seq, view.changed_at, view.unchanged_reads = seq, t, 0
                    self._succ_ranks = sorted(int(r) for r in procs)
                    for r, (beat, silence, straggler, factor, reads) in procs.items():
                        if not beat:
                            continue
                        rp = self._succ_procs.get(int(r))
                        if rp is None:  # its bounds are read once, not at every record
                            cfg = DetectorConfig(silence_floor_s=silence, straggler_floor_s=straggler,
                                                 slow_factor=factor, min_silent_reads=int(reads))
                            rp = self._succ_procs[int(r)] = RemoteProc(PeerView(changed_at=t), cfg)
                        rp.view.update(beat, t)
                else:
                    view.unchanged_reads += 1
            except (ValueError, KeyError, TypeError) as e:
                log.warning("node %d: node %d's record is malformed (%s): ignored", self.node, succ, e)
                return
        if view.seq < 0:
            return  # not started yet: a node that never starts is the launchers' business
        silent = t - view.changed_at
        bound = max(self.cfg.silence_floor_s, self.cfg.min_silent_reads * self.node_hb)
        if not self.lease_s and silent > bound and view.unchanged_reads >= self.cfg.min_silent_reads:
            # (On etcd the lease's expiry is the evidence, above: a silent record alone is not.)
            why = f"node {succ} silent for {silent:.2f} s > bound {bound:.2f} s (its agent and record stopped)"
            self._suspect(self._succ_ranks, why, time.time() - silent, node=succ, m=m)
            with self._lock:
                self.gone_nodes.add(succ)
            return
        for r, rp in list(self._succ_procs.items()) if observers else ():  # stragglers: only if some wait
            late = self._straggler(rp.view, rp.cfg, observers, t)
            if late:
                del self._succ_procs[r]  # reported once
                self._suspect([r], f"{late} (seen by node {self.node})", time.time() - (t - rp.view.changed_at), m=m)

    # -- events ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the events and joins threads (their own store connections), and on etcd the
        lease thread."""
        self.joins = JoinBatcher(self.m, self.joining)
        self._events_thread = threading.Thread(target=self._events_loop, name="rc-agent-events", daemon=True)
        self._events_thread.start()
        if self.lease_s:
            self._lease_thread = threading.Thread(target=self._lease_loop, name="rc-agent-lease", daemon=True)
            self._lease_thread.start()
            self._fence_thread = threading.Thread(target=self._fence_loop, name="rc-agent-fence", daemon=True)
            self._fence_thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._lease_wake.set()
        # On a TCPStore the events thread blocks in a wait that only the store can end: it is
        # woken (`wake_event_waiters`). On etcd its watch is woken, unless the thread is
        # inside a store call retrying an unreachable store (10 s): a launcher whose store is
        # gone does not wait for that (the thread is a daemon, in Python code).
        # A wake that lands before the thread's wait begins is lost: it is repeated.
        th = self._events_thread
        end = time.monotonic() + 2.0
        while th is not None and th.is_alive() and time.monotonic() < end:
            if self._events_watch is not None:
                self._events_watch.wake()
            elif not self.m.watches and not self.store_lost:
                try:
                    self.m.wake_event_waiters(self._next_event)
                except dist.DistError:
                    pass  # the store is gone: so is the thread's wait
            th.join(timeout=0.1)
        for th in (self._lease_thread, self._fence_thread):
            if th is not None and th.is_alive():
                th.join()
        if self.joins is not None:
            self.joins.close()
        for c in list(self._conns):
            self._close(c)
        if self._listener is not None:
            if self._unregister is not None:
                self._unregister(self._listener)
            self._listener.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _lost(self, e: BaseException) -> None:
        """The store failed a call. A TCPStore does not come back: the workers are told. On etcd
        another endpoint may answer the next call; the lease decides (`_lease_loop`)."""
        if self.lease_s:
            log.warning("node %d: a store call failed (%s); the lease thread fences the node if it lasts", self.node, e)
            return
        if self.store_lost is None and not self._stop.is_set():
            self.store_lost = f"node {self.node}'s agent lost the store: {e}"
            log.error("%s", self.store_lost)
            self.broadcast(f"lost {self.store_lost}")

    def _fence(self, why: str) -> None:
        with self._lock:
            if self.fenced is not None:
                return
            self.fenced = why
        log.error("node %d fenced: %s", self.node, why)
        self.broadcast(f"fence {why}")

    def _check_lease(self, t: float) -> None:
        """Fencing (a thread of its own, `_fence_loop`, and the loop's tick): the lease expires on the
        store at the earliest `lease_s` after the last keepalive it answered, so a node that
        has had no answer for `lease_s` minus a margin stops its workers before the others can
        see it gone and decide without them."""
        silent = t - self._last_ok
        if silent > self._fence_after_s():
            self._fence(f"node {self.node}'s agent could not reach a store majority for {silent:.1f} s (its "
                        f"lease is {self.lease_s:g} s): its workers stop so that the others can go on without them")

    def _fence_after_s(self) -> float:
        return self.lease_s - min(0.5, self.lease_s / 6)

    def _lease_loop(self) -> None:
        """etcd: grant the node's lease, rewrite its record with it, watch the successor; the
        keepalives have a thread of their own (`_keepalive_loop`)."""
        m = self.m.clone(timeout=datetime.timedelta(seconds=self.lease_s))
        store: Any = m.store
        period = self.lease_s / 3
        lease = None
        keeper: threading.Thread | None = None
        while not self._stop.is_set():
            t0 = time.monotonic()
            self._lease_wake.clear()
            try:
                if lease is None:
                    lease = store.grant(int(self.lease_s))
                    self._last_ok = store.answered_sent_at
                    keeper = threading.Thread(target=self._keepalive_loop, args=(lease,), name="rc-agent-keepalive",
                                              daemon=True)
                    keeper.start()
                if self._finished:
                    store.set(m.key("node", self.node), json.dumps({"seq": self._seq + 1, "procs": {}, "done": True}))
                else:
                    store.put_with_lease(m.key("node", self.node), self.record(), lease)
                with self._lock:
                    observers = list(self._observers)
                self._watch_successor(m, observers, time.monotonic())
                self._successor_watch(store, m)
            except dist.DistError as e:
                if "lease not found" in str(e):  # an answer: the store let the lease expire
                    self._fence(f"node {self.node}'s lease expired on the store (its record was refused: {e})")
                    break  # a new lease would bring back a node the others may have decided without
                log.warning("node %d: no store majority for %.1f s (%s)", self.node, time.monotonic() - self._last_ok, e)
            self._lease_wake.wait(max(0.0, jittered(period) - (time.monotonic() - t0)))
        if self.succ_watch is not None:
            self.succ_watch.close()
        if keeper is not None:
            keeper.join()

    def _successor_watch(self, store: Any, m: Membership) -> None:
        """etcd: the stream that wakes the lease loop when the successor's record is deleted
        (its lease expired), moved to the new successor when the ring changes: the loss is
        then read at once, not up to a third of the lease later."""
        with self._lock:
            succ = None if self._watched in self.gone_nodes else self._watched
        key = None if succ is None else m.key("node", succ)
        if self.succ_watch is not None and self.succ_watch.key != key:
            old, self.succ_watch = self.succ_watch, None
            old.close()
        if self.succ_watch is None and key is not None:
            self.succ_watch = DeleteWatch(store, key, self._lease_wake.set)

    def _fence_loop(self) -> None:
        """etcd: checks the lease on a thread that makes no store call. The loop's
        tick also checks, but the launcher's own store calls (reporting an exit, reading the
        membership) block that loop for up to the store's retry budget (10 s): a node cut off
        from the store went on training long past its lease."""
        while not self._stop.is_set() and self.fenced is None:
            t = time.monotonic()
            self._check_lease(t)
            # Asleep until the moment it would fence if no answer came meanwhile (`_last_ok`
            # only grows): not every 100 ms, which at 2,048 emulated agents was 20,000 wake-ups
            # a second.
            self._stop.wait(max(0.01, self._last_ok + self._fence_after_s() - t + 0.01))

    def _keepalive_loop(self, lease: int) -> None:
        """etcd: refresh the lease every `lease_s` / 6 on a connection of its own. Never behind
        the record's put or the successor's read: during an election those can each take
        seconds, and a keepalive waiting behind them let a healthy node's lease run out (it
        was fenced). `_last_ok` is the send time of the last refresh answered."""
        m = self.m.clone(timeout=datetime.timedelta(seconds=self.lease_s / 2))
        store: Any = m.store
        period = self.lease_s / 6
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                if store.keepalive(lease) <= 0:
                    self._fence(f"node {self.node}'s lease expired before the store heard from it again")
                    return
                sent = store.answered_sent_at
                # A keepalive is no proof of a majority: etcd's leader renews leases on its own,
                # and a leader cut off with this node went on renewing them until it stepped
                # down (the node was fenced 21 s after the cut, its lease 8 s). A linearizable
                # read is answered only by a majority.
                store.value(m.key("node", self.node))
                self._last_ok = max(self._last_ok, sent)
            except dist.DistError as e:
                log.warning("node %d: lease keepalive: no store majority for %.1f s (%s)", self.node,
                            time.monotonic() - self._last_ok, e)
            self._stop.wait(max(0.0, jittered(period) - (time.monotonic() - t0)))

    def _events_loop(self) -> None:
        # Waits for the next event's key. TCPStore: a wait the store answers when the key is
        # written (no timeout that would log every second; every agent wakes from the poster's
        # one write). etcd: one watch stream on the events, open for the agent's life (no
        # request per wait), each wait bounded so that `stop` is seen.
        m = self.m.clone(timeout=datetime.timedelta(days=1))
        try:
            self._events(m)
        finally:
            if self._events_watch is not None:
                self._events_watch.close()

    def _events(self, m: Membership) -> None:
        while not self._stop.is_set():
            try:
                if m.watches:
                    if self._events_watch is None:
                        # (Its backstop read, every 2 s of waiting, scales with a long lease: at
                        # thousands of nodes those reads would be most of the store's load.)
                        self._events_watch = PrefixWatch(m.store, m.key("events", ""), max(2.0, self.lease_s / 6))
                    if not self._events_watch.wait_for(m.key("events", self._next_event), 10.0, self._stop):
                        continue
                else:
                    m.wait_event(self._next_event)
                if self._stop.is_set():
                    return
                # One event per wake-up: the wait for the next one answers at once if it is
                # there (a check first would cost every node one more round trip per event);
                # on etcd the watch brought the event's value (no request at all).
                key, watch = m.key("events", self._next_event), self._events_watch
                if (ev := m.event(self._next_event, watch.value(key) if watch else None)) is not None:
                    self._next_event += 1
                    self._forward(m, ev)
                    if ev.get("kind") == "finished":
                        return  # every member finished: no event after it concerns this node
            except dist.DistError as e:
                if self._stop.is_set():
                    return
                if not m.watches and self._answers(m):
                    continue  # a day without an event: the wait's own bound
                self._lost(e)
                if not m.watches:
                    return
                self._stop.wait(0.5)  # etcd: every endpoint failed this time; try again

    def _answers(self, m: Membership) -> bool:
        try:
            m.store.check([m.key("events", self._next_event)])
            return True
        except dist.DistError:
            return False

    @property
    def events_read(self) -> int:
        """How many events the events thread has read (a capacity node's launcher looks at
        the membership when it grows)."""
        return self._next_event

    def _forward(self, m: Membership, ev: dict[str, Any]) -> None:
        try:
            kind = ev["kind"]
            if kind == "node":  # a capacity node joined the ring: news for agents, not workers
                with self._lock:
                    self.present.add(int(ev["node"]))
                    self._announced.add(int(ev["node"]))
                return
            if kind == "malformed":
                return  # logged by the membership: nothing to forward
            if kind == "gone":
                ranks = [int(r) for r in ev["ranks"]]  # (their evidence is in the event: no read)
                gones = [Gone.from_dict(g) for g in ev.get("gone", [])]  # refused here if malformed
                with self._lock:
                    for g in gones:
                        if g.rank in self.procs:
                            self.procs[g.rank].gone_why = g.detail  # (the answer to its join)
                    if ev.get("node") is not None:
                        self.gone_nodes.add(int(ev["node"]))
                    for r in ranks:
                        if r in self.procs:
                            self.procs[r].done = True
            elif kind == "decided":
                with self._lock:
                    for r in ev["joiners"]:
                        if int(r) in self.procs:
                            self.procs[int(r)].placed = True
            line = "ev " + json.dumps(ev, separators=(",", ":"))
        except (KeyError, TypeError, ValueError) as e:
            log.warning("node %d: event %d is malformed (%s): ignored", self.node, self._next_event - 1, e)
            return
        joins = self.joins if kind == "gone" else None
        if joins is not None:
            joins.expect()  # this thread writes the join records its workers send now (`JoinBatcher`)
        self.broadcast(line)
        if joins is not None:
            joins.help(joins.window_s, m)


__all__ = ["ENV_AGENT", "MAX_LINE", "NodeAgent", "Proc", "hello_line", "node_heartbeat_s", "parse_hello"]
