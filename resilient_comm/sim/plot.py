"""The PNG of ``resilient-comm sim --plot``: goodput against GPU count, waste against interval.

matplotlib is imported here and only here, with the Agg backend, so the simulator and its
tables work without it; :func:`write_png` raises a ``RuntimeError`` naming the package to
install when it is missing.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from resilient_comm.sim.model import Policy
from resilient_comm.sim.validation import IntervalSweep

__all__ = ["write_png"]


def write_png(
    path: str | pathlib.Path,
    gpus: Sequence[int],
    goodput: dict[Policy, list[float]],
    sweeps: Sequence[tuple[IntervalSweep, list[float], float]],
    title: str,
) -> None:
    """Two panels: each policy's goodput against ``gpus``; each sweep's simulated waste
    against the checkpoint interval, with its analytic curve and the analytic optimum.

    ``sweeps`` holds ``(sweep, analytic waste at each interval, analytic optimum in s)``.
    """
    try:
        import matplotlib
    except ImportError as e:
        raise RuntimeError("the plot needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for policy, values in goodput.items():
        left.plot(gpus, [100 * v for v in values], marker="o", label=policy.value)
    left.set_xscale("log")
    left.set_xticks(list(gpus), [f"{g // 1024}K" if g % 1024 == 0 else f"{g / 1000:.0f}K" for g in gpus])
    left.minorticks_off()
    left.set_xlabel("GPUs")
    left.set_ylabel("goodput (effective training time, %)")
    left.set_title("goodput against job size")
    left.grid(True, alpha=0.3)
    left.legend()

    for sweep, analytic, optimum in sweeps:
        minutes = [t / 60 for t in sweep.intervals_s]
        (line,) = right.plot(
            minutes,
            [100 * w for w in sweep.waste],
            marker="o",
            linestyle="none",
            label=f"{sweep.scenario} {sweep.policy.value}: simulated",
        )
        right.plot(minutes, [100 * w for w in analytic], color=line.get_color(), label="Daly, exact")
        right.axvline(
            optimum / 60, color=line.get_color(), linestyle=":", label=f"Daly optimum {optimum / 60:.1f} min"
        )
    right.set_xscale("log")
    right.set_xlabel("checkpoint interval (min)")
    right.set_ylabel("waste (% of wall time)")
    right.set_title("waste against checkpoint interval")
    right.grid(True, alpha=0.3)
    right.legend(fontsize="small")

    fig.suptitle(title, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
