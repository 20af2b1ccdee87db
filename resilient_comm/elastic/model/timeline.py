"""The recovery timeline: one record per recovery and member, as log lines and as metrics.

Phases, in order (wall-clock times, so records of different processes line up)::

    failure       when the failure happened, as best known: the launcher's exit time of the
                  dead rank, the last heartbeat of a silent one, else the first evidence
    detected      this process's first evidence (op error, exit report or suspicion)
    aborted       its groups aborted (every pending op released)
    agreed        the epoch's decision read (who stays, from which step)
    rebuilt       the new world and DP/TP/PP groups built and verified by a collective
    restored      the state at the agreed step (rolled forward or back)
    first_commit  the first step committed after the recovery

Each finished record is logged by logger ``resilient_comm.elastic`` at INFO as one line::

    recovery {"epoch": 1, "rank": 0, "cause": "...", "t": {...}, "ms": {"detected": 18.1, ...},
              "via_ms": {"op_error": 0.9, "exit_report": 2.3}}

where ``ms`` holds each phase's duration since the previous phase and ``total`` (failure to
first commit), and ``via_ms`` when each source of evidence reached this process, after the
failure: ``op_error`` (a collective raised), ``exit_report`` (the launcher's report) and
``suspicion`` (heartbeat silence or straggler). `prometheus()` renders records in the
Prometheus text format.

Kept by a worker through each recovery (`worker.controller`, `worker.inprocess`); pure, but for
the log line it emits.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from resilient_comm.elastic.model.records import now

PHASES = ("failure", "detected", "aborted", "agreed", "rebuilt", "restored", "first_commit")
SOURCES = ("op_error", "exit_report", "suspicion")  # where evidence came from (`Timeline.via`)

log = logging.getLogger("resilient_comm.elastic")


@dataclass
class Timeline:
    """One member's view of one recovery. `epoch` is the epoch it resumed in; `attempts`
    counts the epochs it took (more than one when a failure hit the recovery itself)."""

    rank: int
    cause: str
    t: dict[str, float] = field(default_factory=dict)
    epoch: int = -1
    attempts: int = 0
    resume_step: int = -1
    members: list[int] = field(default_factory=list)
    mode: str = ""
    lost: list[int] = field(default_factory=list)  # ranks that left: dead or suspected
    via: dict[str, float] = field(default_factory=dict)  # evidence source -> wall time it arrived
    op_error: str = ""  # the kind of the collective error that started it ("" if news did)

    def mark(self, phase: str, at: float | None = None) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown recovery phase {phase!r} (one of {PHASES})")
        self.t[phase] = now() if at is None else at

    def durations_ms(self) -> dict[str, float]:
        """Each reached phase's duration since the previous reached one, and the total."""
        out: dict[str, float] = {}
        prev: float | None = None
        for p in PHASES:
            if p in self.t:
                if prev is not None:
                    out[p] = round(1e3 * (self.t[p] - prev), 3)
                prev = self.t[p]
        if "failure" in self.t and prev is not None:
            out["total"] = round(1e3 * (prev - self.t["failure"]), 3)
        return out

    def as_dict(self) -> dict[str, Any]:
        failure = self.t.get("failure")
        via_ms = (
            {k: round(1e3 * (v - failure), 3) for k, v in self.via.items()} if failure is not None else {}
        )
        return {
            "epoch": self.epoch,
            "rank": self.rank,
            "cause": self.cause,
            "attempts": self.attempts,
            "resume_step": self.resume_step,
            "members": self.members,
            "mode": self.mode,
            "lost": self.lost,
            "t": self.t,
            "ms": self.durations_ms(),
            "via": self.via,
            "via_ms": via_ms,
            "op_error": self.op_error,
        }

    def log_line(self) -> str:
        return "recovery " + json.dumps(self.as_dict(), sort_keys=True)

    def emit(self) -> None:
        log.info("%s", self.log_line())


def prometheus(timelines: list[Timeline]) -> str:
    """Recovery metrics in the Prometheus text exposition format: a counter of recoveries and
    the last recovery's phase durations."""
    lines = [
        "# HELP resilient_comm_recoveries_total In-process recoveries completed by this member.",
        "# TYPE resilient_comm_recoveries_total counter",
        f"resilient_comm_recoveries_total {len(timelines)}",
        "# HELP resilient_comm_recovery_phase_seconds Duration of each phase of the last recovery.",
        "# TYPE resilient_comm_recovery_phase_seconds gauge",
    ]
    if timelines:
        for phase, ms in timelines[-1].durations_ms().items():
            lines.append(f'resilient_comm_recovery_phase_seconds{{phase="{phase}"}} {ms / 1e3:.6f}')
    return "\n".join(lines) + "\n"


__all__ = ["PHASES", "SOURCES", "Timeline", "prometheus"]
