"""Collectives benchmark: resilient_tcp against gloo, in the same worker processes.

For each world size, one set of worker processes is started (``resilient_comm.testing``).
Each worker inits the default group with ``resilient_tcp`` ("ours") and makes a gloo group
over the same ranks. For every (op, size) both backends then run in the same processes, on
the same tensors, alternating blocks:

1. one verified op per backend (the result is checked, so a fast wrong answer cannot win);
2. a warm-up block per backend (not reported), whose time, maxed over ranks, gives the
   per-op estimate from which that backend's iterations per block ``k`` are chosen so that a
   block lasts about ``--block-ms``, with at least ``--min-iters`` (each backend gets the
   same block duration, not the same ``k``: a slow backend would otherwise leave the fast
   one with a handful of iterations);
3. ``reps`` repetitions; in each, one timed block of ``k`` back-to-back ops per backend, in
   alternating order (ours first on even repetitions, gloo first on odd ones), each block
   preceded by a barrier on the gloo group that is outside the timed region.

Timing: every op is issued synchronously (``async_op=False``: the call returns after the
op's ``Work.wait()``), so a block is ``k`` ops back to back with no barrier in between and
the last op's own completion as the final synchronisation. Each rank measures its own block
time; a block's per-op time is ``max over ranks (block time / k)``, i.e. the slowest rank,
which is when the collective has finished everywhere. The reported latency is the median
over repetitions of those per-op times.

Bandwidth, as in nccl-tests (GB/s = 1e9 bytes/s):

- ``algbw = bytes / time``, where ``bytes`` is the tensor size for all_reduce and broadcast,
  and the size of the whole gathered / scattered tensor (``world_size`` x the per-rank
  chunk) for all_gather and reduce_scatter;
- ``busbw = algbw * factor``, factor ``2(n-1)/n`` for all_reduce, ``(n-1)/n`` for all_gather
  and reduce_scatter, ``1`` for broadcast.

Tensors are float32 (reductions are SUM); a size is rounded up to a whole number of
elements, and for all_gather / reduce_scatter to a whole number of elements per rank, so at
8 B with 4 ranks those two ops move 16 B (the ``bytes`` column shows what was moved).

Entry point: :func:`main` (``resilient-comm bench collectives ...``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from resilient_comm.tools.bench.common import human_bytes, iters_for, machine, parse_size, timed_block

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
DEFAULT_SIZES = (8, 64, 512, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
DEFAULT_WORLD_SIZES = (2, 4)
ELEM = 4  # float32

# Project targets (on the reference 2-core machine).
LATENCY_TARGET_BYTES = 8  # ours <= 1.0x gloo latency at this nominal size
BANDWIDTH_TARGET_MIN_BYTES = 1 << 20  # ours >= 1.0x gloo busbw at sizes >= this
# With same-host payloads through shared memory (issue #18): all_reduce busbw vs gloo at >= 1 MiB
# by world size, 8 B latency, and the absolute busbw at 64 MiB on 2 ranks.
SHM_BUSBW_X = {2: 2.0, 4: 1.5}
SHM_LATENCY_X = 0.5
SHM_BUSBW_64MIB_GBPS = 3.0


def memcpy_GBps(nbytes: int = 64 << 20, reps: int = 9) -> float:
    """Median bandwidth of one process copying `nbytes` between two buffers (torch's copy,
    this process's threads): the limit a same-host data path moves bytes toward."""
    import torch

    a = torch.ones(nbytes // 4)
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        b.copy_(a)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


def busbw_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown op {op!r}")


def actual_bytes(op: str, nominal: int, n: int) -> int:
    """Bytes the op moves for a nominal size: whole float32 elements, whole chunks per rank."""
    unit = ELEM * n if op in ("all_gather", "reduce_scatter") else ELEM
    return max(unit, -(-nominal // unit) * unit)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad list of integers {text!r}") from None
    if not values or any(v < 2 for v in values):
        raise argparse.ArgumentTypeError("world sizes must be integers >= 2")
    return values


def _op_list(text: str) -> list[str]:
    values = [v for v in text.replace(",", " ").split() if v]
    bad = [v for v in values if v not in OPS]
    if bad or not values:
        raise argparse.ArgumentTypeError(f"unknown op(s) {bad}; choose from {', '.join(OPS)}")
    return values


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


_OpParts = tuple[Callable[[Any], Callable[[], None]], Callable[[], None], Callable[[], "str | None"]]


def _make_op(op: str, nbytes: int, n: int, rank: int) -> _OpParts:
    """Tensors for one (op, size), shared by both backends.

    Returns (bind(group) -> zero-arg op, reset() -> refill inputs with the check pattern,
    check() -> None or an error text about the last op's result).
    """
    import torch
    import torch.distributed as dist

    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    numel = nbytes // ELEM
    v = float(rank + 1)
    total = n * (n + 1) / 2  # sum over ranks of (rank + 1)

    if op == "all_reduce":
        t = torch.empty(numel, dtype=torch.float32)

        def bind(g):
            return lambda: dist.all_reduce(t, group=g)

        def reset():
            t.fill_(v)

        def check():
            if not bool((t == total).all()):
                return f"all_reduce: expected {total}, got {t[:4].tolist()}..."
            t.zero_()  # timed iterations reduce zeros: no overflow, no denormals
            return None

    elif op == "all_gather":
        inp = torch.empty(numel // n, dtype=torch.float32)
        out = torch.empty(numel, dtype=torch.float32)

        def bind(g):
            return lambda: all_gather(out, inp, group=g)

        def reset():
            inp.fill_(v)
            out.fill_(-1.0)

        def check():
            want = torch.arange(1, n + 1, dtype=torch.float32).unsqueeze(1).expand(n, numel // n)
            if not torch.equal(out.view(n, -1), want):
                return f"all_gather: wrong result {out[:8].tolist()}..."
            return None

    elif op == "reduce_scatter":
        inp = torch.empty(numel, dtype=torch.float32)
        out = torch.empty(numel // n, dtype=torch.float32)

        def bind(g):
            return lambda: reduce_scatter(out, inp, group=g)

        def reset():
            # chunk j on rank r holds (j + 1) * (r + 1): rank r receives (r + 1) * total
            inp.view(n, -1).copy_(torch.arange(1, n + 1, dtype=torch.float32).unsqueeze(1) * v)
            out.fill_(-1.0)

        def check():
            if not bool((out == (rank + 1) * total).all()):
                return f"reduce_scatter: expected {(rank + 1) * total}, got {out[:4].tolist()}..."
            return None

    elif op == "broadcast":
        t = torch.empty(numel, dtype=torch.float32)

        def bind(g):
            return lambda: dist.broadcast(t, 0, group=g)

        def reset():
            t.fill_(v)

        def check():
            if not bool((t == 1.0).all()):
                return f"broadcast: expected 1.0, got {t[:4].tolist()}..."
            return None

    else:
        raise ValueError(op)
    return bind, reset, check


def _worker(ctx: Any, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist

    ctx.init("resilient_tcp")
    n, rank = ctx.world_size, ctx.rank
    world = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    groups = {"ours": world, "gloo": gloo}
    names = ("ours", "gloo")

    def agree_max(values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=gloo)
        return t.tolist()

    records = []
    for op in cfg["ops"]:
        for nominal in cfg["sizes"]:
            nbytes = actual_bytes(op, nominal, n)
            bind, reset, check = _make_op(op, nbytes, n, rank)
            fns = {name: bind(groups[name]) for name in names}

            # 1. one verified op per backend (its time is a first, pessimistic estimate)
            first = []
            for name in names:
                reset()
                dist.barrier(group=gloo)
                first.append(timed_block(fns[name], 1))
                err = check()
                if err:
                    raise RuntimeError(f"[{name}] rank {rank}, {nbytes} B: {err}")
            first = agree_max(first)

            # 2. warm-up block per backend, timed to choose its iterations per block
            warm = {name: iters_for(cfg["warmup_s"], t, 1, cfg["max_iters"]) for name, t in zip(names, first)}
            est = []
            for name in names:
                dist.barrier(group=gloo)
                est.append(timed_block(fns[name], warm[name]))
            est = agree_max(est)
            iters = {
                name: iters_for(cfg["block_s"], t, cfg["min_iters"], cfg["max_iters"])
                for name, t in zip(names, est)
            }

            # 3. timed repetitions, alternating which backend goes first
            times: dict[str, list[float]] = {name: [] for name in names}
            for r in range(cfg["reps"]):
                for name in names if r % 2 == 0 else names[::-1]:
                    dist.barrier(group=gloo)
                    times[name].append(timed_block(fns[name], iters[name]))
            records.append(
                {
                    "op": op,
                    "nominal_bytes": nominal,
                    "bytes": nbytes,
                    "iters": iters,
                    "warmup_iters": warm,
                    "times": times,
                }
            )
            if rank == 0 and cfg["progress"]:
                print(
                    f"  [world {n}] {op:<14} {human_bytes(nbytes):>5}  "
                    f"ours {statistics.median(times['ours']) * 1e6:10.1f} us  "
                    f"gloo {statistics.median(times['gloo']) * 1e6:10.1f} us  (rank 0)",
                    file=sys.stderr,
                    flush=True,
                )
            del fns, bind, reset, check

    dist.barrier(group=gloo)
    import resilient_comm

    info = {
        "torch_threads": torch.get_num_threads(),
        "pid": os.getpid(),
        "shm_peers": resilient_comm.shm_peers(),
    }
    dist.destroy_process_group(gloo)
    dist.destroy_process_group()
    return {"records": records, "info": info}


# --------------------------------------------------------------------------------------------
# Driver side
# --------------------------------------------------------------------------------------------


def _summarise(world_size: int, worker_values: list[dict]) -> list[dict]:
    """Combine per-rank block times: per block, the slowest rank; then stats over blocks."""
    rows = []
    per_rank = [v["records"] for v in worker_values]
    for i, rec in enumerate(per_rank[0]):
        op, nbytes = rec["op"], rec["bytes"]
        factor = busbw_factor(op, world_size)
        row: dict[str, Any] = {
            "world_size": world_size,
            "op": op,
            "nominal_bytes": rec["nominal_bytes"],
            "bytes": nbytes,
            "iters": rec["iters"],
            "warmup_iters": rec["warmup_iters"],
            "busbw_factor": factor,
        }
        for name in ("ours", "gloo"):
            blocks = [
                max(recs[i]["times"][name][b] for recs in per_rank) for b in range(len(rec["times"][name]))
            ]
            med = statistics.median(blocks)
            algbw = nbytes / med / 1e9
            row[name] = {
                "time_s": med,
                "min_s": min(blocks),
                "max_s": max(blocks),
                "blocks_s": blocks,
                "rank0_time_s": statistics.median(rec["times"][name]),
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * factor,
            }
        row["latency_ratio"] = row["ours"]["time_s"] / row["gloo"]["time_s"]
        row["busbw_ratio"] = row["ours"]["busbw_GBps"] / row["gloo"]["busbw_GBps"]
        rows.append(row)
    return rows


def _targets(rows: list[dict], shm: bool = False) -> dict:
    lat = [r for r in rows if r["nominal_bytes"] == LATENCY_TARGET_BYTES]
    bw = [r for r in rows if r["nominal_bytes"] >= BANDWIDTH_TARGET_MIN_BYTES]

    def desc(r: dict, key: str) -> str:
        return f"world {r['world_size']} {r['op']} {human_bytes(r['bytes'])}: {r[key]:.2f}x"

    out = {}
    if shm:
        ar = [r for r in rows if r["op"] == "all_reduce"]
        lat2 = [r for r in ar if r["world_size"] == 2 and r["nominal_bytes"] == LATENCY_TARGET_BYTES]
        if lat2:
            miss = [desc(r, "latency_ratio") for r in lat2 if r["latency_ratio"] > SHM_LATENCY_X]
            out["shm_latency_8B"] = {
                "target": f"shm: all_reduce latency <= {SHM_LATENCY_X}x gloo at 8 B, 2 ranks",
                "checked": len(lat2),
                "met": len(lat2) - len(miss),
                "all_met": not miss,
                "misses": miss,
            }
        for ws, x in SHM_BUSBW_X.items():
            sel = [
                r for r in ar if r["world_size"] == ws and r["nominal_bytes"] >= BANDWIDTH_TARGET_MIN_BYTES
            ]
            if sel:
                miss = [desc(r, "busbw_ratio") for r in sel if r["busbw_ratio"] < x]
                out[f"shm_busbw_{ws}"] = {
                    "target": f"shm: all_reduce busbw >= {x}x gloo at >= 1 MiB, {ws} ranks",
                    "checked": len(sel),
                    "met": len(sel) - len(miss),
                    "all_met": not miss,
                    "misses": miss,
                }
        big = [r for r in ar if r["world_size"] == 2 and r["nominal_bytes"] == 64 << 20]
        if big:
            miss = [
                f"{r['ours']['busbw_GBps']:.2f} GB/s"
                for r in big
                if r["ours"]["busbw_GBps"] < SHM_BUSBW_64MIB_GBPS
            ]
            out["shm_busbw_64MiB"] = {
                "target": f"shm: all_reduce busbw >= {SHM_BUSBW_64MIB_GBPS:g} GB/s at 64 MiB, 2 ranks",
                "checked": len(big),
                "met": len(big) - len(miss),
                "all_met": not miss,
                "misses": miss,
            }
    if lat:
        miss = [desc(r, "latency_ratio") for r in lat if r["latency_ratio"] > 1.0]
        out["latency_8B"] = {
            "target": "ours latency <= 1.0x gloo at 8 B",
            "checked": len(lat),
            "met": len(lat) - len(miss),
            "all_met": not miss,
            "misses": miss,
        }
    if bw:
        miss = [desc(r, "busbw_ratio") for r in bw if r["busbw_ratio"] < 1.0]
        out["busbw_ge_1MiB"] = {
            "target": "ours busbw >= 1.0x gloo at >= 1 MiB",
            "checked": len(bw),
            "met": len(bw) - len(miss),
            "all_met": not miss,
            "misses": miss,
        }
    return out


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'op':<14} {'bytes':>6} {'iters o/g':>10} | {'ours us':>10} {'gloo us':>10} {'lat x':>6} | "
        f"{'ours algbw':>10} {'ours busbw':>10} {'gloo algbw':>10} {'gloo busbw':>10} {'busbw x':>7}"
    )
    lines = []
    for ws in sorted({r["world_size"] for r in rows}):
        lines.append(
            f"world size {ws}   (latency: median over blocks of the slowest rank's per-op time; "
            f"bandwidth in GB/s; x = ours/gloo)"
        )
        lines.append(head)
        lines.append("-" * len(head))
        for r in (r for r in rows if r["world_size"] == ws):
            o, g = r["ours"], r["gloo"]
            iters = f"{r['iters']['ours']}/{r['iters']['gloo']}"
            lines.append(
                f"{r['op']:<14} {human_bytes(r['bytes']):>6} {iters:>10} | "
                f"{o['time_s'] * 1e6:>10.1f} {g['time_s'] * 1e6:>10.1f} {r['latency_ratio']:>6.2f} | "
                f"{o['algbw_GBps']:>10.3f} {o['busbw_GBps']:>10.3f} {g['algbw_GBps']:>10.3f} "
                f"{g['busbw_GBps']:>10.3f} {r['busbw_ratio']:>7.2f}"
            )
        lines.append("")
    return "\n".join(lines)


def format_targets(targets: dict) -> str:
    lines = []
    for t in targets.values():
        verdict = "MET" if t["all_met"] else "NOT MET"
        lines.append(f"target: {t['target']}: {verdict} ({t['met']}/{t['checked']})")
        for m in t["misses"]:
            lines.append(f"    miss: {m}")
    return "\n".join(lines)


def build_parser(prog: str = "resilient-comm bench collectives") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Latency and bus bandwidth of resilient_tcp vs gloo (same processes, interleaved).",
    )
    p.add_argument(
        "--world-sizes",
        type=_int_list,
        default=None,
        metavar="N[,N...]",
        help="world sizes to run (default: 2,4)",
    )
    p.add_argument(
        "--ops",
        type=_op_list,
        default=None,
        metavar="OP[,OP...]",
        help=f"ops (default: all of {','.join(OPS)})",
    )
    p.add_argument("--min-bytes", type=parse_size, default=None, help="smallest message size (default 8)")
    p.add_argument(
        "--max-bytes",
        type=parse_size,
        default=None,
        help="largest message size (default 64MiB; --quick: 1MiB)",
    )
    p.add_argument("--reps", type=int, default=None, help="timed blocks per backend (default 7; --quick: 3)")
    p.add_argument(
        "--block-ms",
        type=float,
        default=None,
        help="target duration of one timed block, picks the iterations per block (default 100; --quick: 20)",
    )
    p.add_argument(
        "--min-iters",
        type=int,
        default=None,
        help="iterations per block at least (default 3; --quick: 1); large sizes hit this",
    )
    p.add_argument("--max-iters", type=int, default=2000, help="cap on iterations per block (default 2000)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="short run (~20 s): sizes up to 1 MiB, 3 reps, 20 ms blocks, 1 iteration at least",
    )
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON to PATH")
    p.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds before a world size's workers are given up on (default 900)",
    )
    p.add_argument("--no-progress", action="store_true", help="do not print progress lines to stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    quick = args.quick
    world_sizes = args.world_sizes or list(DEFAULT_WORLD_SIZES)
    ops = args.ops or list(OPS)
    min_bytes = args.min_bytes if args.min_bytes is not None else 8
    max_bytes = args.max_bytes if args.max_bytes is not None else (1 << 20 if quick else 64 << 20)
    sizes = [s for s in DEFAULT_SIZES if min_bytes <= s <= max_bytes]
    if not sizes:
        print(
            f"no sizes between {min_bytes} and {max_bytes} bytes (sizes: {list(DEFAULT_SIZES)})",
            file=sys.stderr,
        )
        return 2
    reps = args.reps or (3 if quick else 7)
    min_iters = args.min_iters or (1 if quick else 3)
    block_ms = args.block_ms or (20.0 if quick else 100.0)
    if reps < 1 or block_ms <= 0 or min_iters < 1 or args.max_iters < min_iters:
        print("--reps, --block-ms, --min-iters must be positive, --max-iters >= --min-iters", file=sys.stderr)
        return 2
    cfg = {
        "ops": ops,
        "sizes": sizes,
        "reps": reps,
        "block_s": block_ms / 1e3,
        "warmup_s": block_ms / 1e3 / 2,
        "min_iters": min_iters,
        "max_iters": args.max_iters,
        "progress": not args.no_progress,
    }

    from resilient_comm.testing import run_workers

    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.monotonic()
    load_before = os.getloadavg()
    host = machine()
    rows: list[dict] = []
    worker_info: dict[int, Any] = {}
    for ws in world_sizes:
        if not args.no_progress:
            print(f"world size {ws}: starting {ws} workers", file=sys.stderr, flush=True)
        results = run_workers(_worker, ws, cfg, timeout_s=args.timeout)
        failed = [r for r in results if not r.ok]
        if failed:
            for r in failed:
                print(
                    f"world size {ws}, rank {r.rank} failed (exit code {r.exitcode}):\n{r.error}",
                    file=sys.stderr,
                )
            return 1
        rows.extend(_summarise(ws, [r.value for r in results]))
        worker_info[ws] = results[0].value["info"]
    copy_GBps = memcpy_GBps()  # the limit, measured in the same run
    elapsed = time.monotonic() - t0
    shm = {str(k): bool(v["shm_peers"]) for k, v in worker_info.items()}
    targets = _targets(rows, shm=any(shm.values()))
    host["memcpy_64MiB_GBps"] = round(copy_GBps, 2)
    host["shm_in_use"] = shm
    host["torch_threads_per_worker"] = {str(k): v["torch_threads"] for k, v in worker_info.items()}
    host["loadavg_before"] = list(load_before)
    host["loadavg_after"] = list(os.getloadavg())

    print()
    print(
        f"resilient_comm collectives benchmark  {started.strftime('%Y-%m-%d %H:%M UTC')}  ({elapsed:.0f} s)"
    )
    print(
        f"host: {host['cpu_count']} CPUs ({host['cpu_model']}), torch {host['torch']}, "
        f"python {host['python']}, load avg before/after "
        f"{load_before[0]:.2f}/{host['loadavg_after'][0]:.2f}"
    )
    print(
        f"float32, {reps} reps x ~{block_ms:g} ms blocks per backend, ours = resilient_tcp "
        f"(RESILIENT_COMM_ALGO={host['knobs'].get('RESILIENT_COMM_ALGO')})"
    )
    print()
    print(
        "ours' same-host payloads: "
        + ("shared-memory rings" if any(shm.values()) else "the socket (RESILIENT_COMM_SHM=0 or unavailable)")
        + f"; memcpy in one process, 64 MiB, median: {copy_GBps:.2f} GB/s (the limit)"
    )
    print()
    print(format_table(rows))
    print(format_targets(targets))

    if args.json:
        doc = {
            "benchmark": "collectives",
            "date_utc": started.isoformat(timespec="seconds"),
            "elapsed_s": round(elapsed, 1),
            "command": shlex.join([sys.executable, *sys.argv]),
            "argv": list(sys.argv[1:] if argv is None else argv),
            "host": host,
            "config": {
                "world_sizes": world_sizes,
                "ops": ops,
                "sizes": sizes,
                "reps": reps,
                "block_ms": block_ms,
                "min_iters": min_iters,
                "max_iters": args.max_iters,
                "dtype": "float32",
                "timing": "per block: max over ranks of (block time / iters); reported: median over blocks",
                "bandwidth_unit": "GB/s = 1e9 B/s",
            },
            "results": rows,
            "targets": targets,
        }
        path = os.path.abspath(args.json)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
