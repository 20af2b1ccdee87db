"""The per-step commit vote and where it runs, and the back-off of the controller's polls."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def vote_device(backend: str, device: torch.device | str | None = None) -> torch.device:
    """Where the per-step commit vote runs: `device` if given; else the current accelerator
    of a device backend (resilient_nccl: CUDA, resilient_hccl: NPU), so that a GPU job's
    vote goes through the device communicator like its gradients and not through TCP; else
    the CPU."""
    if device is not None:
        return torch.device(device)
    if backend == "resilient_nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    npu = getattr(torch, "npu", None)
    if backend == "resilient_hccl" and npu is not None and npu.is_available():
        return torch.device("npu", npu.current_device())
    return torch.device("cpu")


def commit_vote(group: dist.ProcessGroup, device: torch.device) -> None:
    """The commit vote: an all_reduce(MIN) of 1 that returns only once it has completed on
    every member, or raises its error. On a device the op is stream-ordered (`wait` only
    orders the caller's stream), so the host polls it to the end: the update must not be
    applied, nor the step counted committed, before the vote is known to have landed. What
    ends the poll is the op: it completes, fails, or is failed by its deadline (the watchdog)
    or a revoke."""
    vote = torch.ones(1, dtype=torch.int32, device=device)
    work = dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=group, async_op=True)
    assert work is not None
    pace = Pacer(first_s=20e-6, cap_s=0.001)
    while not work.is_completed():
        pace.wait()
    work.wait()  # raises the op's error, if it failed


class Pacer:
    """Back-off for store polling loops (pacing only: what ends a loop is a key or a bound)."""

    def __init__(self, first_s: float = 0.0005, cap_s: float = 0.005) -> None:
        self._d, self._cap = first_s, cap_s

    def wait(self) -> None:
        time.sleep(self._d)
        self._d = min(self._cap, self._d * 1.5)
