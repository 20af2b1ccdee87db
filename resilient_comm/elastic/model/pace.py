"""Fail-slow ranks: who the others wait for, and whether the job is faster without it.

A rank that turns slow (a throttled clock, a noisy neighbour, a CPU quota) kills nothing: the
others wait for it at every synchronisation, and the whole job runs at its pace. Each rank
measures its own *compute* per step, the time from the step's start to its first wait on the
others (`Controller._commit`; on an accelerator the device's time, not the host's:
`worker/step_timer.py`): a rank's compute is its own work, while the time in the
collectives is set by the slowest member. Every `window` steps the members gather the median
compute of each over the window (`worker/pace_watch.py`), and every member judges the same
numbers alike, here:

- a rank's **relative speed** is the median of every member's median compute over its own
  (1.0: as fast as the typical member; 0.5: half as fast);
- it is **slow** when the evidence is enough for the claim: a window's speed is noisy (on a
  shared 2-core machine a healthy rank's 20-step window wanders over 0.76-1.4, measured:
  docs/elastic.md), a persistent slowdown is not. So a big slowdown counts at once: every one
  of the last `patience` windows under `sure_below` (0.6); a mild one over a long horizon:
  the median of the last `horizon` windows (all of them, once there are that many) under
  `slow_below` (0.9). It is fast again once its last `patience` windows are all at or over
  `clear_above` (its horizon then starts again): hysteresis, so a rank near a threshold is
  not reported and cleared in turn. Its judged speed is the median of the windows that
  named it;
- **what to do** with a slow rank: where a hot spare waits, hand its place to the spare (the
  spare runs at full speed); where none does, drop its replica only when the job is faster
  without it: dp replicas with the slow one at speed s run at s x dp replica-speeds, dp - 1
  replicas at dp - 1, so shrinking wins when s < (dp - 1) / dp, by `evict_margin` (the cost of
  the recovery, and the noise of s); otherwise keep it and keep reporting it.

**A slow link is not a slow rank.** A node whose link lost bandwidth (a degraded NIC, an
optical module that flaps to a lower rate) slows every collective, while its ranks' compute
is as fast as ever: the compute times above do not name it, and must not (handing its ranks
to a spare or dropping its replica would not help: the link stays). What does name it is the
rate at which its bytes arrive: the TCP transport times every large frame a rank receives
from its first byte to its last (csrc/transport/tcp/transfer.h, [Note: link rates]), which
a late sender does not lengthen and a slow link does. Each window every member adds its
typical (median) frame's rate from each of the peers it received most from; for every node, the median rate of the transfers between nodes that
went in or out of it is compared with the median of those that did not (`link_speeds`): a
node whose link is slow has every one of its own transfers slow and the others not, whatever
the algorithm's pattern of peers. A node under `link_slow_below` (0.5: a link's rate is far
noisier than a rank's compute) for `patience` windows is reported as a slow link; nothing is
evicted for it.

Pure: no I/O, no clock. Tested alone in tests/unit/test_pace_judge.py.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from resilient_comm.config import knob, knob_int

WINDOW_KNOB = "RESILIENT_COMM_PACE_WINDOW"


def _default_window() -> int:
    """The knob's declared default (csrc/common/env.h), whatever the environment says."""
    return int(knob(WINDOW_KNOB).default)


@dataclass(frozen=True)
class PaceConfig:
    """`window`: steps per comparison (0: fail-slow detection off, the default of
    ``RESILIENT_COMM_PACE_WINDOW`` too; 20 is a window to try); `sure_below`: a window
    this slow, `patience` windows in a row, is a slow rank; `slow_below`: the median of the
    last `horizon` windows this slow is one too; `clear_above`: `patience` windows this fast
    clear it; `evict_margin`: how far
    under (dp - 1) / dp the slow replica's speed must be before its replica is dropped;
    `link_slow_below`, `link_clear_above`: a node's link rate relative to the others'."""

    window: int = field(default_factory=_default_window)
    slow_below: float = 0.9
    clear_above: float = 0.95
    patience: int = 2
    sure_below: float = 0.6
    horizon: int = 12
    evict_margin: float = 0.05
    link_slow_below: float = 0.5
    link_clear_above: float = 0.7

    @staticmethod
    def from_env() -> PaceConfig:
        return PaceConfig(window=knob_int(WINDOW_KNOB, 0))


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
    links: dict[int, float] = field(default_factory=dict)  # node -> its link's relative rate
    slow_links: dict[int, float] = field(default_factory=dict)  # every node whose link is slow now
    newly_slow_links: list[int] = field(default_factory=list)
    cleared_links: list[int] = field(default_factory=list)


def link_speeds(node_of: dict[int, int], received: dict[tuple[int, int], float]) -> dict[int, float]:
    """Each node's link rate relative to the rest of the job's: `received[(i, j)]` = the rate
    (bytes/s, a typical frame's) at which rank i received from rank j in the window;
    `node_of`: rank -> node. Only transfers between two nodes count; a node is judged only
    where there are transfers both through it and elsewhere (with two nodes every transfer
    goes through both: nothing can be told)."""
    rates = [
        (node_of[i], node_of[j], rate)
        for (i, j), rate in received.items()
        if i in node_of and j in node_of and node_of[i] != node_of[j] and rate > 0
    ]
    out: dict[int, float] = {}
    for n in sorted({x for a, b, _ in rates for x in (a, b)}):
        mine = [r for a, b, r in rates if n in (a, b)]
        others = [r for a, b, r in rates if n not in (a, b)]
        if mine and others:
            out[n] = statistics.median(mine) / statistics.median(others)
    return out


