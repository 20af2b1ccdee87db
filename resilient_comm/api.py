"""Public API on top of torch.distributed: abort a group, ask whether it has failed.

Arguments are checked before anything reaches the communicator: a ``group`` that is not a
ProcessGroup (or None) is a TypeError, a group without a resilient_comm backend a ValueError;
either way nothing is sent and the group is untouched.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from resilient_comm import _C
from resilient_comm.config import knob_int
from resilient_comm.errors import CommError


def checked_group(group: object, caller: str) -> dist.ProcessGroup:
    """`group`, or the default group for None; a TypeError naming `caller` for anything else."""
    if group is None:
        return dist.distributed_c10d._get_default_group()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{caller}: group must be a torch.distributed.ProcessGroup or None, "
            f"got {type(group).__name__} {short_repr(group)}"
        )
    return group


def short_repr(value: object) -> str:
    """`value`'s repr, cut to 60 characters (for error messages)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def resilient_backend(group: object, caller: str = "resilient_comm") -> _C.ResilientBackend:
    """The resilient_comm backend of `group` (default: the world); a ValueError naming `caller`
    if it has none (shrink, split and the elastic controller use it too)."""
    pg = checked_group(group, caller)
    backend = pg._get_backend(torch.device("cpu"))
    if not isinstance(backend, _C.ResilientBackend):
        raise ValueError(
            f"group {pg.group_name!r} does not use a resilient_comm backend "
            f"(its CPU backend is {type(backend).__name__})"
        )
    return backend


def abort(group: dist.ProcessGroup | None = None, reason: str = "resilient_comm.abort() called") -> None:
    """Abort `group` (default: the world): every pending and later op on it fails at once.

    Returns immediately; safe from any thread, any number of times. Recovery builds a new group.
    """
    backend = resilient_backend(group, "abort")
    if not isinstance(reason, str):
        raise TypeError(f"abort: reason must be a str, got {type(reason).__name__} {short_repr(reason)}")
    backend.abort_with_reason(reason)


def errored(group: dist.ProcessGroup | None = None) -> CommError | None:
    """The first error of `group`'s communicator, or None while it is healthy.

    The error is the exception an op on the group raises (CommTimeoutError, PeerFailureError,
    ...), returned, not raised; polling it is cheap (no communication).
    """
    return resilient_backend(group, "errored").comm_error()


def shm_peers(group: dist.ProcessGroup | None = None) -> list[int]:
    """The ranks of `group` (default: the world) whose large payloads this rank moves through
    shared memory rather than the socket: same-host peers, unless RESILIENT_COMM_SHM=0. Empty
    until the group's first op has built its connections.
    """
    return list(resilient_backend(group, "shm_peers").shm_peers())


def tainted() -> str | None:
    """Why this process is tainted (an abort that did not return in time), or None."""
    return _C.tainted()


def liveness_slot() -> tuple[int, dict[str, str]] | None:
    """A liveness slot for a child process to hold ([Note: the liveness lock] in
    csrc/common/liveness.h): its fd, to pass to the child (``pass_fds``), and the environment
    that names it there. Watch it with ``_C.LivenessWatch(fd, child_pid)``, then close the fd.
    None where RESILIENT_COMM_LIVENESS=0 turns the lock off, or the system offers no memfd
    (logged; the child's death is then known from its exit)."""
    if knob_int("RESILIENT_COMM_LIVENESS", 0) == 0:
        return None
    try:
        fd = _C.liveness_slot()
    except OSError as e:
        logging.getLogger("resilient_comm").warning("no liveness slot: %s", e)
        return None
    return fd, {_C.LIVENESS_SLOT_ENV: f"{fd}:{os.fstat(fd).st_ino}"}
