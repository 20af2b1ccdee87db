"""`resilient-comm demo`: N local workers all-reduce in a loop; one is SIGKILLed.

Shows what a survivor sees: a clear error within milliseconds of the kill (not a hang until
a watchdog fires), while its process stays alive; the survivors then build a new group
among themselves and carry on. The elastic controller (agreement, state restore, resume at
a committed step) builds on exactly these moves.
"""

from __future__ import annotations

import argparse
import datetime
import signal
import time

import torch
import torch.distributed as dist

from resilient_comm.testing import WorkerContext, start_workers


def _worker(ctx: WorkerContext, victim: int, steps_before_kill: int, steps_after: int, numel: int) -> dict:
    ctx.init("resilient_tcp")
    store = ctx.store()
    t = torch.ones(numel)
    step = 0
    try:
        while True:
            dist.all_reduce(t)
            t.fill_(1.0)
            step += 1
            if step == steps_before_kill:
                store.set(f"demo/reached/{ctx.rank}", "1")
    except dist.DistBackendError as e:
        failed_at = time.time()
        error = str(e).splitlines()[0]
    dist.destroy_process_group()

    survivors = [r for r in range(ctx.world_size) if r != victim]
    rebuilt_start = time.time()
    dist.init_process_group(
        "resilient_tcp",
        store=dist.PrefixStore("demo/gen1/", store),
        rank=survivors.index(ctx.rank),
        world_size=len(survivors),
        timeout=datetime.timedelta(seconds=ctx.timeout_s),
    )
    x = torch.ones(numel)
    for _ in range(steps_after):
        dist.all_reduce(x)
        x.fill_(1.0)
    done_at = time.time()
    dist.destroy_process_group()
    return {
        "steps": step,
        "failed_at": failed_at,
        "error": error,
        "rebuilt_s": done_at - rebuilt_start,
        "first_step_at": done_at,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="resilient-comm demo", description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4, help="worker processes (default 4)")
    p.add_argument("--victim", type=int, default=None, help="rank to SIGKILL (default: the middle one)")
    p.add_argument("--kill-after", type=int, default=50, help="all_reduces every rank completes before the kill")
    p.add_argument("--steps-after", type=int, default=20, help="all_reduces the survivors run afterwards")
    p.add_argument("--numel", type=int, default=1 << 18, help="float32 elements per all_reduce")
    p.add_argument("--timeout", type=float, default=30.0, help="op timeout in seconds (never waited out)")
    a = p.parse_args(argv)
    if a.nproc < 2:
        p.error("--nproc must be at least 2")
    victim = a.nproc // 2 if a.victim is None else a.victim
    if not 0 <= victim < a.nproc:
        p.error(f"--victim must be in [0, {a.nproc})")

    print(f"starting {a.nproc} workers (resilient_tcp, op timeout {a.timeout:.0f} s) ...", flush=True)
    t0 = time.time()
    with start_workers(_worker, a.nproc, victim, a.kill_after, a.steps_after, a.numel, timeout_s=a.timeout) as w:
        for r in range(a.nproc):
            w.wait_key(f"demo/reached/{r}")
        print(f"all workers past step {a.kill_after} after {time.time() - t0:.1f} s; SIGKILL rank {victim}", flush=True)
        w.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        results = w.join()

    print()
    print(f"{'rank':>4}  {'detected after':>14}  {'survivors rebuilt + ' + str(a.steps_after) + ' steps':>26}  error")
    ok = True
    for r in results:
        if r.rank == victim:
            print(f"{r.rank:>4}  {'(killed)':>14}")
            continue
        if not r.ok:
            ok = False
            print(f"{r.rank:>4}  FAILED: {r.error.splitlines()[0]}")
            continue
        v = r.value
        print(f"{r.rank:>4}  {1000 * (v['failed_at'] - killed_at):>11.1f} ms  {v['rebuilt_s']:>24.3f} s  {v['error'][:110]}")
    if ok:
        worst = max(r.value["failed_at"] for r in results if r.rank != victim) - killed_at
        resumed = max(r.value["first_step_at"] for r in results if r.rank != victim) - killed_at
        print()
        print(f"every survivor detected the failure within {1000 * worst:.0f} ms (op timeout: {a.timeout:.0f} s);")
        print(f"the {a.nproc - 1} survivors were training again {resumed:.2f} s after the kill, in the same processes.")
    return 0 if ok else 1
