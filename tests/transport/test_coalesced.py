"""Coalesced forms, batched send/recv and the monitored barrier."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import resilient_comm
from resilient_comm.testing import WorkerContext, run_workers


def _coalesced(ctx: WorkerContext) -> dict:
    ctx.init("resilient_tcp")
    n, r = ctx.world_size, ctx.rank
    out: dict = {}
    a, b = torch.full((3,), float(r)), torch.full((5,), float(r))
    dist.all_reduce_coalesced([a, b])
    out["all_reduce_coalesced"] = (a.tolist(), b.tolist())

    outs = [torch.empty(3 * n), torch.empty(5 * n)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(outs[0], torch.full((3,), float(r)))
        dist.all_gather_into_tensor(outs[1], torch.full((5,), float(r)))
    cm.wait()
    out["all_gather_coalesced"] = [o.tolist() for o in outs]

    rs = [torch.empty(2), torch.empty(4)]
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.reduce_scatter_tensor(rs[0], torch.arange(2 * n, dtype=torch.float32))
        dist.reduce_scatter_tensor(rs[1], torch.arange(4 * n, dtype=torch.float32))
    cm.wait()
    out["reduce_scatter_coalesced"] = [x.tolist() for x in rs]

    big = 1 << 20  # 4 MiB each way: both sends outgrow the socket buffers
    right, left = (r + 1) % n, (r - 1) % n
    recv = torch.empty(big)
    ops = [dist.P2POp(dist.isend, torch.full((big,), float(r)), right), dist.P2POp(dist.irecv, recv, left)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    out["batch_isend_irecv"] = (recv.min().item(), recv.max().item())
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
def test_coalesced_forms_and_batched_p2p() -> None:
    n = 3
    total = float(sum(range(n)))
    for res in run_workers(_coalesced, n, timeout_s=50):
        assert res.ok, res.error
        v, r = res.value, res.rank
        assert v["all_reduce_coalesced"] == ([total] * 3, [total] * 5)
        assert v["all_gather_coalesced"] == [
            [float(i) for i in range(n) for _ in range(3)],
            [float(i) for i in range(n) for _ in range(5)],
        ]
        assert v["reduce_scatter_coalesced"] == [
            [float(n * (2 * r + j)) for j in range(2)],
            [float(n * (4 * r + j)) for j in range(4)],
        ]
        assert v["batch_isend_irecv"] == (float((r - 1) % n), float((r - 1) % n))


def _monitored(ctx: WorkerContext) -> str:
    ctx.init("resilient_tcp", timeout_s=30)
    pg = dist.group.WORLD
    pg.monitored_barrier(datetime.timedelta(seconds=5), wait_all_ranks=True)  # everyone arrives
    if ctx.rank == 2:
        ctx.store().wait(["released"], datetime.timedelta(seconds=30))
        return "skipped"
    start = time.monotonic()
    try:
        pg.monitored_barrier(datetime.timedelta(seconds=1), wait_all_ranks=True)
        return "no error"
    except resilient_comm.CommError as e:
        return f"{time.monotonic() - start:.2f}|{type(e).__name__}|{e}"
    finally:
        if ctx.rank == 0:
            ctx.store().set("released", "1")


@pytest.mark.timeout(60)
def test_monitored_barrier_names_the_rank_that_did_not_arrive() -> None:
    results = run_workers(_monitored, 3, timeout_s=40)
    assert all(r.ok for r in results), [r.error for r in results]
    elapsed, kind, text = results[0].value.split("|", 2)
    assert kind == "CommTimeoutError", text
    assert "receiving from rank 2" in text and "monitored_barrier" in text, text
    # gloo's words, which code written for torch (and torch's own suite) matches on
    assert "[Rank 0]: Ranks 2 failed to pass monitoredBarrier in 1000 ms" in text, text
    assert float(elapsed) < 1.5
    _, _, text1 = results[1].value.split("|", 2)
    assert ("Rank 1 successfully reached monitoredBarrier, but received errors while waiting for send/recv "
            "from rank 0") in text1, text1
