"""How a worker leaves the job: `Evicted` (it is no longer a member) and `RecoveryError` (the
job cannot go on in-process; `ReplicaMismatchError`: the replicas' state differs for good).
Raised in a worker (`Controller`, `restartable`); the exit status of an evicted worker, which
its launcher ignores, is `model.env.EXIT_EVICTED`.
"""

from __future__ import annotations


class Evicted(Exception):
    """This process is no longer a member (suspected, or its replica left): it should exit."""


class RecoveryError(RuntimeError):
    """The job cannot go on in-process: no replica survived, the launcher's store is gone, or
    recovery made no progress."""


class ReplicaMismatchError(RecoveryError):
    """The dp replicas' state differs in a way going back does not heal (the same keys again
    after going back, or too many go-backs): a per-rank value compared as replicated, or a
    replica that computes differently every time. Raised on every member alike."""


__all__ = ["Evicted", "RecoveryError", "ReplicaMismatchError"]
