"""Async tiered checkpoint: snapshot to host memory off the training thread, flush to local disk
in the background, restore the newest checkpoint that verifies.

Tiers. ``save()`` returns at once; a background thread copies every tensor of the state into
host buffers that are reused from save to save (pinned memory for CUDA tensors, copied on a
side stream), then writes the host copy to local disk with ``torch.save``. The training thread
is blocked only for the walk of the state's containers in ``save()`` and, when the copy is not
done yet, in ``wait_snapshot()``; measure it with ``resilient-comm bench checkpoint``.

Layout (``docs/checkpoint.md``)::

    {directory}/step-{step:08d}/rank-{rank:05d}.pt     torch.save of the host copy
    {directory}/step-{step:08d}/rank-{rank:05d}.json   manifest: step, rank, bytes, sha256

``rank`` is a mesh position, not a process: a hot spare that takes rank 3's place reads
``rank-00003.pt``. A step directory is shared by every rank of the job on the host; each rank
writes, prunes and cleans only its own files.

Durability. The data file is written as ``.rank-R.pt.tmp-PID``, fsynced, renamed into place;
then the manifest (size and SHA-256 of the data file, computed while writing) goes through the
same tmp + fsync + rename, and the step directory is fsynced. The manifest is the commit point:
a rank file without one, or whose size or checksum differs from it, is not a checkpoint. A
process killed at any point leaves the previous checkpoints untouched; its tmp files are
removed by the next checkpointer of the same rank once the writer's pid is gone.

Restore. ``load()`` tries this rank's checkpoints newest first, verifies size and checksum, and
reads the file with ``torch.load(weights_only=True)`` (no arbitrary unpickling); a checkpoint
that fails is logged with the file and the reason, and the previous one is tried.
:func:`latest_complete` finds the newest step every rank of a job can restore.

Interval. :class:`IntervalAdvisor` turns the measured stall and flush time, the failure rate and
the restart time into a checkpoint interval (Young/Daly, ``resilient_comm.sim.young_daly``).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any, Literal, cast

import torch

if TYPE_CHECKING:
    from typing_extensions import Self

from resilient_comm.sim.young_daly import daly_interval, expected_waste, job_mtbf_s, young_interval

__all__ = [
    "AsyncCheckpointer",
    "CheckpointError",
    "CheckpointStats",
    "IntervalAdvice",
    "IntervalAdvisor",
    "SaveRecord",
    "latest_complete",
    "verify",
]

log = logging.getLogger("resilient_comm.checkpoint")

kFormat = "resilient_comm.checkpoint/1"
_STEP_DIR = re.compile(r"step-(\d+)")
_TMP = re.compile(r"\.rank-(\d+)\.(?:pt|json)\.tmp-(\d+)")
_HASH_CHUNK = 8 << 20
# Leaves torch.load(weights_only=True) gives back unchanged.
_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.Size)


class CheckpointError(RuntimeError):
    """No checkpoint could be written or restored; the message names the files and the reasons."""


def step_dir(directory: str | os.PathLike, step: int) -> str:
    return os.path.join(os.fspath(directory), f"step-{step:08d}")


def rank_file(directory: str | os.PathLike, step: int, rank: int) -> str:
    return os.path.join(step_dir(directory, step), f"rank-{rank:05d}.pt")


def manifest_file(directory: str | os.PathLike, step: int, rank: int) -> str:
    return os.path.join(step_dir(directory, step), f"rank-{rank:05d}.json")


def _steps(directory: str | os.PathLike) -> list[int]:
    """Step numbers that have a directory, newest first."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted((int(m.group(1)) for n in names if (m := _STEP_DIR.fullmatch(n))), reverse=True)


# --------------------------------------------------------------------------------------------
# Verification


# Files this process has verified (or written), keyed by what a change to the file would change,
# so latest()/latest_complete() reread a file only when it changed.
_verified: dict[tuple[str, int, int, int, str], bool] = {}
_verified_lock = threading.Lock()


def _stat_key(path: str, sha256: str) -> tuple[str, int, int, int, str]:
    st = os.stat(path)
    return (path, st.st_ino, st.st_size, st.st_mtime_ns, sha256)


