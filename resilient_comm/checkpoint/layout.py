"""The on-disk layout of checkpoints and its verification, and the durable writing of one rank's
files: names, the step listing, ``verify`` / ``latest_complete`` (with a cache of the files
this process has verified), writing a rank file and its manifest (tmp, fsync, rename,
manifest, directory fsync), pruning a rank's old steps and removing dead writers' tmp files.

Plain functions of a directory and a rank; the threads that call them are in
:mod:`resilient_comm.checkpoint.writer`. The layout is described in docs/checkpoint.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from typing import IO, Any, cast

import torch

__all__ = [
    "CheckpointError",
    "kFormat",
    "latest_complete",
    "list_steps",
    "manifest_file",
    "prune_rank",
    "rank_file",
    "remove_dead_tmp",
    "step_dir",
    "verify",
    "write_rank_file",
]

log = logging.getLogger("resilient_comm.checkpoint")

kFormat = "resilient_comm.checkpoint/1"
_STEP_DIR = re.compile(r"step-(\d+)")
_TMP = re.compile(r"\.rank-(\d+)\.(?:pt|json)\.tmp-(\d+)")
_HASH_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """No checkpoint could be written or restored; the message names the files and the reasons."""


def step_dir(directory: str | os.PathLike, step: int) -> str:
    return os.path.join(os.fspath(directory), f"step-{step:08d}")


def rank_file(directory: str | os.PathLike, step: int, rank: int) -> str:
    return os.path.join(step_dir(directory, step), f"rank-{rank:05d}.pt")


def manifest_file(directory: str | os.PathLike, step: int, rank: int) -> str:
    return os.path.join(step_dir(directory, step), f"rank-{rank:05d}.json")


def list_steps(directory: str | os.PathLike) -> list[int]:
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
    for step in list_steps(directory):
        if all(verify(directory, step, r, checksum=checksum) is None for r in range(world_size)):
            return step
    return None


# --------------------------------------------------------------------------------------------
# Writing one rank's files


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


def write_rank_file(
    directory: str | os.PathLike,
    step: int,
    rank: int,
    tree: Any,
    hook: Callable[[str, dict[str, Any]], None] | None = None,
) -> int:
    """Write ``tree`` as rank ``rank``'s checkpoint of ``step`` durably; return the file's size.

    The data file goes through a tmp file (fsync, rename), then the manifest (size and SHA-256,
    computed while writing) the same way, then the step directory is fsynced. On any error the
    tmp files are removed and the error is raised; the previous checkpoints are untouched.
    ``hook`` is a test hook, called with ``("write", {"path", "bytes"})`` after each write to
    the tmp file.
    """
    sdir = step_dir(directory, step)
    final, mfinal = rank_file(directory, step, rank), manifest_file(directory, step, rank)
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
            w = _HashingWriter(f, tmp, hook)
            torch.save(tree, cast(IO[bytes], w))
            f.flush()
            os.fsync(f.fileno())
        # A re-save of a step (after a rollback) first invalidates the old manifest.
        if os.path.exists(mfinal):
            os.unlink(mfinal)
        os.replace(tmp, final)
        manifest: dict[str, Any] = {
            "format": kFormat,
            "step": step,
            "rank": rank,
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
            with contextlib.suppress(OSError):
                os.unlink(p)
        raise
    with _verified_lock:
        _verified[_stat_key(final, manifest["sha256"])] = True
    return w.nbytes


def prune_rank(directory: str | os.PathLike, rank: int, keep: int) -> None:
    """Keep rank ``rank``'s newest ``keep`` complete checkpoints; remove its files in older steps."""
    steps = list_steps(directory)
    kept = [s for s in steps if verify(directory, s, rank, checksum=False) is None][:keep]
    if len(kept) < keep:
        return
    for s in steps:
        if s >= kept[-1]:
            continue
        # Manifest first: a crash in between leaves an incomplete file, never a false checkpoint.
        for p in (manifest_file(directory, s, rank), rank_file(directory, s, rank)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        with contextlib.suppress(OSError):  # other ranks' files, or a tmp file still there
            os.rmdir(step_dir(directory, s))


def remove_dead_tmp(directory: str | os.PathLike, rank: int) -> None:
    """Remove rank ``rank``'s tmp files left by writers that are gone (killed mid-flush)."""
    for s in list_steps(directory):
        sdir = step_dir(directory, s)
        try:
            names = os.listdir(sdir)
        except FileNotFoundError:
            continue
        for n in names:
            m = _TMP.fullmatch(n)
            if m and int(m.group(1)) == rank and not _pid_alive(int(m.group(2))):
                log.info("checkpoint rank %d: removing %s, left by a writer that died", rank, n)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(sdir, n))
