"""etcd only: a node's liveness as a lease, and fencing. Runs in the node agent
(``resilient-run``) on threads of its own (`NodeLease.start`): the lease thread grants the
lease and rewrites the node's record with it (``RESILIENT_COMM_NODE_LEASE_MS``), the
keepalive thread refreshes it, and the fence thread checks it.

**Fencing**: an agent whose last keepalive the store answered is older than its lease (less
a margin) tells its workers ``fence``; they raise ``Evicted`` before the others can see the
lease expire and decide without them.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from resilient_comm.elastic.membership.etcd.store import jittered
from resilient_comm.elastic.membership.etcd.watch import DeleteWatch
from resilient_comm.elastic.membership.protocol import Membership

log = logging.getLogger("resilient_comm.agent")

# After a link comes back, how long the store may take to answer the keepalive (a request sent
# anew on a fresh connection: a round trip and a linearizable read; measured 0.1-0.3 s on the
# loaded test machine, namespaces on a bridge).
ANSWER_AFTER_LINK_S = 0.5


def fence_after_s(lease_s: float) -> float:
    """A node whose store went this long without answering its keepalive fences itself: the
    lease, less a margin (the store may drop the lease as soon as it ends)."""
    return lease_s - min(0.5, lease_s / 6)


def tolerated_outage_s(lease_s: float) -> float:
    """The longest outage of a node's link (or of its store) that is guaranteed to cost
    nothing: no fence, no eviction. The fence judges the time since the last keepalive the
    store answered; when the link goes down that one may already be up to a keepalive period
    (a sixth of the lease) old, and when it comes back the next answer takes up to
    `ANSWER_AFTER_LINK_S`. Longer outages up to `fence_after_s` may be ridden out too, by luck
    of timing; longer than the lease, the node is the partition it is (docs/elastic.md,
    "Link flaps")."""
    return fence_after_s(lease_s) - lease_s / 6 - ANSWER_AFTER_LINK_S


class NodeLease:
    """The lease of node `node` on etcd. Its collaborators are the agent's: `record()` the
    record to put now and whether it goes with the lease (a finished node's last one does
    not: it must outlive the lease); `watch_successor(m)` reads the ring successor through
    `m` (`SuccessorWatch.check`) and returns whose record to watch for its deletion;
    `fence(why)` cuts the node off (once); `fenced()` whether it is; `rode_out(seconds)` is told
    of every store outage the node rode out (answered again before it fenced)."""

    def __init__(
        self,
        m: Membership,
        node: int,
        lease_s: float,
        stop: threading.Event,
        record: Callable[[], tuple[str, bool]],
        watch_successor: Callable[[Membership], int | None],
        fence: Callable[[str], None],
        fenced: Callable[[], str | None],
        rode_out: Callable[[float], None] | None = None,
    ) -> None:
        self.m, self.node, self.lease_s = m, node, lease_s
        self._rode_out = rode_out
        self._stop = stop
        self._record, self._watch_successor = record, watch_successor
        self._fence, self._fenced = fence, fenced
        self.last_ok = time.monotonic()  # the last keepalive the store answered (its send time)
        self._wake = threading.Event()  # the lease loop's wait ends (stop, the successor's record deleted)
        self.succ_watch: DeleteWatch | None = None  # the lease loop's watch of the successor's record
        self.thread: threading.Thread | None = None
        self._fence_thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._lease_loop, name="rc-agent-lease", daemon=True)
        self.thread.start()
        self._fence_thread = threading.Thread(target=self._fence_loop, name="rc-agent-fence", daemon=True)
        self._fence_thread.start()

    def wake(self) -> None:
        """End the lease loop's wait now (the agent stops: set its `stop` first)."""
        self._wake.set()

    def join(self) -> None:
        for th in (self.thread, self._fence_thread):
            if th is not None and th.is_alive():
                th.join()

    def check(self, t: float) -> None:
        """Fencing (a thread of its own, `_fence_loop`, and the loop's tick): the lease expires on the
        store at the earliest `lease_s` after the last keepalive it answered, so a node that
        has had no answer for `lease_s` minus a margin stops its workers before the others can
        see it gone and decide without them."""
        silent = t - self.last_ok
        if silent > self._fence_after_s():
            self._fence(
                f"node {self.node}'s agent could not reach a store majority for {silent:.1f} s (its "
                f"lease is {self.lease_s:g} s): its workers stop so that the others can go on without them"
            )

    def _fence_after_s(self) -> float:
        return fence_after_s(self.lease_s)

    def _lease_loop(self) -> None:
        """Grant the node's lease, rewrite its record with it, watch the successor; the
        keepalives have a thread of their own (`_keepalive_loop`)."""
        m = self.m.clone(timeout=datetime.timedelta(seconds=self.lease_s))
        store: Any = m.store
        period = self.lease_s / 3
        lease = None
        keeper: threading.Thread | None = None
        while not self._stop.is_set():
            t0 = time.monotonic()
            self._wake.clear()
            try:
                if lease is None:
                    lease = store.grant(int(self.lease_s))
                    self.last_ok = store.answered_sent_at
                    keeper = threading.Thread(
                        target=self._keepalive_loop, args=(lease,), name="rc-agent-keepalive", daemon=True
                    )
                    keeper.start()
                text, leased = self._record()
                if leased:
                    store.put_with_lease(m.key("node", self.node), text, lease)
                else:
                    store.set(m.key("node", self.node), text)
                self._successor_watch(store, m, self._watch_successor(m))
            except dist.DistError as e:
                if "lease not found" in str(e):  # an answer: the store let the lease expire
                    self._fence(
                        f"node {self.node}'s lease expired on the store (its record was refused: {e})"
                    )
                    break  # a new lease would bring back a node the others may have decided without
                log.warning(
                    "node %d: no store majority for %.1f s (%s)",
                    self.node,
                    time.monotonic() - self.last_ok,
                    e,
                )
            self._wake.wait(max(0.0, jittered(period) - (time.monotonic() - t0)))
        if self.succ_watch is not None:
            self.succ_watch.close()
        if keeper is not None:
            keeper.join()

    def _successor_watch(self, store: Any, m: Membership, succ: int | None) -> None:
        """The stream that wakes the lease loop when the successor's record is deleted (its
        lease expired), moved to the new successor when the ring changes: the loss is then
        read at once, not up to a third of the lease later."""
        key = None if succ is None else m.key("node", succ)
        if self.succ_watch is not None and self.succ_watch.key != key:
            old, self.succ_watch = self.succ_watch, None
            old.close()
        if self.succ_watch is None and key is not None:
            self.succ_watch = DeleteWatch(store, key, self._wake.set)

    def _outage(self, silent: float) -> None:
        """The store answered again after `silent` seconds (two keepalives or more went
        unanswered: a link that flapped, an election), before the node fenced."""
        log.warning(
            "node %d rode out a store outage: no answer for %.2f s (it fences past %.2f s; its lease is %g s)",
            self.node,
            silent,
            self._fence_after_s(),
            self.lease_s,
        )
        if self._rode_out is not None:
            self._rode_out(silent)

    def _fence_loop(self) -> None:
        """Checks the lease on a thread that makes no store call. The loop's tick also checks,
        but the launcher's own store calls (reporting an exit, reading the membership) block
        that loop for up to the store's retry budget (10 s): a node cut off from the store
        went on training long past its lease."""
        while not self._stop.is_set() and self._fenced() is None:
            t = time.monotonic()
            self.check(t)
            # Asleep until the moment it would fence if no answer came meanwhile (`last_ok`
            # only grows): not every 100 ms, which at 2,048 emulated agents was 20,000 wake-ups
            # a second.
            self._stop.wait(max(0.01, self.last_ok + self._fence_after_s() - t + 0.01))

    def _keepalive_loop(self, lease: int) -> None:
        """Refresh the lease every `lease_s` / 6 on a connection of its own. Never behind the
        record's put or the successor's read: during an election those can each take
        seconds, and a keepalive waiting behind them let a healthy node's lease run out (it
        was fenced). `last_ok` is the send time of the last refresh answered."""
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
                silent = time.monotonic() - self.last_ok
                self.last_ok = max(self.last_ok, sent)
                if silent > 2 * period and self._fenced() is None:
                    self._outage(silent)
            except dist.DistError as e:
                log.warning(
                    "node %d: lease keepalive: no store majority for %.1f s (%s)",
                    self.node,
                    time.monotonic() - self.last_ok,
                    e,
                )
            self._stop.wait(max(0.0, jittered(period) - (time.monotonic() - t0)))


__all__ = ["ANSWER_AFTER_LINK_S", "NodeLease", "fence_after_s", "tolerated_outage_s"]
