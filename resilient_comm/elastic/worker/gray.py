"""Gray failures, where nothing dies: the checks a member runs between its steps, judged alike
by every member at the same step's end. Runs in a worker, on its training thread
(`Controller._begin`, `Controller._commit`).

- the replicas' comparison (`integrity.py`): silent data corruption; on a mismatch the state
  goes back and the steps since run again;
- fail-slow (`pace_watch.py`): a rank that computes slower than its peers leaves (a spare
  takes its place, or its replica is dropped when the job is faster without it).

Both restart from nothing after a recovery (`forget`): the replicas, their shards and the
members may all have changed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from resilient_comm.config import knob_int
from resilient_comm.elastic.model.pace import PaceConfig
from resilient_comm.elastic.model.policy import Mesh
from resilient_comm.elastic.state.provider import Stateful
from resilient_comm.elastic.worker.integrity import Integrity
from resilient_comm.elastic.worker.pace_watch import PaceWatch


@dataclass
class After:
    """What a step's end asks of the controller: go back to committed step `back_to` (the
    steps since run again), or recover without the ranks that `leave` (planned: nothing
    failed). Neither: go on."""

    back_to: int | None = None
    leave: list[int] = field(default_factory=list)


class GrayChecks:
    """One member's gray-failure checks. `fingerprint_every` None: the knob's; `pace` None:
    ``RESILIENT_COMM_PACE_WINDOW`` and the defaults; `sharded`: the state is sharded over dp
    (nothing to compare). `emit(event, **info)`: the controller's hook."""

    def __init__(
        self,
        fingerprint_every: int | None,
        pace: PaceConfig | None,
        sharded: bool,
        rank: int,
        emit: Callable[..., None],
    ) -> None:
        if fingerprint_every is None:
            fingerprint_every = knob_int("RESILIENT_COMM_FINGERPRINT_EVERY", 0)
        self.integrity = Integrity(fingerprint_every, emit, sharded)
        self.pace = PaceWatch(pace or PaceConfig.from_env(), rank)
        self.rank = rank
        self._emit = emit

    def step_started(
        self,
        committed: int,
        state: Stateful | None,
        snapshot: tuple[int, dict[str, Any]] | None,
        device: torch.device,
    ) -> None:
        self.integrity.begin(committed, state, snapshot)
        self.pace.step_started(device)

    def step_computed(self) -> None:
        """The step's own work ends: what follows waits on the others."""
        self.pace.step_computed()

    def forget(self, members: list[int]) -> None:
        self.integrity.forget()
        self.pace.forget(members)

    def after_commit(
        self,
        step: int,
        *,
        last: bool,
        checkpoint: bool,
        state: Stateful | None,
        world: dist.ProcessGroup,
        members: list[int],
        mesh: Mesh,
        spares: Callable[[], int],
    ) -> After:
        """After `step` committed (the run's `last`, or a state a `checkpoint` saves next):
        compare the replicas where due, then judge the pace window where due. Raises
        `Evicted` on a member that leaves, `ReplicaMismatchError` on every member alike when
        the replicas differ for good."""
        if self.integrity.due(step, last, checkpoint) and state is not None:
            back_to = self.integrity.check(step, state, world, members, mesh, self.rank)
            if back_to is not None:
                self.pace.forget(members)  # this window's times go with the steps redone
                return After(back_to=back_to)
        if self.pace.due():
            return After(leave=self.pace.window_end(step, world, members, mesh, spares, self._emit))
        return After()


__all__ = ["After", "GrayChecks"]
