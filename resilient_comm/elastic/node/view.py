"""What a node agent knows of its node and the ring: its processes (`Proc`), the nodes on
the ring, and the lock that guards both. Runs in the node agent (``resilient-run``): the
launcher's loop and the agent's events thread share it (`node.agent`, `node.events`,
`node.ring`, `node.lease`).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from resilient_comm.elastic.model.bounds import DetectorConfig, PeerView


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


def cfg_fields(c: DetectorConfig) -> list[float]:
    """A process's bounds as its node's record carries them (`NodeView.record`)."""
    return [c.silence_floor_s, c.straggler_floor_s, c.slow_factor, c.min_silent_reads]


class NodeView:
    """This node's processes and the ring's nodes. `lock` guards `procs` (their connections
    and marks), `gone_nodes`, `present` and `observers`: the launcher's loop and the events
    thread both change them."""

    def __init__(self, node: int, nnodes: int, present: Iterable[int] | None = None) -> None:
        self.node, self.nnodes = node, nnodes
        self.lock = threading.Lock()
        self.procs: dict[int, Proc] = {}
        self.gone_nodes: set[int] = set()  # lost, or finished (their agents said so)
        # The ring's nodes: the initial ones, and capacity nodes that announced themselves.
        self.present: set[int] = {node, *(range(nnodes) if present is None else present)}
        self.announced: set[int] = set()  # capacity nodes that said they started (they had a record)
        self.observers: list[PeerView] = []  # this node's processes that wait for the others

    # -- processes ------------------------------------------------------------------------

    def add(self, rank: int, pid: int) -> None:
        with self.lock:
            self.procs[rank] = Proc(rank, pid)

    def hello(self, rank: int, cfg: DetectorConfig) -> Proc:
        with self.lock:
            p = self.procs[rank]
            p.cfg, p.view = cfg, PeerView(changed_at=time.monotonic())
        return p

    def mark_done(self, ranks: Iterable[int]) -> None:
        """These processes are judged no more (reported gone, or said bye)."""
        with self.lock:
            for r in ranks:
                if r in self.procs:
                    self.procs[r].done = True

    def joining(self) -> int:
        """How many of this node's processes would join an epoch now: alive, past hello, not
        spares waiting (`join_batcher.JoinBatcher` writes a batch once all of them sent theirs)."""
        with self.lock:
            return sum(
                1 for p in self.procs.values() if not p.done and p.cfg is not None and p.view.phase != "spare"
            )

    def record(self, seq: int, default: DetectorConfig) -> str:
        """This node's liveness record: a sequence number and, for every process it runs, the
        last beat of a judged one ("" for one not judged: it has not said hello yet, or is a
        spare still waiting) and its bounds. A lost node's report names them all."""
        with self.lock:
            procs = {
                p.rank: [p.beat if p.judged() else "", *cfg_fields(p.cfg or default)]
                for p in self.procs.values()
                if not p.done
            }
        return json.dumps({"seq": seq, "procs": procs}, separators=(",", ":"))

    # -- the ring -------------------------------------------------------------------------

    def ring(self) -> set[int]:
        """The nodes on the ring: present (initial, or announced) and not gone."""
        with self.lock:
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

    def node_gone(self, n: int) -> None:
        """Node `n` is lost, or finished: the ring goes on past it."""
        with self.lock:
            self.gone_nodes.add(n)

    def node_joined(self, n: int) -> None:
        """A capacity node announced itself (a "node" event): it is on the ring."""
        with self.lock:
            self.present.add(n)
            self.announced.add(n)


__all__ = ["NodeView", "Proc", "RemoteProc", "cfg_fields"]
