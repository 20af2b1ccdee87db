"""The worker's side of failure detection: `Detector`, the threads that beat to the node
agent and read what it forwards, over the node-local channel (`model.channel`).

Runs in every worker (the `Controller`'s, or `restartable`'s). What a beat carries and the
dead-vs-slow bounds the agent applies to it: `model.bounds`. Neither thread touches the store.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable

from resilient_comm.elastic.model.bounds import PHASES, DetectorConfig, StepTimes, comm_cost_s
from resilient_comm.elastic.model.channel import hello_line
from resilient_comm.elastic.model.records import Gone, JoinRecord

log = logging.getLogger("resilient_comm.elastic")


class Detector:
    """The detection threads of one worker: a heartbeat thread that beats to the node agent
    (`node.agent`) and an events thread that reads what the agent forwards.
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
        self._threads = [
            threading.Thread(target=self._events_loop, name="rc-events", daemon=True),
            threading.Thread(target=self._heartbeat_loop, name="rc-heartbeat", daemon=True),
        ]

    def start(self) -> None:
        """Connect to the node agent, say hello, beat once, and start both threads."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(10.0)
            sock.connect(self._path)
        except OSError as e:
            sock.close()
            raise RuntimeError(
                f"rank {self.rank}: cannot reach the node agent at {self._path} ({e}): "
                "start workers with resilient-run"
            ) from e
        self._sock = sock
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
            self._lock.wait_for(
                lambda: applied in self._joins or self._lost_reason is not None or self._fenced, timeout_s
            )
            answer = self._joins.pop(applied, None)
            if answer is None and (self._lost_reason is not None or self._fenced):
                return None  # the caller leaves (its `on_fenced`, `on_store_lost` were called)
        if answer is None:
            log.warning(
                "rank %d: the node agent did not answer its join within %g s: it joins by itself",
                self.rank,
                timeout_s,
            )
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
            log.warning(
                "rank %d: ignoring a malformed event from the node agent (%s): %.80s", self.rank, e, rest
            )
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


__all__ = ["Detector"]
