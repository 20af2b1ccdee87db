"""What a node's launcher reads of the job from the membership: the newest decision, the
spares it placed, whether the job finished or can go on no more. Runs in the node agent
process (``resilient-run``, `node.launcher`), on the launcher's loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch.distributed as dist

from resilient_comm.elastic.membership.protocol import Membership
from resilient_comm.elastic.model.records import Decision

log = logging.getLogger("resilient_comm.launcher")


class JobView:
    """The job as the membership says, through `membership()` (a new client each call: the
    launcher's loop shares its store with nothing else). Nothing is asked while `cut_off()`
    says why this node can no longer use the store: each call would only wait out the
    store's retry budget (10 s on etcd)."""

    def __init__(self, membership: Callable[[], Membership], cut_off: Callable[[], str | None]) -> None:
        self._membership, self._cut_off = membership, cut_off

    def placed(self) -> set[int]:
        """Spares that the membership has given a place (they are members now)."""
        d = self.last_decision()
        return set(d.used_spares) if d is not None else set()

    def last_decision(self) -> Decision | None:
        """The newest membership decision (None: none, or the store cannot be read)."""
        m = self._membership()
        if self._cut_off():
            return None
        try:
            if not m.store.check([m.key("epoch")]):
                return None
            for e in range(m.epoch(), -1, -1):
                d = m.decision(e)
                if d is not None:
                    return d
        except dist.DistError as e:
            log.error("could not read the membership: the store failed (%s)", e)
        return None

    def over(self) -> bool:
        """Whether the job has ended -- every member finished, or a decision failed it -- or
        can go on no more: every member of the newest decision is gone (nobody is left to
        decide, so no spare can be placed)."""
        m = self._membership()
        if self._cut_off():
            return True  # its spares can never be placed: the others go on without this node
        try:
            if m.finished():
                return True
            d = self.last_decision()  # None: not started yet
            return d is not None and (d.mode == "fail" or len(m.gone(d.members)) == len(d.members))
        except dist.DistError as e:  # (a TCPStore lost for good: the agent tells the spares)
            log.error("could not read the membership: the store failed (%s)", e)
            return False

    def finished(self) -> bool:
        """Whether every member finished (False when the store cannot say)."""
        if self._cut_off():
            return False
        try:
            return self._membership().finished()
        except dist.DistError as e:
            log.error("could not read whether the job finished: the store failed (%s)", e)
            return False


__all__ = ["JobView"]
