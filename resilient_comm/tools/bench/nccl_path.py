"""The NCCL code path's overlap, without a GPU: resilient_nccl on the NCCL emulator.

With RESILIENT_COMM_NCCL_EMULATE=1 and every kernel lasting ``--kernel-ms`` (5 ms by default),
the workers issue rounds of 8 async all_reduces back to back and measure, per round:

- the host time of each ``dist.all_reduce(..., async_op=True)`` call (a launch: the op follows
  the caller's stream, its NCCL group is settled, its end event recorded; it must not wait for
  the kernel);
- how many of the 8 were still in flight when the 8th call returned (8: none waited for another);
- how long after the first call the last op completed (the kernels run one after the other on
  the communicator's stream: about 8 kernel times).

The same async calls on resilient_tcp (the worker-thread path) and on gloo are the baselines,
measured in the same processes. Medians over rounds; the slowest rank's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from resilient_comm.tools.bench.common import machine

PATHS = ("nccl (emulated)", "resilient_tcp", "gloo")


def _worker(ctx: Any, rounds: int, numel: int) -> dict:
    import torch
    import torch.distributed as dist

    ctx.init("resilient_nccl")
    tcp = dist.new_group(backend="resilient_tcp")
    gloo = dist.new_group(backend="gloo")
    groups = {"nccl (emulated)": None, "resilient_tcp": tcp, "gloo": gloo}
    out: dict[str, dict[str, list[float]]] = {
        p: {"call_us": [], "in_flight": [], "all_done_ms": []} for p in PATHS
    }
    for name, g in groups.items():
        dist.all_reduce(torch.ones(4), group=g)  # connected
        for _ in range(rounds):
            ts = [torch.ones(numel) for _ in range(8)]
            dist.barrier(group=gloo)
            works = []
            first = time.perf_counter()
            for t in ts:
                t0 = time.perf_counter()
                works.append(dist.all_reduce(t, group=g, async_op=True))
                out[name]["call_us"].append(1e6 * (time.perf_counter() - t0))
            out[name]["in_flight"].append(float(sum(not w.is_completed() for w in works)))
            for w in works:
                w.wait()
            out[name]["all_done_ms"].append(1e3 * (time.perf_counter() - first))
    dist.destroy_process_group(tcp)
    dist.destroy_process_group(gloo)
    dist.destroy_process_group()
    return {p: {k: statistics.median(v) for k, v in d.items()} for p, d in out.items()}


def main(argv: list[str] | None = None) -> int:
    from resilient_comm.testing import run_workers

    p = argparse.ArgumentParser(prog="resilient-comm bench nccl", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--kernel-ms", type=float, default=5.0, help="device time of every emulated kernel")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--numel", type=int, default=1024, help="float32 elements per all_reduce")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    a = p.parse_args(argv)
    os.environ["RESILIENT_COMM_NCCL_EMULATE"] = "1"
    os.environ["RESILIENT_COMM_NCCL_EMULATE_KERNEL_US"] = str(int(a.kernel_ms * 1000))
    print(
        f"the NCCL code path on the emulator: {a.world_size} ranks, {a.kernel_ms:g} ms kernels, {a.rounds} rounds "
        f"of 8 async all_reduces ({a.numel * 4} bytes) ...",
        flush=True,
    )
    res = run_workers(_worker, a.world_size, a.rounds, a.numel, timeout_s=600)
    bad = [r for r in res if not r.ok]
    if bad:
        print(bad[0].error)
        return 1
    worst = {
        path: {
            k: max(r.value[path][k] if k != "in_flight" else -r.value[path][k] for r in res)
            for k in ("call_us", "in_flight", "all_done_ms")
        }
        for path in PATHS
    }
    for path in PATHS:
        worst[path]["in_flight"] = -worst[path]["in_flight"]  # the fewest in flight is the worst
    print(f"{'path':<16} | {'async call us':>13} {'in flight of 8':>14} {'8 done after ms':>15}")
    for path in PATHS:
        w = worst[path]
        print(f"{path:<16} | {w['call_us']:13.1f} {w['in_flight']:14.0f} {w['all_done_ms']:15.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine(), "args": vars(a), "medians": worst}, f, indent=1)
    return 0
