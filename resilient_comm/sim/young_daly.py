"""Optimal checkpoint interval (Young 1974, Daly 2006) and the waste it leads to.

The public API shared by the failure simulator and the checkpoint interval advisor. All
times are in seconds; ``mtbf_s`` is the mean time between failures *of the whole job*
(``1/λ``; see :func:`job_mtbf_s` to get it from a per-GPU figure).

Model (the one both formulas assume): a job computes for ``interval_s`` then blocks for
``cost_s`` to write a checkpoint, again and again. Failures arrive as a Poisson process of
rate ``1/mtbf_s``; a failure throws away everything since the last *completed* checkpoint
(a checkpoint being written when the failure hits is lost too), and the job restarts from
that checkpoint after ``restart_s`` (detection + relaunch + checkpoint load), during which
failures keep arriving and a failure starts the restart over.

- :func:`young_interval`: ``√(2·c·M)`` — Young's first-order optimum (the ``Δt* ≈ √(2c/λ)``
  of the design notes). It minimises :func:`first_order_waste`.
- :func:`daly_interval`: Daly's higher-order optimum, accurate while ``c`` is a sizeable
  fraction of ``M``; equal to Young's to first order.
- :func:`first_order_waste`: ``c/τ + (τ/2 + R)/M``, the fraction of time lost.
- :func:`expected_waste`: Daly's exact expected waste for the model above,
  ``1 − τ / (M·e^{R/M}·(e^{(τ+c)/M} − 1))``. The restart time only scales the loss; it does
  not move the optimum.

Worked example (the design notes' textbook case): ``c = 60 s``, ``λ = 1/3 per hour``:
``young_interval(60, 3 * 3600)`` is 1,138 s (19 min) and
``first_order_waste(1138, 60, 3 * 3600)`` is 0.105 (10.5% of the time lost).
"""

from __future__ import annotations

import math

__all__ = [
    "daly_interval",
    "expected_waste",
    "first_order_waste",
    "job_mtbf_s",
    "young_interval",
]


def _check(cost_s: float, mtbf_s: float) -> None:
    if not cost_s > 0:
        raise ValueError(f"checkpoint cost must be > 0 s, got {cost_s}")
    if not mtbf_s > 0:
        raise ValueError(f"MTBF must be > 0 s, got {mtbf_s}")


def job_mtbf_s(gpus: int, gpu_hours_per_failure: float) -> float:
    """The job's mean time between failures in seconds, from GPU-hours per failure.

    Failures of independent GPUs add up: a job of ``gpus`` GPUs fails ``gpus`` times as
    often as one GPU. Llama 3's ≈45,600 GPU-hours per interruption on 16,384 GPUs gives
    one failure every 2.8 hours.
    """
    if gpus <= 0 or not gpu_hours_per_failure > 0:
        raise ValueError(f"need gpus > 0 and GPU-hours per failure > 0, got {gpus}, {gpu_hours_per_failure}")
    return gpu_hours_per_failure * 3600.0 / gpus


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's optimal compute time between checkpoints: ``√(2·cost·MTBF)``."""
    _check(cost_s, mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimal compute time between checkpoints.

    ``√(2cM)·[1 + ⅓·√(c/2M) + ⅑·(c/2M)] − c`` for ``c < 2M``, else ``M`` (checkpointing
    more often than once per MTBF only adds cost). Minimises :func:`expected_waste` to
    within a fraction of a percent wherever ``c ≪ M``.
    """
    _check(cost_s, mtbf_s)
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost_s


def first_order_waste(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Fraction of time lost, to first order: ``c/τ + (τ/2 + R)/M``.

    Checkpoint writes cost ``c`` every ``τ``; each failure (one per ``M``) loses half an
    interval of work on average plus the restart ``R``. At ``τ = young_interval(c, M)`` and
    ``R = 0`` it equals ``√(2c/M)``.
    """
    _check(cost_s, mtbf_s)
    if not interval_s > 0:
        raise ValueError(f"checkpoint interval must be > 0 s, got {interval_s}")
    return cost_s / interval_s + (interval_s / 2.0 + restart_s) / mtbf_s


def expected_waste(interval_s: float, cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Daly's exact expected fraction of wall time lost under Poisson failures.

    The expected wall time to complete ``W`` of work is
    ``M·e^{R/M}·(e^{(τ+c)/M} − 1)·W/τ``; the waste is one minus ``W`` over that. This is
    the model the simulator's restart-all policy must reproduce when nodes never run out.
    """
    _check(cost_s, mtbf_s)
    if not interval_s > 0:
        raise ValueError(f"checkpoint interval must be > 0 s, got {interval_s}")
    wall_per_work = (
        mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + cost_s) / mtbf_s) / interval_s
    )
    return 1.0 - 1.0 / wall_per_work
