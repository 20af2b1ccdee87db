"""The checkpointer of one rank: :class:`AsyncCheckpointer` (its snapshot and flush threads,
save / wait_snapshot / wait / load / close), the save it has in flight, and its statistics
(:class:`SaveRecord`, :class:`CheckpointStats`). The files are named, written, verified and
pruned by :mod:`resilient_comm.checkpoint.layout`; the state is planned by
:mod:`resilient_comm.checkpoint.snapshot`.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from typing_extensions import Self

from resilient_comm.checkpoint.layout import (
    CheckpointError,
    list_steps,
    manifest_file,
    prune_rank,
    rank_file,
    remove_dead_tmp,
    verify,
    write_rank_file,
)
from resilient_comm.checkpoint.snapshot import fill_tree, plan_tree

__all__ = ["AsyncCheckpointer", "CheckpointStats", "SaveRecord"]

log = logging.getLogger("resilient_comm.checkpoint")


# --------------------------------------------------------------------------------------------
# Statistics


@dataclasses.dataclass
class SaveRecord:
    """One accepted save. ``stall_s``: the caller's time in save() and in the wait_snapshot()
    that followed it; ``snapshot_s``: the host copy; ``flush_s``: write + fsync + rename +
    manifest + prune; ``nbytes``: the file's size."""

    step: int
    stall_s: float = 0.0
    snapshot_s: float = math.nan
    flush_s: float = math.nan
    nbytes: int = 0


@dataclasses.dataclass
class CheckpointStats:
    """Counters of an AsyncCheckpointer. ``blocked_s`` is the total time the caller's thread
    spent in save(), wait_snapshot() and wait(); ``skipped`` counts saves dropped because the
    previous one was still being written (``if_busy="skip"``), ``waited`` saves that waited for it
    (``if_busy="wait"``); ``history`` holds the last 64 accepted saves."""

    saves: int = 0
    skipped: int = 0
    waited: int = 0
    completed: int = 0
    failed: int = 0
    blocked_s: float = 0.0
    snapshot_s: float = math.nan
    flush_s: float = math.nan
    history: collections.deque[SaveRecord] = dataclasses.field(
        default_factory=lambda: collections.deque(maxlen=64)
    )

    def median(self, field: Literal["stall_s", "snapshot_s", "flush_s"]) -> float:
        """Median of ``field`` over the completed saves of ``history`` (nan when there is none)."""
        vals = [getattr(r, field) for r in self.history if not math.isnan(r.flush_s)]
        return statistics.median(vals) if vals else math.nan


# --------------------------------------------------------------------------------------------
# The checkpointer


class _Job:
    """An accepted save: its plan and tensors, and the events its threads set when done."""

    def __init__(self, step: int, plan: Any, tensors: list[torch.Tensor], events: dict[Any, Any]) -> None:
        self.step = step
        self.plan = plan
        self.tensors = tensors
        self.events = events  # CUDA device -> event recorded on the caller's stream at save()
        self.record = SaveRecord(step)
        self.snapshotted = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None


