"""One-GPU check of resilient_nccl, prepared to run in one call on a lent GPU machine.

    python benchmarks/gpu/check.py            # builds in place, then checks and measures

It needs a CUDA build of torch already installed and no network. Steps (each reported, none
fatal to the others), finishing in a few minutes on one GPU:

1. build the extension in place (pip install --no-build-isolation -e .);
2. doctor: the libnccl found, its version and features;
3. correctness at world size 1 (every collective on cuda:0 tensors through resilient_nccl);
4. with NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1, two ranks on the one GPU: all_reduce
   correctness, then a rank that stops joining -> the other's op times out and aborts
   (mid-op abort latency), shrink and split latency;
5. latencies at world size 1: NCCL init (create -> ready), abort when idle;
6. all_reduce busbw from 1 to 256 MiB, resilient_nccl against torch's nccl, same process.

It prints one table at the end; paste it into benchmarks/README.md with the date and device.
"""

from __future__ import annotations

import datetime
import os
import statistics
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ROWS: list[tuple[str, str]] = []


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
        row(name, f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]}")


def build() -> None:
    subprocess.check_call([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-q",
                           "-e", ROOT])


def doctor() -> None:
    from resilient_comm import _C

    info = _C.probe_nccl([])
    if not info["found"]:
        raise RuntimeError(info["error"])
    row("libnccl", f"{info['version']} at {info['path']}")
    row("nccl caps", " ".join(k for k, v in info["caps"].items() if v))


def _init_single(backend: str) -> None:
    import torch.distributed as dist

    import resilient_comm  # noqa: F401

    store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))


def correctness_ws1() -> None:
    import torch
    import torch.distributed as dist

    _init_single("resilient_nccl")
    dev = torch.device("cuda", 0)
    t = torch.arange(1024, device=dev, dtype=torch.float32)
    dist.all_reduce(t)
    assert torch.equal(t, torch.arange(1024, device=dev, dtype=torch.float32))
    for dt in (torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64, torch.uint8, torch.int8):
        x = torch.ones(33, device=dev, dtype=dt)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        dist.broadcast(x, src=0)
        assert x.sum().item() == 33
    out = torch.empty(8, device=dev)
    dist.all_gather_into_tensor(out, torch.ones(8, device=dev))
    dist.reduce_scatter_tensor(out, torch.ones(8, device=dev))
    a2a = torch.empty(16, device=dev)
    dist.all_to_all_single(a2a, torch.ones(16, device=dev))
    dist.barrier()
    torch.cuda.synchronize()
    dist.destroy_process_group()


def latencies_ws1() -> None:
    import torch
    import torch.distributed as dist

    from resilient_comm import _C

    inits, aborts = [], []
    for i in range(10):
        t0 = time.perf_counter()
        text = _C.nccl_init_check(60.0)
        inits.append(time.perf_counter() - t0)
        if text != "Ok":
            raise RuntimeError(text)
    row("NCCL init, 1 rank (median of 10)", f"{1e3 * statistics.median(inits):.1f} ms")
    for i in range(10):
        _init_single("resilient_nccl")
        x = torch.ones(4, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        import resilient_comm

        t0 = time.perf_counter()
        resilient_comm.abort()
        aborts.append(time.perf_counter() - t0)
        dist.destroy_process_group()
    row("abort when idle, 1 rank (median of 10)", f"{1e3 * statistics.median(aborts):.2f} ms")


def busbw_ws1() -> None:
    import torch
    import torch.distributed as dist

    import resilient_comm  # noqa: F401

    store = dist.HashStore()
    dist.init_process_group("resilient_nccl", store=store, rank=0, world_size=1)
    ref = dist.new_group(backend="nccl")
    for mib in (1, 4, 16, 64, 256):
        t = torch.ones(mib << 18, device="cuda")
        times = {}
        for name, g in (("ours", None), ("nccl", ref)):
            for _ in range(3):
                dist.all_reduce(t, group=g)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                dist.all_reduce(t, group=g)
            torch.cuda.synchronize()
            times[name] = (time.perf_counter() - t0) / 10
        row(f"all_reduce {mib} MiB, 1 rank: ours / torch nccl",
            f"{1e3 * times['ours']:.3f} / {1e3 * times['nccl']:.3f} ms ({times['nccl'] / times['ours']:.2f}x busbw)")
    dist.destroy_process_group()


def multi_rank() -> None:
    from resilient_comm import _C

    info = _C.probe_nccl([])
    major, minor, _ = (int(x) for x in info["version"].split("."))
    if (major, minor) < (2, 30):
        row("2 ranks on one GPU", f"skipped: NCCL {info['version']} < 2.30")
        return
    env = dict(os.environ, NCCL_MULTI_RANK_GPU_ENABLE="1")
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "two_ranks.py")], check=False, env=env,
                         capture_output=True, text=True, timeout=240)
    print(out.stdout, out.stderr[-3000:])
    for line in out.stdout.splitlines():
        if line.startswith("ROW "):
            name, value = line[4:].split("=", 1)
            row(name, value)
    if out.returncode != 0:
        raise RuntimeError(f"two_ranks.py exited {out.returncode}")


def main() -> int:
    import torch

    print(f"resilient_nccl GPU check, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", flush=True)
    step("build in place", build)
    row("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO GPU")
    row("torch", torch.__version__)
    for name, fn in (("doctor", doctor), ("collectives at world size 1", correctness_ws1),
                     ("latencies at world size 1", latencies_ws1), ("2 ranks on one GPU", multi_rank),
                     ("busbw vs torch nccl", busbw_ws1)):
        step(name, fn)
    width = max(len(n) for n, _ in ROWS)
    print("\n| check | result |\n|---|---|")
    for n, v in ROWS:
        print(f"| {n:<{width}} | {v} |")
    return 0 if not any(v.startswith("FAILED") for _, v in ROWS) else 1


if __name__ == "__main__":
    sys.exit(main())
