"""Failure detection: the launcher's exit reports, heartbeats, and dead-vs-slow bounds.

Three sources of evidence reach the controller:

1. **Op errors** from the backend (``PeerFailureError`` within milliseconds of a peer's
   death, ``CommTimeoutError``): raised in the training thread itself.
2. **The launcher's exit report**: ``resilient-run`` sees a worker end (pidfd) and records it
   under ``{ns}/gone/{rank}`` with an event. Every node's agent reads the event once and
   forwards it to its workers, whose *events thread* reads them from the agent's socket: a
   report reaches every worker within a store round trip and a local hop.
3. **Heartbeats**: a *heartbeat thread* beats to the node agent (a Unix socket) every
   ``heartbeat_s`` (~100 ms); the agent judges them (`resilient_comm.elastic.agent`: nodes
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
"""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from resilient_comm.elastic.membership import Gone, JoinRecord

log = logging.getLogger("resilient_comm.elastic")

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


def silence_why(peer: PeerView, t: float, cfg: DetectorConfig) -> str | None:
    """Why `peer`'s silence at monotonic time `t` makes it a suspect, or None."""
    if peer.seq < 0:
        return None  # never beat yet (still starting): the launcher reports a death at start-up
    silent = t - peer.changed_at
    bound = slow_bound_s(peer.p99_s, peer.comm_s, cfg.silence_floor_s, cfg.slow_factor)
    if peer.phase == "start":
        bound = max(bound, STARTUP_FLOORS * cfg.silence_floor_s)
    if silent > bound and peer.unchanged_reads >= cfg.min_silent_reads:
        return (f"heartbeat silent for {silent:.2f} s > bound {bound:.2f} s "
                f"(p99 step {1e3 * peer.p99_s:.1f} ms, comm {1e3 * peer.comm_s:.2f} ms)")
    return None


def straggler_why(peer: PeerView, my_step: int, my_phase: str, t: float, cfg: DetectorConfig) -> str | None:
    """Why `peer` is a straggler for an observer at (`my_step`, `my_phase`), or None."""
    if peer.seq >= 0 and peer.phase == "compute" and my_phase in WAITING and peer.step >= my_step:
        busy = peer.elapsed_s + (t - peer.changed_at)
        bound = slow_bound_s(peer.p99_s, peer.comm_s, cfg.straggler_floor_s, cfg.slow_factor)
        if busy > bound:
            return (f"straggler: computing step {peer.step} for {busy:.2f} s > bound {bound:.2f} s "
                    f"(p99 step {1e3 * peer.p99_s:.1f} ms) while others wait")
    return None


def assess(peer: PeerView, my_step: int, my_phase: str, t: float, cfg: DetectorConfig) -> str | None:
    """Why `peer` should be suspected at monotonic time `t`, or None. Pure: unit-testable."""
    return silence_why(peer, t, cfg) or straggler_why(peer, my_step, my_phase, t, cfg)


