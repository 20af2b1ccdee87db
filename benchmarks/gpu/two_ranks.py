"""Two ranks of resilient_nccl on one GPU (NCCL >= 2.30, NCCL_MULTI_RANK_GPU_ENABLE=1), run by
check.py: correctness, split latency, a mid-op abort on a missing peer, then shrink latency. Prints
`ROW name=value` lines for check.py's table."""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from resilient_comm.testing import WorkerContext, run_workers


def worker(ctx: WorkerContext) -> dict:
    import resilient_comm

    ctx.init("resilient_nccl", timeout_s=5)
    dev = torch.device("cuda", 0)
    x = torch.full((1 << 20,), float(ctx.rank + 1), device=dev)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    res = {"sum_ok": bool(torch.all(x == 3.0).item())}
    t0 = time.perf_counter()
    sub = resilient_comm.split(0)
    y = torch.ones(4, device=dev)
    dist.all_reduce(y, group=sub)
    torch.cuda.synchronize()
    res["split_ms"] = 1e3 * (time.perf_counter() - t0)
    store = ctx.store()
    if ctx.rank == 1:  # stops joining: rank 0's next op hangs on the device until its timeout
        store.wait(["done"], datetime.timedelta(seconds=60))
        return res
    t0 = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(4, device=dev), timeout=datetime.timedelta(seconds=1))
        res["hung"] = "completed?!"
    except resilient_comm.CommError as e:
        res["hung"] = f"{type(e).__name__} after {time.perf_counter() - t0:.2f} s (op timeout 1 s)"
    t0 = time.perf_counter()
    resilient_comm.shrink([1])  # the missing peer leaves; ncclCommShrink with NCCL_SHRINK_ABORT
    z = torch.ones(4, device=dev)
    dist.all_reduce(z)
    torch.cuda.synchronize()
    res["shrink_ms"] = 1e3 * (time.perf_counter() - t0)
    store.set("done", "1")
    return res


if __name__ == "__main__":
    results = run_workers(worker, 2, timeout_s=120)
    for r in results:
        if not r.ok:
            print(r.error)
    if all(r.ok for r in results):
        v = results[0].value
        print(f"ROW 2 ranks: all_reduce correct={v['sum_ok']}")
        print(f"ROW 2 ranks: split -> first all_reduce={v['split_ms']:.1f} ms")
        print(f"ROW 2 ranks: op on a missing peer={v['hung']}")
        print(f"ROW 2 ranks: shrink after it -> first all_reduce={v['shrink_ms']:.1f} ms")
