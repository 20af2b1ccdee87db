"""Public API on top of torch.distributed: abort a group, ask whether it has failed."""

from __future__ import annotations

import torch
import torch.distributed as dist

from resilient_comm import _C
from resilient_comm.errors import CommError


def _backend(group: dist.ProcessGroup | None) -> _C.ResilientBackend:
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    backend = pg._get_backend(torch.device("cpu"))
    if not isinstance(backend, _C.ResilientBackend):
        raise ValueError(  # noqa: TRY004  (the documented contract: ValueError for a bad group)
            f"group {pg.group_name!r} does not use a resilient_comm backend "
            f"(its CPU backend is {type(backend).__name__})"
        )
    return backend


def abort(group: dist.ProcessGroup | None = None, reason: str = "resilient_comm.abort() called") -> None:
    """Abort `group` (default: the world): every pending and later op on it fails at once.

    Returns immediately; safe from any thread, any number of times. Recovery builds a new group.
    """
    _backend(group).abort_with_reason(reason)


def errored(group: dist.ProcessGroup | None = None) -> CommError | None:
    """The first error of `group`'s communicator, or None while it is healthy.

    The error is the exception an op on the group raises (CommTimeoutError, PeerFailureError,
    ...), returned, not raised; polling it is cheap (no communication).
    """
    return _backend(group).comm_error()


def tainted() -> str | None:
    """Why this process is tainted (an abort that did not return in time), or None."""
    return _C.tainted()
