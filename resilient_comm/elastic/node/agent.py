"""The node agent: each node's ``resilient-run`` watches its own processes and speaks for them.

Workers never touch the store per heartbeat. What each side does (docs/elastic.md, "Node
agents"):

- **Workers** (and waiting spares) beat over a node-local Unix socket every
  ``heartbeat_s`` (~100 ms). The agent applies the dead-vs-slow bounds (`model.bounds`) to
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
  node's records in one request (`join_batcher.JoinBatcher`): one transaction per node per
  failure, not per rank.

Runs in each node's ``resilient-run`` (`node.launcher`). The socket's lines: `model.channel`;
its trust rule: `node.channel`; the ring: `node.ring`; the lease: `node.lease`; the events
thread: `node.events`.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed as dist

from resilient_comm.config import knob_s
from resilient_comm.elastic.membership.protocol import Membership
from resilient_comm.elastic.model.bounds import (
    WAITING,
    DetectorConfig,
    silence_why,
    straggler_among,
)
from resilient_comm.elastic.model.channel import parse_hello
from resilient_comm.elastic.model.records import Gone, JoinRecord
from resilient_comm.elastic.node.channel import ChannelServer, Conn, ancestors, peer_cred
from resilient_comm.elastic.node.events import EventForwarder
from resilient_comm.elastic.node.join_batcher import JoinBatcher
from resilient_comm.elastic.node.lease import NodeLease
from resilient_comm.elastic.node.ring import SuccessorWatch
from resilient_comm.elastic.node.view import NodeView, Proc

log = logging.getLogger("resilient_comm.agent")


def node_heartbeat_s() -> float:
    return knob_s("RESILIENT_COMM_NODE_HEARTBEAT_MS", 0)


def node_lease_s() -> float:
    return knob_s("RESILIENT_COMM_NODE_LEASE_MS", 2000)  # etcd's shortest lease is about 2 s


class NodeAgent:
    """Detection for one node. Threads: the launcher's loop calls `add`, `exited`, `tick` and
    the socket callbacks; the events thread (`start`) forwards events. `broadcast` may be
    called from either; `stop` from the launcher's loop.

    Its parts: `nodes` (its processes and the ring's nodes, under one lock), `channel` (the
    socket), `succ` (the ring successor's record, judged), `events` (the events thread),
    `lease` (etcd: the node's lease and fencing) and `joins` (the join batcher)."""

    def __init__(
        self,
        membership: Membership,
        node: int,
        nnodes: int,
        *,
        nproc: int,
        config: DetectorConfig | None = None,
        node_heartbeat: float | None = None,
        register: Callable[[Any, Callable[[], None]], object] | None = None,
        unregister: Callable[[Any], object] | None = None,
        lease_s: float | None = None,
        present: Iterable[int] | None = None,
    ) -> None:
        """`register(fileobj, callback)` / `unregister(fileobj)` put the socket and its
        connections in the caller's event loop (the launcher's selector); without them the
        agent has no socket (the benchmark feeds beats by `on_beat`). `nnodes` is the most
        nodes the job may have; `present` the nodes that are there from the start (default:
        all of them), the others join the ring when they `announce` themselves."""
        self.m, self.node, self.nnodes, self.nproc = membership, node, nnodes, nproc
        self.cfg = config or DetectorConfig.from_env()
        self.node_hb = node_heartbeat or node_heartbeat_s()
        # On etcd, node liveness is a lease (`lease`); on a TCPStore, a record rewritten by
        # `tick` whose silence is judged.
        self.lease_s = lease_s or node_lease_s() if membership.watches else 0.0
        # Why this node's processes were told to leave: cut off from the store (`lease`), or
        # the node left the job (`leave`).
        self.fenced: str | None = None
        self.store_lost: str | None = None
        self.nodes = NodeView(node, nnodes, present)
        self.procs, self.gone_nodes, self.present = (
            self.nodes.procs,
            self.nodes.gone_nodes,
            self.nodes.present,
        )
        self._lock = self.nodes.lock  # procs' connections, gone_nodes and present: both threads
        self._send_lock = threading.Lock()  # whole lines to a worker from the events and joins threads
        self.metrics: Any = None  # a node.metrics.NodeMetrics (resilient-run --metrics-port), or None
        self.joins: JoinBatcher | None = None  # (`start`)
        self._finished = False
        self.outages: list[float] = []  # store outages ridden out, in seconds (`NodeLease`)
        self._seq = 0
        self._next_tick = time.monotonic()
        self._next_node_beat = self._next_tick
        self._next_judge = self._next_tick
        self._stop = threading.Event()
        self.succ = SuccessorWatch(self.nodes, self.cfg, self.node_hb, self.lease_s, self._suspect)
        # (Through the agent's own methods: a subclass, the benchmark's, overrides them.)
        self.events = EventForwarder(
            membership,
            self.nodes,
            self.lease_s,
            self._stop,
            lambda line: self.broadcast(line),
            self._lost,
            lambda: self.joins,
        )
        self.lease = (
            NodeLease(
                membership,
                node,
                self.lease_s,
                self._stop,
                self._lease_record,
                self._lease_successor,
                self._fence,
                lambda: self.fenced,
                self._rode_out,
            )
            if self.lease_s
            else None
        )
        self.channel = (
            ChannelServer(node, register, unregister, self._line, self._closed)
            if register is not None
            else None
        )
        self.path = self.channel.path if self.channel is not None else ""

    def _rode_out(self, seconds: float) -> None:
        """A store outage the node rode out (`NodeLease`): counted where metrics are served."""
        self.outages.append(seconds)
        if self.metrics is not None:
            self.metrics.outage(seconds)

    # -- processes ------------------------------------------------------------------------

    def add(self, rank: int, pid: int) -> None:
        self.nodes.add(rank, pid)

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
        if conn is not None and self.channel is not None:
            self.channel.close_socket(conn)

    def hello(self, rank: int, cfg: DetectorConfig) -> Proc:
        """A process said hello (the benchmark calls this directly)."""
        return self.nodes.hello(rank, cfg)

    def on_beat(self, p: Proc, text: str, t: float) -> None:
        p.beat = text
        p.view.update(text, t)

    def joining(self) -> int:
        """How many of this node's processes would join an epoch now (`NodeView.joining`)."""
        return self.nodes.joining()

    # -- the socket's lines ---------------------------------------------------------------

    def _closed(self, c: Conn) -> None:
        with self._lock:
            if c.proc is not None and c.proc.conn is c.sock:
                c.proc.conn = None

    def _line(self, c: Conn, line: bytes, t: float) -> str:
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
        if word == "rec":  # a finished recovery, for the metrics (model.channel.recovery_line)
            if self.metrics is not None:
                try:
                    self.metrics.recovery(fields)
                except ValueError as e:
                    log.warning(
                        "node %d: ignoring a bad recovery report from rank %d: %s", self.node, c.proc.rank, e
                    )
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
                self.joins.refuse(
                    rec, reply, f"rank {rec.rank} was reported gone: {c.proc.gone_why or 'it ended'}"
                )
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
                self._watch_successor(self.m, t)
            except dist.DistError as e:
                self._lost(e)

    def _judge(self, t: float) -> None:
        """Judge this node's processes (at their heartbeat): silent ones, and stragglers that
        the others wait for."""
        self._next_judge = t + min(
            [p.cfg.heartbeat_s for p in self.procs.values() if p.cfg] + [self.cfg.heartbeat_s]
        )
        with self._lock:
            procs = [p for p in self.procs.values() if p.judged()]
        for p in procs:
            if p.view.seq >= 0 and p.view.changed_at < t:
                p.view.unchanged_reads += 1
        observers = [p.view for p in procs if p.view.phase in WAITING]
        with self._lock:
            self.nodes.observers = observers
        if self.metrics is not None:
            self._report_metrics(t, procs)
        if self.lease is not None and not self.fenced:
            self.lease.check(t)
        if self.fenced:
            return  # cut off from the store: its view is stale and its reports could not land
        for p in procs:
            assert p.cfg is not None
            if p.view.phase == "done":
                continue  # finished: it leaves, and its exit is reported
            why = silence_why(p.view, t, p.cfg) or straggler_among(p.view, p.cfg, observers, t)
            if why:
                self._suspect([p.rank], why, time.time() - (t - p.view.changed_at))

    def _report_metrics(self, t: float, judged: list[Proc]) -> None:
        with self._lock:
            waiting = sum(
                1
                for p in self.procs.values()
                if not p.done and p.cfg is not None and p.view.phase == "spare" and not p.placed
            )
            lags = {p.rank: t - p.view.changed_at for p in judged if p.view.seq >= 0 and not p.done}
            self.metrics.heartbeats(lags, waiting)  # under the lock: `exited` forgets a rank's lag

    def _suspect(
        self,
        ranks: list[int],
        why: str,
        failed_at: float,
        node: int | None = None,
        m: Membership | None = None,
        kind: str = "suspect",
    ) -> None:
        self.nodes.mark_done(ranks)
        gones = [Gone(r, kind, why, failed_at, f"agent {self.node}") for r in ranks]
        try:
            first = (m or self.m).report_gone_many(gones, node=node)
        except dist.DistError as e:
            self._lost(e)
            return
        if first:
            log.warning(
                "node %d %s %s %s: %s",
                self.node,
                "suspects" if kind == "suspect" else "reports gone",
                "ranks" if len(first) > 1 else "rank",
                ",".join(map(str, first)),
                why,
            )

    def record(self) -> str:
        """This node's liveness record (`NodeView.record`), with the next sequence number."""
        self._seq += 1
        return self.nodes.record(self._seq, self.cfg)

    def finish(self) -> None:
        """Every process of this node has ended: a last record says so, so that the node's
        watcher moves on without suspecting it. The agent still watches its successor."""
        self._finished = True
        self._seq += 1
        if self.fenced or self.store_lost:
            return  # the call would only wait out the store's retry budget (10 s on etcd)
        try:
            self.m.node_beat(self.node, self._done_record(self._seq))
        except dist.DistError as e:
            self._lost(e)

    def _done_record(self, seq: int) -> str:
        return json.dumps({"seq": seq, "procs": {}, "done": True})

    def ring(self) -> set[int]:
        """The nodes on the ring: present (initial, or announced) and not gone."""
        return self.nodes.ring()

    def successor(self) -> int | None:
        """The next node of the ring after this one (`NodeView.successor`)."""
        return self.nodes.successor()

    def announce(self) -> None:
        """A capacity node joins the ring: once this node has a record (its predecessor, told
        by the event, must find one to watch), post a "node" event. Every agent's events
        thread adds the node to `present` (`EventForwarder`), an agent that starts later too:
        each reads the events from the first."""
        if self.lease_s:  # etcd: the lease thread puts the first record, with the lease
            store: Any = self.m.store
            if not store.wait_for(self.m.key("node", self.node), self.lease_s, self._stop):
                log.warning("node %d: no record after %g s; announcing it anyway", self.node, self.lease_s)
        else:
            self.m.node_beat(self.node, self.record())
        self.m.announce_node(self.node)

    def _watch_successor(self, m: Membership, t: float) -> None:
        with self._lock:
            observers = list(self.nodes.observers)
        self.succ.check(m, observers, t)

    def _lease_record(self) -> tuple[str, bool]:
        """(etcd) The record the lease thread puts now, and whether with the lease: a finished
        node's last record is not leased (its watcher must read that it ended)."""
        if self._finished:
            return self._done_record(self._seq + 1), False
        return self.record(), True

    def _lease_successor(self, m: Membership) -> int | None:
        """(etcd) Read and judge the successor through `m`; whose record to watch for its
        deletion (None: none, or one already gone)."""
        self._watch_successor(m, time.monotonic())
        with self._lock:
            return None if self.succ.watched in self.gone_nodes else self.succ.watched

    # -- threads, and the store lost ------------------------------------------------------

    @property
    def events_read(self) -> int:
        """How many events the events thread has read (a capacity node's launcher looks at
        the membership when it grows)."""
        return self.events.read

    def start(self) -> None:
        """Start the events and joins threads (their own store connections), and on etcd the
        lease threads."""
        self.joins = JoinBatcher(self.m, self.joining)
        self.events.start()
        if self.lease is not None:
            self.lease.start()

    def stop(self) -> None:
        self._stop.set()
        if self.lease is not None:
            self.lease.wake()
        self.events.stop(store_lost=bool(self.store_lost))
        if self.lease is not None:
            self.lease.join()
        if self.joins is not None:
            self.joins.close()
        if self.channel is not None:
            self.channel.shutdown()

    def _lost(self, e: BaseException) -> None:
        """The store failed a call. A TCPStore does not come back: the workers are told. On etcd
        another endpoint may answer the next call; the lease decides (`node.lease`)."""
        if self.lease_s:
            log.warning(
                "node %d: a store call failed (%s); the lease thread fences the node if it lasts",
                self.node,
                e,
            )
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

    def leave(self, why: str) -> None:
        """The node leaves the job at once, as a lost node (its health check failed,
        `node.health`; the launcher's loop calls this). Its processes are told ``fence``, as
        when the node is cut off: they leave (``Evicted``) and its agent judges and beats no
        more. Then, its store still answering, it reports every process it runs gone in one
        event that names the node -- the report its ring predecessor would make after the
        node bound or the lease, made now: the others decide without it at once, and drop it
        from the ring."""
        with self._lock:
            if self.fenced is not None:
                return
            self.fenced = why
            ranks = sorted(r for r, p in self.procs.items() if not p.done)
        log.error("node %d leaves the job as a lost node: %s", self.node, why)
        self.broadcast(f"fence {why}")
        self._suspect(ranks, why, time.time(), node=self.node, kind="unhealthy")


__all__ = ["NodeAgent", "node_heartbeat_s", "node_lease_s"]
