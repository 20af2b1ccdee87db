"""Silent data corruption: the data-parallel replicas compare fingerprints of their state, and
on a mismatch every member goes back to the newest state they agreed on. Runs in a worker, on
its training thread, after a step's commit (`Controller._commit`).

Every `every` committed steps, after the run's last step, and before every checkpoint is
written (so that no job ends and no checkpoint is saved from a state that failed its
comparison), each member fingerprints the part of its state that every replica holds alike
(`state.provider.replicated_view`: parameters and optimizer state, never per-rank RNG or data
positions; [Note: what the replicas compare]) and the world all-gathers the 16-byte
fingerprints. The members that must hold identical state are the dp replicas of one (pp, tp)
place; each such set is compared. Under ``shard_dp`` no two ranks hold the same shard (the
mesh has no replicate dimension): the check is off and says so once; likewise for a state
provider with nothing known to be replicated. Every member computes the same verdict from the
same gathered bytes, so nothing more is exchanged:

- **all agree**: this state is the newest agreed one; a private copy of it is kept (one deep
  copy of this member's state dict, replacing the previous one, on the device where the
  state lives: the commit protocol's snapshot of the next step's start, which is this state,
  where it takes one);
- **a mismatch**: the members gather one fingerprint per key to name the keys that differ. A
  corrupted replica's gradients have already been averaged into every replica, so healing one
  replica from a peer is not enough: *every* member loads the agreed copy and the job redoes
  the steps since (the loop's `next_step` moves back). Where a strict majority of a place's
  replicas agree, the others are named as diverged; with two replicas nobody can be named. A
  member named a second time is treated as failing: it leaves the job (`Evicted`, exit status
  `EXIT_EVICTED`), which the others see as a lost rank (a hot spare takes its place, or the
  policy shrinks).

[Note: a mismatch that going back does not heal] Going back heals corruption, which does not
come back when the same steps are redone. A mismatch right after going back, in the same keys
of the same replicas, is not corruption: the state differs deterministically per rank (a
per-rank value marked replicated) or a replica computes differently every time. Going back
again would loop forever, so every member raises `ReplicaMismatchError` naming the keys (the
job stops within two comparisons); so does any run of more than `MAX_GO_BACKS` go-backs within
`GO_BACK_WINDOW` comparisons, whatever differed.

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
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from resilient_comm.elastic.model.policy import Mesh
from resilient_comm.elastic.state.fingerprint import fingerprint, leaf_fingerprints
from resilient_comm.elastic.state.provider import Stateful, replicated_view
from resilient_comm.elastic.worker.errors import Evicted, ReplicaMismatchError

log = logging.getLogger("resilient_comm.elastic")

_BYTES = 16
MAX_GO_BACKS = 3  # go-backs allowed within the last GO_BACK_WINDOW comparisons
GO_BACK_WINDOW = 10
_SHOWN_KEYS = 8  # keys named in a message (the event carries them all)


@dataclass
class Verdict:
    """What one comparison found (the same on every member)."""

    step: int  # the committed step whose state was compared
    agreed: bool
    # Per (pp, tp) place that disagreed: the launch ranks named as diverged (empty: no majority).
    diverged: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    back_to: int = -1  # the step every member went back to (after a mismatch)
    ms: float = 0.0  # this member's time for the comparison
    keys: list[str] = field(default_factory=list)  # the state's keys that differ (a mismatch)

    @property
    def named(self) -> list[int]:
        return sorted(r for ranks in self.diverged.values() for r in ranks)


class Integrity:
    """One member's side of the replica comparison. `every`: compare after every `every`-th
    committed step (0: never); `sharded`: the state is sharded over dp (off: nothing to
    compare). `emit(event, **info)`: the controller's hook."""

    def __init__(self, every: int, emit: Callable[..., None], sharded: bool = False) -> None:
        if every < 0:
            raise ValueError(f"fingerprint_every must be >= 0, got {every}")
        self.every = every
        self._emit = emit
        # (committed step, a private copy of the state then; None until the next step's start)
        self.agreed: tuple[int, dict[str, Any] | None] | None = None
        self.named: Counter[int] = Counter()  # launch rank -> comparisons that named it
        self.verdicts: list[Verdict] = []  # every mismatch, in order
        self._recent: deque[bool] = deque(maxlen=GO_BACK_WINDOW)  # the last comparisons: went back?
        self._last: Verdict | None = None  # the last mismatch, while no comparison agreed since
        if sharded:
            self.turn_off(
                "the state is sharded over dp (shard_dp: FSDP2) and the mesh has no replicate "
                "dimension, so no two ranks hold the same shard"
            )

    def turn_off(self, why: str) -> None:
        """Compare nothing from now on, and say why (once)."""
        if self.every:
            log.info("the replicas' comparison is off: %s", why)
            self._emit("integrity.off", why=why)
        self.every, self.agreed = 0, None

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
        self.agreed, self._last = None, None

    def due(self, committed: int, last: bool = False, checkpoint: bool = False) -> bool:
        """Whether to compare after step `committed`: every `every`-th, the run's `last`, and
        the state a `checkpoint` is about to save."""
        return self.every > 0 and ((committed + 1) % self.every == 0 or last or checkpoint)

    def check(
        self, step: int, state: Stateful, world: dist.ProcessGroup, members: list[int], mesh: Mesh, rank: int
    ) -> int | None:
        """The comparison after `step`, as the controller runs it: None where the replicas
        agree (or nothing is compared); on a mismatch, the step the state went back to (logged,
        and the hook's ``integrity.mismatch``). Launch rank `rank` named a second time raises
        `Evicted`; a mismatch that going back did not heal raises `ReplicaMismatchError`."""
        view = replicated_view(state)
        if view is None:
            self.turn_off(
                f"the state provider ({type(state).__name__}) has no replicated_state_dict() and is not "
                "a module, so nothing of it is known to be equal on every replica (TrainState, or a "
                "replicated_state_dict() method, says what is)"
            )
            return None
        v = self.compare(step, view, state, world, members, mesh)
        self._recent.append(not v.agreed)
        if v.agreed:
            self._last = None
            self._emit("integrity.agreed", step=step, ms=v.ms)
            return None
        named = f"diverged: rank(s) {v.named}" if v.named else "no majority names a replica"
        log.warning(
            "rank %d: the replicas' state differs after step %d in %s (%s); every member goes back to step %d",
            rank,
            step,
            _shown(v.keys),
            named,
            v.back_to,
        )
        self._emit("integrity.mismatch", step=step, back_to=v.back_to, diverged=v.named, keys=v.keys)
        last, self._last = self._last, v
        if last is not None and (last.diverged, last.keys) == (v.diverged, v.keys):
            raise ReplicaMismatchError(
                f"the replicas' state differs again after going back to step {last.back_to} "
                f"(after steps {last.step} and {step}), in the same keys: {_shown(v.keys)} ({named}). "
                "Going back does not heal it: a value that differs per rank is compared as replicated "
                "(leave it out of TrainState(replicated=...) or replicated_state_dict()), or a replica "
                "computes differently every time"
            )
        if sum(self._recent) > MAX_GO_BACKS:
            raise ReplicaMismatchError(
                f"the replicas' state differed at {sum(self._recent)} of the last {len(self._recent)} "
                f"comparisons (the last after step {step}, in {_shown(v.keys)}): more than "
                f"{MAX_GO_BACKS} go-backs, the job stops"
            )
        if rank in v.named and self.named[rank] >= 2:
            raise Evicted(
                f"rank {rank}'s replica diverged from its peers {self.named[rank]} times (the last after "
                f"step {step}): treated as failing, it leaves the job"
            )
        return v.back_to

    def compare(
        self,
        committed: int,
        view: dict[str, Any],
        state: Stateful,
        world: dist.ProcessGroup,
        members: list[int],
        mesh: Mesh,
    ) -> Verdict:
        """Fingerprint `view` (this member's replicated state after step `committed`), gather
        every member's, and judge; on a mismatch, gather per-key fingerprints to name the keys.
        On a mismatch `state` is already back at the agreed step (`Verdict.back_to`)."""
        t0 = time.monotonic()
        mine = torch.frombuffer(bytearray(fingerprint(view)), dtype=torch.uint8)
        gathered = [torch.empty(_BYTES, dtype=torch.uint8) for _ in members]
        dist.all_gather(gathered, mine, group=world)
        prints = [t.numpy().tobytes() for t in gathered]
        verdict = judge(committed, prints, members, mesh)
        if verdict.agreed:
            self.agreed = (committed, None)  # kept at the next step's start (`begin`)
        else:
            verdict.keys = differing_keys(_gather_leaves(view, world, len(members)), mesh)
            assert self.agreed is not None and self.agreed[1] is not None, "begin() runs before every step"
            # A private copy again: load_state_dict may alias what it is given (optimizer state).
            state.load_state_dict(copy.deepcopy(self.agreed[1]))
            verdict.back_to = self.agreed[0]
            self.named.update(verdict.named)
            self.verdicts.append(verdict)
        verdict.ms = 1e3 * (time.monotonic() - t0)
        return verdict


