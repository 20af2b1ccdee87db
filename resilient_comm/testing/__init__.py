"""Helpers for multi-process tests and benchmarks: real processes, real sockets."""

from resilient_comm.testing.harness import (
    WorkerContext,
    WorkerResult,
    Workers,
    all_reduce_until_failure,
    run_workers,
    start_workers,
    wait_for,
)

__all__ = [
    "WorkerContext",
    "WorkerResult",
    "Workers",
    "all_reduce_until_failure",
    "run_workers",
    "start_workers",
    "wait_for",
]
