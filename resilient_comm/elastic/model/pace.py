"""Fail-slow ranks: who the others wait for, and whether the job is faster without it.

A rank that turns slow (a throttled clock, a noisy neighbour, a CPU quota) kills nothing: the
others wait for it at every synchronisation, and the whole job runs at its pace. Each rank
measures its own *compute* per step, the time from the step's start to its first wait on the
others (`Controller._commit`): a rank's compute is its own work, while the time in the
collectives is set by the slowest member. Every `window` steps the members gather the median
compute of each over the window (`worker/pace_watch.py`), and every member judges the same
numbers alike, here:

- a rank's **relative speed** is the median of every member's median compute over its own
  (1.0: as fast as the typical member; 0.5: half as fast);
- it is **slow** once its speed stayed under `slow_below` for `patience` windows in a row, and
  fast again once it stayed at or over `clear_above` for as many (hysteresis: a rank near the
  threshold is not reported and cleared in turn);
- **what to do** with a slow rank: where a hot spare waits, hand its place to the spare (the
  spare runs at full speed); where none does, drop its replica only when the job is faster
  without it: dp replicas with the slow one at speed s run at s x dp replica-speeds, dp - 1
  replicas at dp - 1, so shrinking wins when s < (dp - 1) / dp, by `evict_margin` (the cost of
  the recovery, and the noise of s); otherwise keep it and keep reporting it.

Pure: no I/O, no clock. Tested alone in tests/unit/test_pace.py.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from resilient_comm.config import knob_int


@dataclass(frozen=True)
class PaceConfig:
    """`window`: steps per comparison (0: fail-slow detection off); `slow_below`,
    `clear_above`: relative speeds; `patience`: windows in a row; `evict_margin`: how far
    under (dp - 1) / dp the slow replica's speed must be before its replica is dropped."""

    window: int = 20
    slow_below: float = 0.9
    clear_above: float = 0.95
    patience: int = 2
    evict_margin: float = 0.05

    @staticmethod
    def from_env() -> PaceConfig:
        return PaceConfig(window=knob_int("RESILIENT_COMM_PACE_WINDOW", 0))


@dataclass
class PaceVerdict:
    """One window's judgement, the same on every member."""

    step: int  # the last step of the window
    speeds: dict[int, float]  # launch rank -> relative speed in this window
    slow: dict[int, float] = field(default_factory=dict)  # every rank slow now -> its speed
    newly_slow: list[int] = field(default_factory=list)  # became slow in this window
    cleared: list[int] = field(default_factory=list)  # slow before, fast again in this window
    leave: list[int] = field(default_factory=list)  # ranks to hand to a spare or drop
    why: str = ""  # what the policy said of the slow ranks


class Pace:
    """The judge: fed each window's per-rank median compute, it keeps the streaks."""

    def __init__(self, cfg: PaceConfig) -> None:
        self.cfg = cfg
        self._under: dict[int, int] = {}  # launch rank -> windows in a row under slow_below
        self._over: dict[int, int] = {}  # launch rank -> windows in a row at or over clear_above
        self.slow: set[int] = set()

    def forget(self, keep: list[int]) -> None:
        """After a recovery: only the ranks in `keep` are judged on."""
        for d in (self._under, self._over):
            for r in [r for r in d if r not in keep]:
                del d[r]
        self.slow &= set(keep)

    def judge(self, step: int, compute_s: dict[int, float]) -> PaceVerdict:
        """`compute_s`: launch rank -> its median compute in the window. The streaks move on;
        `act` then says what to do with the slow ranks."""
        typical = statistics.median(compute_s.values())
        speeds = {r: (typical / c if c > 0 else 1.0) for r, c in compute_s.items()}
        v = PaceVerdict(step, speeds)
        for r, s in speeds.items():
            if s < self.cfg.slow_below:
                self._under[r], self._over[r] = self._under.get(r, 0) + 1, 0
            elif s >= self.cfg.clear_above:
                self._over[r], self._under[r] = self._over.get(r, 0) + 1, 0
            else:
                self._under[r] = self._over[r] = 0  # in the band: neither streak grows
            if r not in self.slow and self._under[r] >= self.cfg.patience:
                self.slow.add(r)
                v.newly_slow.append(r)
            elif r in self.slow and self._over[r] >= self.cfg.patience:
                self.slow.discard(r)
                v.cleared.append(r)
        v.slow = {r: speeds[r] for r in sorted(self.slow)}
        return v

    def act(self, v: PaceVerdict, replica_of: dict[int, int], dp: int, spares: int) -> None:
        """Fill `v.leave` and `v.why` for its slow ranks. `replica_of`: launch rank -> its dp
        index; `spares`: hot spares waiting (as one member saw them, for all)."""
        if not v.slow:
            return
        speeds = v.speeds
        if spares > 0:
            # The slowest first, one per spare: a spare runs at full speed.
            by_speed = sorted(v.slow, key=lambda r: v.slow[r])[:spares]
            v.leave = sorted(by_speed)
            v.why = f"{len(v.leave)} hot spare(s) take the place of slow rank(s) {v.leave}"
            return
        # No spare: a replica runs at its slowest rank's speed; dropping the slowest replica
        # wins when it is slower than (dp - 1) / dp by the margin.
        replica_speed: dict[int, float] = {}
        for r, s in speeds.items():
            replica_speed[replica_of[r]] = min(s, replica_speed.get(replica_of[r], 1.0))
        worst = min(v.slow, key=lambda r: v.slow[r])
        s = replica_speed[replica_of[worst]]
        keep_if = (dp - 1) / dp - self.cfg.evict_margin
        if dp > 1 and s < keep_if:
            v.leave = [worst]
            v.why = (
                f"rank {worst}'s replica runs at {s:.2f} of the others' speed, under "
                f"(dp-1)/dp - margin = {keep_if:.2f}: the job is faster without it"
            )
        else:
            v.why = (
                f"slowest replica at {s:.2f}, not under (dp-1)/dp - margin = {keep_if:.2f} "
                f"(dp={dp}): kept, and reported"
            )


__all__ = ["Pace", "PaceConfig", "PaceVerdict"]
