"""Failure simulator: what a recovery policy is worth for a synchronous job at 10K–100K GPUs.

A discrete-event simulation of one training job (a tp × pp × dp mesh on nodes) under a
Poisson failure process with published rates, with checkpoints, a spare pool that is
replenished as failed nodes are repaired, and three recovery policies: ``restart-all``
(torchrun: relaunch everything, reload the checkpoint), ``shrink`` (in process, drop the
data-parallel replica holding the failed node) and ``hot-spare`` (in process, a spare
takes the failed node's place; shrink when none is left). It reports the effective
training time ratio (goodput), the time lost by cause and the spare-exhaustion events;
runs are deterministic in their seed. Gray failures (:mod:`.gray`: a node that turns slow,
silent data corruption) can be added, ignored or acted on as resilient_comm's controller does
(``resilient-comm sim --gray``).

- :func:`simulate` runs one scenario under one policy (:mod:`.engine` has the semantics).
- The optimal checkpoint interval formulas (Young/Daly) come from
  :mod:`resilient_comm.checkpoint.interval`, beside the checkpoint interval advisor.
- :mod:`.presets` holds the published failure rates, the stated recovery times and the
  ``llama3-16k`` and ``100k`` jobs; :mod:`.validation` the checks against published
  baselines; :func:`main` is ``resilient-comm sim``. The model is described in docs/sim.md.
"""

from __future__ import annotations

from resilient_comm.sim.cli import main
from resilient_comm.sim.engine import checkpoint_interval, simulate
from resilient_comm.sim.gray import FailSlow, GrayFailures, GrayPolicy, SilentCorruption
from resilient_comm.sim.model import Mesh, Policy, RecoveryTimes, Scenario, SimResult
from resilient_comm.sim.presets import (
    FAILURE_RATES,
    GRAY,
    PRESETS,
    STATED_RECOVERY,
    preset,
    suggested_spare_nodes,
)

__all__ = [
    "FAILURE_RATES",
    "GRAY",
    "PRESETS",
    "STATED_RECOVERY",
    "FailSlow",
    "GrayFailures",
    "GrayPolicy",
    "Mesh",
    "Policy",
    "RecoveryTimes",
    "Scenario",
    "SilentCorruption",
    "SimResult",
    "checkpoint_interval",
    "main",
    "preset",
    "simulate",
    "suggested_spare_nodes",
]
