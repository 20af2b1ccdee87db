"""Failure evidence held by one member, shared by the `Controller` and `restartable`. Runs in
a worker: its detector's threads deliver the evidence, its training thread reads it.

The detector's threads deliver it (`_on_gone`, `_on_fenced`, `_on_store_lost`) and abort what
the member holds -- its process groups, or the backends a script made -- so that the training
thread's collective returns at once; the training thread reads it when it recovers
(`_check_fatal`, `_failure_times`, `_forget`). Everything here is under one lock, never held
while aborting.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Collection
from typing import Any, NoReturn

import torch.distributed as dist

from resilient_comm.elastic.membership.protocol import Membership
from resilient_comm.elastic.model.pacer import Pacer
from resilient_comm.elastic.model.records import Decision, Gone, JoinRecord, now
from resilient_comm.elastic.worker.detector import Detector
from resilient_comm.elastic.worker.errors import Evicted, RecoveryError
from resilient_comm.elastic.worker.rejoin import join_wait_s


class Evidence:
    """What this member knows of failures, and what a failure aborts (`_held`)."""

    _m: Membership
    _detector: Detector
    _decision: Decision
    _timeout: datetime.timedelta
    applied_epoch: int

    def __init__(self, rank: int, members: list[int]) -> None:
        self.rank = rank
        self._lock = threading.Lock()
        self._held: list[Any] = []  # what a failure aborts (`_abort`)
        self._aborting: list[Any] = []  # those of `_held` an abort was started for (`_abort_held`)
        self._watching: set[int] = set(members)  # ranks whose loss concerns this member
        self._evidence: dict[int, Gone] = {}
        self._detected_at: float | None = None
        self._fatal: str | None = None  # the agent is gone, or it lost the store
        self._fenced: str | None = None  # the node agent cut this node off (no store majority)
        self._finished = False

    def _abort(self, held: list[Any], reason: str) -> None:
        raise NotImplementedError

    def _abort_held(self, held: list[Any], reason: str, *, again: bool = False) -> None:
        """Abort those of `held` that no abort was started for yet (all of them where `again`:
        the training thread goes on only once what it holds is aborted). An abort is idempotent
        but not free: under load the gone event's abort of the groups the training thread had
        just aborted kept the detector thread from the agent's next message -- the answer to
        the join -- for 2-5 ms."""
        with self._lock:
            fresh = [h for h in held if again or not any(h is a for a in self._aborting)]
            self._aborting += [h for h in fresh if not any(h is a for a in self._aborting)]
        if fresh:
            self._abort(fresh, reason)

    def _take_held(self) -> list[Any]:
        """What this member held until now; it holds nothing after (a rebuild's or a restart's
        start). Called under the lock."""
        old, self._held, self._aborting = self._held, [], []
        return old

    def _hold(self, held: Any, members: Collection[int]) -> None:
        """Hold `held` (a process group, a backend) for a failure to abort; abort it at once
        where one of `members` is gone already, or this member was fenced or lost the store."""
        with self._lock:
            self._held.append(held)
            doomed = sorted(r for r in self._evidence if r in members)
            reason = self._fenced or self._fatal
        if doomed or reason:
            self._abort_held([held], reason or f"rank(s) {doomed} gone while the group was being made")

    def _note(self, g: Gone) -> None:
        """Called under the lock with every report, watched or not."""

    def _on_gone(self, g: Gone) -> None:
        with self._lock:
            self._note(g)
            if self._finished or g.rank not in self._watching:
                return
            self._evidence.setdefault(g.rank, g)
            if self._detected_at is None:
                self._detected_at = now()
            held = list(self._held)
        if g.kind == "left":
            # [Note: a planned departure aborts nothing] The members agreed that g.rank leaves
            # at a pace window's end (`worker/pace_watch.py`), each by its own judgement of the
            # same numbers, and the leaver takes part in that judgement's collectives to their
            # end. The first member through reports it; the others may still be finishing
            # theirs (an all-gather completes at each member when *it* has every row), and an
            # abort now would fail their judgement and turn a planned handover into a failed
            # op. Each member recovers on purpose after its own judgement; the abort is only a
            # guard for one that has not within LEFT_GRACE_S.
            guard = threading.Timer(self.LEFT_GRACE_S, self._left_guard, (g, held))
            guard.daemon = True
            guard.start()
            return
        self._abort_held(held, f"rank {g.rank} is gone ({g.kind}: {g.detail}, reported by {g.by})")

    LEFT_GRACE_S = 2.0

    def _left_guard(self, g: Gone, held: list[Any]) -> None:
        """A planned departure's guard: abort what this member held when it heard, unless it
        finished or recovered since (its new groups built, the leaver's evidence forgotten).
        Mid-recovery, what it held is aborted already: aborting it again changes nothing."""
        with self._lock:
            if self._finished or self._evidence.get(g.rank) is not g:
                return
        self._abort_held(
            held, f"rank {g.rank} left ({g.detail}, reported by {g.by}) and this member has not recovered"
        )

    def _on_fenced(self, reason: str) -> None:
        with self._lock:
            self._fenced = reason
            held = list(self._held)
        self._abort_held(held, f"fenced: {reason}")

    def _on_store_lost(self, reason: str) -> None:
        with self._lock:
            self._fatal = reason
            held = list(self._held)
        self._abort_held(held, reason)

    def _check_fatal(self) -> None:
        """Leave if the node was fenced (`Evicted`) or the store is gone (`RecoveryError`)."""
        if self._fenced:
            raise Evicted(f"rank {self.rank} was fenced: {self._fenced}")
        if self._fatal:
            raise RecoveryError(self._fatal)

    def _join_via_agent(self, record: JoinRecord, deadline: float) -> tuple[str, str] | None:
        """`catch_up`'s `via`: the node agent writes this node's join records together. A fence
        or the agent's loss while waiting ends the wait and the recovery (`_check_fatal`)."""
        answer = self._detector.join(record, join_wait_s(deadline))
        self._check_fatal()
        return answer

    def _store_failed(self, e: BaseException) -> NoReturn:
        """A store call failed: fenced meanwhile (`Evicted`), or no membership (`RecoveryError`)."""
        self._check_fatal()
        raise RecoveryError(f"rank {self.rank}: the store failed: {e}") from e

    def _failure_times(self) -> tuple[float, float]:
        """(when the failure happened as best known, when this member first learnt of one)."""
        with self._lock:
            detected = self._detected_at or now()
            return min([g.t for g in self._evidence.values()] + [detected]), detected

    def _forget(self, members: list[int]) -> None:
        """Drop the evidence on ranks that are no longer members."""
        with self._lock:
            for r in [r for r in self._evidence if r not in members]:
                del self._evidence[r]
            if not self._evidence:
                self._detected_at = None

    def _wait_all_done(self, done_of: Callable[[list[int]], dict[int, int]]) -> bool:
        """This member is done: wait until every member of its epoch is done or gone (True; the
        job is over, waiting spares are told to leave), or a later epoch started (False: a
        member recovers after this one finished, and this one must join it)."""
        deadline = time.monotonic() + self._timeout.total_seconds()
        pace = Pacer(cap_s=0.02)
        while True:
            self._check_fatal()
            members = self._decision.members
            try:
                done, gone = done_of(members), self._detector.gone()
                if all(r in done or r in gone for r in members):
                    with self._lock:
                        self._finished = True
                    if not self._m.finished():
                        self._m.set_finished()
                        self._m.post_event({"kind": "finished"})  # waiting spares leave
                    return True
                if self._m.epoch() > self.applied_epoch:
                    return False
            except (dist.DistStoreError, dist.DistNetworkError) as e:
                self._store_failed(e)
            if time.monotonic() > deadline:
                raise RecoveryError(f"members {[r for r in members if r not in done]} never finished")
            pace.wait()


__all__ = ["Evidence"]
