"""The ring of node agents: each agent reads its ring successor's liveness record
(``{ns}/node/{n}``) and judges it. Runs in the node agent (``resilient-run``): on a TCPStore
at the loop's node heartbeat (`NodeAgent.tick`), on etcd on the lease thread (`node.lease`).

A record whose sequence stops for longer than the node bound (``max(silence floor,
min_silent_reads x node heartbeat)``) means the node is lost (TCPStore); on etcd the record
is leased, and its deletion at the lease's expiry is the evidence. Either way every process
the record named is reported gone in one event, and the ring goes on past the node.
Stragglers on the successor are judged from its record, against this node's waiting
processes.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from resilient_comm.elastic.membership.protocol import Membership
from resilient_comm.elastic.model.bounds import DetectorConfig, PeerView, straggler_among
from resilient_comm.elastic.node.view import NodeView, RemoteProc

log = logging.getLogger("resilient_comm.agent")

# suspect(ranks, why, failed_at, node, m): report ranks gone (a whole node's, when `node`)
Suspect = Callable[[list[int], str, float, int | None, Membership], None]


class SuccessorWatch:
    """What this agent knows of its ring successor (`watched`): the record's sequence as last
    read (`view`), and the successor's processes and their bounds, from that record."""

    def __init__(
        self, nodes: NodeView, cfg: DetectorConfig, node_hb: float, lease_s: float, suspect: Suspect
    ) -> None:
        self.nodes, self.cfg, self.node_hb, self.lease_s = nodes, cfg, node_hb, lease_s
        self._suspect = suspect
        self.watched: int | None = None  # the ring successor
        self.view = PeerView()
        self.procs: dict[int, RemoteProc] = {}
        self.ranks: list[int] = []

    def check(self, m: Membership, observers: list[PeerView], t: float) -> None:
        """Read the successor's record through `m` and judge it at monotonic time `t`;
        `observers`: this node's processes that wait for the others (stragglers)."""
        node = self.nodes.node
        succ = self.nodes.successor()
        if succ != self.watched:
            self.watched, self.view, self.procs, self.ranks = succ, PeerView(), {}, []
        if succ is None:
            return
        view = self.view
        text = m.node_record(succ)
        # (A node that announced itself had a record: if its lease took it before this agent
        # read it once, the node is lost all the same, though which processes it ran is unknown.)
        if text is None and (view.seq >= 0 or succ in self.nodes.announced) and self.lease_s:
            why = (
                f"node {succ}'s lease ({self.lease_s:g} s) expired: its agent stopped renewing it "
                "(the node is lost or cut off from the store)"
            )
            if view.seq < 0:
                log.warning(
                    "node %d: %s before its record was read once: the ring goes on past it", node, why
                )
            self._suspect(self.ranks, why, time.time() - self.lease_s, succ, m)
            self.nodes.node_gone(succ)
            return
        if text is not None:
            try:
                rec = json.loads(text)
                seq, procs = int(rec["seq"]), rec["procs"]
                if rec.get("done"):
                    self.nodes.node_gone(succ)  # it ended: watch the next one
                    return
                if seq != view.seq:
                    view.seq, view.changed_at, view.unchanged_reads = seq, t, 0
                    self.ranks = sorted(int(r) for r in procs)
                    for r, (beat, silence, straggler, factor, reads) in procs.items():
                        if not beat:
                            continue
                        rp = self.procs.get(int(r))
                        if rp is None:  # its bounds are read once, not at every record
                            cfg = DetectorConfig(
                                silence_floor_s=silence,
                                straggler_floor_s=straggler,
                                slow_factor=factor,
                                min_silent_reads=int(reads),
                            )
                            rp = self.procs[int(r)] = RemoteProc(PeerView(changed_at=t), cfg)
                        rp.view.update(beat, t)
                else:
                    view.unchanged_reads += 1
            except (ValueError, KeyError, TypeError) as e:
                log.warning("node %d: node %d's record is malformed (%s): ignored", node, succ, e)
                return
        if view.seq < 0:
            return  # not started yet: a node that never starts is the launchers' business
        silent = t - view.changed_at
        bound = max(self.cfg.silence_floor_s, self.cfg.min_silent_reads * self.node_hb)
        if not self.lease_s and silent > bound and view.unchanged_reads >= self.cfg.min_silent_reads:
            # (On etcd the lease's expiry is the evidence, above: a silent record alone is not.)
            why = (
                f"node {succ} silent for {silent:.2f} s > bound {bound:.2f} s (its agent and record stopped)"
            )
            self._suspect(self.ranks, why, time.time() - silent, succ, m)
            self.nodes.node_gone(succ)
            return
        for r, rp in list(self.procs.items()) if observers else ():  # stragglers: only if some wait
            late = straggler_among(rp.view, rp.cfg, observers, t)
            if late:
                del self.procs[r]  # reported once
                self._suspect(
                    [r], f"{late} (seen by node {node})", time.time() - (t - rp.view.changed_at), None, m
                )


__all__ = ["SuccessorWatch"]
