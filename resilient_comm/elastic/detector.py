"""Failure detection: the launcher's exit reports, heartbeats, and dead-vs-slow bounds.

Three sources of evidence reach the controller:

1. **Op errors** from the backend (``PeerFailureError`` within milliseconds of a peer's
   death, ``CommTimeoutError``): raised in the training thread itself.
2. **The launcher's exit report**: ``resilient-run`` sees a worker end (pidfd) and records it
   under ``{ns}/gone/{rank}`` with an event and a wake-up in every rank's queue. Here an
   *events thread* blocks on that queue, so a report reaches every worker within a store
   round trip.
3. **Heartbeats**: a *heartbeat thread* writes ``{ns}/hb/{rank}`` every ``heartbeat_s``
   (~100 ms) and reads every peer's key in one ``multi_get``. A heartbeat carries a sequence
   number, the rank's step and phase ("compute", "sync", "recovery", "done"), how long it has
   been in that phase, the p99 of its recent step times and the expected cost of its step's
   collectives.

**Dead vs slow.** A process whose heartbeat advances is alive: it is never declared dead,
whatever its speed. It is suspected only on one of two adaptive bounds, both derived from
*its own* recent behaviour, ``bound = max(floor, slow_factor * p99_step + comm_cost)``, where
``comm_cost`` is the alpha-beta model's time for the step's collectives (the same model and
knobs, ``RESILIENT_COMM_ALPHA_US`` / ``RESILIENT_COMM_BANDWIDTH_GBPS``, as the TCP transport):

- **silence**: its heartbeat has not advanced for longer than ``bound`` (floor
  ``silence_floor_s``), seen over at least ``min_silent_reads`` of the observer's own reads
  (so an observer that was descheduled, or a stalled store, never counts as evidence). A
  SIGSTOPped or wedged process, or a lost host, ends up here; a short stop does not.
- **straggler**: its heartbeat is live, but it has been computing step ``s`` (or a later one)
  for longer than ``bound`` (floor ``straggler_floor_s``) while the observer waits: at the
  step's synchronisation, in a recovery the straggler has not joined, or at the end. Only a
  rank that others wait for can be a straggler: ranks that all compute alike (a long
  checkpoint everywhere) suspect nobody.

The observer measures silence on its own monotonic clock, so hosts need no clock sync. The
op timeout is never the evidence: the controller reacts to these bounds long before it.
"""

from __future__ import annotations

import datetime
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from resilient_comm.elastic.membership import Gone, Membership, now

log = logging.getLogger("resilient_comm.elastic")

PHASES = ("compute", "sync", "recovery", "done")
WAITING = ("sync", "recovery", "done")  # phases in which a rank waits for the others


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

        return cls(heartbeat_s=num("RESILIENT_COMM_HEARTBEAT_MS") / 1e3,
                   silence_floor_s=num("RESILIENT_COMM_SILENCE_FLOOR_MS") / 1e3,
                   straggler_floor_s=num("RESILIENT_COMM_STRAGGLER_FLOOR_MS") / 1e3,
                   slow_factor=num("RESILIENT_COMM_SLOW_FACTOR"))


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
            self.elapsed_s, self.p99_s, self.comm_s = float(elapsed_ms) / 1e3, float(p99_ms) / 1e3, float(comm_ms) / 1e3
            self.changed_at, self.unchanged_reads = t, 0
        else:
            self.unchanged_reads += 1


def assess(peer: PeerView, my_step: int, my_phase: str, t: float, cfg: DetectorConfig) -> str | None:
    """Why `peer` should be suspected at monotonic time `t`, or None. Pure: unit-testable."""
    if peer.seq < 0:
        return None  # never beat yet (still starting): the launcher reports a death at start-up
    silent = t - peer.changed_at
    bound = slow_bound_s(peer.p99_s, peer.comm_s, cfg.silence_floor_s, cfg.slow_factor)
    if silent > bound and peer.unchanged_reads >= cfg.min_silent_reads:
        return (f"heartbeat silent for {silent:.2f} s > bound {bound:.2f} s "
                f"(p99 step {1e3 * peer.p99_s:.1f} ms, comm {1e3 * peer.comm_s:.2f} ms)")
    if peer.phase == "compute" and my_phase in WAITING and peer.step >= my_step:
        busy = peer.elapsed_s + silent
        bound = slow_bound_s(peer.p99_s, peer.comm_s, cfg.straggler_floor_s, cfg.slow_factor)
        if busy > bound:
            return (f"straggler: computing step {peer.step} for {busy:.2f} s > bound {bound:.2f} s "
                    f"(p99 step {1e3 * peer.p99_s:.1f} ms) while others wait")
    return None


