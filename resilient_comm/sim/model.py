"""What the simulator is told (a :class:`Scenario` and a :class:`Policy`) and what it answers.

A scenario is one synchronous training job: a ``tp × pp × dp`` mesh of GPUs packed
``gpus_per_node`` to a node, a failure rate, a checkpoint cost and interval, a pool of
spare nodes with a repair time, and the durations of every recovery phase
(:class:`RecoveryTimes`). All durations are seconds.

Units of failure and of repair are *nodes*: a GPU fault (Xid, HBM error, a dead NIC) takes
its node out of service until it is repaired, and a hot spare is a whole node. A
tensor-/pipeline-parallel replica (``tp·pp`` GPUs) is atomic: it is whole nodes, and
without a spare the replica holding the failed node leaves the job (see
:mod:`resilient_comm.sim.engine` for the policies' exact semantics).

Gray failures (a node that turns slow, a flipped bit: :mod:`.gray`) are part of a scenario
too, absent unless set; what the job does about them is a
:class:`~resilient_comm.sim.gray.GrayPolicy`, given to the run beside the :class:`Policy`.

Recovery times are *stated parameters*, not measurements, until a benchmark writes them:
:meth:`RecoveryTimes.from_json` replaces any subset of them from a JSON object whose keys
are the field names below (``{"detect_s": 0.8, "rebuild_s": 4.0, "source": "bench ..."}``).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import pathlib
from typing import Any

from resilient_comm.sim.gray import GRAY_COUNTS, GrayFailures


class Policy(str, enum.Enum):
    """What the job does when a node fails.

    - ``restart-all`` (torchrun): every process is killed and relaunched; the job reloads
      its last checkpoint and recomputes what was lost since. The failed node is replaced
      from the spare pool (the job waits for a repaired node when the pool is empty).
    - ``shrink`` (in process, no spares): the survivors abort their communicators, agree,
      and rebuild without the data-parallel replica that held the failed node; no state is
      reloaded (a data-parallel peer holds the same shard). The replica's healthy nodes go
      idle and the job grows back by one replica as soon as idle healthy nodes make one.
    - ``hot-spare`` (in process, the project's policy): a spare node takes the failed node's
      place and copies its state from a data-parallel peer; the job keeps its size. When the
      pool is empty (a spare-exhaustion event) it shrinks as above.
    """

    RESTART_ALL = "restart-all"
    SHRINK = "shrink"
    HOT_SPARE = "hot-spare"

    @property
    def in_process(self) -> bool:
        return self is not Policy.RESTART_ALL

    @property
    def uses_spares(self) -> bool:
        return self is not Policy.SHRINK


@dataclasses.dataclass(frozen=True)
class RecoveryTimes:
    """Duration of each recovery phase, in seconds, and where the numbers come from.

    In-process recovery (``shrink``, ``hot-spare``): ``detect_s`` (failure to every
    survivor knowing), ``abort_s`` (abort the communicators), ``rebuild_s`` (agree on the
    new membership and build the new communicators), ``state_copy_s`` (a spare, or a
    replica joining a grow, copies its shard from a data-parallel peer).

    Restart-all (torchrun, and any interruption in-process recovery cannot absorb):
    ``restart_detect_s`` (until the launcher kills the job), ``restart_s`` (re-queue,
    relaunch every process, build the communicators, warm up), ``restore_s`` (load the
    checkpoint).
    """

    detect_s: float
    abort_s: float
    rebuild_s: float
    state_copy_s: float
    restart_detect_s: float
    restart_s: float
    restore_s: float
    source: str

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "source" and not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"recovery time {f.name} must be a finite number >= 0, got {v!r}")

    @property
    def restart_total_s(self) -> float:
        """Detection to the first step after a full restart (Daly's ``R``)."""
        return self.restart_detect_s + self.restart_s + self.restore_s

    def replaced(self, values: dict[str, Any]) -> RecoveryTimes:
        """These times with ``values`` (field name → seconds, or ``source``) replacing theirs."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown recovery parameter(s) {unknown}; known: {sorted(known)}")
        return dataclasses.replace(self, **values)

    def from_json(self, path: str | pathlib.Path) -> RecoveryTimes:
        """These times with those of the JSON object in ``path`` replacing theirs.

        Without a ``source`` key the source becomes the file's path, so a table says which
        numbers were measured.
        """
        data = json.loads(pathlib.Path(path).read_text())
        if not isinstance(data, dict):
            raise TypeError(f"{path}: expected a JSON object of recovery times, got {type(data).__name__}")
        return self.replaced({"source": f"measured: {path}", **data})


@dataclasses.dataclass(frozen=True)
class Mesh:
    """A ``tp × pp × dp`` job; a replica is ``tp·pp`` GPUs on whole nodes."""

    tp: int
    pp: int
    dp: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.dp, self.gpus_per_node) < 1:
            raise ValueError(f"mesh sizes must be >= 1: {self}")
        if self.replica_gpus % self.gpus_per_node:
            raise ValueError(
                f"a replica (tp·pp = {self.replica_gpus} GPUs) must be whole nodes of {self.gpus_per_node} GPUs"
            )

    @property
    def replica_gpus(self) -> int:
        return self.tp * self.pp

    @property
    def nodes_per_replica(self) -> int:
        return self.replica_gpus // self.gpus_per_node

    @property
    def gpus(self) -> int:
        return self.replica_gpus * self.dp

    @property
    def nodes(self) -> int:
        return self.nodes_per_replica * self.dp

    def __str__(self) -> str:
        return f"tp{self.tp}×pp{self.pp}×dp{self.dp}"


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One job to simulate (see the module docstring for units).

    ``gpu_hours_per_failure``: the failure rate, as GPU-hours between interruptions; every
    GPU of the job fails independently (a Poisson process) while the job holds it,
    including during recovery. ``unabsorbable_fraction``: the share of interruptions that
    no in-process recovery can absorb (software bugs, switch or storage outages): they
    take no node out of service but force a full restart from the checkpoint under every
    policy. ``ckpt_interval_s``: compute time between checkpoints; ``None`` picks Daly's
    optimum for the rate of failures that make the policy roll back, capped at
    ``max_ckpt_interval_s`` (jobs checkpoint for other reasons too). ``gray``: slow nodes and
    silent data corruption (:mod:`.gray`); none by default.
    """

    name: str
    mesh: Mesh
    gpu_hours_per_failure: float
    days: float
    step_s: float
    ckpt_cost_s: float
    spare_nodes: int
    replenish_s: float
    recovery: RecoveryTimes
    unabsorbable_fraction: float = 0.0
    ckpt_interval_s: float | None = None
    max_ckpt_interval_s: float = 3600.0
    gray: GrayFailures | None = None

    def __post_init__(self) -> None:
        if not (self.gpu_hours_per_failure > 0 and self.days > 0 and self.ckpt_cost_s > 0):
            raise ValueError(f"{self.name}: failure rate, days and checkpoint cost must be > 0")
        if self.step_s < 0 or self.spare_nodes < 0 or self.replenish_s < 0:
            raise ValueError(f"{self.name}: step time, spare nodes and replenish time must be >= 0")
        if not 0.0 <= self.unabsorbable_fraction <= 1.0:
            raise ValueError(f"{self.name}: unabsorbable_fraction must be in [0, 1]")
        if self.ckpt_interval_s is not None and not self.ckpt_interval_s > 0:
            raise ValueError(f"{self.name}: checkpoint interval must be > 0 s")

    @property
    def node_failure_rate(self) -> float:
        """Failures per second of one node."""
        return self.mesh.gpus_per_node / (self.gpu_hours_per_failure * 3600.0)

    @property
    def job_mtbf_s(self) -> float:
        """Mean time between failures of the full-size job."""
        return 1.0 / (self.node_failure_rate * self.mesh.nodes)

    def with_(self, **changes: Any) -> Scenario:
        """A copy with ``changes`` applied (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What one simulated run produced.

    ``useful_s`` is training progress in full-job seconds (a job running with 127 of 128
    replicas makes 127/128 s of progress per second). ``lost_s`` splits the rest of the wall
    time by cause, in the same unit, so ``useful_s + sum(lost_s.values()) == wall_s``:
    ``checkpoint`` (blocking writes), ``rollback`` (work recomputed: since the last
    checkpoint after a restart, the step in flight after an in-process recovery),
    ``detection``, ``restart`` (relaunch), ``rebuild`` (abort + new communicators),
    ``restore`` (checkpoint load or state copy to a spare), ``grow`` (pause to add a
    replica back), ``spare_wait`` (a restart waiting for a repaired node), ``shrunk``
    (running with fewer replicas than the mesh); and, from gray failures (:data:`GRAY_CAUSES`),
    ``slow`` (running at a slow node's pace), ``integrity`` (replica comparisons) and
    ``corruption`` (work redone because of a flipped bit). ``gray_counts``: the gray events
    and what was done about them (:data:`~resilient_comm.sim.gray.GRAY_COUNTS`).
    """

    scenario: str
    policy: Policy
    seed: int
    gpus: int
    wall_s: float
    useful_s: float
    lost_s: dict[str, float]
    ckpt_interval_s: float
    failures: int
    restarts: int
    spare_swaps: int
    shrinks: int
    grows: int
    spare_exhaustions: int
    min_replicas: int
    gray_counts: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(GRAY_COUNTS, 0))

    @property
    def goodput(self) -> float:
        """Effective training time ratio: progress over wall time."""
        return self.useful_s / self.wall_s


LOSS_CAUSES: tuple[str, ...] = (
    "checkpoint",
    "rollback",
    "detection",
    "restart",
    "rebuild",
    "restore",
    "grow",
    "spare_wait",
    "shrunk",
)

GRAY_CAUSES: tuple[str, ...] = ("slow", "integrity", "corruption")
"""Causes of lost time that only gray failures produce (:mod:`.gray`)."""
