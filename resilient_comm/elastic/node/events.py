"""The node agent's events thread: every membership event (a rank gone, a decision
published, a node joining the ring, the job finished) reaches each agent once, and the agent
forwards it to its processes. Runs in the node agent (``resilient-run``), on a thread of its
own with its own store connection.

Every agent waits for the next event's key: on a TCPStore a wait the store answers for all
its waiters when the poster writes the key, so posting costs one write whatever the number
of nodes; on etcd one watch stream (`PrefixWatch`) open for the agent's life.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import torch.distributed as dist

from resilient_comm.elastic.membership.etcd.watch import PrefixWatch
from resilient_comm.elastic.membership.protocol import Membership
from resilient_comm.elastic.model.records import Gone
from resilient_comm.elastic.node.join_batcher import JoinBatcher
from resilient_comm.elastic.node.view import NodeView

log = logging.getLogger("resilient_comm.agent")


class EventForwarder:
    """Reads the events in order (`read`: how many so far) and forwards each: marks what it
    says on `nodes`, then `broadcast(line)` to the node's processes. `joins()` is the agent's
    join batcher: after a gone event this thread writes the joins its workers send
    (`JoinBatcher.help`). `lost(e)`: a store call failed."""

    def __init__(
        self,
        m: Membership,
        nodes: NodeView,
        lease_s: float,
        stop: threading.Event,
        broadcast: Callable[[str], None],
        lost: Callable[[BaseException], None],
        joins: Callable[[], JoinBatcher | None],
    ) -> None:
        self.m, self.nodes, self.lease_s = m, nodes, lease_s
        self._stop = stop
        self._broadcast, self._lost, self._joins = broadcast, lost, joins
        self.next_event = 0
        self.watch: PrefixWatch | None = None  # etcd: the thread's watch stream
        self._thread: threading.Thread | None = None

    @property
    def read(self) -> int:
        return self.next_event

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="rc-agent-events", daemon=True)
        self._thread.start()

    def stop(self, store_lost: bool) -> None:
        """End the thread (the agent's `stop` is set). On a TCPStore it blocks in a wait that
        only the store can end: it is woken (`wake_event_waiters`). On etcd its watch is
        woken, unless the thread is inside a store call retrying an unreachable store (10 s):
        a launcher whose store is gone does not wait for that (the thread is a daemon, in
        Python code). A wake that lands before the thread's wait begins is lost: it is
        repeated."""
        th = self._thread
        end = time.monotonic() + 2.0
        while th is not None and th.is_alive() and time.monotonic() < end:
            if self.watch is not None:
                self.watch.wake()
            elif not self.m.watches and not store_lost:
                try:
                    self.m.wake_event_waiters(self.next_event)
                except dist.DistError:
                    pass  # the store is gone: so is the thread's wait
            th.join(timeout=0.1)

    def _loop(self) -> None:
        # Waits for the next event's key. TCPStore: a wait the store answers when the key is
        # written (no timeout that would log every second; every agent wakes from the poster's
        # one write). etcd: one watch stream on the events, open for the agent's life (no
        # request per wait), each wait bounded so that `stop` is seen.
        m = self.m.clone(timeout=datetime.timedelta(days=1))
        try:
            self._events(m)
        finally:
            if self.watch is not None:
                self.watch.close()

    def _events(self, m: Membership) -> None:
        while not self._stop.is_set():
            try:
                if m.watches:
                    if self.watch is None:
                        # (Its backstop read, every 2 s of waiting, scales with a long lease: at
                        # thousands of nodes those reads would be most of the store's load.)
                        self.watch = PrefixWatch(
                            cast(Any, m.store), m.key("events", ""), max(2.0, self.lease_s / 6)
                        )
                    if not self.watch.wait_for(m.key("events", self.next_event), 10.0, self._stop):
                        continue
                else:
                    m.wait_event(self.next_event)
                if self._stop.is_set():
                    return
                # One event per wake-up: the wait for the next one answers at once if it is
                # there (a check first would cost every node one more round trip per event);
                # on etcd the watch brought the event's value (no request at all).
                key, watch = m.key("events", self.next_event), self.watch
                if (ev := m.event(self.next_event, watch.value(key) if watch else None)) is not None:
                    self.next_event += 1
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
            m.store.check([m.key("events", self.next_event)])
            return True
        except dist.DistError:
            return False

    def _forward(self, m: Membership, ev: dict[str, Any]) -> None:
        nodes = self.nodes
        try:
            kind = ev["kind"]
            if kind == "node":  # a capacity node joined the ring: news for agents, not workers
                nodes.node_joined(int(ev["node"]))
                return
            if kind == "malformed":
                return  # logged by the membership: nothing to forward
            if kind == "gone":
                ranks = [int(r) for r in ev["ranks"]]  # (their evidence is in the event: no read)
                gones = [Gone.from_dict(g) for g in ev.get("gone", [])]  # refused here if malformed
                with nodes.lock:
                    for g in gones:
                        if g.rank in nodes.procs:
                            nodes.procs[g.rank].gone_why = g.detail  # (the answer to its join)
                    if ev.get("node") is not None:
                        nodes.gone_nodes.add(int(ev["node"]))
                    for r in ranks:
                        if r in nodes.procs:
                            nodes.procs[r].done = True
            elif kind == "decided":
                with nodes.lock:
                    for r in ev["joiners"]:
                        if int(r) in nodes.procs:
                            nodes.procs[int(r)].placed = True
            line = "ev " + json.dumps(ev, separators=(",", ":"))
        except (KeyError, TypeError, ValueError) as e:
            log.warning("node %d: event %d is malformed (%s): ignored", nodes.node, self.next_event - 1, e)
            return
        joins = self._joins() if kind == "gone" else None
        if joins is not None:
            joins.expect()  # this thread writes the join records its workers send now (`JoinBatcher`)
        self._broadcast(line)
        if joins is not None:
            joins.help(joins.window_s, m)


__all__ = ["EventForwarder"]
