"""Exceptions of resilient_comm. All subclass torch.distributed.DistBackendError, so code
that catches torch's error keeps working; each carries the facts of the failure.

==================  ==========================================================
CommTimeoutError    an op (or init) did not finish by its deadline
CommAbortedError    the group was aborted (resilient_comm.abort(), a watchdog, shutdown)
PeerFailureError    a peer died, closed its connection, or reported its own failure
CommMismatchError   ranks disagree on an op: size, dtype, reduce op, kind or order
CommError           the base class; also anything else (a failed system call)
==================  ==========================================================

After any of these the group's communicator is finished; recovery builds a new group.
"""

from __future__ import annotations

import torch.distributed as dist


class CommError(dist.DistBackendError):
    """A collective failed. Attributes: rank, group, op, seq (None for send/recv), cause."""

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        group: str | None = None,
        op: str | None = None,
        seq: int | None = None,
        cause: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.group = group
        self.op = op
        self.seq = seq
        self.cause = cause

    def __reduce__(self):  # picklable across processes, attributes included
        return (type(self), (str(self), self.rank, self.group, self.op, self.seq, self.cause))


class CommTimeoutError(CommError):
    """An op or an init did not finish before its deadline."""


class CommAbortedError(CommError):
    """The communicator was aborted before or during the op."""


class PeerFailureError(CommError):
    """A peer died, closed its connection or reported its own failure."""


class CommMismatchError(CommError):
    """Ranks called different collectives, or the same one with different tensors."""


__all__ = ["CommAbortedError", "CommError", "CommMismatchError", "CommTimeoutError", "PeerFailureError"]
