"""`resilient-comm bench integrity`: what comparing the replicas' fingerprints costs.

The demo's job (`resilient_comm.testing.toy`, 4 ranks, dp=4, its default model) trains under
``resilient-run`` with the comparison off (``--fingerprint-every 0``) and at each interval
asked for, alternating within every round, in the same run. Per job:

- **step**: the median time between rank 0's consecutive commits (the whole step: compute,
  gradient all-reduce, vote, update; the comparison too, on the steps that have one);
- **compare**: the median time of one comparison on rank 0 (fingerprint, 16-byte all-gather,
  the copy of the agreed state), from the controller's ``integrity.agreed`` event;
- **per step**: compare / interval, as a share of the step without comparisons: what the
  comparison adds to an average step. The end-to-end ratio of the step medians is printed
  too; on this noisy machine it moves by more than the cost it would show.

The state copy kept for going back is one copy of the state (parameters, optimizer state,
buffers): its size is printed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import tempfile
from typing import Any

from resilient_comm.tools.bench.common import machine


def _job(nproc: int, steps: int, every: int, extra: list[str]) -> dict[str, Any]:
    from resilient_comm.testing.toy import ToyJob

    with tempfile.TemporaryDirectory(prefix="rc-integrity-") as tmp:
        job = ToyJob(
            nproc, ["--steps", str(steps), "--fingerprint-every", str(every), *extra], tmp, quiet=True
        )
        status = job.start().wait(600.0)
        if status != 0:
            raise RuntimeError(f"the toy job with --fingerprint-every {every} exited {status}")
        events = job.events()
    commits = sorted(e["t"] for e in events if e["event"] == "commit" and e["rank"] == 0)
    gaps = [1e3 * (b - a) for a, b in itertools.pairwise(commits)]
    compares = [e["ms"] for e in events if e["event"] == "agreed" and e["rank"] == 0]
    return {
        "every": every,
        "step_ms": statistics.median(gaps[len(gaps) // 10 :]),  # past the warm-up
        "compare_ms": statistics.median(compares) if compares else 0.0,
        "compares": len(compares),
    }


def _state_bytes(extra: list[str]) -> int:
    from resilient_comm.testing.toy import Trainer, parser

    a = parser().parse_args(extra)
    import torch

    t = Trainer(a.seed, a.features, a.hidden, 1, 0, a.batch, getattr(torch, a.dtype))
    t.model(torch.zeros(1, a.features, dtype=t.dtype), None).sum().backward()
    t.opt.step()  # the momentum buffers exist from the first step on
    return sum(v.numel() * v.element_size() for v in _tensors(t.state_dict()))


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="resilient-comm bench integrity", description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="ranks, all dp replicas (default 4)")
    p.add_argument("--steps", type=int, default=400, help="steps per job (default 400)")
    p.add_argument("--every", default="100,50", help="intervals to measure, comma-separated (default 100,50)")
    p.add_argument("--rounds", type=int, default=3, help="rounds; every round runs each setting once")
    p.add_argument("--json", default=None, help="also write every job's figures here")
    p.add_argument("toy_args", nargs="*", help="more arguments for the toy (after --), e.g. --hidden 4000")
    a = p.parse_args(argv)
    intervals = [0] + [int(x) for x in a.every.split(",") if x]
    runs: list[dict[str, Any]] = []
    for r in range(a.rounds):
        for every in intervals if r % 2 == 0 else intervals[::-1]:
            row = _job(a.nproc, a.steps, every, a.toy_args)
            runs.append(row)
            print(
                f"round {r + 1}/{a.rounds}: every {every:>3}: step {row['step_ms']:.2f} ms, "
                f"compare {row['compare_ms']:.2f} ms ({row['compares']} comparisons)",
                flush=True,
            )
    step_off = statistics.median(x["step_ms"] for x in runs if x["every"] == 0)
    nbytes = _state_bytes(a.toy_args)
    m = machine()
    print(
        f"\nreplica fingerprints, {a.nproc} ranks (dp={a.nproc}), toy model {' '.join(a.toy_args) or '(demo default)'}, "
        f"{a.steps} steps x {a.rounds} rounds; {m.get('cpu_count', '?')} cpus"
    )
    print(f"state kept in memory to go back to: {nbytes / 1e3:.1f} kB (one copy of this rank's state)")
    print(
        f"{'every':>6} {'step ms':>9} {'compare ms':>11} {'per step':>9} {'% of step':>10} {'step / off':>11}"
    )
    for every in intervals:
        rows = [x for x in runs if x["every"] == every]
        step = statistics.median(x["step_ms"] for x in rows)
        compare = statistics.median(x["compare_ms"] for x in rows)
        per = compare / every if every else 0.0
        print(
            f"{every or 'off':>6} {step:9.2f} {compare:11.2f} {per:9.3f} {100 * per / step_off:9.2f}% "
            f"{step / step_off:11.3f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"machine": m, "state_bytes": nbytes, "runs": runs}, f, indent=1)
        print(f"wrote {os.path.abspath(a.json)}")
    return 0
