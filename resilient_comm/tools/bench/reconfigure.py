"""`resilient-comm bench reconfigure`: one SIGKILL, recovered through torch's own API.

Every stack runs the same job, written as torch's docs say to use the reconfigure API
(torch >= 2.14): ``init_process_group(backend, enable_reconfigure=True)``, handles exchanged
out of band (here through the job's TCPStore), ``dist._reconfigure(uuid, handles).wait()``,
then a loop of all_reduces. Once every rank loops, the bench SIGKILLs rank 1 (a ring
neighbour of ranks 0 and 2; the others are not). Each survivor catches the error, takes a new
handle, and reconfigures with the survivors' handles in their old order, then runs one
all_reduce whose value it checks. Measured per survivor, from the kill: the error it saw
(kill -> error), the reconfigure itself, and kill -> the first correct all_reduce; a
repetition's figure is its last survivor's (the job goes on when every rank does).

Stacks: ``gloo`` (torch's own; a rank that is not a ring neighbour of the dead one waits for
the op timeout, so gloo runs with ``--gloo-timeout`` seconds: with torch's default of 30
minutes a repetition would take 30 minutes), ``resilient_tcp`` and ``resilient_nccl`` on the
NCCL emulator (``nccl-emu``), both at torch's default timeout, and ``tcp-no-lock``:
resilient_tcp with RESILIENT_COMM_LIVENESS=0 (a death known only from the dead process's
sockets, once the kernel has torn it down). Stacks interleave within each
repetition, so a noisy machine affects them alike. Medians and p90 over repetitions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import sys
import time

import torch
import torch.distributed as dist

from resilient_comm.testing import WorkerContext, all_reduce_until_failure, start_workers
from resilient_comm.tools.bench.common import machine, p90

VICTIM = 1
STACKS = {
    "gloo": "gloo",
    "resilient_tcp": "resilient_tcp",
    "nccl-emu": "resilient_nccl",
    "tcp-no-lock": "resilient_tcp",
}


def _job(ctx: WorkerContext, stack: str, timeout_s: float | None, numel: int) -> dict:
    import resilient_comm  # noqa: F401  (registers our backends)

    if stack == "nccl-emu":
        os.environ["RESILIENT_COMM_NCCL_EMULATE"] = "1"
    if stack == "tcp-no-lock":  # the baseline: a death known once the kernel closed its sockets
        os.environ["RESILIENT_COMM_LIVENESS"] = "0"
    store = ctx.store()
    kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group(
        STACKS[stack], store=store, rank=ctx.rank, world_size=ctx.world_size, enable_reconfigure=True, **kw
    )

    def handles(key: str, members: list[int]) -> list[str]:
        store.set(f"{key}/{ctx.rank}", dist._get_reconfigure_handle())
        return [store.get(f"{key}/{m}").decode() for m in members]

    everyone = list(range(ctx.world_size))
    dist._reconfigure(1, handles("h1", everyone)).wait()
    # gloo raises RuntimeError, ours DistBackendError subclasses
    error, error_at = all_reduce_until_failure(
        store, ctx.rank, numel, announce_after=5, catch=(RuntimeError,)
    )
    survivors = [r for r in everyone if r != VICTIM]
    start = time.time()
    dist._reconfigure(2, handles("h2", survivors)).wait()
    reconfigured = time.time()
    x = torch.full((numel,), float(ctx.rank + 1))
    dist.all_reduce(x)
    correct = bool(torch.all(x == float(sum(r + 1 for r in survivors))))
    done = time.time()
    return {
        "error_at": error_at,
        "error": error,
        "reconfigure_s": reconfigured - start,
        "done": done,
        "correct": correct,
        "size": dist.get_world_size(),
    }


def _one(stack: str, world: int, timeout_s: float | None, numel: int) -> dict:
    with start_workers(_job, world, stack, timeout_s, numel, timeout_s=(timeout_s or 0) + 120) as w:
        w.wait_ranks("looping")
        killed = time.time()
        w.kill(VICTIM, signal.SIGKILL)
        results = w.join()
    rows = [r for r in results if r.rank != VICTIM]
    bad = [
        f"rank {r.rank}: {r.error.strip().splitlines()[-1] if r.error else 'no result'}"
        for r in rows
        if not r.ok
    ]
    if bad:
        return {"ok": False, "why": "; ".join(bad)}
    vals = [r.value for r in rows]
    return {
        "ok": all(v["correct"] and v["size"] == world - 1 for v in vals),
        "kill_to_error_s": max(v["error_at"] for v in vals) - killed,
        "reconfigure_s": max(v["reconfigure_s"] for v in vals),
        "kill_to_allreduce_s": max(v["done"] for v in vals) - killed,
        "per_rank_kill_to_error_s": {r.rank: round(r.value["error_at"] - killed, 4) for r in rows},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="resilient-comm bench reconfigure", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, nargs="+", default=[4, 8], help="world sizes (default 4 8)")
    p.add_argument("--reps", type=int, default=5, help="repetitions per stack and world size (default 5)")
    p.add_argument("--stacks", nargs="+", default=list(STACKS), choices=list(STACKS))
    p.add_argument(
        "--gloo-timeout",
        type=float,
        default=10.0,
        help="gloo's op timeout in seconds (default 10; ours run at torch's default, 30 min)",
    )
    p.add_argument("--numel", type=int, default=1024, help="float32 elements per all_reduce (default 1024)")
    p.add_argument("--json", help="write every run here")
    a = p.parse_args(argv)
    if not hasattr(dist, "_reconfigure"):
        print(f"torch {torch.__version__} has no reconfigure API (torch >= 2.14 has)", file=sys.stderr)
        return 2
    runs: dict[tuple[str, int], list[dict]] = {}
    total = len(a.world) * a.reps * len(a.stacks)
    n = 0
    for world in a.world:
        for rep in range(a.reps):
            for stack in a.stacks:
                n += 1
                timeout = a.gloo_timeout if stack == "gloo" else None
                r = _one(stack, world, timeout, a.numel)
                runs.setdefault((stack, world), []).append(r)
                figure = f"{r['kill_to_allreduce_s']:.3f} s" if r.get("ok") else f"FAILED {r.get('why', '')}"
                print(
                    f"[{n}/{total}] {stack:13s} world {world} rep {rep + 1}: kill -> first correct all_reduce "
                    f"{figure}",
                    flush=True,
                )
    print()
    print(
        f"SIGKILL of rank {VICTIM} -> first correct all_reduce through dist._reconfigure "
        f"(torch {torch.__version__}, {a.reps} reps, medians; the last survivor's figure)"
    )
    head = (
        f"{'stack':13s} {'world':>5s} {'op timeout':>11s} {'kill->error':>12s} {'reconfigure':>12s} "
        f"{'kill->all_reduce':>17s} {'p90':>8s} {'x ours':>7s} ok"
    )
    print(head)
    print("-" * len(head))
    summary = []
    for world in a.world:
        ours = None
        for stack in a.stacks:
            rs = runs[(stack, world)]
            good = [r for r in rs if r.get("ok")]
            if not good:
                print(f"{stack:13s} {world:5d} {'':>11s} every run failed: {rs[0].get('why', '')}")
                continue
            med = {
                k: statistics.median(r[k] for r in good)
                for k in ("kill_to_error_s", "reconfigure_s", "kill_to_allreduce_s")
            }
            if stack == "resilient_tcp":
                ours = med["kill_to_allreduce_s"]
            summary.append(
                {
                    "stack": stack,
                    "world": world,
                    "ok": f"{len(good)}/{len(rs)}",
                    **med,
                    "p90_kill_to_allreduce_s": p90([r["kill_to_allreduce_s"] for r in good]),
                }
            )
        for s in summary:
            if s["world"] != world:
                continue
            tmo = f"{a.gloo_timeout:g} s" if s["stack"] == "gloo" else "30 min"
            ratio = f"{s['kill_to_allreduce_s'] / ours:6.1f}x" if ours else "   n/a"
            print(
                f"{s['stack']:13s} {world:5d} {tmo:>11s} {s['kill_to_error_s'] * 1e3:9.1f} ms "
                f"{s['reconfigure_s'] * 1e3:9.1f} ms {s['kill_to_allreduce_s'] * 1e3:14.1f} ms "
                f"{s['p90_kill_to_allreduce_s'] * 1e3:5.0f} ms {ratio} {s['ok']}"
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "machine": machine(),
                    "torch": torch.__version__,
                    "summary": summary,
                    "runs": {f"{k[0]}/{k[1]}": v for k, v in runs.items()},
                },
                f,
                indent=1,
            )
    return 0 if all(r.get("ok") for rs in runs.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