class _Streaks:
    """Windows in a row under `below` (to become slow) and at or over `above` (to be fast
    again), for ranks or nodes alike."""

    def __init__(self, below: float, above: float, patience: int) -> None:
        self.below, self.above, self.patience = below, above, patience
        self._under: dict[int, int] = {}
        self._over: dict[int, int] = {}
        self.slow: set[int] = set()

    def forget(self, keep: set[int]) -> None:
        for d in (self._under, self._over):
            for k in [k for k in d if k not in keep]:
                del d[k]
        self.slow &= keep

    def see(self, speeds: dict[int, float]) -> tuple[list[int], list[int]]:
        """One window; returns (newly slow, cleared)."""
        newly, cleared = [], []
        for k, s in speeds.items():
            if s < self.below:
                self._under[k], self._over[k] = self._under.get(k, 0) + 1, 0
            elif s >= self.above:
                self._over[k], self._under[k] = self._over.get(k, 0) + 1, 0
            else:
                self._under[k] = self._over[k] = 0  # in the band: neither streak grows
            if k not in self.slow and self._under[k] >= self.patience:
                self.slow.add(k)
                newly.append(k)
            elif k in self.slow and self._over[k] >= self.patience:
                self.slow.discard(k)
                cleared.append(k)
        return newly, cleared


class _RankSpeeds:
    """Each rank's recent window speeds, and which ranks are slow (the rules above)."""

    def __init__(self, cfg: PaceConfig) -> None:
        self.cfg = cfg
        self._seen: dict[int, list[float]] = {}  # launch rank -> its last `horizon` windows
        self.slow: dict[int, float] = {}  # launch rank -> its judged speed

    def forget(self, keep: set[int]) -> None:
        for r in [r for r in self._seen if r not in keep]:
            del self._seen[r]
        self.slow = {r: s for r, s in self.slow.items() if r in keep}

    def see(self, speeds: dict[int, float]) -> tuple[list[int], list[int]]:
        """One window; returns (newly slow, cleared)."""
        c = self.cfg
        newly, cleared = [], []
        for r, s in speeds.items():
            seen = self._seen.setdefault(r, [])
            seen.append(s)
            del seen[: -max(c.horizon, c.patience)]
            last = seen[-c.patience :] if len(seen) >= c.patience else []
            if r in self.slow:
                if last and min(last) >= c.clear_above:
                    del self.slow[r]
                    seen.clear()  # the windows that named it no longer count
                    cleared.append(r)
                else:
                    self.slow[r] = statistics.median(seen[-c.horizon :])
                continue
            if last and max(last) < c.sure_below:
                self.slow[r] = statistics.median(last)
            elif len(seen) >= c.horizon and statistics.median(seen[-c.horizon :]) < c.slow_below:
                self.slow[r] = statistics.median(seen[-c.horizon :])
            else:
                continue
            newly.append(r)
        return newly, cleared


class Pace:
    """The judge: fed each window's per-rank median compute (and what each rank received from
    each, where known), it keeps the streaks."""

    def __init__(self, cfg: PaceConfig) -> None:
        self.cfg = cfg
        self._ranks = _RankSpeeds(cfg)
        self._links = _Streaks(cfg.link_slow_below, cfg.link_clear_above, cfg.patience)

    @property
    def slow(self) -> set[int]:
        return set(self._ranks.slow)

    def forget(self, keep: list[int]) -> None:
        """After a recovery: only the ranks in `keep` are judged on (nodes start again)."""
        self._ranks.forget(set(keep))
        self._links.forget(set())

    def judge(
        self,
        step: int,
        compute_s: dict[int, float],
        received: dict[tuple[int, int], float] | None = None,
        node_of: dict[int, int] | None = None,
    ) -> PaceVerdict:
        """`compute_s`: launch rank -> its median compute in the window; `received`, `node_of`:
        as `link_speeds` takes them. The streaks move on; `act` then says what to do with the
        slow ranks."""
        typical = statistics.median(compute_s.values())
        speeds = {r: (typical / c if c > 0 else 1.0) for r, c in compute_s.items()}
        v = PaceVerdict(step, speeds)
        v.newly_slow, v.cleared = self._ranks.see(speeds)
        v.slow = {r: self._ranks.slow[r] for r in sorted(self._ranks.slow)}
        if received and node_of:
            v.links = link_speeds(node_of, received)
            v.newly_slow_links, v.cleared_links = self._links.see(v.links)
            v.slow_links = {n: v.links[n] for n in sorted(self._links.slow) if n in v.links}
        return v

    def act(self, v: PaceVerdict, replica_of: dict[int, int], dp: int, spares: int) -> None:
        """Fill `v.leave` and `v.why` for its slow ranks. `replica_of`: launch rank -> its dp
        index; `spares`: hot spares waiting (as one member saw them, for all)."""
        if not v.slow:
            return
        if spares > 0:
            # The slowest first, one per spare: a spare runs at full speed.
            by_speed = sorted(v.slow, key=lambda r: v.slow[r])[:spares]
            v.leave = sorted(by_speed)
            v.why = f"{len(v.leave)} hot spare(s) take the place of slow rank(s) {v.leave}"
            return
        # No spare: a replica runs at its slowest rank's speed; dropping the slowest replica
        # wins when it is slower than (dp - 1) / dp by the margin.
        replica_speed: dict[int, float] = {}
        for r, s in v.slow.items():
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


__all__ = ["Pace", "PaceConfig", "PaceVerdict", "link_speeds"]
