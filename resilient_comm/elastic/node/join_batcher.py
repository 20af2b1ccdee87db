"""A node's join records, written by its agent in one request per epoch.

After a failure every surviving rank joins the next epoch (`worker.rejoin.catch_up`): it checks
that it was not reported gone, proposes the epoch and puts its join record. Done by each
rank, that is a read and a transaction per rank per failure: at 16,384 ranks on etcd, 16,384
transactions, and etcd's cost is mostly per transaction, not per key (measured on a 3-member
cluster on this 2-core machine: 0.92 ms of etcd CPU for a transaction with one put, 1.43 ms
with eight; `resilient-comm bench etcd-costs`). So a worker sends its record to its node agent over the
node-local socket (``join <record>``), and the agent's `JoinBatcher` writes the records of
its node's workers together: one `Membership.propose_join` per node, once every worker it
expects has sent its record, or `window_s` after the first. The gone check needs no read:
the agent forwarded every gone event to its workers, and answers a rank it knows gone at
once. (A rank whose gone record lands after it joined is not in the decision: the decider
counts only the live ranks' records, and the rank leaves when it reads the decision.)

The answers, one line to each worker (`Detector.join`):

    joined <applied> <epoch>   the record is in: epoch `epoch` is current (applied + 1, or a
                               later one: a decision was missed, and the worker catches up)
    joingone <applied> <why>   the rank was reported gone: it must leave (`Evicted`; sent by
                               the agent at once, nothing written)
    nojoin <applied> <why>     the store failed the call (after its retry budget): the
                               worker's recovery fails as its own call would have

A worker whose agent does not answer in time (`worker.rejoin.join_wait_s`) joins by itself:
the agent saves requests, it is never needed for progress.

Runs in the node agent (``resilient-run``): `node.agent` owns the batcher.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from resilient_comm.config import knob_s
from resilient_comm.elastic.membership.protocol import Membership
from resilient_comm.elastic.model.records import JoinRecord

log = logging.getLogger("resilient_comm.joins")
ENV_JOIN_WINDOW = "RESILIENT_COMM_JOIN_WINDOW_MS"


def join_window_s() -> float:
    """How long the agent holds a node's first join record for the others
    (``RESILIENT_COMM_JOIN_WINDOW_MS``, 50 ms; the batch goes as soon as every worker it
    expects has sent its own)."""
    return knob_s(ENV_JOIN_WINDOW, 0)


Reply = Callable[[str], None]


class JoinBatcher:
    """Collects join records by the epoch their ranks hold (`applied`) and writes each batch.
    `expected()`: how many of the node's workers would join now (those alive, past hello, and
    not spares waiting).

    Who writes: after the agent forwards a gone event its events thread `help`s (its workers'
    records follow the event within milliseconds, and the next event cannot come before they
    land: it is the decision they wait for). Otherwise, or where records come later than the
    window, a thread of the batcher's own writes them (its own store connection, opened when
    it first writes: a slow store never holds up the agent's loop; a helper writes through
    the events thread's), and it is not woken while a helper is at work. That
    matters where many agents share a process (the benchmark's 256 per driver): with each
    agent's batcher thread woken by its first record and again at its window, 2,048 threads
    woke in the same moments as the events had to reach the other agents, and at 16,384 ranks
    on a TCPStore a silent node's decision took 4.0-5.1 s instead of 2.2-2.5 s."""

    def __init__(self, m: Membership, expected: Callable[[], int], window_s: float | None = None) -> None:
        self._base = m
        self._m: Membership | None = None  # the batcher thread's connection, opened when it first writes
        self._expected = expected
        self.window_s = join_window_s() if window_s is None else window_s
        lock = threading.Lock()
        self._cond = threading.Condition(lock)  # for the batcher's thread: a batch was started
        self._filled = threading.Condition(lock)  # for a helper: a record came
        self._helping = 0  # helpers at work: the batcher's thread leaves them the batches that fill
        self._batches: dict[
            int, tuple[float, dict[int, tuple[JoinRecord, Reply]]]
        ] = {}  # applied -> (first, by rank)
        self._closed = False
        self.written = 0  # batches written (for tests and the benchmark)
        self._thread = threading.Thread(target=self._run, name="rc-agent-joins", daemon=True)
        self._thread.start()

    def submit(self, record: JoinRecord, reply: Reply) -> None:
        """Queue `record` (its rank checked by the caller); `reply` gets the answer line. A
        rank's second record for the same epoch replaces its first (answered once)."""
        with self._cond:
            self._batches.setdefault(record.applied, (time.monotonic(), {}))[1][record.rank] = (record, reply)
            self._filled.notify_all()
            if not self._helping:  # (a helper wakes the batcher's thread if it leaves one)
                self._cond.notify_all()

    def expect(self) -> None:
        """A helper is coming (`help`): until then the batcher's thread leaves filled batches."""
        with self._cond:
            self._helping += 1

    def help(self, wait_s: float, m: Membership) -> None:
        """(After `expect`.) Write, on this thread and through `m` (its connection), the
        batches that fill or fall due within `wait_s`; return once none is pending, or at
        `wait_s`."""
        end = time.monotonic() + wait_s
        try:
            while True:
                with self._cond:
                    while True:
                        applied, _ = self._due(time.monotonic(), filled=True)
                        if applied is not None:
                            batch = self._batches.pop(applied)[1]
                            break
                        left = end - time.monotonic()
                        if left <= 0 or self._closed:
                            return
                        self._filled.wait(left)
                self._write(applied, batch, m)
                with self._cond:
                    if not self._batches:
                        return
        finally:
            with self._cond:
                self._helping -= 1
                if self._batches:
                    self._cond.notify_all()  # those that fill later, or fall due: the batcher's thread

    def refuse(self, record: JoinRecord, reply: Reply, why: str) -> None:
        """Answer `record` at once: its rank must leave (`why`); nothing is written."""
        _send(reply, f"joingone {record.applied} {why}")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._filled.notify_all()
        self._thread.join(timeout=5)

    def _due(self, t: float, filled: bool) -> tuple[int | None, float]:
        """(Under `_cond`.) A batch to write now, or how long until the next one is due:
        filled (if `filled`) or past its window."""
        expected = self._expected() if filled else 0
        wait = 3600.0
        for applied, (first, batch) in self._batches.items():
            if (filled and len(batch) >= expected) or t >= first + self.window_s:
                return applied, 0.0
            wait = min(wait, first + self.window_s - t)
        return None, wait

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        left = [entry for _, b in self._batches.values() for entry in b.values()]
                        self._batches.clear()
                        break
                    applied, wait = self._due(time.monotonic(), filled=not self._helping)
                    if applied is not None:
                        batch = self._batches.pop(applied)[1]
                        break
                    self._cond.wait(wait)
            if self._closed:
                for rec, reply in left:
                    _send(reply, f"nojoin {rec.applied} the node agent is stopping")
                return
            assert applied is not None  # the loop above breaks with one unless closed
            self._write(applied, batch, None)

    def _write(self, applied: int, batch: dict[int, tuple[JoinRecord, Reply]], m: Membership | None) -> None:
        """Write `batch` through `m`, or (None: the batcher's thread) its own connection."""
        try:
            if m is None:
                if self._m is None:
                    self._m = self._base.clone(timeout=datetime.timedelta(seconds=30))
                m = self._m
            epoch = m.propose_join(applied, [rec for _, (rec, _) in sorted(batch.items())])
        except (dist.DistError, ValueError) as e:
            log.warning("could not join %d ranks to epoch %d: %s", len(batch), applied + 1, e)
            for _, reply in batch.values():
                _send(reply, f"nojoin {applied} {e}")
            return
        self.written += 1
        for _, reply in batch.values():
            _send(reply, f"joined {applied} {epoch}")


def _send(reply: Reply, line: str) -> None:
    try:
        reply(" ".join(line.split("\n")))
    except OSError as e:  # the worker went away meanwhile: its exit is the launcher's news
        log.debug("could not answer a join: %s", e)


__all__ = ["ENV_JOIN_WINDOW", "JoinBatcher", "join_window_s"]
