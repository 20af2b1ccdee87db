"""Silent data corruption: the data-parallel replicas compare fingerprints of their state, and
on a mismatch every member goes back to the newest state they agreed on. Runs in a worker, on
its training thread, after a step's commit (`Controller._commit`).

Every `every` committed steps each member fingerprints its state (`state/fingerprint.py`: a
hash of the bits, never the tensors) and the world all-gathers the 16-byte fingerprints. The
members that must hold identical state are the dp replicas of one (pp, tp) place; each such
set is compared. Every member computes the same verdict from the same gathered bytes, so
nothing more is exchanged:

- **all agree**: this state is the newest agreed one; a private copy of it is kept in memory
  (one copy of this member's state, replacing the previous one: the commit protocol's
  snapshot of the next step's start, which is this state, where it takes one);
- **a mismatch**: a corrupted replica's gradients have already been averaged into every
  replica, so healing one replica from a peer is not enough: *every* member loads the agreed
  copy and the job redoes the steps since (the loop's `next_step` moves back). Where a strict
  majority of a place's replicas agree, the others are named as diverged; with two replicas
  nobody can be named. A member named a second time is treated as failing: it leaves the job
  (`Evicted`, exit status `EXIT_EVICTED`), which the others see as a lost rank (a hot spare
  takes its place, or the policy shrinks).

What this cannot see: corruption that leaves the replicas identical. A gradient corrupted
before the all-reduce is averaged into every replica alike; so is a flipped bit in an
activation. Only the state's own bits, differing between replicas, are caught, and only at the
next comparison: a member that reads its corrupted state sooner (a checkpoint written in
between) writes it as is.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from resilient_comm.elastic.model.policy import Mesh
from resilient_comm.elastic.state.fingerprint import fingerprint
from resilient_comm.elastic.state.provider import Stateful
from resilient_comm.elastic.worker.errors import Evicted

log = logging.getLogger("resilient_comm.elastic")

_BYTES = 16


@dataclass
class Verdict:
    """What one comparison found (the same on every member)."""

    step: int  # the committed step whose state was compared
    agreed: bool
    # Per (pp, tp) place that disagreed: the launch ranks named as diverged (empty: no majority).
    diverged: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    back_to: int = -1  # the step every member went back to (after a mismatch)
    ms: float = 0.0  # this member's time for the comparison

    @property
    def named(self) -> list[int]:
        return sorted(r for ranks in self.diverged.values() for r in ranks)


class Integrity:
    """One member's side of the replica comparison. `every`: compare after every `every`-th
    committed step (0: never). `emit(event, **info)`: the controller's hook."""

    def __init__(self, every: int, emit: Callable[..., None]) -> None:
        if every < 0:
            raise ValueError(f"fingerprint_every must be >= 0, got {every}")
        self.every = every
        self._emit = emit
        # (committed step, a private copy of the state then; None until the next step's start)
        self.agreed: tuple[int, dict[str, Any] | None] | None = None
        self.named: Counter[int] = Counter()  # launch rank -> comparisons that named it
        self.verdicts: list[Verdict] = []  # every mismatch, in order

    def begin(
        self, committed: int, state: Stateful | None, snapshot: tuple[int, dict[str, Any]] | None
    ) -> None:
        """A step starts, after `committed`: keep the state as the one to go back to where that
        is due (the first step, or the first after a recovery: the baseline; the first after a
        comparison that agreed). `snapshot`: the commit protocol's copy of this state, taken at
        the step's start (`Commits.begin`); nobody changes it, so it is kept as is instead of
        copied again."""
        if not self.every or state is None or (self.agreed is not None and self.agreed[1] is not None):
            return
        if snapshot is not None and snapshot[0] == committed + 1:
            self.agreed = (committed, snapshot[1])
        else:
            self.agreed = (committed, copy.deepcopy(state.state_dict()))

    def forget(self) -> None:
        """A recovery rebuilt the world (the replicas, their shards, the committed step may all
        have changed): the next step's state is the new baseline."""
        self.agreed = None

    def due(self, committed: int) -> bool:
        return self.every > 0 and (committed + 1) % self.every == 0

    def check(
        self, step: int, state: Stateful, world: dist.ProcessGroup, members: list[int], mesh: Mesh, rank: int
    ) -> int | None:
        """The comparison after `step`, as the controller runs it: None where the replicas
        agree; on a mismatch, the step the state went back to (logged, and the hook's
        ``integrity.mismatch``). Launch rank `rank` named a second time raises `Evicted`."""
        v = self.compare(step, state, world, members, mesh)
        if v.agreed:
            self._emit("integrity.agreed", step=step, ms=v.ms)
            return None
        named = f"diverged: rank(s) {v.named}" if v.named else "no majority names a replica"
        log.warning(
            "rank %d: the replicas' state differs after step %d (%s); every member goes back to step %d",
            rank,
            step,
            named,
            v.back_to,
        )
        self._emit("integrity.mismatch", step=step, back_to=v.back_to, diverged=v.named)
        if rank in v.named and self.named[rank] >= 2:
            raise Evicted(
                f"rank {rank}'s replica diverged from its peers {self.named[rank]} times (the last after "
                f"step {step}): treated as failing, it leaves the job"
            )
        return v.back_to

    def compare(
        self,
        committed: int,
        state: Stateful,
        world: dist.ProcessGroup,
        members: list[int],
        mesh: Mesh,
    ) -> Verdict:
        """Fingerprint this member's state after step `committed`, gather every member's, and
        judge. On a mismatch the state is already back at the agreed step (`Verdict.back_to`)."""
        t0 = time.monotonic()
        mine = torch.frombuffer(bytearray(fingerprint(state.state_dict())), dtype=torch.uint8)
        gathered = [torch.empty(_BYTES, dtype=torch.uint8) for _ in members]
        dist.all_gather(gathered, mine, group=world)
        prints = [bytes(t.tolist()) for t in gathered]
        verdict = judge(committed, prints, members, mesh)
        if verdict.agreed:
            self.agreed = (committed, None)  # kept at the next step's start (`begin`)
        else:
            assert self.agreed is not None and self.agreed[1] is not None, "begin() runs before every step"
            # A private copy again: load_state_dict may alias what it is given (optimizer state).
            state.load_state_dict(copy.deepcopy(self.agreed[1]))
            verdict.back_to = self.agreed[0]
            self.named.update(verdict.named)
            self.verdicts.append(verdict)
        verdict.ms = 1e3 * (time.monotonic() - t0)
        return verdict


def judge(step: int, prints: list[bytes], members: list[int], mesh: Mesh) -> Verdict:
    """Compare the fingerprints of each (pp, tp) place's dp replicas. `prints[i]` is world rank
    i's; `members[i]` its launch rank."""
    places: dict[tuple[int, int], list[int]] = {}
    for i in range(len(members)):
        c = mesh.coords(i)
        places.setdefault((c["pp"], c["tp"]), []).append(i)
    diverged: dict[tuple[int, int], list[int]] = {}
    for place, ranks in places.items():
        counts = Counter(prints[i] for i in ranks)
        if len(counts) == 1:
            continue
        value, n = counts.most_common(1)[0]
        majority = value if 2 * n > len(ranks) else None
        diverged[place] = [] if majority is None else [members[i] for i in ranks if prints[i] != majority]
    return Verdict(step, not diverged, diverged)


__all__ = ["Integrity", "Verdict", "judge"]
