"""Gray failures: a node that turns slow and a bit that flips. Neither kills anything.

Both arrive per node as Poisson processes, in GPU-hours per event like fail-stop failures,
while the job holds the node. A :class:`GrayPolicy` answers them; the published figures
behind the rates are in :mod:`.presets` and docs/sim.md.

**Fail-slow** (:class:`FailSlow`). An episode slows one node to a relative speed ``s``, drawn
from a few discrete levels, for an exponential duration. A synchronous job runs at the pace
of its slowest rank, so while any node of the job is slow, the job's progress is multiplied
by the lowest ``s`` (the loss is booked as ``slow``).

- ``ignore``: the episode lasts its natural duration.
- ``act``: what resilient_comm's pace judge does (elastic/model/pace.py). A node under
  ``sure_below`` is found slow after ``patience`` whole windows of ``window`` steps, one under
  ``slow_below`` once most of the last ``horizon`` windows were slow (``horizon // 2 + 1``);
  its steps run at its pace, so that takes ``(windows + u)·window·step_s / s`` seconds, ``u``
  being the onset's place in its window. With a hot spare waiting, the spare takes the node's place in a planned
  handover: an in-process recovery (detect, abort + rebuild, state copy) with no step redone.
  Without one, the node's replica is dropped only if ``s < (r-1)/r - evict_margin`` with ``r``
  replicas. Otherwise the node is kept, and judged again every window. A node that leaves goes
  to repair like a failed one. The judge times each rank's own compute: a slow link (every
  rank then waits alike) is reported as one, and nobody is evicted for it; ``1 - detectable``
  of the episodes are left alone under both policies.

**Silent data corruption** (:class:`SilentCorruption`). A flipped bit in one node's share of
the state, while the job computes. A node that corrupted once is defective: it corrupts
again at the rate ``1/repeat_s`` until it leaves the job (Hochschild et al.'s mercurial
cores corrupt repeatedly).

- ``ignore``: nothing sees the flip until somebody notices, ``notice_s`` later (a loss spike).
  Every checkpoint written since holds the flip, so the job restarts from the last one
  written *before* it: the work since that checkpoint is redone (``corruption``), plus a full
  restart. The node that was traced is drained. Flips made while one is still unnoticed are
  undone by the same restart.
- ``act``: what resilient_comm's replica comparison does (elastic/worker/integrity.py). Every
  ``every_steps`` steps the replicas compare fingerprints of their state, at ``compare_cost``
  of the compute time (``integrity``). The first comparison after a flip finds the mismatch and
  every member goes back to the last agreed state. The whole interval is redone: on average
  half of it came before the flip and half waiting for the comparison. With three replicas
  or more, a majority names the node; a node named a second time is evicted (a hot spare takes
  its place, or the job shrinks). The comparison cannot see a flip that leaves the replicas
  identical (a gradient corrupted before the all-reduce reaches every replica alike): the
  ``1 - visible`` of flips it misses are handled as under ``ignore``.

Both processes read the job through :class:`GrayJob` and draw from their own random stream,
so a run with gray failures sees the same fail-stop failures as one without: with no gray
event (and, under ``act``, no comparison cost) the result is the fail-stop-only one exactly.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import math
from typing import Protocol

import numpy as np

__all__ = [
    "GRAY_COUNTS",
    "FailSlow",
    "GrayFailures",
    "GrayJob",
    "GrayPolicy",
    "GraySource",
    "SilentCorruption",
    "keep_slow_replica",
]


class GrayPolicy(str, enum.Enum):
    """What the job does about gray failures (both kinds alike): see the module docstring."""

    IGNORE = "ignore"
    ACT = "act"


def _check(name: str, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {what}")


@dataclasses.dataclass(frozen=True)
class FailSlow:
    """Slow episodes. ``speeds``: ``(relative speed, probability)`` levels. The pace judge's
    parameters mirror :class:`resilient_comm.elastic.model.pace.PaceConfig`'s defaults, but
    for the window: the judge's default is off (0), the simulator's the advised 20 (the
    simulator may not import the controller; a test keeps them in line)."""

    gpu_hours_per_episode: float
    speeds: tuple[tuple[float, float], ...]
    mean_duration_s: float
    detectable: float = 1.0
    window: int = 20
    patience: int = 2
    slow_below: float = 0.9
    evict_margin: float = 0.05
    sure_below: float = 0.6
    horizon: int = 12

    def __post_init__(self) -> None:
        _check(
            "fail-slow",
            self.gpu_hours_per_episode > 0 and self.mean_duration_s > 0,
            "rate and duration must be > 0",
        )
        _check(
            "fail-slow", all(0 < s <= 1 and p >= 0 for s, p in self.speeds), "speeds in (0, 1], weights >= 0"
        )
        _check("fail-slow", math.isclose(sum(p for _, p in self.speeds), 1.0), "speed weights must sum to 1")
        _check("fail-slow", 0 <= self.detectable <= 1, "detectable must be in [0, 1]")
        _check("fail-slow", self.window >= 1 and self.patience >= 1, "window and patience must be >= 1")


@dataclasses.dataclass(frozen=True)
class SilentCorruption:
    """Flips. ``notice_s``: how long an unnoticed flip takes to be noticed; ``every_steps`` and
    ``compare_cost`` (fraction of compute time): the replica comparison; ``visible``: the share
    of flips it can see; ``repeat_s``: mean time until a defective node corrupts again (None:
    never)."""

    gpu_hours_per_event: float
    notice_s: float
    every_steps: int = 100
    compare_cost: float = 0.0055
    visible: float = 1.0
    repeat_s: float | None = None

    def __post_init__(self) -> None:
        _check("SDC", self.gpu_hours_per_event > 0 and self.notice_s >= 0, "rate > 0 and notice >= 0")
        _check("SDC", self.every_steps >= 1 and 0 <= self.compare_cost < 1, "every >= 1, cost in [0, 1)")
        _check("SDC", 0 <= self.visible <= 1, "visible must be in [0, 1]")
        _check("SDC", self.repeat_s is None or self.repeat_s > 0, "repeat time must be > 0")


@dataclasses.dataclass(frozen=True)
class GrayFailures:
    """The gray failures of a scenario; either kind may be absent."""

    slow: FailSlow | None = None
    sdc: SilentCorruption | None = None


class GrayJob(Protocol):
    """What the gray processes read from a running job and do to it (the engine's job)."""

    t: float
    useful: float
    since_ckpt: float
    replicas: int

    @property
    def running(self) -> bool: ...

    @property
    def nodes_held(self) -> int: ...

    @property
    def spares_waiting(self) -> int: ...

    def evict_node(self) -> None:
        """A node leaves at a step boundary, on purpose: a spare or a shrink, no step redone."""

    def redo(self, amount: float, cause: str) -> None:
        """``amount`` of progress is taken back, past checkpoints if need be."""

    def restart_from(self, progress: float, drained: int) -> None:
        """Full restart from the checkpoint at ``progress``; ``drained`` nodes leave."""


GRAY_COUNTS: tuple[str, ...] = (
    "slow_episodes",
    "slow_handovers",
    "slow_drops",
    "sdc_events",
    "sdc_rollbacks",
    "sdc_evictions",
    "sdc_restarts",
)
"""Event counters a run reports (:attr:`~resilient_comm.sim.model.SimResult.gray_counts`)."""


def keep_slow_replica(speed: float, replicas: int, margin: float) -> bool:
    """The pace judge's rule without a spare: keep a replica running at ``speed`` unless the
    job is faster without it (``replicas`` at ``speed`` make ``speed·r`` replica-speeds,
    ``r - 1`` without it make ``r - 1``), by ``margin``."""
    return replicas <= 1 or speed >= (replicas - 1) / replicas - margin


class _Timers:
    """Scheduled events ``(time, kind, key)``, earliest first; ties keep their order."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, str, int]] = []
        self._seq = 0

    def push(self, at: float, kind: str, key: int) -> None:
        heapq.heappush(self._heap, (at, self._seq, kind, key))
        self._seq += 1

    def next_at(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def pop(self) -> tuple[str, int]:
        _, _, kind, key = heapq.heappop(self._heap)
        return kind, key


class _Process:
    """A Poisson arrival stream (a hazard budget spent at a rate that changes at events) and
    the timers it sets. Subclasses say the rate and what arrivals and timers do."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.hazard = float(rng.standard_exponential())
        self.timers = _Timers()
        self.counts = dict.fromkeys(GRAY_COUNTS, 0)
        self._rate = 0.0
        self._timer_first = False

    def rate(self, job: GrayJob) -> float:
        raise NotImplementedError

    def arrive(self, job: GrayJob, speed: float) -> None:
        raise NotImplementedError

    def on_timer(self, job: GrayJob, kind: str, key: int, speed: float) -> None:
        raise NotImplementedError

    def next_dt(self, job: GrayJob) -> float:
        self._rate = self.rate(job)
        arrival = self.hazard / self._rate if self._rate > 0 else math.inf
        timer = self.timers.next_at() - job.t
        self._timer_first = timer <= arrival
        return max(0.0, min(arrival, timer))

    def elapse(self, dt: float) -> None:
        self.hazard -= self._rate * dt

    def fire(self, job: GrayJob, speed: float) -> None:
        if self._timer_first:
            kind, key = self.timers.pop()
            self.on_timer(job, kind, key, speed)
        else:
            self.hazard = float(self.rng.standard_exponential())
            self.arrive(job, speed)


class _SlowRanks(_Process):
    """Fail-slow episodes and, under ``act``, the pace judge's answer to them."""

    def __init__(
        self, spec: FailSlow, act: bool, step_s: float, gpus_per_node: int, rng: np.random.Generator
    ):
        super().__init__(rng)
        self.spec, self.act, self.step_s = spec, act, step_s
        self.node_rate = gpus_per_node / (spec.gpu_hours_per_episode * 3600.0)
        self.levels = [s for s, _ in spec.speeds]
        self.cumulative = np.cumsum([p for _, p in spec.speeds]).tolist()
        self.active: dict[int, float] = {}  # episode -> speed, while its node slows the job
        self.next_id = 0

    @property
    def speed(self) -> float:
        return min(self.active.values(), default=1.0)

    def rate(self, job: GrayJob) -> float:
        return job.nodes_held * self.node_rate

    def arrive(self, job: GrayJob, speed: float) -> None:
        level, length, seen, onset = self.rng.random(4).tolist()  # as many draws under any policy
        s = self.levels[min(int(np.searchsorted(self.cumulative, level, side="right")), len(self.levels) - 1)]
        episode, self.next_id = self.next_id, self.next_id + 1
        self.active[episode] = s
        self.counts["slow_episodes"] += 1
        self.timers.push(job.t - self.spec.mean_duration_s * math.log1p(-length), "end", episode)
        if self.act and seen < self.spec.detectable and s < self.spec.slow_below:
            sure = s < self.spec.sure_below
            windows = (self.spec.patience if sure else self.spec.horizon // 2 + 1) + onset
            self.timers.push(job.t + windows * self._window_s(s), "judge", episode)

    def _window_s(self, s: float) -> float:
        return self.spec.window * self.step_s / s

    def on_timer(self, job: GrayJob, kind: str, key: int, speed: float) -> None:
        if key not in self.active:
            return  # the episode ended, or its node already left
        if kind == "end":
            del self.active[key]
            return
        s = self.active[key]
        if job.running and job.spares_waiting > 0:
            self.counts["slow_handovers"] += 1
        elif job.running and not keep_slow_replica(s, job.replicas, self.spec.evict_margin):
            self.counts["slow_drops"] += 1
        else:  # kept (or the job is recovering): judged again after the next window
            self.timers.push(job.t + self._window_s(s), "judge", key)
            return
        del self.active[key]
        job.evict_node()


@dataclasses.dataclass
class _Flip:
    """Flips waiting for a comparison or to be noticed: their nodes, and the progress that
    gets undone back to (``progress``, minus ``before`` made earlier in the interval)."""

    nodes: set[int]
    progress: float
    before: float = 0.0


class _Corruptions(_Process):
    """Silent data corruption and, under ``act``, the replica comparison's answer to it."""

    def __init__(
        self,
        spec: SilentCorruption,
        act: bool,
        step_s: float,
        dp: int,
        gpus_per_node: int,
        rng: np.random.Generator,
    ):
        super().__init__(rng)
        self.spec, self.act, self.step_s, self.dp = spec, act, step_s, dp
        self.node_rate = gpus_per_node / (spec.gpu_hours_per_event * 3600.0)
        self.repeat_rate = 0.0 if spec.repeat_s is None else 1.0 / spec.repeat_s
        self.named: dict[int, int] = {}  # defective node -> comparisons that named it
        self.next_id = 0
        self.compare: _Flip | None = None  # act: flips the next comparison finds
        self.notice: _Flip | None = None  # flips somebody will notice

    @property
    def overhead(self) -> float:
        return self.spec.compare_cost if self.act else 0.0

    def rate(self, job: GrayJob) -> float:
        if not job.running:
            return 0.0
        return job.nodes_held * self.node_rate + len(self.named) * self.repeat_rate

    def arrive(self, job: GrayJob, speed: float) -> None:
        source, which, seen, onset = self.rng.random(4).tolist()  # as many draws under any policy
        if source * self._rate < len(self.named) * self.repeat_rate:
            node = list(self.named)[int(which * len(self.named))]
        else:
            node, self.next_id = self.next_id, self.next_id + 1
            self.named[node] = 0
        self.counts["sdc_events"] += 1
        if self.act and seen < self.spec.visible:
            self._to_compare(job, node, speed, onset)
        else:
            self._to_notice(job, node)

    def _interval_s(self) -> float:
        return self.spec.every_steps * self.step_s

    def _to_compare(self, job: GrayJob, node: int, speed: float, u: float) -> None:
        """``u``: the flip's place in the interval between two comparisons."""
        if self.compare is not None:
            self.compare.nodes.add(node)
            return
        share = job.replicas / self.dp
        self.compare = _Flip({node}, job.useful, u * self._interval_s() * share)
        self.timers.push(job.t + (1.0 - u) * self._interval_s() / speed, "compare", 0)

    def _to_notice(self, job: GrayJob, node: int) -> None:
        if self.notice is not None:
            self.notice.nodes.add(node)
            return
        self.notice = _Flip({node}, job.useful - job.since_ckpt)
        self.timers.push(job.t + self.spec.notice_s, "notice", 0)

    def on_timer(self, job: GrayJob, kind: str, key: int, speed: float) -> None:
        if (self.notice if kind == "notice" else self.compare) is None:
            return  # a restart undid the flip meanwhile
        if kind == "notice":
            self._noticed(job)
        elif not job.running:  # a recovery is under way: the comparison comes later
            self.timers.push(job.t + self._interval_s() / speed, "compare", 0)
        else:
            self._mismatch(job)

    def _mismatch(self, job: GrayJob) -> None:
        flip, self.compare = self.compare, None
        assert flip is not None
        job.redo(max(0.0, job.useful - flip.progress + flip.before), "corruption")
        self.counts["sdc_rollbacks"] += 1
        if job.replicas < 3:
            return  # two replicas disagree: nobody can be named
        for node in sorted(flip.nodes):
            if node not in self.named:
                continue  # drained meanwhile
            self.named[node] += 1
            if self.named[node] >= 2:
                del self.named[node]
                self.counts["sdc_evictions"] += 1
                job.evict_node()

    def _noticed(self, job: GrayJob) -> None:
        flip, self.notice = self.notice, None
        assert flip is not None
        for node in flip.nodes:
            self.named.pop(node, None)
        if job.useful <= flip.progress:
            return  # a restart since went back before the flip
        if self.compare is not None and self.compare.progress >= flip.progress:
            self.compare = None  # undone by the same restart
        self.counts["sdc_restarts"] += 1
        job.restart_from(flip.progress, drained=len(flip.nodes))


class GraySource:
    """The gray failures of one run: the engine asks it for its next event and the job's
    speed and comparison overhead, and lets it fire. Deterministic in its seed."""

    def __init__(
        self,
        gray: GrayFailures | None,
        policy: GrayPolicy,
        step_s: float,
        dp: int,
        gpus_per_node: int,
        seed: np.random.SeedSequence,
    ) -> None:
        act = policy is GrayPolicy.ACT
        slow_seed, sdc_seed = seed.spawn(2)
        self.slow: _SlowRanks | None = None
        self.sdc: _Corruptions | None = None
        if gray is not None and gray.slow is not None:
            self.slow = _SlowRanks(gray.slow, act, step_s, gpus_per_node, np.random.default_rng(slow_seed))
        if gray is not None and gray.sdc is not None:
            self.sdc = _Corruptions(gray.sdc, act, step_s, dp, gpus_per_node, np.random.default_rng(sdc_seed))
        self._parts: list[_Process] = [p for p in (self.slow, self.sdc) if p is not None]
        self._due: _Process | None = None
        self.active = bool(self._parts)  # False: the engine skips its calls (they cost ~15%)

    @property
    def speed(self) -> float:
        """The job's relative speed now: its slowest node's."""
        return self.slow.speed if self.slow is not None else 1.0

    @property
    def overhead(self) -> float:
        """The share of compute time the replica comparison takes."""
        return self.sdc.overhead if self.sdc is not None else 0.0

    def next_dt(self, job: GrayJob) -> float:
        best = math.inf
        self._due = None
        for part in self._parts:
            dt = part.next_dt(job)
            if dt < best:
                best, self._due = dt, part
        return best

    def elapse(self, dt: float) -> None:
        for part in self._parts:
            part.elapse(dt)

    def fire(self, job: GrayJob) -> None:
        assert self._due is not None
        self._due.fire(job, self.speed)

    def counts(self) -> dict[str, int]:
        total = dict.fromkeys(GRAY_COUNTS, 0)
        for part in self._parts:
            for k, v in part.counts.items():
                total[k] += v
        return total