def _shown(keys: list[str]) -> str:
    more = f" and {len(keys) - _SHOWN_KEYS} more" if len(keys) > _SHOWN_KEYS else ""
    return f"key(s) {', '.join(keys[:_SHOWN_KEYS])}{more}" if keys else "no key (the keys are equal)"


def _gather_leaves(view: dict[str, Any], world: dist.ProcessGroup, n: int) -> list[dict[str, str]]:
    """Every world rank's per-key fingerprints of its replicated state, as text (a line per
    key: path, tab, hex): lengths first, then the padded bytes. Nothing is unpickled."""
    text = "\n".join(f"{p}\t{h.hex()}" for p, h in leaf_fingerprints(view).items()).encode()
    sizes = [torch.empty(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([len(text)], dtype=torch.int64), group=world)
    longest = max(int(t.item()) for t in sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if text:
        mine[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    out = [torch.empty(longest, dtype=torch.uint8) for _ in range(n)]
    dist.all_gather(out, mine, group=world)
    leaves = []
    for t, size in zip(out, sizes):
        raw = t[: int(size.item())].numpy().tobytes().decode(errors="replace")
        leaves.append(dict(line.split("\t", 1) for line in raw.split("\n") if "\t" in line))
    return leaves


def differing_keys(leaves: list[dict[str, str]], mesh: Mesh) -> list[str]:
    """The keys whose fingerprints differ between the dp replicas of any (pp, tp) place (or
    that some replica lacks); `leaves[i]` is world rank i's (key -> fingerprint)."""
    keys: set[str] = set()
    for ranks in _places(len(leaves), mesh).values():
        for key in set().union(*(leaves[i] for i in ranks)):
            if len({leaves[i].get(key) for i in ranks}) > 1:
                keys.add(key)
    return sorted(keys)


def _places(n: int, mesh: Mesh) -> dict[tuple[int, int], list[int]]:
    """(pp, tp) -> the world ranks of its dp replicas, for a world of `n`."""
    places: dict[tuple[int, int], list[int]] = {}
    for i in range(n):
        c = mesh.coords(i)
        places.setdefault((c["pp"], c["tp"]), []).append(i)
    return places


def judge(step: int, prints: list[bytes], members: list[int], mesh: Mesh) -> Verdict:
    """Compare the fingerprints of each (pp, tp) place's dp replicas. `prints[i]` is world rank
    i's; `members[i]` its launch rank."""
    diverged: dict[tuple[int, int], list[int]] = {}
    for place, ranks in _places(len(members), mesh).items():
        counts = Counter(prints[i] for i in ranks)
        if len(counts) == 1:
            continue
        value, n = counts.most_common(1)[0]
        majority = value if 2 * n > len(ranks) else None
        diverged[place] = [] if majority is None else [members[i] for i in ranks if prints[i] != majority]
    return Verdict(step, not diverged, diverged)


__all__ = ["GO_BACK_WINDOW", "MAX_GO_BACKS", "Integrity", "Verdict", "differing_keys", "judge"]
