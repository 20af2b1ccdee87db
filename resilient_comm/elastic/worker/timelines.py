"""A worker's recovery timelines (`model.timeline.Timeline`): the one in progress, opened by a
recovery or a spare's placement and closed by the first commit after it, and those closed.
Runs in a worker: its training thread marks the phases; its detector's threads note when
each rank's first report arrived (`heard`, under the evidence lock).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from resilient_comm.elastic.model.channel import recovery_line
from resilient_comm.elastic.model.records import Decision, Gone, now
from resilient_comm.elastic.model.timeline import Timeline


class Timelines:
    """`done`: every closed timeline, in order (the controller's `recoveries`); `current`: the
    one waiting for its first commit."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.done: list[Timeline] = []
        self.current: Timeline | None = None
        self._heard: dict[int, tuple[str, float]] = {}  # rank -> (source, arrival) of its first report

    def heard(self, g: Gone) -> None:
        """A report on `g.rank` arrived (the caller holds the evidence lock)."""
        self._heard.setdefault(g.rank, ("exit_report" if g.kind == "exit" else "suspicion", now()))

    def start(self, cause: BaseException, failure: float, detected: float, op_error: bool) -> Timeline:
        """A recovery from `cause` begins; `op_error`: a collective's own failure (evidence)."""
        tl = Timeline(
            self.rank, f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        )
        tl.mark("failure", failure)
        tl.mark("detected", detected)
        if op_error:
            tl.via["op_error"] = now()
            tl.op_error = type(cause).__name__
        return tl

    def placed(self, d: Decision) -> Timeline:
        """A hot spare was placed by `d`: its failure, detection and agreement are the decision's."""
        tl = Timeline(self.rank, "placed as a hot spare")
        tl.mark("failure", d.failed_at or now())
        tl.mark("detected", d.t)
        tl.mark("aborted", d.t)
        tl.mark("agreed")
        return tl

    def restored(self, tl: Timeline, d: Decision) -> None:
        """`tl`'s member holds `d`'s committed step: it waits for its first commit."""
        tl.mark("restored")
        tl.epoch, tl.resume_step, tl.members, tl.mode = d.epoch, d.resume_step, d.members, d.mode
        self.current = tl

    def first_commit(self, lock: threading.Lock, report: Callable[[str], None]) -> None:
        """A step was committed: close the current timeline, if any, with when each source of
        evidence on its lost ranks arrived; log it and `report` its line (to the agent)."""
        tl = self.current
        if tl is None:
            return
        tl.mark("first_commit")
        with lock:
            for source, at in [self._heard[r] for r in tl.lost if r in self._heard]:
                tl.via[source] = min(at, tl.via.get(source, at))
        tl.emit()
        report(recovery_line(tl))
        self.done.append(tl)
        self.current = None


__all__ = ["Timelines"]