class Detector:
    """The detection threads of one worker: a heartbeat thread that beats to the node agent
    (`resilient_comm.elastic.agent`) and an events thread that reads what the agent forwards.
    Neither touches the store. Thread-safety: `set_members`, `progress`, `step_done`, `gone`
    and `wait_news` may be called from any thread; `on_gone(evidence)` and `on_fenced(reason)`
    run on the events thread; `on_store_lost(reason)` on whichever thread learnt it first."""

    def __init__(
        self,
        agent_path: str,
        rank: int,
        config: DetectorConfig,
        on_gone: Callable[[Gone], None],
        on_store_lost: Callable[[str], None],
        on_fenced: Callable[[str], None] | None = None,
    ) -> None:
        self.cfg = config
        self.rank = rank
        self._path = agent_path
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._on_gone = on_gone
        self._on_store_lost = on_store_lost
        self._on_fenced = on_fenced
        self._lock = threading.Condition()
        self._gone: dict[int, Gone] = {}
        self._news = 0  # events received (a decision, the end, a rank gone): spares and waiters block on it
        self._progress = (-1, "start", time.monotonic())
        self._seq = -1  # of the last beat sent
        self._times = StepTimes(config.window)
        self._comm_s = 0.0
        self._stop = threading.Event()
        self._lost_reason: str | None = None
        self._joins: dict[int, tuple[str, str]] = {}  # applied -> the agent's answer to this rank's join
        self._fenced = False
        self._threads = [threading.Thread(target=self._events_loop, name="rc-events", daemon=True),
                         threading.Thread(target=self._heartbeat_loop, name="rc-heartbeat", daemon=True)]

    def start(self) -> None:
        """Connect to the node agent, say hello, beat once, and start both threads."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(10.0)
            sock.connect(self._path)
        except OSError as e:
            sock.close()
            raise RuntimeError(f"rank {self.rank}: cannot reach the node agent at {self._path} ({e}): "
                               "start workers with resilient-run") from e
        self._sock = sock
        from resilient_comm.elastic.wire import hello_line

        self._send(hello_line(self.rank, self.cfg))
        self._beat()
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Stop and join both threads."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._sock is not None:
            try:
                self._send("bye")  # silence from now on is on purpose
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes the events thread
            except OSError:
                pass  # the agent already closed it
        for t in self._threads:
            if t.is_alive():
                t.join()
        if self._sock is not None:
            self._sock.close()

    def set_members(self, ranks: list[int], comm_bytes: int) -> None:
        """The current members, whose step all-reduces `comm_bytes` (the cost in each beat)."""
        with self._lock:
            self._comm_s = comm_cost_s(comm_bytes, len(ranks))

    def progress(self, step: int, phase: str) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r} (one of {PHASES})")
        was = self._progress[1]
        self._progress = (step, phase, time.monotonic())
        if was == "start" and phase != "start" and self._sock is not None:
            # Out of start-up: say so at once, not at the next beat. Fast steps can run far
            # within one heartbeat interval, and a rank stopped there would otherwise be
            # judged by the start-up bound (ten floors) from its last beat.
            try:
                self._beat()
            except OSError:
                pass  # the agent is gone: the heartbeat thread reports it

    def step_done(self, seconds: float) -> None:
        with self._lock:
            self._times.add(seconds)

    def gone(self) -> dict[int, Gone]:
        with self._lock:
            return dict(self._gone)

    def news(self) -> int:
        with self._lock:
            return self._news

    def wait_news(self, seen: int, timeout_s: float) -> int:
        """Block until an event arrives after `seen` (a count from `news`) or `timeout_s` passes,
        or the agent is gone; returns the count."""
        with self._lock:
            self._lock.wait_for(lambda: self._news != seen or self._lost_reason is not None, timeout_s)
            return self._news

    def _lost(self, reason: str) -> None:
        with self._lock:
            if self._lost_reason is not None or self._stop.is_set():
                return
            self._lost_reason = reason
            self._lock.notify_all()
        log.error("rank %d: %s", self.rank, reason)
        self._on_store_lost(reason)

    def join(self, record: JoinRecord, timeout_s: float) -> tuple[str, str] | None:
        """Send `record` to the node agent, which writes its node's records in one request
        (`joins.JoinBatcher`), and wait up to `timeout_s` for its answer: ("joined", the current
        epoch), ("gone", why), ("failed", the store's error) or None (no answer in time: the
        caller joins directly; or the agent fenced the node or is gone: the caller leaves)."""
        if self._sock is None or self._stop.is_set():
            return None
        applied = record.applied
        with self._lock:
            self._joins.pop(applied, None)
        try:
            self._send("join " + record.to_entry().replace(" ", ""))
        except OSError:
            return None
        with self._lock:
            self._lock.wait_for(lambda: applied in self._joins or self._lost_reason is not None or self._fenced,
                                timeout_s)
            answer = self._joins.pop(applied, None)
            if answer is None and (self._lost_reason is not None or self._fenced):
                return None  # the caller leaves (its `on_fenced`, `on_store_lost` were called)
        if answer is None:
            log.warning("rank %d: the node agent did not answer its join within %g s: it joins by itself",
                        self.rank, timeout_s)
            return None
        word, rest = answer
        if word == "joined" and rest.isdigit():
            return "joined", rest
        if word == "joingone":
            return "gone", rest
        return "failed", rest  # nojoin: the store failed the agent's call

    def report(self, line: str) -> None:
        """Tell the agent something for its metrics (a `metrics.recovery_line`); an agent that
        is gone is the heartbeat thread's news, not this caller's."""
        if self._sock is None or self._stop.is_set():
            return
        try:
            self._send(line)
        except OSError:
            pass

    def _send(self, line: str) -> None:
        assert self._sock is not None
        with self._send_lock:
            self._sock.sendall((line + "\n").encode())

    def _events_loop(self) -> None:
        assert self._sock is not None
        buf = b""
        while True:
            try:
                self._sock.settimeout(None)
                data = self._sock.recv(65536)
            except OSError as e:
                data, why = b"", str(e)
            else:
                why = "it closed the connection"
            if self._stop.is_set():
                return
            if not data:
                self._lost(f"the node agent (resilient-run) is gone: {why}")
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                self._message(line.decode())

    def _message(self, line: str) -> None:
        word, _, rest = line.partition(" ")
        if word == "lost":
            self._lost(rest)
            return
        if word in ("joined", "joingone", "nojoin"):  # the answer to `join`: "<word> <applied> <rest>"
            applied, _, rest = rest.partition(" ")
            if applied.lstrip("-").isdigit():
                with self._lock:
                    self._joins[int(applied)] = (word, rest)
                    self._lock.notify_all()
            return
        if word == "fence":
            log.error("rank %d: fenced by its node agent: %s", self.rank, rest)
            with self._lock:
                self._news += 1
                self._fenced = True
                self._lock.notify_all()
            if self._on_fenced is not None:
                self._on_fenced(rest)
            return
        try:  # the agent checked it; a worker trusts nothing it parses either
            ev = json.loads(rest)
            gones = [Gone.from_dict(g) for g in ev.get("gone", [])]
        except (ValueError, TypeError, AttributeError) as e:
            log.warning("rank %d: ignoring a malformed event from the node agent (%s): %.80s", self.rank, e, rest)
            return
        with self._lock:
            for g in gones:
                self._gone.setdefault(g.rank, g)
            self._news += 1
            self._lock.notify_all()
        for g in gones:
            self._on_gone(g)

    def _beat(self) -> None:
        assert self._sock is not None
        with self._send_lock:  # beats leave in the order of their numbers (two threads send them)
            with self._lock:
                self._seq += 1
                seq, (step, phase, since) = self._seq, self._progress
                p99, comm = self._times.p99(), self._comm_s
            line = f"hb {seq} {step} {phase} {1e3 * (time.monotonic() - since):.1f} {1e3 * p99:.3f} {1e3 * comm:.3f}\n"
            self._sock.sendall(line.encode())

    def _heartbeat_loop(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            next_at += self.cfg.heartbeat_s
            try:
                self._beat()
            except OSError as e:
                if not self._stop.is_set():
                    self._lost(f"the node agent (resilient-run) is gone: {e}")
                return
            # Pace the loop (not a synchronisation); after a stall, resume the cadence.
            delay = next_at - time.monotonic()
            if delay < 0:
                next_at, delay = time.monotonic(), 0.0
            self._stop.wait(delay)


__all__ = ["Detector", "DetectorConfig", "PeerView", "StepTimes", "assess", "comm_cost_s", "silence_why", "slow_bound_s",
           "straggler_why"]
