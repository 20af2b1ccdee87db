"""Async checkpoint vs synchronous torch.save: how long the training thread is blocked.

One process, a CPU MLP (``--layers`` x Linear(width, width), ~10.5M parameters by default)
trained with Adam, so the state is the model, Adam's two moments and the RNG state (~126 MB).
Each repetition is one training step with a checkpoint, both ways, the order alternating
between repetitions:

- ``async``: ``save(step, state)``, forward/backward, ``wait_snapshot()``, optimizer update;
  the stall is the time spent in ``save()`` plus ``wait_snapshot()``. Then ``wait()`` (outside
  the stall: in training the next save comes many steps later) gives the flush time.
- ``sync``: forward/backward, ``torch.save(state, path)`` to the same directory, optimizer
  update; the stall is the ``torch.save``.

Reported: medians over ``--reps`` of the stall, the forward/backward time in each mode (the
background copy competes with it for the CPU) and the async flush (write + fsync + rename +
manifest); the ratio ``async stall / sync stall`` against the target (<= 5%). One untimed
warm-up repetition per mode first (host buffers, page cache).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from resilient_comm.checkpoint import AsyncCheckpointer
from resilient_comm.tools.bench.common import machine

kTarget = 0.05


def _model(width: int, layers: int) -> torch.nn.Module:
    mods: list[torch.nn.Module] = []
    for i in range(layers):
        mods.append(torch.nn.Linear(width, width))
        if i + 1 < layers:
            mods.append(torch.nn.ReLU())
    return torch.nn.Sequential(*mods)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="resilient-comm bench checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--batch", type=int, default=256, help="rows per forward/backward")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--dir", default=None, help="where both modes write (default: a temporary directory)")
    p.add_argument(
        "--flush-nice", type=int, default=10, help="AsyncCheckpointer(flush_nice=...); 0: no lower priority"
    )
    p.add_argument("--json", metavar="PATH", help="write the results here")
    a = p.parse_args(argv)

    torch.manual_seed(0)
    model = _model(a.width, a.layers)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x, y = torch.randn(a.batch, a.width), torch.randn(a.batch, a.width)
    params = sum(t.numel() for t in model.parameters())

    def forward_backward() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(model(x), y).backward()
        return time.perf_counter() - t0

    def state(step: int) -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "optim": opt.state_dict(),
            "rng": torch.get_rng_state(),
            "step": step,
        }

    forward_backward()
    opt.step()  # Adam's moments exist from here on
    root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=a.dir)
    ckpt = AsyncCheckpointer(os.path.join(root, "async"), rank=0, keep=2, flush_nice=a.flush_nice)
    sync_path = os.path.join(root, "sync.pt")
    runs: dict[str, dict[str, list[float]]] = {
        m: {"stall_s": [], "compute_s": [], "flush_s": []} for m in ("async", "sync")
    }
    step = 0

    def run(mode: str, record: bool) -> None:
        nonlocal step
        step += 1
        if mode == "async":
            t0 = time.perf_counter()
            ckpt.save(step, state(step))
            stall = time.perf_counter() - t0
            compute = forward_backward()
            t1 = time.perf_counter()
            ckpt.wait_snapshot()
            stall += time.perf_counter() - t1
            opt.step()
            ckpt.wait()
            flush = ckpt.stats.flush_s
        else:
            compute = forward_backward()
            t0 = time.perf_counter()
            torch.save(state(step), sync_path)
            stall = time.perf_counter() - t0
            opt.step()
            flush = 0.0
        if record:
            r = runs[mode]
            r["stall_s"].append(stall)
            r["compute_s"].append(compute)
            r["flush_s"].append(flush)

    state_bytes = sum(t.numel() * t.element_size() for t in _tensors(state(0)))
    print(
        f"checkpoint stall: {params / 1e6:.1f}M parameters + Adam ({state_bytes / 2**20:.0f} MiB of tensors), "
        f"batch {a.batch}, {a.reps} reps, writing to {root} ...",
        flush=True,
    )
    try:
        run("async", False)
        run("sync", False)
        for rep in range(a.reps):
            for mode in ("async", "sync") if rep % 2 == 0 else ("sync", "async"):
                run(mode, True)
        file_bytes = os.path.getsize(sync_path)
    finally:
        ckpt.close()
        shutil.rmtree(root, ignore_errors=True)

    med = {m: {k: statistics.median(v) for k, v in r.items()} for m, r in runs.items()}
    ratio = med["async"]["stall_s"] / med["sync"]["stall_s"]
    met = ratio <= kTarget
    print(f"{'mode':<6} | {'stall ms':>9} {'fwd/bwd ms':>10} {'flush ms':>9}   (medians over {a.reps} reps)")
    for m in ("async", "sync"):
        flush = f"{med[m]['flush_s'] * 1e3:9.1f}" if m == "async" else f"{'-':>9}"
        print(f"{m:<6} | {med[m]['stall_s'] * 1e3:9.2f} {med[m]['compute_s'] * 1e3:10.1f} {flush}")
    print(f"async stall / sync torch.save = {ratio:.4f} ({ratio * 100:.2f}%)")
    print(f"target: async stall <= {kTarget:.0%} of a synchronous torch.save: {'MET' if met else 'NOT MET'}")
    if a.json:
        stats = ckpt.stats
        out = {
            "params": params,
            "state_tensor_bytes": state_bytes,
            "file_bytes": file_bytes,
            "args": vars(a),
            "async": {**runs["async"], **{f"median_{k}": v for k, v in med["async"].items()}},
            "sync": {**runs["sync"], **{f"median_{k}": v for k, v in med["sync"].items()}},
            "ratio": ratio,
            "target": kTarget,
            "met": met,
            "checkpointer": {
                "saves": stats.saves,
                "completed": stats.completed,
                "skipped": stats.skipped,
                "failed": stats.failed,
                "median_snapshot_s": stats.median("snapshot_s"),
            },
            "machine": machine(),
            "torch_threads": torch.get_num_threads(),
        }
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {a.json}")
    return 0


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


if __name__ == "__main__":
    raise SystemExit(main())
