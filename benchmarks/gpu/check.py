"""One-GPU check of resilient_nccl, prepared to run in one call on a lent GPU machine.

    PYTHONUNBUFFERED=1 python3 benchmarks/gpu/check.py --out $OUT     # builds in place, checks, measures

It needs a CUDA build of torch (the lent machine's: torch 2.11+cu130, nvidia-nccl-cu13, CMake and
ninja) and no network; it finishes in about 5 minutes on one H200. Steps (each reported, none
fatal to the others):

1. build the extension in place (pip install --no-build-isolation -e .);
2. doctor: the libnccl found, its version and features;
3. correctness at world size 1 against torch's own `nccl` group in the same process: every
   collective and dtype (fp8/uint32 data movement, PREMUL_SUM, coalesced forms included), and
   the stream semantics (inputs produced on the caller's stream, async ops, Work.wait() with no
   host wait, several ops in flight);
4. per-op host overhead of an async all_reduce: ours and ProcessGroupNCCL's, medians;
5. all_reduce busbw from 1 to 256 MiB, ours against ProcessGroupNCCL, same process;
6. latencies at world size 1: NCCL init (create -> ready), abort when idle and mid-op;
7. with NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1, 2 and 4 ranks on the one GPU
   (multi_rank.py): correctness, busbw against ProcessGroupNCCL, then a rank SIGKILLed mid-loop:
   the survivors abort (as the launcher's report makes them), shrink, and time the first correct
   all_reduce after the kill;
8. torch's reconfigure API (torch >= 2.14; skipped on older torch) at world size 1 on nccl,
   nccl2 and resilient_nccl: reconfigure + a checked all_reduce, five times.

It prints one table at the end (and writes it, with the raw numbers, to --out); paste the table
into benchmarks/README.md with the date and device.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS: list[tuple[str, str]] = []
RAW: dict = {}


def row(name: str, value: str) -> None:
    ROWS.append((name, value))
    print(f"  {name}: {value}", flush=True)


def step(name: str, fn) -> None:
    print(f"== {name}", flush=True)
    t0 = time.monotonic()
    try:
        fn()
        row(name, f"ok ({time.monotonic() - t0:.1f} s)")
    except Exception as e:  # noqa: BLE001  (report and go on)
        traceback.print_exc()
        row(name, f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")


def build() -> None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-q",
                           "-e", ROOT], env=dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 8)))


def doctor() -> None:
    from resilient_comm import _C
    from resilient_comm.tools.doctor import nccl_wheel_candidates

    info = _C.probe_nccl(nccl_wheel_candidates())
    if not info["found"]:
        raise RuntimeError(info["error"])
    row("libnccl", f"{info['version']} at {info['path']}")
    row("nccl caps", " ".join(k for k, v in info["caps"].items() if v))
    RAW["nccl"] = {"version": info["version"], "path": info["path"]}


def _init_single() -> None:
    import torch.distributed as dist

    import resilient_comm  # noqa: F401

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("resilient_nccl", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))


def _cases(torch):
    """(name, dtypes, fn(t, group)) at world size 1; fn returns the tensors to compare."""
    import torch.distributed as dist

    def all_reduce(op):
        def f(t, g):
            x = t.clone()
            dist.all_reduce(x, op=op, group=g)
            return [x]
        return f

    def reduce(t, g):
        x = t.clone()
        dist.reduce(x, 0, group=g)
        return [x]

    def broadcast(t, g):
        x = t.clone()
        dist.broadcast(x, 0, group=g)
        return [x]

    def all_gather(t, g):
        out = [torch.empty_like(t)]
        dist.all_gather(out, t, group=g)
        return out

    def all_gather_into(t, g):
        out = torch.empty_like(t)
        dist.all_gather_into_tensor(out, t, group=g)
        return [out]

    def reduce_scatter(t, g):
        out = torch.empty_like(t)
        dist.reduce_scatter(out, [t.clone()], group=g)
        return [out]

    def reduce_scatter_tensor(t, g):
        out = torch.empty_like(t)
        dist.reduce_scatter_tensor(out, t, group=g)
        return [out]

    def a2a_single(t, g):
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=g)
        return [out]

    def a2a(t, g):
        out = [torch.empty_like(t)]
        dist.all_to_all(out, [t], group=g)
        return out

    def gather(t, g):
        out = [torch.empty_like(t)]
        dist.gather(t, out, 0, group=g)
        return out

    def scatter(t, g):
        out = torch.empty_like(t)
        dist.scatter(out, [t], 0, group=g)
        return [out]

    def coalesced(t, g):
        xs = [t.clone(), t.clone() * 0 + 1]
        dist.all_reduce_coalesced(xs, group=g)
        return xs

    def premul(t, g):
        x = t.clone()
        dist.all_reduce(x, op=dist._make_nccl_premul_sum(0.5), group=g)
        return [x]

    R = dist.ReduceOp
    reducing = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32,
                torch.int64]
    moving = reducing + [torch.bool, torch.uint32, torch.float8_e4m3fn, torch.float8_e5m2]
    floats = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
    cases = [(f"all_reduce {op}", reducing, all_reduce(getattr(R, op))) for op in ("SUM", "PRODUCT", "MIN", "MAX")]
    cases += [("all_reduce AVG", floats, all_reduce(R.AVG)), ("all_reduce PREMUL_SUM", floats, premul),
              ("reduce", reducing, reduce), ("reduce_scatter", reducing, reduce_scatter),
              ("reduce_scatter_tensor", reducing, reduce_scatter_tensor), ("all_reduce_coalesced", floats, coalesced),
              ("broadcast", moving, broadcast), ("all_gather", moving, all_gather),
              ("all_gather_into_tensor", moving, all_gather_into), ("all_to_all_single", moving, a2a_single),
              ("all_to_all", moving, a2a), ("gather", moving, gather), ("scatter", moving, scatter)]
    return cases


def _sample(torch, dtype, n, dev):
    g = torch.Generator(device="cpu").manual_seed(n)
    if dtype.is_floating_point:
        x = torch.randn(n, generator=g).clamp(-8, 8)
    elif dtype == torch.bool:
        x = torch.randint(0, 2, (n,), generator=g).bool()
    else:
        x = torch.randint(0, 100, (n,), generator=g)
    return x.to(dtype).to(dev)


def correctness_ws1() -> None:
    import torch
    import torch.distributed as dist

    _init_single()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    ref = dist.new_group(backend="nccl")
    total, wrong, no_ref = 0, [], []
    for name, dtypes, fn in _cases(torch):
        for dt in dtypes:
            for n in (1, 1023, 1 << 20):
                t = _sample(torch, dt, n, dev)
                total += 1
                where = f"{name} {str(dt).replace('torch.', '')} n={n}"
                try:
                    ours = fn(t, None)
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    wrong.append(f"{where}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                    continue
                try:
                    theirs = fn(t, ref)
                    torch.cuda.synchronize()
                except Exception:  # noqa: BLE001  (torch's nccl lacks it: nothing to compare with)
                    no_ref.append(where)
                    continue
                if not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(ours, theirs)):
                    wrong.append(f"{where}: differs from torch's nccl")
    RAW["correctness_ws1"] = {"cases": total, "wrong": wrong, "no_reference": no_ref}
    row("collectives x dtypes x sizes equal to torch nccl (ws 1)",
        f"{total - len(wrong) - len(no_ref)}/{total - len(no_ref)}" + (f" ({len(no_ref)} without a torch nccl "
                                                                     f"reference, ran)" if no_ref else ""))
    if wrong:
        raise AssertionError("; ".join(wrong[:5]))

    # Stream semantics: an input produced on the caller's stream, async ops in flight, wait()
    # ordering the caller's stream after the op with no host wait.
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.zeros(1 << 24, device=dev)
        for _ in range(20):
            x.add_(1.0)  # a long producer on the caller's (side) stream
        works = [dist.all_reduce(x, async_op=True) for _ in range(8)]
        t0 = time.perf_counter()
        for w in works:
            w.wait()  # orders `side` after the ops; must not block the host
        host_wait_ms = 1e3 * (time.perf_counter() - t0)
        y = x * 2  # a consumer on `side`
    torch.cuda.synchronize()
    ok = bool(torch.all(y == 40.0).item())
    row("stream order: producer -> 8 async ops -> consumer", f"{'correct' if ok else 'WRONG'}, "
        f"wait() held the host {host_wait_ms:.2f} ms")
    RAW["stream_order"] = {"ok": ok, "host_wait_ms": host_wait_ms}
    if not ok:
        raise AssertionError("an async op did not follow the caller's stream")
    dist.destroy_process_group()


def overhead_ws1() -> None:
    import torch
    import torch.distributed as dist

    _init_single()
    ref = dist.new_group(backend="nccl")
    t = torch.ones(16, device="cuda")
    res = {}
    for name, g in (("ours", None), ("nccl", ref)):
        calls = []
        for i in range(2000):
            t0 = time.perf_counter()
            dist.all_reduce(t, group=g, async_op=True)
            calls.append(time.perf_counter() - t0)
            if i % 200 == 199:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        res[name] = 1e6 * statistics.median(calls[200:])
    row("async all_reduce call, host time (median): ours / torch nccl",
        f"{res['ours']:.1f} / {res['nccl']:.1f} us (+{res['ours'] - res['nccl']:.1f} us)")
    RAW["host_overhead_us"] = res
    dist.destroy_process_group()


def busbw_ws1() -> None:
    import torch
    import torch.distributed as dist

    _init_single()
    ref = dist.new_group(backend="nccl")
    RAW["busbw_ws1"] = {}
    for mib in (1, 4, 16, 64, 256):
        t = torch.ones(mib << 18, device="cuda")
        times = {}
        for name, g in (("ours", None), ("nccl", ref)):
            for _ in range(3):
                dist.all_reduce(t, group=g)
            torch.cuda.synchronize()
            reps = []
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(10):
                    dist.all_reduce(t, group=g)
                torch.cuda.synchronize()
                reps.append((time.perf_counter() - t0) / 10)
            times[name] = statistics.median(reps)
        RAW["busbw_ws1"][mib] = times
        row(f"all_reduce {mib} MiB, 1 rank: ours / torch nccl",
            f"{1e3 * times['ours']:.3f} / {1e3 * times['nccl']:.3f} ms ({times['nccl'] / times['ours']:.2f}x)")
    dist.destroy_process_group()


def latencies_ws1() -> None:
    import torch
    import torch.distributed as dist

    import resilient_comm
    from resilient_comm import _C

    inits: list[float] = []
    idle: list[float] = []
    mid: list[float] = []
    for _ in range(5):
        t0 = time.perf_counter()
        text = _C.nccl_init_check(60.0)
        inits.append(time.perf_counter() - t0)
        if text != "Ok":
            raise RuntimeError(text)
    for busy in (False, True) * 5:
        _init_single()
        x = torch.ones(1 << 22, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        if busy:
            for _ in range(20):
                dist.all_reduce(x, async_op=True)
        t0 = time.perf_counter()
        resilient_comm.abort()
        (mid if busy else idle).append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        dist.destroy_process_group()
    row("NCCL init, 1 rank (median of 5)", f"{1e3 * statistics.median(inits):.1f} ms")
    row("abort idle / with 20 ops in flight (median of 5)",
        f"{1e3 * statistics.median(idle):.2f} / {1e3 * statistics.median(mid):.2f} ms")
    RAW["latency_ms"] = {"init": 1e3 * statistics.median(inits), "abort_idle": 1e3 * statistics.median(idle),
                         "abort_mid": 1e3 * statistics.median(mid)}


def multi_rank() -> None:
    from resilient_comm import _C
    from resilient_comm.tools.doctor import nccl_wheel_candidates

    info = _C.probe_nccl(nccl_wheel_candidates())
    major, minor, _ = (int(x) for x in info["version"].split("."))
    if (major, minor) < (2, 30):
        row("2 and 4 ranks on one GPU", f"skipped: NCCL {info['version']} < 2.30 (no several ranks per GPU)")
        return
    env = dict(os.environ, NCCL_MULTI_RANK_GPU_ENABLE="1", PYTHONUNBUFFERED="1")
    RAW["multi_rank"] = {}
    for n in (2, 4):
        out = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "multi_rank.py"), str(n)],
                             check=False, env=env, capture_output=True, text=True, timeout=150)
        print(out.stdout[-4000:], out.stderr[-3000:])
        for line in out.stdout.splitlines():
            if line.startswith("ROW "):
                name, value = line[4:].split("=", 1)
                row(name, value)
            if line.startswith("RAW "):
                RAW["multi_rank"][n] = json.loads(line[4:])
        if out.returncode != 0:
            raise RuntimeError(f"multi_rank.py {n} exited {out.returncode}")


def reconfigure_ws1() -> None:
    """torch's reconfigure API (torch >= 2.14) at world size 1 on nccl, nccl2 and resilient_nccl:
    init with enable_reconfigure=True, reconfigure with the own handle, a CUDA all_reduce checked,
    then the same members again (a second uuid); the reconfigures' times, medians of 5."""
    import torch
    import torch.distributed as dist

    import resilient_comm  # noqa: F401

    if not hasattr(dist, "_reconfigure"):
        row("reconfigure API", f"skipped: torch {torch.__version__} has none (torch >= 2.14)")
        return
    RAW["reconfigure_ws1"] = {}
    for backend in ("nccl", "nccl2", "resilient_nccl"):
        if dist.is_initialized():
            dist.destroy_process_group()
        try:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=datetime.timedelta(seconds=60), enable_reconfigure=True)
        except Exception as e:  # noqa: BLE001  (a backend this torch lacks)
            row(f"reconfigure on {backend}", f"skipped: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            continue
        if not dist._supports_reconfigure():
            row(f"reconfigure on {backend}", "skipped: supports_reconfigure is False")
            continue
        times = []
        for uuid in range(1, 6):
            t0 = time.perf_counter()
            dist._reconfigure(uuid, [dist._get_reconfigure_handle()]).wait()
            x = torch.ones(1 << 20, device="cuda")
            dist.all_reduce(x)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            assert float(x[0]) == 1.0
        RAW["reconfigure_ws1"][backend] = times
        row(f"reconfigure + all_reduce on {backend}", f"first {times[0] * 1e3:.1f} ms, then median "
            f"{statistics.median(times[1:]) * 1e3:.1f} ms")
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None, help="folder for check.md and check.json")
    p.add_argument("--no-build", action="store_true")
    a = p.parse_args()
    import torch

    print(f"resilient_nccl GPU check, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", flush=True)
    if not a.no_build:
        step("build in place", build)
    row("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO GPU")
    row("torch", torch.__version__)
    steps = [("doctor", doctor)]
    if torch.cuda.is_available():
        steps += [("collectives and stream order at world size 1", correctness_ws1), ("host overhead", overhead_ws1),
                  ("busbw vs torch nccl, 1 rank", busbw_ws1), ("latencies at world size 1", latencies_ws1),
                  ("2 and 4 ranks on one GPU", multi_rank), ("reconfigure at world size 1", reconfigure_ws1)]
    for name, fn in steps:
        step(name, fn)
    width = max(len(n) for n, _ in ROWS)
    table = "| check | result |\n|---|---|\n" + "\n".join(f"| {n:<{width}} | {v} |" for n, v in ROWS)
    print("\n" + table)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "check.md"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(a.out, "check.json"), "w") as f:
            json.dump(RAW, f, indent=1, default=str)
    return 0 if not any(v.startswith("FAILED") for _, v in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
