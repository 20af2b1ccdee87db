"""Failure detection's model: the evidence, heartbeats, and the dead-vs-slow bounds.

Three sources of evidence reach the controller:

1. **Op errors** from the backend (``PeerFailureError`` within milliseconds of a peer's
   death, ``CommTimeoutError``): raised in the training thread itself.
2. **The launcher's exit report**: ``resilient-run`` sees a worker end (pidfd) and records it
   under ``{ns}/gone/{rank}`` with an event. Every node's agent reads the event once and
   forwards it to its workers, whose *events thread* reads them from the agent's socket: a
   report reaches every worker within a store round trip and a local hop.
3. **Heartbeats**: a *heartbeat thread* beats to the node agent (a Unix socket) every
   ``heartbeat_s`` (~100 ms); the agent judges them (`node.agent`: nodes
   watch each other through one record per node, never a key per rank). A heartbeat carries a
   sequence number, the rank's step and phase ("start" before its first step, "compute",
   "sync", "recovery", "done", "spare" while a hot spare waits, or "run" in a `restartable`
   script, whose steps nobody sees), how long it has been in that phase, the p99 of its
   recent step times and the expected cost of its step's collectives.

**Dead vs slow.** A process whose heartbeat advances is alive: it is never declared dead,
whatever its speed. It is suspected only on one of two adaptive bounds, both derived from
*its own* recent behaviour, ``bound = max(floor, slow_factor * p99_step + comm_cost)``, where
``comm_cost`` is the alpha-beta model's time for the step's collectives (the same model and
knobs, ``RESILIENT_COMM_ALPHA_US`` / ``RESILIENT_COMM_BANDWIDTH_GBPS``, as the TCP transport):

- **silence**: its heartbeat has not advanced for longer than ``bound`` (floor
  ``silence_floor_s``; ten floors before its first step, `STARTUP_FLOORS`), seen over at least ``min_silent_reads`` of the observer's own ticks
  (so an observer that was descheduled never counts as evidence). A
  SIGSTOPped or wedged process, or a lost host, ends up here; a short stop does not.
- **straggler**: its heartbeat is live, but it has been computing step ``s`` (or a later one)
  for longer than ``bound`` (floor ``straggler_floor_s``) while an observer waits (a member
  of its node, or of the node whose agent watches its node): at the step's synchronisation,
  in a recovery the straggler has not joined, or at the end. Only a
  rank that others wait for can be a straggler: ranks that all compute alike (a long
  checkpoint everywhere) suspect nobody.

The observer measures silence on its own monotonic clock, so hosts need no clock sync. The
op timeout is never the evidence: the controller reacts to these bounds long before it.

Pure (no I/O, no threads; the knobs are read from the environment): the bounds are applied by the node agent (`node.agent`) to its
workers' beats, and the beats' fields are made by each worker's `worker.detector.Detector`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# spare: waiting, not a member yet; run: the body of a `restartable` script, whose steps the
# detector does not see (judged by silence alone, never as a straggler)
PHASES = ("start", "compute", "sync", "recovery", "done", "spare", "run")
WAITING = ("sync", "recovery", "done")  # phases in which a rank waits for the others
# A rank that has not begun its first step ("start": imports, its state factory, the first
# group build) is judged silent only past this many silence floors: on a loaded host its first
# `import torch.optim` can starve its heartbeat thread for over a second (chaos finding 9 of
# issue #16: healthy ranks evicted at start-up). A death at start-up is the launcher's exit
# report, at once; only a rank wedged or stopped before its first step waits the longer bound.
STARTUP_FLOORS = 10


@dataclass(frozen=True)
class DetectorConfig:
    """Detection knobs (see the module docstring for the bounds they feed). The controller's
    default is `from_env()`: the ``RESILIENT_COMM_{HEARTBEAT_MS, SILENCE_FLOOR_MS,
    STRAGGLER_FLOOR_MS, SLOW_FACTOR}`` knobs, whose defaults are these."""

    heartbeat_s: float = 0.1
    silence_floor_s: float = 1.0
    straggler_floor_s: float = 5.0
    slow_factor: float = 10.0
    window: int = 100  # step times kept for the p99
    min_silent_reads: int = 5

    def __post_init__(self) -> None:
        for name in ("heartbeat_s", "silence_floor_s", "straggler_floor_s", "slow_factor"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"DetectorConfig.{name} must be a positive number, got {value!r}")

    @classmethod
    def from_env(cls) -> DetectorConfig:
        from resilient_comm.config import knobs

        k = {kn.name: kn.value for kn in knobs()}

        def num(name: str) -> float:
            try:
                return float(k[name])
            except ValueError:
                raise ValueError(f"{name}={k[name]!r} is not a number") from None

        return cls(
            heartbeat_s=num("RESILIENT_COMM_HEARTBEAT_MS") / 1e3,
            silence_floor_s=num("RESILIENT_COMM_SILENCE_FLOOR_MS") / 1e3,
            straggler_floor_s=num("RESILIENT_COMM_STRAGGLER_FLOOR_MS") / 1e3,
            slow_factor=num("RESILIENT_COMM_SLOW_FACTOR"),
        )


def comm_cost_s(nbytes: int, world: int) -> float:
    """Alpha-beta estimate of an all_reduce of `nbytes` over `world` ranks: the cheaper of the
    ring (2(n-1) steps of n-th chunks) and recursive doubling (log2 n full exchanges)."""
    if world <= 1 or nbytes <= 0:
        return 0.0
    from resilient_comm.config import knobs

    k = {kn.name: kn.value for kn in knobs()}
    alpha = float(k["RESILIENT_COMM_ALPHA_US"]) * 1e-6
    bw = float(k["RESILIENT_COMM_BANDWIDTH_GBPS"]) * 1e9
    ring = 2 * (world - 1) * (alpha + nbytes / world / bw)
    rd = math.ceil(math.log2(world)) * (alpha + nbytes / bw)
    return min(ring, rd)


def slow_bound_s(p99_s: float, comm_s: float, floor_s: float, factor: float) -> float:
    """The adaptive bound: a multiple of the rank's own p99 step time plus its collectives'
    expected cost, never below `floor_s`."""
    return max(floor_s, factor * p99_s + comm_s)


class StepTimes:
    """The last `window` step durations of this rank; p99 by rank statistic."""

    def __init__(self, window: int) -> None:
        self._recent: deque[float] = deque(maxlen=window)

    def add(self, seconds: float) -> None:
        self._recent.append(seconds)

    def p99(self) -> float:
        if not self._recent:
            return 0.0
        ordered = sorted(self._recent)
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


@dataclass
class PeerView:
    """What an observer knows of a peer's heartbeat."""

    seq: int = -1
    step: int = -1
    phase: str = ""
    elapsed_s: float = 0.0  # in its phase, when it last beat
    p99_s: float = 0.0
    comm_s: float = 0.0
    changed_at: float = 0.0  # observer's monotonic clock
    unchanged_reads: int = 0

    def update(self, text: str, t: float) -> None:
        seq, step, phase, elapsed_ms, p99_ms, comm_ms = text.split()
        if int(seq) != self.seq:
            self.seq, self.step, self.phase = int(seq), int(step), phase
            self.elapsed_s, self.p99_s, self.comm_s = (
                float(elapsed_ms) / 1e3,
                float(p99_ms) / 1e3,
                float(comm_ms) / 1e3,
            )
            self.changed_at, self.unchanged_reads = t, 0
        else:
            self.unchanged_reads += 1


