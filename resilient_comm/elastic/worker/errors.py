"""How a worker leaves the job: `Evicted` (it is no longer a member) and `RecoveryError` (the
job cannot go on in-process). Raised in a worker (`Controller`, `restartable`); the exit
status of an evicted worker, which its launcher ignores, is `model.env.EXIT_EVICTED`.
"""

from __future__ import annotations


class Evicted(Exception):
    """This process is no longer a member (suspected, or its replica left): it should exit."""


class RecoveryError(RuntimeError):
    """The job cannot go on in-process: no replica survived, the launcher's store is gone, or
    recovery made no progress."""


__all__ = ["Evicted", "RecoveryError"]