class Detector:
    """The detection threads of one worker. Thread-safety: `watch`, `progress`, `step_done`
    and `gone` may be called from any thread; `on_gone(evidence)` runs on the events thread;
    `on_store_lost(error)` on whichever thread lost the store first."""

    def __init__(
        self,
        membership: Membership,
        rank: int,
        config: DetectorConfig,
        on_gone: Callable[[Gone], None],
        on_store_lost: Callable[[BaseException], None],
    ) -> None:
        self.cfg = config
        self.rank = rank
        self._events = membership.clone(timeout=datetime.timedelta(days=1))
        self._beats = membership.clone()
        self._on_gone = on_gone
        self._on_store_lost = on_store_lost
        self._lock = threading.Lock()
        self._watch: list[int] = []
        self._gone: dict[int, Gone] = {}
        self._peers: dict[int, PeerView] = {}
        self._progress = (-1, "compute", time.monotonic())
        self._times = StepTimes(config.window)
        self._comm_s = 0.0
        self._stop = threading.Event()
        self._next_event = 0
        self._store_lost = False
        self._threads = [threading.Thread(target=self._events_loop, name="rc-events", daemon=True),
                         threading.Thread(target=self._heartbeat_loop, name="rc-heartbeat", daemon=True)]

    def start(self, events: bool = True) -> None:
        """Start heartbeating, and with `events` the events thread (a hot spare starts it
        only once it is placed: until then its own wait consumes its wake-ups)."""
        self._beat(0)
        self._threads[1].start()
        if events:
            self.start_events()

    def start_events(self) -> None:
        if not self._threads[0].is_alive() and not self._stop.is_set():
            self._threads[0].start()

    def stop(self) -> None:
        """Stop and join both threads (a thread left inside a store call while the interpreter
        shuts down would abort the process)."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            self._beats.wake(self.rank, "stop")
        except Exception as e:  # noqa: BLE001  (store gone: the events thread has ended already)
            log.debug("rank %d: no store to wake the events thread: %s", self.rank, e)
        for t in self._threads:
            if t.is_alive():
                t.join()

    def watch(self, ranks: list[int], comm_bytes: int) -> None:
        """Monitor these launch ranks (the current members) whose step all-reduces
        `comm_bytes`."""
        with self._lock:
            self._watch = [r for r in ranks if r != self.rank]
            self._comm_s = comm_cost_s(comm_bytes, len(ranks))

    def progress(self, step: int, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r} (one of {PHASES})")
        self._progress = (step, phase, time.monotonic())

    def step_done(self, seconds: float) -> None:
        with self._lock:
            self._times.add(seconds)

    def gone(self) -> dict[int, Gone]:
        with self._lock:
            return dict(self._gone)

    def _lost(self, e: BaseException) -> None:
        if not self._store_lost and not self._stop.is_set():
            self._store_lost = True
            log.error("rank %d lost the launcher's store (%s): the launcher is gone", self.rank, e)
            self._on_store_lost(e)

    def _events_loop(self) -> None:
        while True:
            try:
                self._events.wait_wake(self.rank)
                if self._stop.is_set():
                    return
                while (ev := self._events.event(self._next_event)) is not None:
                    if ev.get("kind") == "gone":
                        g = self._events.gone([ev["rank"]])[ev["rank"]]
                        with self._lock:
                            self._gone.setdefault(g.rank, g)
                        self._on_gone(g)
                    self._next_event += 1
            except Exception as e:  # noqa: BLE001  (a dead store ends the thread)
                self._lost(e)
                return

    def _beat(self, seq: int) -> None:
        step, phase, since = self._progress
        with self._lock:
            p99, comm = self._times.p99(), self._comm_s
        self._beats.beat(self.rank, f"{seq} {step} {phase} {1e3 * (time.monotonic() - since):.1f} "
                                    f"{1e3 * p99:.3f} {1e3 * comm:.3f}")

    def _heartbeat_loop(self) -> None:
        seq, failures = 1, 0
        next_at = time.monotonic()
        while not self._stop.is_set():
            next_at += self.cfg.heartbeat_s
            try:
                self._beat(seq)
                self._observe()
                if self._beats.event(self._next_event) is not None:
                    self._beats.wake(self.rank, "missed")  # its poster died before waking us
                failures = 0
            except Exception as e:  # noqa: BLE001
                failures += 1
                if failures >= 3:
                    self._lost(e)
                    return
            seq += 1
            # Pace the loop (not a synchronisation); after a stall, resume the cadence.
            delay = next_at - time.monotonic()
            if delay < 0:
                next_at, delay = time.monotonic(), 0.0
            self._stop.wait(delay)

    def _observe(self) -> None:
        with self._lock:
            peers = [r for r in self._watch if r not in self._gone]
        if not peers:
            return
        values = self._beats.beats(peers)
        t = time.monotonic()
        my_step, my_phase, _ = self._progress
        for r in peers:
            view = self._peers.setdefault(r, PeerView(changed_at=t))
            if r in values:
                view.update(values[r], t)
            if view.phase == "done":
                continue  # finished: it leaves, and the launcher reports its exit
            why = assess(view, my_step, my_phase, t, self.cfg)
            if why is not None:
                silent = t - view.changed_at
                first = self._beats.report_gone(Gone(r, "suspect", why, now() - silent, f"rank {self.rank}"))
                if first:
                    log.warning("rank %d suspects rank %d: %s", self.rank, r, why)


__all__ = ["Detector", "DetectorConfig", "PeerView", "StepTimes", "assess", "comm_cost_s", "slow_bound_s"]
