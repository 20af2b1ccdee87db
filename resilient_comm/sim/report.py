"""Runs over several seeds, summarised, and the Markdown tables ``resilient-comm sim`` prints.

A :class:`Summary` is the mean over seeds of one (scenario, policy) pair; losses are shown
as percentages of wall time in full-job units (see :class:`~resilient_comm.sim.model.SimResult`),
so goodput plus the loss columns add up to 100%.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence

from resilient_comm.sim.engine import checkpoint_interval, simulate
from resilient_comm.sim.model import LOSS_CAUSES, Mesh, Policy, Scenario
from resilient_comm.sim.presets import GOALS, suggested_spare_nodes

__all__ = [
    "SWEEP_GPUS",
    "Summary",
    "break_even_unabsorbable",
    "format_parameters",
    "format_summaries",
    "goal_lines",
    "gpu_sweep",
    "run",
    "sensitivity",
    "spare_sweep",
]

SWEEP_GPUS: tuple[int, ...] = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 100096)
"""Job sizes of the goodput-against-GPU-count sweep (tp8 × pp16 replicas of 128 GPUs)."""


@dataclasses.dataclass(frozen=True)
class Summary:
    """Mean over ``seeds`` runs of one policy on one scenario."""

    scenario: Scenario
    policy: Policy
    seeds: int
    goodput: float
    goodput_sd: float
    lost_pct: dict[str, float]
    failures: float
    restarts: float
    spare_exhaustions: float
    ckpt_interval_s: float

    def as_dict(self) -> dict[str, object]:
        return {
            "scenario": self.scenario.name,
            "gpus": self.scenario.mesh.gpus,
            "policy": self.policy.value,
            "seeds": self.seeds,
            "goodput": self.goodput,
            "goodput_sd": self.goodput_sd,
            "lost_pct": self.lost_pct,
            "failures": self.failures,
            "restarts": self.restarts,
            "spare_exhaustions": self.spare_exhaustions,
            "ckpt_interval_s": self.ckpt_interval_s,
        }


def run(scenario: Scenario, policy: Policy, seeds: int, first_seed: int = 0) -> Summary:
    """Simulate ``seeds`` runs (seeds ``first_seed, first_seed+1, …``) and average them."""
    results = [simulate(scenario, policy, first_seed + i) for i in range(seeds)]
    goodputs = [r.goodput for r in results]
    return Summary(
        scenario=scenario,
        policy=policy,
        seeds=seeds,
        goodput=statistics.fmean(goodputs),
        goodput_sd=statistics.stdev(goodputs) if seeds > 1 else 0.0,
        lost_pct={c: 100.0 * statistics.fmean(r.lost_s[c] / r.wall_s for r in results) for c in LOSS_CAUSES},
        failures=statistics.fmean(r.failures for r in results),
        restarts=statistics.fmean(r.restarts for r in results),
        spare_exhaustions=statistics.fmean(r.spare_exhaustions for r in results),
        ckpt_interval_s=results[0].ckpt_interval_s,
    )


def _md(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _hms(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def format_parameters(scenarios: Sequence[Scenario], seeds: int) -> str:
    """The parameters of ``scenarios`` as a Markdown table, one column per scenario."""

    def row(label: str, cell: Callable[[Scenario], str]) -> list[str]:
        return [label, *(cell(s) for s in scenarios)]

    def intervals(s: Scenario) -> str:
        return ", ".join(f"{p.value} {_hms(checkpoint_interval(s, p))}" for p in Policy)

    rows = [
        row("GPUs (mesh)", lambda s: f"{s.mesh.gpus:,} ({s.mesh}, {s.mesh.gpus_per_node} GPUs/node)"),
        row(
            "failures",
            lambda s: (
                f"one per {s.gpu_hours_per_failure:,.0f} GPU-hours: job MTBF {s.job_mtbf_s / 3600:.2f} h"
            ),
        ),
        row("simulated time", lambda s: f"{s.days:g} days × {seeds} seeds"),
        row("step", lambda s: f"{s.step_s:g} s"),
        row("checkpoint cost (blocking)", lambda s: f"{s.ckpt_cost_s:g} s"),
        row("checkpoint interval", intervals),
        row("spare nodes / repair time", lambda s: f"{s.spare_nodes} / {s.replenish_s / 3600:g} h"),
        row("unabsorbable interruptions", lambda s: f"{100 * s.unabsorbable_fraction:g}%"),
        row(
            "in-process recovery",
            lambda s: (
                f"detect {s.recovery.detect_s:g} s, abort {s.recovery.abort_s:g} s, "
                f"rebuild {s.recovery.rebuild_s:g} s, state copy {s.recovery.state_copy_s:g} s"
            ),
        ),
        row(
            "restart-all recovery",
            lambda s: (
                f"detect {s.recovery.restart_detect_s:g} s, restart {s.recovery.restart_s:g} s, "
                f"checkpoint load {s.recovery.restore_s:g} s"
            ),
        ),
        row("recovery times from", lambda s: s.recovery.source),
    ]
    return _md(["parameter", *(s.name for s in scenarios)], rows)


_CAUSE_TITLES = {"spare_wait": "spare wait", "detection": "detect"}


def format_summaries(summaries: Sequence[Summary]) -> str:
    """Goodput, loss by cause (% of wall time) and event counts, one row per summary."""
    header = [
        "job",
        "GPUs",
        "policy",
        "goodput %",
        *(_CAUSE_TITLES.get(c, c) for c in LOSS_CAUSES),
        "failures",
        "restarts",
        "spare exhaustions",
    ]
    rows = [
        [
            s.scenario.name,
            f"{s.scenario.mesh.gpus:,}",
            s.policy.value,
            f"**{100 * s.goodput:.2f}** ± {100 * s.goodput_sd:.2f}",
            *(f"{s.lost_pct[c]:.2f}" for c in LOSS_CAUSES),
            f"{s.failures:.0f}",
            f"{s.restarts:.0f}",
            f"{s.spare_exhaustions:.1f}",
        ]
        for s in summaries
    ]
    return _md(header, rows)


def break_even_unabsorbable(scenario: Scenario, policy: Policy, goal: float, seeds: int) -> float:
    """The largest unabsorbable fraction at which ``policy`` still reaches ``goal``.

    Bisection to 0.1 point over ``[0, 1]`` on the mean goodput over ``seeds`` (the same
    seeds at every fraction, so the curve is monotone up to noise); 0 when even no
    unabsorbable interruption falls short.
    """
    lo, hi = 0.0, 1.0
    if run(scenario.with_(unabsorbable_fraction=lo), policy, seeds).goodput < goal:
        return 0.0
    while hi - lo > 0.001:
        mid = (lo + hi) / 2.0
        if run(scenario.with_(unabsorbable_fraction=mid), policy, seeds).goodput >= goal:
            lo = mid
        else:
            hi = mid
    return lo


def goal_lines(summaries: Sequence[Summary]) -> list[str]:
    """One line per preset with a goal: does the project's policy reach it, and up to what
    share of interruptions that force a full restart?"""
    lines = []
    for s in summaries:
        goal = GOALS.get(s.scenario.name)
        if goal is None or s.policy is not Policy.HOT_SPARE:
            continue
        verdict = "met" if s.goodput >= goal else "NOT met"
        limit = break_even_unabsorbable(s.scenario.with_(unabsorbable_fraction=0.0), s.policy, goal, s.seeds)
        lines.append(
            f"- goal on {s.scenario.name}: hot-spare {100 * s.goodput:.2f}% against ≥ {100 * goal:g}%: {verdict}; "
            f"it holds while at most {100 * limit:.1f}% of interruptions force a full restart"
        )
    return lines


def scaled(base: Scenario, gpus: int) -> Scenario:
    """``base`` with its replica shape on ``gpus`` GPUs and a spare pool sized for it."""
    replica = base.mesh.replica_gpus
    if gpus % replica:
        raise ValueError(f"{gpus} GPUs is not a whole number of {replica}-GPU replicas")
    mesh = Mesh(tp=base.mesh.tp, pp=base.mesh.pp, dp=gpus // replica, gpus_per_node=base.mesh.gpus_per_node)
    job = base.with_(name=f"{gpus}", mesh=mesh)
    return job.with_(spare_nodes=suggested_spare_nodes(job))


def gpu_sweep(base: Scenario, seeds: int, gpus: Sequence[int] = SWEEP_GPUS) -> dict[Policy, list[float]]:
    """Mean goodput of each policy at each job size (see :func:`scaled`)."""
    return {p: [run(scaled(base, n), p, seeds).goodput for n in gpus] for p in Policy}


SENSITIVITY: tuple[tuple[str, dict[str, object]], ...] = (
    ("as stated", {}),
    ("2% of interruptions unabsorbable", {"unabsorbable_fraction": 0.02}),
    ("5% unabsorbable", {"unabsorbable_fraction": 0.05}),
    ("10% unabsorbable", {"unabsorbable_fraction": 0.10}),
    ("22% unabsorbable (all not attributed to hardware)", {"unabsorbable_fraction": 0.22}),
    (
        "10% unabsorbable, 2 s checkpoints (async snapshot)",
        {"unabsorbable_fraction": 0.10, "ckpt_cost_s": 2.0},
    ),
    ("rebuild 60 s instead of 15 s", {"rebuild": 60.0}),
    ("no spare pool", {"spare_nodes": 0}),
    ("RSC-1 failure rate (29,500 GPU-hours)", {"gpu_hours_per_failure": 8 * 24 * 1000 / 6.5}),
)
"""Changes to a preset, one at a time, for :func:`sensitivity`."""


def _changed(base: Scenario, changes: dict[str, object]) -> Scenario:
    changes = dict(changes)
    rebuild = changes.pop("rebuild", None)
    job = base.with_(**changes)
    if rebuild is not None:
        job = job.with_(recovery=job.recovery.replaced({"rebuild_s": rebuild}))
    return job


def sensitivity(bases: Sequence[Scenario], policy: Policy, seeds: int) -> str:
    """Goodput of ``policy`` on each base scenario under each change of :data:`SENSITIVITY`."""
    rows = [
        [label, *(f"{100 * run(_changed(b, changes), policy, seeds).goodput:.2f}" for b in bases)]
        for label, changes in SENSITIVITY
    ]
    return _md([f"{policy.value}: assumption", *(f"{b.name} goodput %" for b in bases)], rows)


def spare_sweep(base: Scenario, spare_nodes: Sequence[int], seeds: int) -> str:
    """Goodput, spare exhaustions and time shrunk of ``hot-spare`` for each pool size."""
    rows = []
    for n in spare_nodes:
        s = run(base.with_(spare_nodes=n), Policy.HOT_SPARE, seeds)
        shrunk = s.lost_pct["shrunk"] + s.lost_pct["grow"]
        rows.append([str(n), f"{100 * s.goodput:.2f}", f"{s.spare_exhaustions:.1f}", f"{shrunk:.2f}"])
    return _md(["spare nodes", "goodput %", "spare exhaustions per run", "shrunk + grow %"], rows)