def verify(directory: str | os.PathLike, step: int, rank: int, *, checksum: bool = True) -> str | None:
    """Why rank ``rank``'s checkpoint of ``step`` cannot be restored, or None when it can.

    Checks that the manifest exists and parses, names this step and rank, and that the data
    file has the manifest's size and (with ``checksum``) SHA-256. Whatever the files hold, the
    answer is a reason, never an exception.
    """
    path, mpath = rank_file(directory, step, rank), manifest_file(directory, step, rank)
    try:
        with open(mpath) as f:
            m = json.load(f)
        expected, digest = int(m["bytes"]), str(m["sha256"])
        if m.get("format") != kFormat or m.get("step") != step or m.get("rank") != rank:
            return f"manifest {mpath} is for another checkpoint ({m.get('format')}, step {m.get('step')}, rank {m.get('rank')})"
    except FileNotFoundError:
        return f"no manifest {mpath} (never completed)"
    except RecursionError:
        return f"manifest {mpath} is unreadable: nested deeper than the JSON parser goes"
    except (OSError, ValueError, KeyError, TypeError, OverflowError) as e:  # OverflowError: "bytes": Infinity
        return f"manifest {mpath} is unreadable: {type(e).__name__}: {e}"
    try:
        size = os.path.getsize(path)
    except OSError as e:
        return f"{path} is missing: {e}"
    if size != expected:
        return f"{path} is truncated or overwritten: {size} bytes on disk, the manifest says {expected}"
    if not checksum:
        return None
    try:
        key = _stat_key(path, digest)
        with _verified_lock:
            if _verified.get(key):
                return None
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                h.update(chunk)
    except OSError as e:
        return f"{path} is unreadable: {e}"
    if h.hexdigest() != digest:
        return f"{path} is corrupted: SHA-256 {h.hexdigest()[:16]}... differs from the manifest's {digest[:16]}..."
    with _verified_lock:
        _verified[key] = True
    return None


def latest_complete(directory: str | os.PathLike, world_size: int, *, checksum: bool = True) -> int | None:
    """The newest step for which every rank ``0..world_size-1`` has a checkpoint that verifies.

    What a job-wide rollback restores when no peer holds a lost shard. Each rank keeps its own
    last N and may skip a save while its previous one flushes (``AsyncCheckpointer``), so the
    steps of different ranks need not line up; this looks at every step directory present.
    """
    for step in _steps(directory):
        if all(verify(directory, step, r, checksum=checksum) is None for r in range(world_size)):
            return step
    return None


# --------------------------------------------------------------------------------------------
# The state tree: containers are walked on the caller's thread, tensors copied on the worker.


@dataclasses.dataclass(frozen=True)
class _Slot:
    index: int


def _plan(obj: Any, tensors: list[torch.Tensor], where: str) -> Any:
    """A copy of ``obj``'s containers with every tensor replaced by a slot into ``tensors``."""
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided or obj.is_quantized or obj.device.type == "meta":
            raise TypeError(f"checkpoint: {where} is a {obj.layout} {obj.device.type} tensor; only dense tensors are saved")
        tensors.append(obj.detach())
        return _Slot(len(tensors) - 1)
    if isinstance(obj, _LEAVES):
        return obj
    if type(obj) in (dict, collections.OrderedDict):
        out = type(obj)()
        for k, v in obj.items():
            if not isinstance(k, (str, int, float, bool, type(None))):
                raise TypeError(f"checkpoint: {where} has a key of type {type(k).__name__}")
            out[k] = _plan(v, tensors, f"{where}[{k!r}]")
        return out
    if type(obj) in (list, tuple):
        return type(obj)(_plan(v, tensors, f"{where}[{i}]") for i, v in enumerate(obj))
    raise TypeError(
        f"checkpoint: {where} is a {type(obj).__module__}.{type(obj).__qualname__}; a state holds tensors, "
        "dicts, lists, tuples, None, bool, int, float, complex, str, bytes, torch.dtype and torch.Size"
    )


def _fill(plan: Any, buffers: list[torch.Tensor]) -> Any:
    if isinstance(plan, _Slot):
        return buffers[plan.index]
    if isinstance(plan, dict):
        out = type(plan)()
        for k, v in plan.items():
            out[k] = _fill(v, buffers)
        return out
    if type(plan) in (list, tuple):
        return type(plan)(_fill(v, buffers) for v in plan)
    return plan


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
    history: collections.deque[SaveRecord] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=64))

    def median(self, field: Literal["stall_s", "snapshot_s", "flush_s"]) -> float:
        """Median of ``field`` over the completed saves of ``history`` (nan when there is none)."""
        vals = [getattr(r, field) for r in self.history if not math.isnan(r.flush_s)]
        return statistics.median(vals) if vals else math.nan


