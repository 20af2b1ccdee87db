"""The gray-failure tables ``resilient-comm sim --gray`` prints: goodput of ignoring and of
acting on slow nodes and on silent data corruption, one kind at a time, against the same job
with fail-stop failures only.

Every row runs the same seeds as its fail-stop-only baseline, and gray failures draw from
their own random stream, so the fail-stop failures are the same in both: the time lost to a
gray failure is the mean of the paired differences, not a difference of noisy means.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

from resilient_comm.sim.engine import simulate
from resilient_comm.sim.gray import GrayFailures, GrayPolicy
from resilient_comm.sim.model import GRAY_CAUSES, Policy, Scenario, SimResult

__all__ = [
    "GRAY_KINDS",
    "GRAY_SENSITIVITY",
    "GrayRow",
    "format_gray",
    "format_gray_parameters",
    "gray_rows",
    "gray_sensitivity",
]

GRAY_KINDS: tuple[str, ...] = ("fail-slow", "SDC")
"""The kinds of gray failure, each run alone (``SDC``: silent data corruption)."""


def _only(gray: GrayFailures, kind: str) -> GrayFailures:
    return GrayFailures(slow=gray.slow) if kind == "fail-slow" else GrayFailures(sdc=gray.sdc)


@dataclasses.dataclass(frozen=True)
class GrayRow:
    """One (job, kind, response) over ``seeds`` runs. ``kind`` is ``None`` for the fail-stop-only
    baseline. ``lost`` is the goodput lost against that baseline (a fraction, paired by seed);
    ``lost_pct`` the gray causes in % of wall time; ``counts`` the mean gray event counts."""

    scenario: Scenario
    kind: str | None
    response: GrayPolicy | None
    seeds: int
    goodput: float
    goodput_sd: float
    lost: float
    lost_pct: dict[str, float]
    counts: dict[str, float]

    @property
    def lost_hours(self) -> float:
        """Full-job hours lost over the run (``lost`` times the run's length)."""
        return self.lost * self.scenario.days * 24.0


def _row(
    job: Scenario, kind: str | None, response: GrayPolicy | None, runs: list[SimResult], base: list[float]
) -> GrayRow:
    goodputs = [r.goodput for r in runs]
    return GrayRow(
        scenario=job,
        kind=kind,
        response=response,
        seeds=len(runs),
        goodput=statistics.fmean(goodputs),
        goodput_sd=statistics.stdev(goodputs) if len(runs) > 1 else 0.0,
        lost=statistics.fmean(b - g for b, g in zip(base, goodputs, strict=True)),
        lost_pct={c: 100.0 * statistics.fmean(r.lost_s[c] / r.wall_s for r in runs) for c in GRAY_CAUSES},
        counts={k: statistics.fmean(r.gray_counts[k] for r in runs) for k in runs[0].gray_counts},
    )


def gray_rows(
    job: Scenario, gray: GrayFailures, policy: Policy, seeds: int, first_seed: int = 0
) -> list[GrayRow]:
    """The baseline (``job`` without gray failures), then each kind under each response."""
    seed_list = range(first_seed, first_seed + seeds)
    base_runs = [simulate(job.with_(gray=None), policy, s) for s in seed_list]
    base = [r.goodput for r in base_runs]
    rows = [_row(job, None, None, base_runs, base)]
    for kind in GRAY_KINDS:
        with_kind = job.with_(gray=_only(gray, kind))
        for response in GrayPolicy:
            runs = [simulate(with_kind, policy, s, response) for s in seed_list]
            rows.append(_row(job, kind, response, runs, base))
    return rows


def _acted(row: GrayRow) -> str:
    c = row.counts
    if row.kind == "fail-slow":
        events = f"{c['slow_episodes']:.0f} episodes"
        return events + (
            f"; {c['slow_handovers']:.0f} to a spare, {c['slow_drops']:.0f} dropped"
            if row.response is GrayPolicy.ACT
            else ""
        )
    if row.kind == "SDC":
        events = f"{c['sdc_events']:.1f} flips"
        if row.response is GrayPolicy.ACT:
            events += f"; {c['sdc_rollbacks']:.1f} rollbacks, {c['sdc_evictions']:.1f} evicted"
        return events + (f"; {c['sdc_restarts']:.1f} late restarts" if c["sdc_restarts"] else "")
    return "—"


def format_gray(rows: Sequence[GrayRow]) -> str:
    """The gray-failure table, Markdown: goodput, loss against fail-stop only, where it went."""
    header = (
        "| job | GPUs | gray failure | policy | goodput % | lost (points) | lost (h per run) "
        "| slow pace % | comparisons % | redone % | events per run (mean) |"
    )
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for r in rows:
        kind = r.kind or "none (fail-stop only)"
        policy = r.response.value if r.response else "—"
        p = r.lost_pct
        lines.append(
            f"| {r.scenario.name} | {r.scenario.mesh.gpus:,} | {kind} | {policy} "
            f"| **{100 * r.goodput:.2f}** ± {100 * r.goodput_sd:.2f} | {100 * r.lost:.2f} | {r.lost_hours:.1f} "
            f"| {p['slow']:.2f} | {p['integrity']:.2f} | {p['corruption']:.2f} | {_acted(r)} |"
        )
    return "\n".join(lines)


def format_gray_parameters(gray: GrayFailures, job: Scenario) -> str:
    """The gray failures' parameters, as a short Markdown list (``job`` gives the step time)."""
    lines = []
    if gray.slow is not None:
        f = gray.slow
        speeds = ", ".join(f"{s:g} ({100 * p:g}%)" for s, p in f.speeds)
        lines += [
            f"- fail-slow: one episode per {f.gpu_hours_per_episode:,.0f} GPU-hours; speed {speeds}; "
            f"exponential duration, mean {f.mean_duration_s / 60:g} min; {100 * f.detectable:g}% seen by the pace judge",
            f"- fail-slow, act: found after {f.patience} windows of {f.window} steps under {f.sure_below:g} "
            f"({f.patience * f.window * job.step_s / 60:g} min at full speed, longer at the slow pace), or once "
            f"{f.horizon // 2 + 1} of the last {f.horizon} windows were under {f.slow_below:g}; a spare takes "
            f"its place, else its replica is dropped if s < (r-1)/r - {f.evict_margin:g}",
        ]
    if gray.sdc is not None:
        c = gray.sdc
        repeat = "never" if c.repeat_s is None else f"after {c.repeat_s / 3600:g} h on average"
        lines += [
            f"- SDC: one flip per {c.gpu_hours_per_event:,.0f} GPU-hours; a defective node corrupts again {repeat}",
            f"- SDC, ignore: noticed {c.notice_s / 3600:g} h after the flip; restart from the checkpoint before it",
            f"- SDC, act: replicas compare every {c.every_steps} steps ({c.every_steps * job.step_s / 60:g} min) at "
            f"{100 * c.compare_cost:g}% of compute; {100 * c.visible:g}% of flips visible to it; named twice: evicted",
        ]
    return "\n".join(lines)


GRAY_SENSITIVITY: tuple[tuple[str, str, dict[str, object]], ...] = (
    ("as stated", "fail-slow", {}),
    ("10x as frequent (100,000 GPU-hours per episode)", "fail-slow", {"gpu_hours_per_episode": 100_000.0}),
    ("10x rarer (10 M GPU-hours per episode)", "fail-slow", {"gpu_hours_per_episode": 10_000_000.0}),
    (
        "episodes of 10 min on average (FALCON's computation fail-slows)",
        "fail-slow",
        {"mean_duration_s": 600.0},
    ),
    ("pace window of 10 steps instead of 20 (found twice as soon)", "fail-slow", {"window": 10}),
    (
        "19% seen by the judge (FALCON: 3 of 16 large-job fail-slows involved a GPU)",
        "fail-slow",
        {"detectable": 3 / 16},
    ),
    ("no spare pool (the (dp-1)/dp rule decides)", "fail-slow", {"spare_nodes": 0}),
    ("as stated", "SDC", {}),
    ("noticed after 30 min instead of 2 h", "SDC", {"notice_s": 1800.0}),
    ("noticed after 24 h", "SDC", {"notice_s": 86400.0}),
    ("10x as frequent (unnoticed flips too)", "SDC", {"gpu_hours_per_event": 16_384 * 54 * 24 / 60}),
    ("half the flips visible to the comparison", "SDC", {"visible": 0.5}),
    ("a tenth of the flips visible to the comparison", "SDC", {"visible": 0.1}),
    ("comparison at 0.01% (estimate at scale, not measured)", "SDC", {"compare_cost": 0.0001}),
    ("compare every 50 steps (1.00%, measured)", "SDC", {"every_steps": 50, "compare_cost": 0.01}),
    ("defective nodes never corrupt again", "SDC", {"repeat_s": None}),
)
"""Changes to the gray failures (or, ``spare_nodes``, to the job), one at a time."""


def _changed(job: Scenario, gray: GrayFailures, kind: str, changes: dict[str, object]) -> Scenario:
    changes = dict(changes)
    if "spare_nodes" in changes:
        job = job.with_(spare_nodes=changes.pop("spare_nodes"))
    if kind == "fail-slow":
        assert gray.slow is not None
        return job.with_(gray=GrayFailures(slow=dataclasses.replace(gray.slow, **changes)))  # type: ignore[arg-type]
    assert gray.sdc is not None
    return job.with_(gray=GrayFailures(sdc=dataclasses.replace(gray.sdc, **changes)))  # type: ignore[arg-type]


def gray_sensitivity(jobs: Sequence[Scenario], gray: GrayFailures, policy: Policy, seeds: int) -> str:
    """Goodput of ignoring and of acting under each change of :data:`GRAY_SENSITIVITY`."""
    header = ["gray failure: assumption", *(f"{j.name} {r.value} %" for j in jobs for r in GrayPolicy)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, kind, changes in GRAY_SENSITIVITY:
        cells = []
        for job in jobs:
            changed = _changed(job, gray, kind, changes)
            for response in GrayPolicy:
                g = statistics.fmean(simulate(changed, policy, s, response).goodput for s in range(seeds))
                cells.append(f"{100 * g:.2f}")
        lines.append(f"| {kind}: {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
