"""Checks that the simulator reproduces published baselines before it predicts anything.

Each function computes one validation figure; ``tests/unit/test_sim.py`` asserts on them and
``resilient-comm sim --report`` prints them, so the documented numbers and the tested ones
come from the same code.

- :func:`textbook_case`: Young's interval and first-order waste for ``c = 60 s``,
  ``λ = 1/3 per hour`` (19 min, 10.5%).
- :func:`llama3_goodput`: ``restart-all`` on the ``llama3-16k`` preset, against Meta's
  reported ≈ 90% effective training time.
- :func:`daly_agreement`: simulated waste of ``restart-all`` with an unlimited spare pool
  against Daly's exact expected waste (same model, so they must agree closely).
- :func:`simulated_optimum`: the checkpoint interval that minimises the *simulated* waste
  (a least-squares fit of ``a/τ + b·τ + c`` over a sweep, with common random numbers across
  the sweep), to compare with Young's and Daly's analytic optima.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from resilient_comm.checkpoint.interval import (
    daly_interval,
    expected_waste,
    first_order_waste,
    young_interval,
)
from resilient_comm.sim.engine import checkpoint_interval, simulate
from resilient_comm.sim.model import Policy, Scenario
from resilient_comm.sim.presets import preset

__all__ = [
    "IntervalSweep",
    "analytic_optima",
    "daly_agreement",
    "interval_sweep",
    "llama3_goodput",
    "simulated_optimum",
    "textbook_case",
]

UNLIMITED_SPARES = 10**9


def textbook_case() -> tuple[float, float]:
    """(Young's interval in seconds, first-order waste) for c = 60 s and one failure per 3 h."""
    mtbf = 3 * 3600.0
    interval = young_interval(60.0, mtbf)
    return interval, first_order_waste(interval, 60.0, mtbf)


def llama3_goodput(seeds: int, first_seed: int = 0) -> list[float]:
    """Goodput of ``restart-all`` on the ``llama3-16k`` preset, one value per seed."""
    job = preset("llama3-16k")
    return [simulate(job, Policy.RESTART_ALL, first_seed + i).goodput for i in range(seeds)]


def daly_agreement(scenario: Scenario, days: float, seeds: int) -> tuple[float, float]:
    """(simulated waste, Daly's exact waste) of ``restart-all`` on ``scenario``.

    The spare pool is made unlimited, since Daly's model never waits for a node.
    """
    job = scenario.with_(spare_nodes=UNLIMITED_SPARES, days=days)
    tau = checkpoint_interval(job, Policy.RESTART_ALL)
    waste = [1.0 - simulate(job, Policy.RESTART_ALL, s).goodput for s in range(seeds)]
    analytic = expected_waste(tau, job.ckpt_cost_s, job.job_mtbf_s, job.recovery.restart_total_s)
    return float(np.mean(waste)), analytic


@dataclasses.dataclass(frozen=True)
class IntervalSweep:
    """Mean simulated waste of one policy at each checkpoint interval."""

    scenario: str
    policy: Policy
    intervals_s: list[float]
    waste: list[float]


def interval_sweep(
    scenario: Scenario, policy: Policy, intervals_s: list[float], seeds: int, unlimited_spares: bool = True
) -> IntervalSweep:
    """Simulated waste of ``policy`` at each interval (the same seeds at every interval)."""
    if unlimited_spares:
        scenario = scenario.with_(spare_nodes=UNLIMITED_SPARES)
    waste = [
        float(
            np.mean(
                [1.0 - simulate(scenario.with_(ckpt_interval_s=t), policy, s).goodput for s in range(seeds)]
            )
        )
        for t in intervals_s
    ]
    return IntervalSweep(scenario.name, policy, list(intervals_s), waste)


def simulated_optimum(
    scenario: Scenario, policy: Policy, days: float, seeds: int, around_s: float, points: int = 13
) -> tuple[float, IntervalSweep]:
    """The interval minimising simulated waste, and the sweep it was fitted to.

    The sweep spans ``around_s / 3`` to ``3·around_s`` geometrically; the waste curve is
    flat near its minimum, so the minimum of a fitted ``a/τ + b·τ + c`` is far less noisy
    than the raw argmin. Raises ``ValueError`` when the raw argmin sits at either end of the
    sweep (the optimum is outside it) or the fit has no minimum.
    """
    intervals = [float(x) for x in np.geomspace(around_s / 3.0, 3.0 * around_s, points)]
    sweep = interval_sweep(scenario.with_(days=days), policy, intervals, seeds)
    best = int(np.argmin(sweep.waste))
    if best in (0, points - 1):
        raise ValueError(f"simulated optimum outside [{intervals[0]:.0f}, {intervals[-1]:.0f}] s")
    taus = np.asarray(intervals)
    design = np.stack([1.0 / taus, taus, np.ones_like(taus)], axis=1)
    a, b, _ = np.linalg.lstsq(design, np.asarray(sweep.waste), rcond=None)[0]
    if a <= 0 or b <= 0:
        raise ValueError(f"fitted waste a/τ + b·τ + c has no minimum (a={a:.3g}, b={b:.3g})")
    return math.sqrt(a / b), sweep


def analytic_optima(scenario: Scenario, rollback_share: float) -> tuple[float, float]:
    """(Young, Daly) optimal intervals for the failures a policy rolls back on."""
    mtbf = scenario.job_mtbf_s / rollback_share
    return young_interval(scenario.ckpt_cost_s, mtbf), daly_interval(scenario.ckpt_cost_s, mtbf)
