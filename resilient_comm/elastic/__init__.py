"""resilient_comm.elastic: detect, agree, evict, shrink and resume in-process.

- `Controller` wraps the training loop (commit protocol, recovery, timelines).
- `restartable` re-enters a script's function in the same process after a failure, for
  scripts not written for the controller (inprocess.py; ``resilient-run --in-process``).
- `Membership` keeps epochs, decisions and failure reports on the launcher's store.
- `Detector` turns exit reports, heartbeats and dead-vs-slow bounds into evidence.
- `Mesh` / `plan` / `plan_shrink`: the mesh-aware policy (hot spares fill lost places; without
  one a TP/PP group is atomic and its whole replica leaves).
- `decision.decide`: an epoch's decision from what the decider read (pure: unit-tested).
- `TrainState`: a state provider (model, optimizer, RNG, extra state) for the controller;
  `statesync` copies a state between members as tensors (hot spares, laggards).
- `Launcher` (the ``resilient-run`` command) hosts the store, starts workers, reports exits;
  its `NodeAgent` judges the node's heartbeats and watches the next node (agent.py).

docs/elastic.md describes the protocol, the bounds and what a user sees.
"""

from resilient_comm.elastic.agent import NodeAgent
from resilient_comm.elastic.controller import (
    EXIT_EVICTED,
    Controller,
    Evicted,
    Groups,
    Place,
    RecoveryError,
    Step,
    TrainState,
)
from resilient_comm.elastic.detector import Detector, DetectorConfig
from resilient_comm.elastic.inprocess import restartable
from resilient_comm.elastic.launcher import Launcher
from resilient_comm.elastic.membership import Decision, Gone, JoinRecord, Membership
from resilient_comm.elastic.policy import Mesh, Plan, plan, plan_shrink
from resilient_comm.elastic.timeline import Timeline, prometheus

__all__ = [
    "EXIT_EVICTED",
    "Controller",
    "Decision",
    "Detector",
    "DetectorConfig",
    "Evicted",
    "Gone",
    "Groups",
    "JoinRecord",
    "Launcher",
    "Membership",
    "Mesh",
    "NodeAgent",
    "Place",
    "Plan",
    "RecoveryError",
    "Step",
    "Timeline",
    "TrainState",
    "plan",
    "plan_shrink",
    "prometheus",
    "restartable",
]
