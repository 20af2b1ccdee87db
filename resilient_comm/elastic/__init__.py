"""resilient_comm.elastic: detect, agree, evict, shrink and resume in-process.

The package is split by the process each part runs in, imports going one way only
(model <- membership <- {node, worker}; worker -> state)::

    model/       pure: the mesh and policy, records, `decide`, the detection bounds, timelines
    membership/  the store protocol every process speaks (and etcd as the store)
    node/        the node agent process: ``resilient-run`` and its `NodeAgent`
    worker/      a training process: the `Controller`, `restartable`, detection, rejoining
    state/       a worker's training state: providers, transfers, re-sharding, DeviceMesh

- `Controller` wraps the training loop (commit protocol, recovery, timelines).
- `restartable` re-enters a script's function in the same process after a failure, for
  scripts not written for the controller (worker/inprocess.py; ``resilient-run --in-process``).
- `Membership` keeps epochs, decisions and failure reports on the launcher's store.
- `Detector` turns exit reports, heartbeats and dead-vs-slow bounds into evidence.
- `Mesh` / `plan` / `plan_shrink`: the mesh-aware policy (hot spares fill lost places; without
  one a TP/PP group is atomic and its whole replica leaves).
- `model.decide.decide`: an epoch's decision from what the decider read (pure: unit-tested).
- `TrainState`: a state provider (model, optimizer, RNG, extra state) for the controller;
  `state.transfer` copies a state between members as tensors (hot spares, laggards).
- `Launcher` (the ``resilient-run`` command) hosts the store, starts workers, reports exits;
  its `NodeAgent` judges the node's heartbeats and watches the next node (node/agent.py).

docs/elastic.md describes the protocol, the bounds and what a user sees.
"""

from resilient_comm.elastic.membership.protocol import Membership
from resilient_comm.elastic.model.bounds import DetectorConfig
from resilient_comm.elastic.model.env import EXIT_EVICTED
from resilient_comm.elastic.model.policy import Mesh, Plan, plan, plan_shrink
from resilient_comm.elastic.model.records import Decision, Gone, JoinRecord
from resilient_comm.elastic.model.timeline import Timeline, prometheus
from resilient_comm.elastic.node.agent import NodeAgent
from resilient_comm.elastic.node.launcher import Launcher
from resilient_comm.elastic.state.provider import Place, TrainState
from resilient_comm.elastic.worker.controller import Controller, Step
from resilient_comm.elastic.worker.detector import Detector
from resilient_comm.elastic.worker.errors import Evicted, RecoveryError, ReplicaMismatchError
from resilient_comm.elastic.worker.groups import Groups
from resilient_comm.elastic.worker.inprocess import restartable

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
    "ReplicaMismatchError",
    "Step",
    "Timeline",
    "TrainState",
    "plan",
    "plan_shrink",
    "prometheus",
    "restartable",
]