def silence_why(peer: PeerView, t: float, cfg: DetectorConfig) -> str | None:
    """Why `peer`'s silence at monotonic time `t` makes it a suspect, or None."""
    if peer.seq < 0:
        return None  # never beat yet (still starting): the launcher reports a death at start-up
    silent = t - peer.changed_at
    bound = slow_bound_s(peer.p99_s, peer.comm_s, cfg.silence_floor_s, cfg.slow_factor)
    if peer.phase == "start":
        bound = max(bound, STARTUP_FLOORS * cfg.silence_floor_s)
    if silent > bound and peer.unchanged_reads >= cfg.min_silent_reads:
        return (
            f"heartbeat silent for {silent:.2f} s > bound {bound:.2f} s "
            f"(p99 step {1e3 * peer.p99_s:.1f} ms, comm {1e3 * peer.comm_s:.2f} ms)"
        )
    return None


def straggler_why(peer: PeerView, my_step: int, my_phase: str, t: float, cfg: DetectorConfig) -> str | None:
    """Why `peer` is a straggler for an observer at (`my_step`, `my_phase`), or None."""
    if peer.seq >= 0 and peer.phase == "compute" and my_phase in WAITING and peer.step >= my_step:
        busy = peer.elapsed_s + (t - peer.changed_at)
        bound = slow_bound_s(peer.p99_s, peer.comm_s, cfg.straggler_floor_s, cfg.slow_factor)
        if busy > bound:
            return (
                f"straggler: computing step {peer.step} for {busy:.2f} s > bound {bound:.2f} s "
                f"(p99 step {1e3 * peer.p99_s:.1f} ms) while others wait"
            )
    return None


def straggler_among(peer: PeerView, cfg: DetectorConfig, observers: list[PeerView], t: float) -> str | None:
    """Why `peer` is a straggler for the first of `observers` (itself excluded) it holds up,
    or None: an agent's judgement of its own processes and of its ring successor's."""
    return next(
        (w for w in (straggler_why(peer, o.step, o.phase, t, cfg) for o in observers if o is not peer) if w),
        None,
    )


def assess(peer: PeerView, my_step: int, my_phase: str, t: float, cfg: DetectorConfig) -> str | None:
    """Why `peer` should be suspected at monotonic time `t`, or None. Pure: unit-testable."""
    return silence_why(peer, t, cfg) or straggler_why(peer, my_step, my_phase, t, cfg)


__all__ = [
    "PHASES",
    "STARTUP_FLOORS",
    "WAITING",
    "DetectorConfig",
    "PeerView",
    "StepTimes",
    "assess",
    "comm_cost_s",
    "silence_why",
    "slow_bound_s",
    "straggler_among",
    "straggler_why",
]