# --------------------------------------------------------------------------------------------
# The checkpointer


class _Job:
    def __init__(self, step: int, plan: Any, tensors: list[torch.Tensor], events: dict[Any, Any]) -> None:
        self.step = step
        self.plan = plan
        self.tensors = tensors
        self.events = events  # CUDA device -> event recorded on the caller's stream at save()
        self.record = SaveRecord(step)
        self.snapshotted = threading.Event()
        self.done = threading.Event()
        self.error: BaseException | None = None


class _HashingWriter:
    """The file object torch.save writes to: hashes and counts what passes, calls the test hook."""

    def __init__(self, f: Any, path: str, hook: Callable[[str, dict[str, Any]], None] | None) -> None:
        self.f, self.path, self.hook = f, path, hook
        self.sha = hashlib.sha256()
        self.nbytes = 0

    def write(self, data: Any) -> int:
        self.sha.update(data)
        n = self.f.write(data)
        self.nbytes += n
        if self.hook is not None:
            self.hook("write", {"path": self.path, "bytes": self.nbytes})
        return n

    def flush(self) -> None:
        self.f.flush()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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
        self._remove_dead_tmp()
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
            plan = _plan(state, tensors, "state")
            events = {}
            for t in tensors:
                if t.device.type == "cuda" and t.device not in events:
                    events[t.device] = torch.cuda.current_stream(t.device).record_event()
            with self._cv:
                job = self._job
                if job is not None and not job.done.is_set():
                    if self.if_busy == "skip":
                        self.stats.skipped += 1
                        log.info("checkpoint rank %d: step %d skipped, step %d is still being written",
                                 self.rank, step, job.step)
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
                raise TimeoutError(f"checkpoint rank {self.rank} step {job.step}: host copy not taken after {timeout_s} s")
        finally:
            dt = time.perf_counter() - t0
            self.stats.blocked_s += dt
            job.record.stall_s += dt
        if job.error is not None and math.isnan(job.record.snapshot_s):
            raise CheckpointError(f"checkpoint rank {self.rank} step {job.step}: host copy failed: {job.error}") from job.error

    def wait(self, timeout_s: float | None = None) -> None:
        """Return once the last accepted save is durable on disk; raise CheckpointError (with the
        cause chained) if it failed, TimeoutError if it is not done within ``timeout_s``."""
        job = self._job
        if job is None:
            return
        t0 = time.perf_counter()
        try:
            if not job.done.wait(timeout_s):
                raise TimeoutError(f"checkpoint rank {self.rank} step {job.step}: not durable after {timeout_s} s")
        finally:
            self.stats.blocked_s += time.perf_counter() - t0
        if job.error is not None:
            raise CheckpointError(f"checkpoint rank {self.rank} step {job.step} failed: {job.error}") from job.error

    def latest(self, *, checksum: bool = True) -> int | None:
        """The newest step of this rank whose checkpoint is complete and verifies."""
        for step in _steps(self.directory):
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
        steps = [step] if step is not None else _steps(self.directory)
        failures = []
        cause: Exception | None = None
        for s in steps:
            why = verify(self.directory, s, self.rank)
            if why is None:
                try:
                    state = torch.load(rank_file(self.directory, s, self.rank), map_location=map_location, weights_only=True)
                    return s, state
                # A file that verifies but holds a malformed pickle makes torch.load raise almost
                # anything (IndexError, KeyError, AttributeError from the weights-only unpickler).
                except Exception as e:  # noqa: BLE001
                    why = f"{rank_file(self.directory, s, self.rank)} does not load: {type(e).__name__}: {e}"
                    cause = cause or e
            failures.append(f"step {s}: {why}")
            if step is None and os.path.exists(manifest_file(self.directory, s, self.rank)):
                log.warning("checkpoint rank %d: %s; falling back to an older checkpoint", self.rank, why)
        if not failures:
            raise CheckpointError(f"checkpoint rank {self.rank}: no checkpoint in {self.directory}")
        raise CheckpointError(f"checkpoint rank {self.rank}: no valid checkpoint in {self.directory}:\n  "
                              + "\n  ".join(failures)) from cause

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
            raise TimeoutError(f"checkpoint rank {self.rank}: the last save was not durable after {timeout_s} s")

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
            except BaseException as e:  # noqa: BLE001 (recorded for wait_snapshot()/wait(), never lost)
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
            except BaseException as e:  # noqa: BLE001
                self._finish(job, e)
                continue
            self._finish(job, None)

    def _finish(self, job: _Job, error: BaseException | None) -> None:
        if error is None:
            self.stats.completed += 1
        else:
            job.error = error
            self.stats.failed += 1
            log.error("checkpoint rank %d step %d failed: %s: %s (previous checkpoints are intact)",
                      self.rank, job.step, type(error).__name__, error)
        job.tensors, job.plan = [], None
        job.snapshotted.set()
        with self._cv:
            job.done.set()
            self._cv.notify_all()

    def _snapshot(self, job: _Job) -> None:
        t0 = time.perf_counter()
        bufs = self._buffers
        del bufs[len(job.tensors):]
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
        tree = _fill(job.plan, self._buffers[: len(job.tensors)])
        sdir = step_dir(self.directory, job.step)
        final, mfinal = rank_file(self.directory, job.step, self.rank), manifest_file(self.directory, job.step, self.rank)
        name = os.path.basename(final)
        tmp = os.path.join(sdir, f".{name}.tmp-{os.getpid()}")
        mtmp = os.path.join(sdir, f".{os.path.basename(mfinal)}.tmp-{os.getpid()}")
        try:
            # Another rank may remove an empty step directory it pruned just after makedirs.
            for attempt in range(3):
                os.makedirs(sdir, exist_ok=True)
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                    break
                except FileNotFoundError:
                    if attempt == 2:
                        raise
            with open(fd, "wb") as f:
                w = _HashingWriter(f, tmp, self._test_hook)
                torch.save(tree, cast(IO[bytes], w))
                f.flush()
                os.fsync(f.fileno())
            # A re-save of a step (after a rollback) first invalidates the old manifest.
            if os.path.exists(mfinal):
                os.unlink(mfinal)
            os.replace(tmp, final)
            manifest: dict[str, Any] = {
                "format": kFormat,
                "step": job.step,
                "rank": self.rank,
                "file": name,
                "bytes": w.nbytes,
                "sha256": w.sha.hexdigest(),
                "created_unix": time.time(),
                "torch": torch.__version__,
            }
            with open(mtmp, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(mtmp, mfinal)
            _fsync_dir(sdir)
        except BaseException:
            for p in (tmp, mtmp):
                try:
                    os.unlink(p)
                except OSError:
                    pass
            raise
        with _verified_lock:
            _verified[_stat_key(final, manifest["sha256"])] = True
        self._prune()
        job.record.nbytes = w.nbytes
        job.record.flush_s = self.stats.flush_s = time.perf_counter() - t0

    def _prune(self) -> None:
        """Keep this rank's newest ``keep`` complete checkpoints; remove its files in older steps."""
        steps = _steps(self.directory)
        kept = [s for s in steps if verify(self.directory, s, self.rank, checksum=False) is None][: self.keep]
        if len(kept) < self.keep:
            return
        for s in steps:
            if s >= kept[-1]:
                continue
            # Manifest first: a crash in between leaves an incomplete file, never a false checkpoint.
            for p in (manifest_file(self.directory, s, self.rank), rank_file(self.directory, s, self.rank)):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            try:
                os.rmdir(step_dir(self.directory, s))
            except OSError:
                pass  # other ranks' files, or a tmp file still there

    def _remove_dead_tmp(self) -> None:
        """Remove this rank's tmp files left by writers that are gone (killed mid-flush)."""
        for s in _steps(self.directory):
            sdir = step_dir(self.directory, s)
            try:
                names = os.listdir(sdir)
            except FileNotFoundError:
                continue
            for n in names:
                m = _TMP.fullmatch(n)
                if m and int(m.group(1)) == self.rank and not _pid_alive(int(m.group(2))):
                    log.info("checkpoint rank %d: removing %s, left by a writer that died", self.rank, n)
                    try:
                        os.unlink(os.path.join(sdir, n))
                    except FileNotFoundError:
                        pass


# --------------------------------------------------------------------------------------------
# Interval advisor


@dataclasses.dataclass(frozen=True)
class IntervalAdvice:
    """``interval_s``: compute time between the starts of two checkpoints; ``interval_steps``:
    the same in steps (when a step time was given); ``waste``: the expected fraction of time
    lost to checkpoint stalls, lost work and restarts at that interval; ``bound``: ``"daly"``
    when the formula set the interval, ``"flush"`` when the flush time did (a save cannot start
    before the previous one is durable)."""

    interval_s: float
    interval_steps: int | None
    waste: float
    young_s: float
    cost_s: float
    flush_s: float
    mtbf_s: float
    restart_s: float
    bound: Literal["daly", "flush"]


class IntervalAdvisor:
    """How often to checkpoint, from Young/Daly with an async checkpoint's two costs.

    The failure rate of the whole job: ``mtbf_s``, or ``gpus`` and ``gpu_hours_per_failure``
    (per-GPU rate × GPUs), or ``interruptions_per_hour``. ``restart_s``: detection, relaunch and
    checkpoint load.

    With an async checkpoint the cost ``c`` of Young/Daly is the training thread's stall (for a
    synchronous one, the whole write), and each failure also loses the checkpoint being
    flushed: on average ``flush_s`` more work, which adds to the restart time in the waste (and,
    like it, does not move the optimum). The interval is Daly's, but never shorter than
    ``flush_s``.
    """

    def __init__(
        self,
        *,
        mtbf_s: float | None = None,
        gpus: int | None = None,
        gpu_hours_per_failure: float | None = None,
        interruptions_per_hour: float | None = None,
        restart_s: float = 0.0,
    ) -> None:
        given = [mtbf_s is not None, gpus is not None or gpu_hours_per_failure is not None,
                 interruptions_per_hour is not None]
        if sum(given) != 1:
            raise ValueError("give exactly one failure rate: mtbf_s, gpus with gpu_hours_per_failure, "
                             "or interruptions_per_hour")
        if mtbf_s is not None:
            self.mtbf_s = float(mtbf_s)
        elif interruptions_per_hour is not None:
            if not interruptions_per_hour > 0:
                raise ValueError(f"interruptions_per_hour must be > 0, got {interruptions_per_hour}")
            self.mtbf_s = 3600.0 / interruptions_per_hour
        else:
            if gpus is None or gpu_hours_per_failure is None:
                raise ValueError("gpus and gpu_hours_per_failure go together")
            self.mtbf_s = job_mtbf_s(gpus, gpu_hours_per_failure)
        if not self.mtbf_s > 0 or restart_s < 0:
            raise ValueError(f"need MTBF > 0 and restart >= 0, got {self.mtbf_s}, {restart_s}")
        self.restart_s = float(restart_s)

    def advise(self, stall_s: float, flush_s: float = 0.0, step_s: float | None = None) -> IntervalAdvice:
        """The interval for a checkpoint that stalls training ``stall_s`` and becomes durable
        ``flush_s`` after the stall; in steps too when ``step_s`` (one step's time) is given."""
        if stall_s < 0 or flush_s < 0:
            raise ValueError(f"stall and flush times must be >= 0, got {stall_s}, {flush_s}")
        cost = max(stall_s, 1e-6)  # a stall too small to measure still costs something
        daly = daly_interval(cost, self.mtbf_s)
        interval = max(daly, flush_s)
        steps = None
        if step_s is not None:
            if not step_s > 0:
                raise ValueError(f"step time must be > 0, got {step_s}")
            steps = max(1, round(interval / step_s))
            interval = steps * step_s
        return IntervalAdvice(
            interval_s=interval,
            interval_steps=steps,
            waste=expected_waste(interval, cost, self.mtbf_s, self.restart_s + flush_s),
            young_s=young_interval(cost, self.mtbf_s),
            cost_s=stall_s,
            flush_s=flush_s,
            mtbf_s=self.mtbf_s,
            restart_s=self.restart_s,
            bound="daly" if daly >= flush_s else "flush",
        )

    def advise_from(self, stats: CheckpointStats, step_s: float | None = None) -> IntervalAdvice:
        """:meth:`advise` with the medians of a checkpointer's completed saves."""
        stall, flush = stats.median("stall_s"), stats.median("flush_s")
        if math.isnan(stall):
            raise ValueError("no completed save to measure yet")
        return self.advise(stall, flush, step_s)
