"""`resilient-comm demo`: kill a training worker, watch the survivors carry on in-process.

N workers (default 4) train a small model on CPU under ``resilient-run`` with the elastic
controller. One SIGKILLs itself at the start of a chosen step. The survivors detect the death
(op error, the launcher's report), agree on a new membership, shrink their groups, restore
the last committed step and go on, in the same processes; the recovery timeline of every
survivor is printed. With ``--spares 1`` a hot spare waits warm and takes the dead rank's
place instead (world size kept; it receives its state from a peer). ``--nccl-emulated`` runs the
workers on ``resilient_nccl`` with RESILIENT_COMM_NCCL_EMULATE=1: every collective, the failure,
the shrink and the state copy go through the NCCL communicator on the NCCL emulator (the NCCL
code path, without a GPU). ``--nodes 3`` runs it on three nodes (network namespaces, the
membership on etcd) and loses a whole node (`demo_nodes`). ``--compare-torchrun`` runs the same experiment (same model, data,
steps and checkpoint cadence) as a torchrun elastic restart from checkpoint, with torch's
defaults and with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, and prints them side by side.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time

import torch.distributed as dist

from resilient_comm.config import knob_int
from resilient_comm.tools.bench.recovery import FIX, Run, Settings, run_ours, run_torchrun

PHASES = ("detected", "aborted", "agreed", "rebuilt", "restored", "first_commit")


def _timeline_table(timelines: list[dict], kill_t: float) -> list[str]:
    lines = [f"{'rank':>4}  " + "  ".join(f"{p:>12}" for p in PHASES) + "   evidence (ms after the kill)"]
    for tl in sorted(timelines, key=lambda t: t["rank"]):
        cells = "  ".join(f"{1e3 * (tl['t'][p] - kill_t):>9.1f} ms" for p in PHASES)
        via = ", ".join(
            f"{k.replace('_', ' ')} {1e3 * (v - kill_t):.1f}"
            for k, v in sorted(tl["via"].items(), key=lambda kv: kv[1])
        )
        lines.append(f"{tl['rank']:>4}  {cells}   {via}")
    return lines


def _outcome(r: Run) -> str:
    if r.recovered:
        return "recovered in-process" if r.system.startswith("ours") else "all restarted, resumed"
    return "hung" if "hung" in r.note else "failed"


def _side_by_side(runs: list[Run], nproc: int) -> list[str]:
    heads = {
        "ours": "ours (resilient-run)",
        "ours-spare": "ours (resilient-run --spares)",
        "torchrun-default": "torchrun (defaults)",
        "torchrun": "torchrun (+" + next(iter(FIX)) + "=1)",
    }

    def row(name: str, cells: list[str]) -> str:
        return f"{name:<32}" + "".join(f"{c:<26}" for c in cells).rstrip()

    def secs(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f} s"

    lines = [
        row("", [heads[r.system].split(" (")[0] for r in runs]),
        row("", ["(" + heads[r.system].split(" (")[1] for r in runs]),
        row("SIGKILL -> first committed step", [secs(r.first_commit_s) for r in runs]),
        row("steps redone", ["-" if r.redone is None else str(r.redone) for r in runs]),
        row("processes restarted", ["0" if r.system.startswith("ours") else str(nproc) for r in runs]),
        row("world after", ["-" if r.world_after is None else f"{r.world_after} ranks" for r in runs]),
        row("outcome", [_outcome(r) for r in runs]),
        "",
    ]
    lines += [f"{heads[r.system]}: {r.note}" for r in runs if not r.system.startswith("ours")]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="resilient-comm demo", description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4, help="worker processes (default 4)")
    p.add_argument(
        "--steps",
        type=int,
        default=120,
        help="training steps (default 120: past the replicas' first comparison at its default interval)",
    )
    p.add_argument(
        "--kill-step", type=int, default=25, help="the victim dies at the start of this step (default 25)"
    )
    p.add_argument("--ckpt-every", type=int, default=10, help="checkpoint cadence in steps (default 10)")
    p.add_argument("--step-ms", type=float, default=0.0, help="extra time per step standing for compute")
    p.add_argument(
        "--spares", type=int, default=0, help="hot spares waiting warm (default 0: the survivors shrink)"
    )
    p.add_argument(
        "--nccl-emulated",
        action="store_true",
        help="run on resilient_nccl through the NCCL emulator (RESILIENT_COMM_NCCL_EMULATE=1)",
    )
    p.add_argument(
        "--compare-torchrun", action="store_true", help="also run it as a torchrun elastic restart"
    )
    p.add_argument("--timeout", type=float, default=90.0, help="bound on each run, seconds (default 90)")
    p.add_argument(
        "--nodes",
        type=int,
        default=0,
        help="N >= 2: N nodes (network namespaces, root) on etcd, 2 workers each; a whole node is lost",
    )
    a = p.parse_args(argv)
    if a.nodes:
        if a.nodes < 2:
            p.error("--nodes must be at least 2")
        from resilient_comm.tools.demo_nodes import run_nodes

        return run_nodes(a.nodes, 2, a.steps, a.kill_step, max(a.timeout, 180.0), _timeline_table)
    if a.nproc < 2:
        p.error("--nproc must be at least 2")
    if not 0 < a.kill_step < a.steps:
        p.error("--kill-step must be inside the run")
    backend = "resilient_nccl" if a.nccl_emulated else "resilient_tcp"
    if a.nccl_emulated:
        os.environ["RESILIENT_COMM_NCCL_EMULATE"] = "1"  # the launcher's workers inherit it
    s = Settings(a.steps, a.kill_step, a.ckpt_every, a.step_ms, a.timeout, backend=backend)
    launcher_log = logging.getLogger("resilient_comm.launcher")
    launcher_log.addHandler(logging.StreamHandler(sys.stdout))
    launcher_log.handlers[-1].setFormatter(logging.Formatter("[resilient-run] %(message)s"))
    launcher_log.setLevel(logging.WARNING)
    victim = a.nproc // 2
    path = "resilient_nccl on the NCCL emulator" if a.nccl_emulated else "resilient_tcp"
    print(
        f"{a.nproc} workers train a small MLP for {a.steps} steps under resilient-run ({path}, op timeout "
        f"{dist.default_pg_timeout.total_seconds() / 60:.0f} min: the default, never waited out); rank {victim} "
        f"SIGKILLs itself at the start of step {a.kill_step} ...",
        flush=True,
    )
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="resilient-demo-") as root:
        started = time.time()
        ours = run_ours(a.nproc, 0, s, root, spares=a.spares)
        runs.append(ours)
        if not ours.recovered:
            print(f"the survivors did not recover: {ours.note}")
            return 1
        assert ours.fault_t is not None
        kill_t = ours.fault_t
        print(
            f"done in {time.time() - started:.1f} s. Recovery timeline of each member, ms after the kill:\n"
        )
        print("\n".join(_timeline_table(ours.timelines, kill_t)))
        tl = next(t for t in ours.timelines if t["lost"])
        placed = [t["rank"] for t in ours.timelines if not t["lost"]]
        if placed:
            print(
                f"\nepoch {tl['epoch']}: rank(s) {tl['lost']} lost; hot spare {placed} took the place (members "
                f"{tl['members']}: world size kept), received its state from a peer, and with the survivors "
                f"resumed at step {tl['resume_step']} ({ours.redone} step redone) and finished all {a.steps} steps."
            )
        else:
            print(
                f"\nepoch {tl['epoch']}: rank(s) {tl['lost']} lost; the {len(tl['members'])} survivors ({tl['mode']} "
                f"of every group) resumed at step {tl['resume_step']} ({ours.redone} step redone) and finished all "
                f"{a.steps} steps in the same processes."
            )
        print(f"SIGKILL -> first committed step on every member: {1e3 * (ours.first_commit_s or 0):.1f} ms.")
        if ours.compared:
            every = knob_int("RESILIENT_COMM_FINGERPRINT_EVERY", 0)
            print(
                f"the replicas' state fingerprints agreed after step(s) {', '.join(map(str, ours.compared))} "
                f"(compared every {every} steps and after the last)."
            )
        if ours.nccl_emulator:
            st = ours.nccl_emulator
            print(
                f"NCCL code path: the {len(st)} survivors ran {min(x['kernels'] for x in st)}-"
                f"{max(x['kernels'] for x in st)} kernels each on the NCCL emulator; {sum(x['revokes'] for x in st)} "
                f"ncclCommRevoke (every group of the failed epoch), {sum(x['shrinks'] for x in st)} ncclCommShrink "
                f"(the world), {sum(x['misuse'] for x in st)} uses of a freed communicator."
            )
        if a.compare_torchrun:
            print(
                "\nthe same run as a torchrun elastic restart from checkpoint (gloo), with torch's defaults ...",
                flush=True,
            )
            runs.append(run_torchrun(a.nproc, 0, s, root, fix=False))
            print(f"... and with {next(iter(FIX))}=1 ...", flush=True)
            runs.append(run_torchrun(a.nproc, 0, s, root, fix=True))
            print()
            print("\n".join(_side_by_side(runs, a.nproc)))
    return 0
