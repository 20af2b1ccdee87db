"""How often to checkpoint: the optimal interval (Young 1974, Daly 2006), the waste it leads
to, and :class:`IntervalAdvisor`, which applies them to an async checkpoint's measured costs.

The formulas are the public API shared by the checkpoint interval advisor and the failure
simulator (:mod:`resilient_comm.sim` imports them from here). This module needs neither torch
nor the rest of the package. All times are in seconds; ``mtbf_s`` is the mean time between
failures *of the whole job* (``1/λ``; see :func:`job_mtbf_s` to get it from a per-GPU figure).

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

import dataclasses
import math
from typing import Literal, Protocol

__all__ = [
    "IntervalAdvice",
    "IntervalAdvisor",
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


# --------------------------------------------------------------------------------------------
# Interval advisor


class _SaveTimes(Protocol):
    """What :meth:`IntervalAdvisor.advise_from` reads: a checkpointer's ``CheckpointStats``."""

    def median(self, field: Literal["stall_s", "snapshot_s", "flush_s"]) -> float: ...


@dataclasses.dataclass(frozen=True)
class IntervalAdvice:
    """``interval_s``: compute time between the starts of two checkpoints; ``interval_steps``:
    the same in steps (when a step time was given); ``waste``: the expected fraction of time
    lost to checkpoint stalls, lost work and restarts at that interval; ``bound``: ``"daly"``
    when the formula set the interval, ``"flush"`` when the flush time did (a save cannot start
    before the previous one is durable)."""

    interval_s: float
    interval_steps: int | None
    waste: float
    young_s: float
    cost_s: float
    flush_s: float
    mtbf_s: float
    restart_s: float
    bound: Literal["daly", "flush"]


class IntervalAdvisor:
    """How often to checkpoint, from Young/Daly with an async checkpoint's two costs.

    The failure rate of the whole job: ``mtbf_s``, or ``gpus`` and ``gpu_hours_per_failure``
    (per-GPU rate × GPUs), or ``interruptions_per_hour``. ``restart_s``: detection, relaunch and
    checkpoint load.

    With an async checkpoint the cost ``c`` of Young/Daly is the training thread's stall (for a
    synchronous one, the whole write), and each failure also loses the checkpoint being
    flushed: on average ``flush_s`` more work, which adds to the restart time in the waste (and,
    like it, does not move the optimum). The interval is Daly's, but never shorter than
    ``flush_s``.
    """

    def __init__(
        self,
        *,
        mtbf_s: float | None = None,
        gpus: int | None = None,
        gpu_hours_per_failure: float | None = None,
        interruptions_per_hour: float | None = None,
        restart_s: float = 0.0,
    ) -> None:
        given = [
            mtbf_s is not None,
            gpus is not None or gpu_hours_per_failure is not None,
            interruptions_per_hour is not None,
        ]
        if sum(given) != 1:
            raise ValueError(
                "give exactly one failure rate: mtbf_s, gpus with gpu_hours_per_failure, "
                "or interruptions_per_hour"
            )
        if mtbf_s is not None:
            self.mtbf_s = float(mtbf_s)
        elif interruptions_per_hour is not None:
            if not interruptions_per_hour > 0:
                raise ValueError(f"interruptions_per_hour must be > 0, got {interruptions_per_hour}")
            self.mtbf_s = 3600.0 / interruptions_per_hour
        else:
            if gpus is None or gpu_hours_per_failure is None:
                raise ValueError("gpus and gpu_hours_per_failure go together")
            self.mtbf_s = job_mtbf_s(gpus, gpu_hours_per_failure)
        if not self.mtbf_s > 0 or restart_s < 0:
            raise ValueError(f"need MTBF > 0 and restart >= 0, got {self.mtbf_s}, {restart_s}")
        self.restart_s = float(restart_s)

    def advise(self, stall_s: float, flush_s: float = 0.0, step_s: float | None = None) -> IntervalAdvice:
        """The interval for a checkpoint that stalls training ``stall_s`` and becomes durable
        ``flush_s`` after the stall; in steps too when ``step_s`` (one step's time) is given."""
        if stall_s < 0 or flush_s < 0:
            raise ValueError(f"stall and flush times must be >= 0, got {stall_s}, {flush_s}")
        cost = max(stall_s, 1e-6)  # a stall too small to measure still costs something
        daly = daly_interval(cost, self.mtbf_s)
        interval = max(daly, flush_s)
        steps = None
        if step_s is not None:
            if not step_s > 0:
                raise ValueError(f"step time must be > 0, got {step_s}")
            steps = max(1, round(interval / step_s))
            interval = steps * step_s
        return IntervalAdvice(
            interval_s=interval,
            interval_steps=steps,
            waste=expected_waste(interval, cost, self.mtbf_s, self.restart_s + flush_s),
            young_s=young_interval(cost, self.mtbf_s),
            cost_s=stall_s,
            flush_s=flush_s,
            mtbf_s=self.mtbf_s,
            restart_s=self.restart_s,
            bound="daly" if daly >= flush_s else "flush",
        )

    def advise_from(self, stats: _SaveTimes, step_s: float | None = None) -> IntervalAdvice:
        """:meth:`advise` with the medians of a checkpointer's completed saves."""
        stall, flush = stats.median("stall_s"), stats.median("flush_s")
        if math.isnan(stall):
            raise ValueError("no completed save to measure yet")
        return self.advise(stall, flush, step_s)