class AsyncCheckpointer:
    """Checkpoints of one rank (a mesh position) under ``directory``, written in the background.

    Threads: one caller thread (the training thread) calls every method. This object owns two
    more: the snapshot thread takes the host copy, then hands it to the flush thread, which
    writes the files at a lower CPU priority (``flush_nice``, Linux: the write and the checksum
    then yield the cores to training; 0 keeps the caller's priority). Order per save:
    ``save(step, state)`` → (forward/backward may run) → ``wait_snapshot()`` before the first
    in-place change to a tensor of ``state`` (the optimizer update) → optionally ``wait()``
    for durability. ``close()`` (or leaving a ``with`` block) waits for the last save and stops
    the threads.

    At most one save is in flight: its host buffers are being written to disk until it is
    durable. A ``save()`` while the previous one is still in flight is skipped (counted in
    ``stats.skipped``, never blocking) with ``if_busy="skip"``, or waits for it (counted in
    ``stats.waited`` and in ``stats.blocked_s``) with ``if_busy="wait"``. ``wait()`` then
    ``save()`` always saves.

    A failure in the background is logged at once (the previous checkpoints stay intact), counted
    in ``stats.failed`` and raised as :class:`CheckpointError` by ``wait()`` /
    ``wait_snapshot()``; the next ``save()`` tries again.

    ``close()`` is needed for the last save to be durable: the threads are daemons, so an
    interpreter that exits without it may leave a tmp file (ignored, then cleaned) behind.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        rank: int,
        *,
        keep: int = 3,
        if_busy: Literal["skip", "wait"] = "skip",
        flush_nice: int = 10,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if rank < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        if if_busy not in ("skip", "wait"):
            raise ValueError(f"if_busy must be 'skip' or 'wait', got {if_busy!r}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.rank = rank
        self.keep = keep
        self.if_busy = if_busy
        self.flush_nice = flush_nice
        self.stats = CheckpointStats()
        # Test hook, called on the worker thread: ("write", {"path", "bytes"}) after each write to
        # the tmp file (tests block here to kill a process mid-flush), ("busy", {"step"}) on the
        # caller's thread when save() starts waiting for the previous save.
        self._test_hook: Callable[[str, dict[str, Any]], None] | None = None
        self._buffers: list[torch.Tensor] = []
        self._streams: dict[Any, Any] = {}
        self._cv = threading.Condition()
        self._job: _Job | None = None  # the last accepted save
        self._queued = False  # the worker has not picked self._job up yet
        self._closed = False
        os.makedirs(self.directory, exist_ok=True)
        remove_dead_tmp(self.directory, self.rank)
        self._to_flush: _Job | None = None  # snapshot taken, handed to the flush thread
        self._snapshots_over = False
        self._threads = [
            threading.Thread(target=self._run_snapshots, name=f"checkpoint-snapshot-rank{rank}", daemon=True),
            threading.Thread(target=self._run_flushes, name=f"checkpoint-flush-rank{rank}", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- the caller's side ----

    def save(self, step: int, state: dict[str, Any]) -> bool:
        """Start a checkpoint of ``state`` at ``step``; True if accepted, False if skipped.

        Returns after walking the containers of ``state`` (they may change as soon as it
        returns); the tensors must not change until ``wait_snapshot()`` returns. Raises
        TypeError, before anything is started, for a value a checkpoint cannot hold.
        """
        t0 = time.perf_counter()
        accepted: _Job | None = None
        try:
            if self._closed:
                raise CheckpointError(f"checkpoint rank {self.rank}: save({step}) after close()")
            if step < 0:
                raise ValueError(f"step must be >= 0, got {step}")
            tensors: list[torch.Tensor] = []
            plan = plan_tree(state, tensors, "state")
            events = {}
            for t in tensors:
                if t.device.type == "cuda" and t.device not in events:
                    events[t.device] = torch.cuda.current_stream(t.device).record_event()
            with self._cv:
                job = self._job
                if job is not None and not job.done.is_set():
                    if self.if_busy == "skip":
                        self.stats.skipped += 1
                        log.info(
                            "checkpoint rank %d: step %d skipped, step %d is still being written",
                            self.rank,
                            step,
                            job.step,
                        )
                        return False
                    self.stats.waited += 1
                    if self._test_hook is not None:
                        self._test_hook("busy", {"step": step})
                    self._cv.wait_for(job.done.is_set)
                self._job = accepted = _Job(step, plan, tensors, events)
                self._queued = True
                self.stats.saves += 1
                self.stats.history.append(accepted.record)
                self._cv.notify_all()
            return True
        finally:
            dt = time.perf_counter() - t0
            self.stats.blocked_s += dt
            if accepted is not None:
                accepted.record.stall_s += dt

    def wait_snapshot(self, timeout_s: float | None = None) -> None:
        """Return once the host copy of the last accepted save is taken: from then on the
        caller may change the state's tensors. Raises CheckpointError if the copy failed."""
        job = self._job
        if job is None:
            return
        t0 = time.perf_counter()
        try:
            if not job.snapshotted.wait(timeout_s):
                raise TimeoutError(
                    f"checkpoint rank {self.rank} step {job.step}: host copy not taken after {timeout_s} s"
                )
        finally:
            dt = time.perf_counter() - t0
            self.stats.blocked_s += dt
            job.record.stall_s += dt
        if job.error is not None and math.isnan(job.record.snapshot_s):
            raise CheckpointError(
                f"checkpoint rank {self.rank} step {job.step}: host copy failed: {job.error}"
            ) from job.error

    def wait(self, timeout_s: float | None = None) -> None:
        """Return once the last accepted save is durable on disk; raise CheckpointError (with the
        cause chained) if it failed, TimeoutError if it is not done within ``timeout_s``."""
        job = self._job
        if job is None:
            return
        t0 = time.perf_counter()
        try:
            if not job.done.wait(timeout_s):
                raise TimeoutError(
                    f"checkpoint rank {self.rank} step {job.step}: not durable after {timeout_s} s"
                )
        finally:
            self.stats.blocked_s += time.perf_counter() - t0
        if job.error is not None:
            raise CheckpointError(
                f"checkpoint rank {self.rank} step {job.step} failed: {job.error}"
            ) from job.error

    def latest(self, *, checksum: bool = True) -> int | None:
        """The newest step of this rank whose checkpoint is complete and verifies."""
        for step in list_steps(self.directory):
            if verify(self.directory, step, self.rank, checksum=checksum) is None:
                return step
        return None

    def load(self, step: int | None = None, *, map_location: Any = "cpu") -> tuple[int, dict[str, Any]]:
        """``(step, state)`` of the newest checkpoint of this rank that verifies and loads.

        With ``step``, that checkpoint or CheckpointError. Without, a checkpoint that fails
        (truncated, corrupted, incomplete, unreadable) is logged as a warning naming the file
        and the reason, and the previous one is tried; CheckpointError lists every failure when
        none is left, chained to the newest step's torch.load error if there was one. Reads
        with ``torch.load(weights_only=True)``.
        """
        steps = [step] if step is not None else list_steps(self.directory)
        failures = []
        cause: Exception | None = None
        for s in steps:
            why = verify(self.directory, s, self.rank)
            if why is None:
                try:
                    state = torch.load(
                        rank_file(self.directory, s, self.rank), map_location=map_location, weights_only=True
                    )
                    return s, state
                # A file that verifies but holds a malformed pickle makes torch.load raise almost
                # anything (IndexError, KeyError, AttributeError from the weights-only unpickler).
                except Exception as e:
                    why = f"{rank_file(self.directory, s, self.rank)} does not load: {type(e).__name__}: {e}"
                    cause = cause or e
            failures.append(f"step {s}: {why}")
            if step is None and os.path.exists(manifest_file(self.directory, s, self.rank)):
                log.warning("checkpoint rank %d: %s; falling back to an older checkpoint", self.rank, why)
        if not failures:
            raise CheckpointError(f"checkpoint rank {self.rank}: no checkpoint in {self.directory}")
        raise CheckpointError(
            f"checkpoint rank {self.rank}: no valid checkpoint in {self.directory}:\n  "
            + "\n  ".join(failures)
        ) from cause

    def close(self, timeout_s: float | None = None) -> None:
        """Wait for the last save to be durable (its error is logged, not raised), stop the
        worker. Idempotent; save() afterwards raises."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for t in self._threads:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in self._threads):
            raise TimeoutError(
                f"checkpoint rank {self.rank}: the last save was not durable after {timeout_s} s"
            )

    # ---- the worker ----

    def _run_snapshots(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queued or self._closed)
                if not self._queued:
                    self._snapshots_over = True
                    self._cv.notify_all()
                    return
                job = self._job
                self._queued = False
            assert job is not None
            try:
                self._snapshot(job)
            except BaseException as e:  # recorded for wait_snapshot()/wait(), never lost
                self._finish(job, e)
                continue
            job.snapshotted.set()
            with self._cv:
                self._to_flush = job
                self._cv.notify_all()

    def _run_flushes(self) -> None:
        if self.flush_nice and sys.platform.startswith("linux"):  # per thread on Linux only
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.flush_nice)
            except OSError as e:
                log.info("checkpoint rank %d: flush thread keeps its priority: %s", self.rank, e)
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._to_flush is not None or self._snapshots_over)
                job = self._to_flush
                if job is None:
                    return
                self._to_flush = None
            try:
                self._flush(job)
            except BaseException as e:
                self._finish(job, e)
                continue
            self._finish(job, None)

    def _finish(self, job: _Job, error: BaseException | None) -> None:
        if error is None:
            self.stats.completed += 1
        else:
            job.error = error
            self.stats.failed += 1
            log.error(
                "checkpoint rank %d step %d failed: %s: %s (previous checkpoints are intact)",
                self.rank,
                job.step,
                type(error).__name__,
                error,
            )
        job.tensors, job.plan = [], None
        job.snapshotted.set()
        with self._cv:
            job.done.set()
            self._cv.notify_all()

    def _snapshot(self, job: _Job) -> None:
        t0 = time.perf_counter()
        bufs = self._buffers
        del bufs[len(job.tensors) :]
        with torch.no_grad():
            for i, src in enumerate(job.tensors):
                pin = src.device.type == "cuda"
                if i == len(bufs):
                    bufs.append(torch.empty(0))
                b = bufs[i]
                if b.shape != src.shape or b.dtype != src.dtype or (pin and not b.is_pinned()):
                    b = bufs[i] = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
                if pin:
                    stream = self._streams.get(src.device)
                    if stream is None:
                        stream = self._streams[src.device] = torch.cuda.Stream(src.device)
                    stream.wait_event(job.events[src.device])
                    with torch.cuda.stream(stream):
                        b.copy_(src, non_blocking=True)
                else:
                    b.copy_(src)
            for stream in self._streams.values():
                stream.synchronize()
        job.record.snapshot_s = self.stats.snapshot_s = time.perf_counter() - t0

    def _flush(self, job: _Job) -> None:
        t0 = time.perf_counter()
        tree = fill_tree(job.plan, self._buffers[: len(job.tensors)])
        nbytes = write_rank_file(self.directory, job.step, self.rank, tree, self._test_hook)
        prune_rank(self.directory, self.rank, self.keep)
        job.record.nbytes = nbytes
        job.record.flush_s = self.stats.flush_s = time.perf_counter() - t0
