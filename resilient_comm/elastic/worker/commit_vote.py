"""The per-step commit vote of the commit protocol (`worker.controller`), and the device it
runs on. Runs in a worker, on its training thread."""

from __future__ import annotations

import torch
import torch.distributed as dist

from resilient_comm.elastic.model.pacer import Pacer


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


__all__ = ["commit_vote", "vote_device"]
