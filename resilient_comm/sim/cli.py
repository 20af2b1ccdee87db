"""``resilient-comm sim``: goodput of restart-all, shrink and hot-spare on the presets.

Prints the parameters and a Markdown table (goodput, time lost by cause, failures,
restarts, spare exhaustions, each the mean over ``--seeds`` runs) for each preset and
policy, and whether the project's policy reaches its goal. ``--report`` adds the
sensitivity to each assumption, a spare-pool sweep, a checkpoint-interval sweep and the
validation figures; ``--plot PATH`` writes a PNG (goodput against GPU count for each
policy, waste against checkpoint interval); ``--json PATH`` writes the summaries.
``--recovery-json PATH`` replaces the stated recovery times with measured ones.

``--gray`` prints instead the gray-failure table (:mod:`.gray_report`): each preset with slow
nodes, then with silent data corruption, ignored and acted on, against fail-stop only,
under the project's policy (``hot-spare``; ``--policy shrink`` for no spares); ``--report``
adds the sensitivity to each gray assumption. The ``--slow-*`` and ``--sdc-*`` options
replace the published figures and stated assumptions of :data:`~.presets.GRAY`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import sys
import time

import numpy as np

from resilient_comm.checkpoint.interval import expected_waste
from resilient_comm.sim.engine import checkpoint_interval
from resilient_comm.sim.gray import GrayFailures
from resilient_comm.sim.gray_report import format_gray, format_gray_parameters, gray_rows, gray_sensitivity
from resilient_comm.sim.model import Policy, Scenario
from resilient_comm.sim.presets import FAILURE_RATES, GRAY, PRESETS, preset, suggested_spare_nodes
from resilient_comm.sim.report import (
    SWEEP_GPUS,
    Summary,
    format_parameters,
    format_summaries,
    goal_lines,
    gpu_sweep,
    run,
    sensitivity,
    spare_sweep,
)
from resilient_comm.sim.validation import (
    IntervalSweep,
    analytic_optima,
    daly_agreement,
    interval_sweep,
    llama3_goodput,
    simulated_optimum,
    textbook_case,
)

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="resilient-comm sim",
        description="Discrete-event failure simulator: goodput of restart-all, shrink and hot-spare at scale.",
    )
    p.add_argument(
        "--preset", action="append", choices=sorted(PRESETS), help="job to simulate (repeat; default: all)"
    )
    p.add_argument(
        "--policy", action="append", choices=[x.value for x in Policy], help="policy (repeat; default: all)"
    )
    p.add_argument("--seeds", type=int, default=5, help="runs per (preset, policy), averaged (default 5)")
    p.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    p.add_argument("--days", type=float, help="simulated days per run (preset: 54)")
    rate = p.add_mutually_exclusive_group()
    rate.add_argument("--failure-rate", choices=sorted(FAILURE_RATES), help="published failure rate to use")
    rate.add_argument(
        "--gpu-hours-per-failure", type=float, help="failure rate as GPU-hours per interruption"
    )
    p.add_argument("--step", type=float, help="seconds per training step (preset: 6)")
    p.add_argument("--ckpt-cost", type=float, help="seconds a checkpoint blocks training (preset: 15)")
    p.add_argument(
        "--ckpt-interval", type=float, help="seconds of compute between checkpoints (default: Daly optimum)"
    )
    p.add_argument("--spare-nodes", type=int, help="spare nodes (default: enough for the nodes in repair)")
    p.add_argument(
        "--replenish-hours", type=float, help="hours until a failed node is back as a spare (preset: 24)"
    )
    p.add_argument(
        "--unabsorbable", type=float, help="fraction of interruptions forcing a full restart (preset: 0)"
    )
    p.add_argument("--recovery-json", type=pathlib.Path, help="JSON object of measured recovery times to use")
    p.add_argument(
        "--report", action="store_true", help="add sensitivity, spare and interval sweeps, validation"
    )
    p.add_argument("--plot", type=pathlib.Path, help="write a PNG plot here (needs matplotlib)")
    p.add_argument("--json", type=pathlib.Path, help="write the summaries here as JSON")
    _gray_arguments(p)
    return p


def _gray_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("gray failures (slow nodes, silent data corruption)")
    g.add_argument("--gray", action="store_true", help="print the gray-failure table: ignore vs act")
    g.add_argument("--slow-gpu-hours", type=float, help="GPU-hours per fail-slow episode (1,000,000)")
    g.add_argument("--slow-minutes", type=float, help="mean fail-slow duration in minutes (72)")
    g.add_argument("--slow-seen", type=float, help="share of episodes the pace judge can see (1)")
    g.add_argument("--sdc-gpu-hours", type=float, help="GPU-hours per silent data corruption (3.54 M)")
    g.add_argument("--sdc-notice-hours", type=float, help="hours until an ignored flip is noticed (2)")
    g.add_argument("--sdc-visible", type=float, help="share of flips the replica comparison sees (1)")
    g.add_argument(
        "--sdc-repeat-hours", type=float, help="mean hours until a defective node flips again (24; 0: never)"
    )
    g.add_argument("--fingerprint-every", type=int, help="steps between replica comparisons (100)")
    g.add_argument("--fingerprint-cost", type=float, help="comparison cost, fraction of compute (0.0055)")


def _gray(a: argparse.Namespace) -> GrayFailures:
    """:data:`GRAY` with the ``--slow-*`` / ``--sdc-*`` / ``--fingerprint-*`` options applied."""
    slow: dict[str, object] = {}
    sdc: dict[str, object] = {}
    pick = [
        (slow, "gpu_hours_per_episode", a.slow_gpu_hours, 1.0),
        (slow, "mean_duration_s", a.slow_minutes, 60.0),
        (slow, "detectable", a.slow_seen, 1.0),
        (sdc, "gpu_hours_per_event", a.sdc_gpu_hours, 1.0),
        (sdc, "notice_s", a.sdc_notice_hours, 3600.0),
        (sdc, "visible", a.sdc_visible, 1.0),
        (sdc, "every_steps", a.fingerprint_every, 1),
        (sdc, "compare_cost", a.fingerprint_cost, 1.0),
    ]
    for changes, field, value, unit in pick:
        if value is not None:
            changes[field] = value * unit
    if a.sdc_repeat_hours is not None:
        sdc["repeat_s"] = a.sdc_repeat_hours * 3600.0 if a.sdc_repeat_hours > 0 else None
    assert GRAY.slow is not None and GRAY.sdc is not None
    return GrayFailures(
        slow=dataclasses.replace(GRAY.slow, **slow),  # type: ignore[arg-type]
        sdc=dataclasses.replace(GRAY.sdc, **sdc),  # type: ignore[arg-type]
    )


def _print_gray(jobs: list[Scenario], a: argparse.Namespace) -> int:
    policies = [Policy(p) for p in a.policy] if a.policy else [Policy.HOT_SPARE]
    if any(not p.in_process for p in policies):
        print("resilient-comm sim: --gray acts in process: use --policy hot-spare or shrink", file=sys.stderr)
        return 2
    try:
        gray = _gray(a)
    except ValueError as e:
        print(f"resilient-comm sim: {e}", file=sys.stderr)
        return 2
    print("## Gray failures: parameters\n")
    print(format_gray_parameters(gray, jobs[0]))
    for policy in policies:
        print(f"\n## Gray failures under {policy.value} (% of wall time, mean over {a.seeds} seeds)\n")
        print(format_gray([row for job in jobs for row in gray_rows(job, gray, policy, a.seeds, a.seed)]))
        if a.report:
            print(f"\n## Sensitivity of gray failures under {policy.value} (goodput %, {a.seeds} seeds)\n")
            print(gray_sensitivity(jobs, gray, policy, a.seeds))
    return 0


def _configure(base: Scenario, a: argparse.Namespace) -> Scenario:
    changes: dict[str, object] = {}
    if a.days is not None:
        changes["days"] = a.days
    if a.failure_rate is not None:
        changes["gpu_hours_per_failure"] = FAILURE_RATES[a.failure_rate]
    if a.gpu_hours_per_failure is not None:
        changes["gpu_hours_per_failure"] = a.gpu_hours_per_failure
    if a.step is not None:
        changes["step_s"] = a.step
    if a.ckpt_cost is not None:
        changes["ckpt_cost_s"] = a.ckpt_cost
    if a.ckpt_interval is not None:
        changes["ckpt_interval_s"] = a.ckpt_interval
    if a.replenish_hours is not None:
        changes["replenish_s"] = a.replenish_hours * 3600.0
    if a.unabsorbable is not None:
        changes["unabsorbable_fraction"] = a.unabsorbable
    if a.recovery_json is not None:
        changes["recovery"] = base.recovery.from_json(a.recovery_json)
    job = base.with_(**changes)
    return job.with_(spare_nodes=suggested_spare_nodes(job) if a.spare_nodes is None else a.spare_nodes)


def _restart_sweep(job: Scenario, seeds: int) -> tuple[IntervalSweep, list[float], float]:
    """restart-all waste over intervals around Daly's optimum, with Daly's exact curve."""
    optimum = checkpoint_interval(job.with_(ckpt_interval_s=None), Policy.RESTART_ALL)
    intervals = [float(x) for x in np.geomspace(optimum / 4.0, optimum * 4.0, 9)]
    sweep = interval_sweep(job, Policy.RESTART_ALL, intervals, seeds)
    total = job.recovery.restart_total_s
    analytic = [expected_waste(t, job.ckpt_cost_s, job.job_mtbf_s, total) for t in intervals]
    return sweep, analytic, optimum


def _gpu_table(goodput: dict[Policy, list[float]]) -> str:
    lines = ["| GPUs | " + " | ".join(p.value for p in goodput) + " |", "|---" * (len(goodput) + 1) + "|"]
    for i, n in enumerate(SWEEP_GPUS):
        lines.append(f"| {n:,} | " + " | ".join(f"{100 * v[i]:.2f}" for v in goodput.values()) + " |")
    return "\n".join(lines)


def _interval_table(sweeps: list[tuple[IntervalSweep, list[float], float]]) -> str:
    lines = ["| job | interval (min) | simulated waste % | Daly exact % |", "|---|---|---|---|"]
    for sweep, analytic, optimum in sweeps:
        for t, w, d in zip(sweep.intervals_s, sweep.waste, analytic, strict=True):
            mark = " (optimum)" if math.isclose(t, optimum) else ""
            lines.append(f"| {sweep.scenario} | {t / 60:.1f}{mark} | {100 * w:.2f} | {100 * d:.2f} |")
    return "\n".join(lines)


def _validation() -> list[str]:
    interval, waste = textbook_case()
    llama = llama3_goodput(seeds=10)
    lines = [
        (
            f"- textbook case (c = 60 s, λ = 1/3 per hour): Young's interval {interval / 60:.1f} min, "
            f"first-order waste {100 * waste:.1f}%"
        ),
        (
            f"- Llama 3 (llama3-16k, restart-all, 10 × 54 days): goodput {100 * np.mean(llama):.1f}% "
            f"(runs {100 * min(llama):.1f}–{100 * max(llama):.1f}%); Meta reports > 90%"
        ),
    ]
    for name in ("llama3-16k", "100k"):
        sim, exact = daly_agreement(preset(name), days=365, seeds=3)
        lines.append(
            f"- restart-all on {name}, unlimited spares, 3 × 365 days: simulated waste {100 * sim:.2f}%, "
            f"Daly's exact formula {100 * exact:.2f}%"
        )
    cases = [
        ("llama3-16k", Policy.RESTART_ALL, 0.0),
        ("100k", Policy.RESTART_ALL, 0.0),
        ("100k", Policy.HOT_SPARE, 0.1),
    ]
    for name, policy, share in cases:
        job = preset(name).with_(unabsorbable_fraction=share)
        young, daly = analytic_optima(job, 1.0 if policy is Policy.RESTART_ALL else share)
        best, _ = simulated_optimum(job, policy, days=365, seeds=3, around_s=daly)
        what = f"{policy.value} on {name}" + (f", {100 * share:g}% unabsorbable" if share else "")
        lines.append(
            f"- optimal interval, {what}: simulated {best:.0f} s, Daly {daly:.0f} s "
            f"({100 * (best / daly - 1):+.1f}%), Young {young:.0f} s ({100 * (best / young - 1):+.1f}%)"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``resilient-comm sim``; returns the exit status."""
    a = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if a.seeds < 1:
        print("resilient-comm sim: --seeds must be >= 1", file=sys.stderr)
        return 2
    try:
        jobs = [_configure(preset(name), a) for name in (a.preset or list(PRESETS))]
    except (OSError, ValueError) as e:
        print(f"resilient-comm sim: {e}", file=sys.stderr)
        return 2
    if a.gray:
        return _print_gray(jobs, a)
    policies = [Policy(p) for p in a.policy] if a.policy else list(Policy)

    summaries: list[Summary] = []
    timings: list[str] = []
    for job in jobs:
        start = time.perf_counter()
        summaries += [run(job, p, a.seeds, a.seed) for p in policies]
        per_run = (time.perf_counter() - start) / (a.seeds * len(policies))
        timings.append(
            f"{job.name} ({job.mesh.gpus:,} GPUs × {job.days:g} days) {1000 * per_run:.0f} ms per run"
        )
    print("## Parameters\n")
    print(format_parameters(jobs, a.seeds))
    print("\n## Goodput and time lost by cause (% of wall time, mean over seeds)\n")
    print(format_summaries(summaries))
    print()
    for line in goal_lines(summaries):
        print(line)
    print(f"- run time: {'; '.join(timings)}")

    wants_sweeps = a.report or a.plot is not None
    sweeps = [_restart_sweep(job, seeds=3) for job in jobs] if wants_sweeps else []
    base = jobs[0]
    goodput = gpu_sweep(base, seeds=3) if wants_sweeps else {}
    if a.report:
        print(f"\n## Goodput against job size ({base.name}'s parameters, spares sized per job, 3 seeds)\n")
        print(_gpu_table(goodput))
        print("\n## Sensitivity of the project's policy (one change at a time)\n")
        print(sensitivity(jobs, Policy.HOT_SPARE, a.seeds))
        for job in jobs:
            pools = sorted(
                {0, job.spare_nodes // 4, job.spare_nodes // 2, 3 * job.spare_nodes // 4, job.spare_nodes}
            )
            print(
                f"\n## Spare pool: hot-spare on {job.name} ({job.replenish_s / 3600:g} h to repair a node)\n"
            )
            print(spare_sweep(job, pools, a.seeds))
        print("\n## restart-all waste against checkpoint interval (unlimited spares, 3 seeds)\n")
        print(_interval_table(sweeps))
        print("\n## Validation (presets as shipped)\n")
        for line in _validation():
            print(line)
    if a.plot:
        title = (
            f"tp{base.mesh.tp}×pp{base.mesh.pp} replicas, one failure per {base.gpu_hours_per_failure:,.0f} GPU-hours, "
            f"{base.days:g} days; recovery times: {base.recovery.source}"
        )
        try:
            from resilient_comm.sim.plot import write_png

            write_png(a.plot, SWEEP_GPUS, goodput, sweeps, title)
        except RuntimeError as e:
            print(f"resilient-comm sim: {e}", file=sys.stderr)
            return 1
        print(f"\nplot written to {a.plot}")
    if a.json:
        a.json.write_text(json.dumps([s.as_dict() for s in summaries], indent=2) + "\n")
        print(f"summaries written to {a.json}")
    return 0
