"""N ranks of resilient_nccl on one GPU (NCCL >= 2.30, NCCL_MULTI_RANK_GPU_ENABLE=1), run by check.py:

    python3 benchmarks/gpu/multi_rank.py N

correctness of all_reduce, all_gather and reduce_scatter; all_reduce busbw against torch's
nccl where torch allows several ranks on one GPU; then rank N-1 is SIGKILLed mid-loop: the
survivors abort their group when told (as resilient-run's exit report makes the controller do:
NCCL's intra-node transports report a dead peer to nobody), shrink, and time the first correct
all_reduce after the kill. Prints `ROW name=value` lines for check.py's table and one
`RAW {json}` line.
"""

from __future__ import annotations

import json
import signal
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

from resilient_comm.testing import WorkerContext, start_workers


def _busbw(t: torch.Tensor, n: int, group) -> float:
    for _ in range(3):
        dist.all_reduce(t, group=group)
    torch.cuda.synchronize()
    reps = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(10):
            dist.all_reduce(t, group=group)
        torch.cuda.synchronize()
        reps.append((time.perf_counter() - t0) / 10)
    return 2 * (n - 1) / n * t.nbytes / statistics.median(reps) / 1e9


def worker(ctx: WorkerContext) -> dict:
    import resilient_comm

    n, r = ctx.world_size, ctx.rank
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    ctx.init("resilient_nccl", timeout_s=30)
    res: dict = {}
    x = torch.full((1 << 20,), float(r + 1), device=dev)
    dist.all_reduce(x)
    g = [torch.empty(4, device=dev) for _ in range(n)]
    dist.all_gather(g, torch.full((4,), float(r), device=dev))
    rs = torch.empty(4, device=dev)
    dist.reduce_scatter_tensor(rs, torch.ones(4 * n, device=dev))
    torch.cuda.synchronize()
    res["correct"] = bool(torch.all(x == n * (n + 1) / 2).item() and all(torch.all(g[i] == i).item() for i in range(n))
                          and torch.all(rs == n).item())
    try:
        ref = dist.new_group(backend="nccl")
        dist.all_reduce(torch.ones(1, device=dev), group=ref)
    except Exception as e:  # noqa: BLE001  (torch's nccl may refuse two ranks on one device)
        ref = None
        res["ref_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    res["busbw"] = {}
    for mib in (1, 16, 64):
        t = torch.ones(mib << 18, device=dev)
        res["busbw"][mib] = {"ours": _busbw(t, n, None), "nccl": _busbw(t, n, ref) if ref is not None else None}

    store = ctx.store()
    victim = n - 1
    if r != victim:
        def watch() -> None:  # the launcher's exit report, as the elastic controller gets it
            store.wait(["killed"])
            resilient_comm.abort(reason=f"rank {victim} was killed")
        threading.Thread(target=watch, daemon=True).start()
    y = torch.ones(1 << 16, device=dev)
    i = 0
    try:
        while True:
            dist.all_reduce(y)
            torch.cuda.synchronize()
            y.fill_(1.0)
            i += 1
            if i == 20:
                store.set(f"looping/{r}", "1")
    except dist.DistBackendError as e:
        res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    resilient_comm.shrink([victim])
    z = torch.full((8,), float(r), device=dev)
    dist.all_reduce(z)
    torch.cuda.synchronize()
    killed_at = float(store.get("killed").decode())
    res["kill_to_first_allreduce_s"] = time.time() - killed_at
    res["after_kill_correct"] = bool(torch.all(z == sum(range(n - 1))).item())
    dist.destroy_process_group()
    return res


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    with start_workers(worker, n, timeout_s=120) as w:
        for rank in range(n):
            w.wait_key(f"looping/{rank}")
        w.kill(n - 1, signal.SIGKILL)
        w.store.set("killed", repr(time.time()))
        results = w.join()
    bad = [r for r in results[:-1] if not r.ok]
    for r in bad:
        print(r.error)
    if bad:
        return 1
    v = [r.value for r in results[:-1]]
    print(f"ROW {n} ranks on one GPU: all_reduce, all_gather, reduce_scatter correct="
          f"{all(x['correct'] for x in v)}")
    for mib, b in v[0]["busbw"].items():
        ref = f"{b['nccl']:.1f} GB/s ({b['ours'] / b['nccl']:.2f}x)" if b["nccl"] else v[0].get("ref_error", "-")
        print(f"ROW {n} ranks: all_reduce {mib} MiB busbw ours / torch nccl={b['ours']:.1f} GB/s / {ref}")
    worst = max(x["kill_to_first_allreduce_s"] for x in v)
    print(f"ROW {n} ranks: SIGKILL -> survivors' error={v[0].get('error', 'none')}")
    print(f"ROW {n} ranks: SIGKILL -> shrink -> first correct all_reduce={1e3 * worst:.0f} ms (slowest survivor), "
          f"correct={all(x['after_kill_correct'] for x in v)}")
    print("RAW " + json.dumps(v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
