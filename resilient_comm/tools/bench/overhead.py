"""Backend overhead: the same all_reduce three ways, in the same worker processes.

- ``direct``: the TCP communicator called from the worker's thread, no torch in the loop
  (``ResilientBackend._direct_all_reduce``: k all-reduces in one C++ call);
- ``ours``: ``dist.all_reduce`` on ``resilient_tcp``: torch's dispatch, our argument checks,
  the queue to the group's worker thread, the watchdog entry, the Work and its wait;
- ``gloo``: ``dist.all_reduce`` on gloo, the baseline a user would otherwise have.

Blocks of k back-to-back synchronous ops, alternating order between repetitions; per-op time
is the slowest rank's; the table reports medians over repetitions and the overhead
``ours - direct`` (what the backend layer adds per op) and the ratio ``ours / gloo``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from resilient_comm.tools.bench.common import human_bytes, iters_for, machine, parse_size, timed_block

WAYS = ("direct", "ours", "gloo")


def _worker(ctx: Any, sizes: list[int], reps: int, block_s: float) -> list[dict]:
    import torch
    import torch.distributed as dist

    ctx.init("resilient_tcp")
    gloo = dist.new_group(backend="gloo")
    world = dist.group.WORLD
    assert world is not None
    backend: Any = world._get_backend(torch.device("cpu"))
    rows = []
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4))
        fns = {
            "direct": lambda k, t=t: backend._direct_all_reduce(t, k),
            "ours": lambda k, t=t: [dist.all_reduce(t) for _ in range(k)],
            "gloo": lambda k, t=t: [dist.all_reduce(t, group=gloo) for _ in range(k)],
        }

        def per_op(way: str, k: int, fns: dict[str, Any] = fns) -> float:
            dist.barrier(group=gloo)
            per = timed_block(lambda: fns[way](k), 1) / k
            m = torch.tensor([per], dtype=torch.float64)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=gloo)
            return float(m.item())

        iters = {w: iters_for(block_s, per_op(w, 3), 3, 5000) for w in WAYS}
        times: dict[str, list[float]] = {w: [] for w in WAYS}
        for r in range(reps):
            for w in WAYS if r % 2 == 0 else WAYS[::-1]:
                times[w].append(per_op(w, iters[w]))
        rows.append(
            {
                "bytes": t.numel() * 4,
                "iters": iters,
                "times_us": {w: [x * 1e6 for x in v] for w, v in times.items()},
            }
        )
    dist.destroy_process_group(gloo)
    dist.destroy_process_group()
    return rows


def main(argv: list[str] | None = None) -> int:
    from resilient_comm.testing import run_workers

    p = argparse.ArgumentParser(prog="resilient-comm bench overhead", description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--sizes", default="8,4K,256K,4M,16M", help="message sizes (e.g. 8,4K,1M)")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--block-ms", type=float, default=100.0)
    p.add_argument("--json", metavar="PATH", help="write the results here")
    a = p.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    print(f"backend overhead: world size {a.world_size}, sizes {a.sizes}, {a.reps} reps ...", flush=True)
    res = run_workers(_worker, a.world_size, sizes, a.reps, a.block_ms / 1000, timeout_s=900)
    bad = [r for r in res if not r.ok]
    if bad:
        print(bad[0].error)
        return 1
    rows = res[0].value
    print(
        f"{'bytes':>6} | {'direct us':>10} {'ours us':>10} {'gloo us':>10} | {'ours-direct':>11} {'ours/gloo':>9}"
    )
    for row in rows:
        med = {w: statistics.median(row["times_us"][w]) for w in WAYS}
        row["median_us"] = med
        print(
            f"{human_bytes(row['bytes']):>6} | {med['direct']:10.1f} {med['ours']:10.1f} {med['gloo']:10.1f} | "
            f"{med['ours'] - med['direct']:11.1f} {med['ours'] / med['gloo']:9.2f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": machine(), "world_size": a.world_size, "rows": rows}, f, indent=1)
    return 0
