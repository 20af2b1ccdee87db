"""The discrete-event engine: one synchronous training job under one recovery policy.

Events are failures, the end of a recovery phase, and a repaired node coming back; time
jumps from one to the next (never step by step), so 100,000 GPUs over 54 days is a few
thousand events. Between events the job either runs or is paused in a recovery phase.

Running. The job computes for ``τ`` (the checkpoint interval) and then blocks for ``c`` to
write a checkpoint, cycle after cycle; the position in that cycle carries across in-process
recoveries and restarts from zero after a full restart. A job with ``r`` of its ``dp``
replicas makes ``r/dp`` of full-size progress per second (same global batch, more
gradient accumulation per replica); the missing ``1 − r/dp`` is booked as ``shrunk``.

Failures. Every node the job holds fails as a Poisson process of rate
``gpus_per_node / (gpu_hours_per_failure·3600)`` per second, while running *and* while
recovering, so the job's rate is proportional to the nodes it holds. The rate changes
only at events, so the next failure time is drawn exactly by spending a unit-exponential
"hazard budget" (pre-drawn in bulk with numpy) at the current rate. A failure is
*unabsorbable* with probability ``unabsorbable_fraction``; otherwise the failed node goes
to repair and comes back to the idle pool ``replenish_s`` later. Spare nodes and idle
nodes do not fail.

Recovery (see :class:`~resilient_comm.sim.model.Policy`):

- full restart (every failure under ``restart-all``; unabsorbable failures under every
  policy): the work since the last completed checkpoint is lost (a checkpoint being
  written is lost too), then ``detection → [spare_wait] → restart → restore``. Under
  ``restart-all`` the failed node must be replaced from the idle pool before relaunch;
  when the pool is empty the job waits for a repaired node (a spare-exhaustion event).
- in-process swap (``hot-spare`` with an idle node): the step in flight is lost (uniform
  in ``[0, step_s]``), then ``detection → rebuild (abort + new communicators) → restore
  (state copy to the spare)``; the job keeps its size.
- in-process shrink (``shrink``, or ``hot-spare`` with an empty pool — a spare-exhaustion
  event): the step in flight is lost, then ``detection → rebuild``; the replica holding the
  failed node leaves and its healthy nodes become idle.
- grow (in-process policies): whenever the job is short of replicas, running, and idle
  nodes make a whole replica, it pauses ``rebuild_s + state_copy_s`` to add one.

A failure during a recovery starts a new recovery at once (Daly's assumption for
restarts); once a full restart is under way, any failure restarts it.

Gray failures (:mod:`.gray`, when the scenario has them) are one more event source: a
:class:`~resilient_comm.sim.gray.GraySource` says when its next event is, the job's speed
(its slowest node's: running progress is multiplied by it, the rest booked as ``slow``) and
the replica comparison's share of compute time (``integrity``), and acts on the job through
:meth:`_Job.evict_node` (a planned in-process recovery, no step redone), :meth:`_Job.redo`
and :meth:`_Job.restart_from`.

Draws come from three generators spawned from the seed (failure times, unabsorbable or
not, lost fraction of a step), so every policy and every checkpoint interval sees the same
sequence of random numbers: comparisons between them are paired, not independent. Gray
failures draw from a fourth, so adding them leaves the fail-stop failures as they were.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

from resilient_comm.checkpoint.interval import daly_interval
from resilient_comm.sim.gray import GrayPolicy, GraySource
from resilient_comm.sim.model import GRAY_CAUSES, LOSS_CAUSES, Policy, Scenario, SimResult

__all__ = ["checkpoint_interval", "simulate"]

_CHUNK = 4096


def checkpoint_interval(scenario: Scenario, policy: Policy) -> float:
    """Compute seconds between checkpoints that ``policy`` runs ``scenario`` with.

    The scenario's own interval if it sets one; else Daly's optimum for the rate of the
    failures that make this policy roll back to a checkpoint (all of them for
    ``restart-all``, the unabsorbable ones otherwise), capped at ``max_ckpt_interval_s``.
    """
    if scenario.ckpt_interval_s is not None:
        return scenario.ckpt_interval_s
    share = 1.0 if policy is Policy.RESTART_ALL else scenario.unabsorbable_fraction
    if share == 0.0:
        return scenario.max_ckpt_interval_s
    mtbf = scenario.job_mtbf_s / share
    return min(daly_interval(scenario.ckpt_cost_s, mtbf), scenario.max_ckpt_interval_s)


class _Draws:
    """A numpy generator read one float at a time from buffers drawn ``_CHUNK`` at once."""

    def __init__(self, seed: np.random.SeedSequence, exponential: bool) -> None:
        self._rng = np.random.default_rng(seed)
        self._exponential = exponential
        self._buf: list[float] = []
        self._i = 0

    def next(self) -> float:
        if self._i == len(self._buf):
            draw = self._rng.standard_exponential if self._exponential else self._rng.random
            self._buf = draw(_CHUNK).tolist()
            self._i = 0
        self._i += 1
        return self._buf[self._i - 1]


@dataclasses.dataclass
class _Phase:
    cause: str
    left: float


class _Job:
    """Mutable state of one run; :func:`simulate` is its only user."""

    def __init__(self, scenario: Scenario, policy: Policy, seed: int, gray: GrayPolicy) -> None:
        s = scenario
        self.s, self.policy, self.seed = s, policy, seed
        self.tau = checkpoint_interval(s, policy)
        self.period = self.tau + s.ckpt_cost_s
        self.dp, self.npr = s.mesh.dp, s.mesh.nodes_per_replica
        self.node_rate = s.node_failure_rate
        self.rec = s.recovery
        hazard, kind, step, gray_seed = np.random.SeedSequence(seed).spawn(4)
        self.hazard_draws = _Draws(hazard, exponential=True)
        self.kind_draws = _Draws(kind, exponential=False)
        self.step_draws = _Draws(step, exponential=False)
        self.gray = GraySource(s.gray, gray, s.step_s, self.dp, s.mesh.gpus_per_node, gray_seed)

        self.t = 0.0
        self.replicas = self.dp
        self.idle = s.spare_nodes if policy.uses_spares else 0
        self.missing = 0  # nodes a restart-all relaunch still needs from the idle pool
        self.repairs: collections.deque[float] = collections.deque()  # return times, in order
        self.phases: list[_Phase] = []  # empty while running; phases[0] is under way
        self.restarting = False
        self.cycle_pos = 0.0  # position in the compute-then-write cycle, in [0, period)
        self.since_ckpt = 0.0  # progress since the last completed checkpoint
        self.useful = 0.0
        self.lost = dict.fromkeys(LOSS_CAUSES + GRAY_CAUSES, 0.0)
        self.failures = self.restarts = self.swaps = self.shrinks = self.grows = self.exhaustions = 0
        self.min_replicas = self.dp

    def run(self) -> SimResult:
        end = self.s.days * 86400.0
        hazard = self.hazard_draws.next()
        while True:
            rate = self.replicas * self.npr * self.node_rate
            dt_fail = hazard / rate if rate > 0 else math.inf
            dt_repair = self.repairs[0] - self.t if self.repairs else math.inf
            dt_phase = self.phases[0].left if self.phases else math.inf
            dt_gray = self.gray.next_dt(self) if self.gray.active else math.inf
            dt_end = end - self.t
            dt = max(0.0, min(dt_end, dt_fail, dt_repair, dt_phase, dt_gray))
            self._advance(dt)
            if self.gray.active:
                self.gray.elapse(dt)
            if dt == dt_end:
                self.t = end
                break
            self.t += dt
            if dt == dt_phase:
                hazard -= rate * dt
                self._phase_done()
            elif dt == dt_repair:
                hazard -= rate * dt
                self._repair_back()
            elif dt == dt_gray:
                hazard -= rate * dt
                self.gray.fire(self)
            else:
                hazard = self.hazard_draws.next()
                self._fail()
        return SimResult(
            scenario=self.s.name,
            policy=self.policy,
            seed=self.seed,
            gpus=self.s.mesh.gpus,
            wall_s=end,
            useful_s=self.useful,
            lost_s=dict(self.lost),
            ckpt_interval_s=self.tau,
            failures=self.failures,
            restarts=self.restarts,
            spare_swaps=self.swaps,
            shrinks=self.shrinks,
            grows=self.grows,
            spare_exhaustions=self.exhaustions,
            min_replicas=self.min_replicas,
            gray_counts=self.gray.counts(),
        )

    def _advance(self, dt: float) -> None:
        if self.phases:
            self.lost[self.phases[0].cause] += dt
            self.phases[0].left -= dt
            return
        k = self.replicas / self.dp
        speed, overhead = (self.gray.speed, self.gray.overhead) if self.gray.active else (1.0, 0.0)
        gain = k * speed * (1.0 - overhead)  # progress per second of compute
        x0, x1 = self.cycle_pos, self.cycle_pos + dt
        computed = self._compute_until(x1) - self._compute_until(x0)
        self.useful += gain * computed
        self.lost["slow"] += k * (1.0 - speed) * computed
        self.lost["integrity"] += k * speed * overhead * computed
        self.lost["checkpoint"] += k * (dt - computed)
        self.lost["shrunk"] += (1.0 - k) * dt
        last_write_end = math.floor(x1 / self.period) * self.period
        if last_write_end > x0:
            self.since_ckpt = gain * min(x1 - last_write_end, self.tau)
        else:
            self.since_ckpt += gain * computed
        self.cycle_pos = x1 - last_write_end

    def _compute_until(self, x: float) -> float:
        """Compute seconds in the cycle positions ``[0, x)``."""
        q, r = divmod(x, self.period)
        return q * self.tau + min(r, self.tau)

    def _roll_back(self, amount: float) -> None:
        amount = min(amount, self.since_ckpt)
        self.useful -= amount
        self.lost["rollback"] += amount
        self.since_ckpt -= amount

    def _fail(self) -> None:
        self.failures += 1
        unabsorbable = self.kind_draws.next() < self.s.unabsorbable_fraction
        running = not self.phases
        swapped = False
        if not unabsorbable:
            self.repairs.append(self.t + self.s.replenish_s)
            if self.policy is Policy.RESTART_ALL:
                self.missing += 1
            else:
                swapped = self._replace_or_shrink()
        if self.policy is Policy.RESTART_ALL or unabsorbable or self.restarting:
            self._restart()
            return
        if running and self.cycle_pos < self.tau:
            self._roll_back(self.replicas / self.dp * self.step_draws.next() * self.s.step_s)
        # An interrupted swap or grow still owes its newcomers their state copy.
        owes_copy = swapped or any(p.cause in ("restore", "grow") for p in self.phases)
        r = self.rec
        phases = [_Phase("detection", r.detect_s), _Phase("rebuild", r.abort_s + r.rebuild_s)]
        if owes_copy:
            phases.append(_Phase("restore", r.state_copy_s))
        self._start(phases)

    def _restart(self) -> None:
        """Lose the work since the last completed checkpoint; relaunch and reload it."""
        self._roll_back(self.since_ckpt)
        self.cycle_pos = 0.0
        self.restarting = True
        self.restarts += 1
        r = self.rec
        self._start(
            [
                _Phase("detection", r.restart_detect_s),
                _Phase("spare_wait", 0.0),
                _Phase("restart", r.restart_s),
                _Phase("restore", r.restore_s),
            ]
        )

    def _replace_or_shrink(self) -> bool:
        """Node accounting of an absorbable failure in process; True if a spare took over."""
        if self.policy is Policy.HOT_SPARE:
            if self.idle >= 1:
                self.idle -= 1
                self.swaps += 1
                return True
            self.exhaustions += 1
        self.replicas -= 1
        self.idle += self.npr - 1
        self.shrinks += 1
        self.min_replicas = min(self.min_replicas, self.replicas)
        return False

    def _start(self, phases: list[_Phase]) -> None:
        self.phases = phases
        self._enter_phase()

    def _enter_phase(self) -> None:
        phase = self.phases[0]
        if phase.cause != "spare_wait":
            return
        if self.idle >= self.missing:
            self.idle -= self.missing
            self.missing = 0
            phase.left = 0.0
        else:
            self.exhaustions += 1
            phase.left = math.inf

    def _phase_done(self) -> None:
        self.phases.pop(0)
        if self.phases:
            self._enter_phase()
            return
        self.restarting = False
        self._maybe_grow()

    def _repair_back(self) -> None:
        self.repairs.popleft()
        self.idle += 1
        if not self.phases:
            self._maybe_grow()
        elif self.phases[0].cause == "spare_wait" and self.idle >= self.missing:
            self.idle -= self.missing
            self.missing = 0
            self.phases[0].left = 0.0

    def _maybe_grow(self) -> None:
        if self.policy.in_process and self.replicas < self.dp and self.idle >= self.npr:
            self.replicas += 1
            self.idle -= self.npr
            self.grows += 1
            self._start([_Phase("grow", self.rec.rebuild_s + self.rec.state_copy_s)])

    # --- what gray failures read and do (gray.GrayJob) ---------------------------------------

    @property
    def running(self) -> bool:
        return not self.phases

    @property
    def nodes_held(self) -> int:
        return self.replicas * self.npr

    @property
    def spares_waiting(self) -> int:
        return self.idle if self.policy is Policy.HOT_SPARE else 0

    def evict_node(self) -> None:
        """A node leaves on purpose at a step boundary (slow, or named twice): it goes to
        repair and a spare takes its place, or its replica leaves; no step is redone."""
        self.repairs.append(self.t + self.s.replenish_s)
        r = self.rec
        phases = [_Phase("detection", r.detect_s), _Phase("rebuild", r.abort_s + r.rebuild_s)]
        if self._replace_or_shrink():
            phases.append(_Phase("restore", r.state_copy_s))
        self._start(phases)

    def redo(self, amount: float, cause: str) -> None:
        """Take ``amount`` of progress back to compute again (past checkpoints if need be)."""
        amount = max(0.0, min(amount, self.useful))
        self.useful -= amount
        self.lost[cause] += amount
        self.since_ckpt = max(0.0, self.since_ckpt - amount)

    def restart_from(self, progress: float, drained: int) -> None:
        """Full restart from the checkpoint at ``progress`` (an older one than the last);
        ``drained`` nodes go to repair and are replaced (or their replicas leave)."""
        self.redo(self.useful - progress, "corruption")
        self.since_ckpt = 0.0
        for _ in range(drained):
            self.repairs.append(self.t + self.s.replenish_s)
            if self.policy is Policy.RESTART_ALL:
                self.missing += 1
            else:
                self._replace_or_shrink()
        self._restart()


def simulate(
    scenario: Scenario, policy: Policy | str, seed: int = 0, gray: GrayPolicy | str = GrayPolicy.IGNORE
) -> SimResult:
    """Run ``scenario`` for ``scenario.days`` under ``policy``, answering its gray failures (if
    it has any) with ``gray``; deterministic in ``seed``. Acting on gray failures needs an
    in-process policy (the controller does it)."""
    gray = GrayPolicy(gray)
    if gray is GrayPolicy.ACT and not Policy(policy).in_process and scenario.gray is not None:
        raise ValueError("acting on gray failures needs an in-process policy (shrink or hot-spare)")
    return _Job(scenario, Policy(policy), seed, gray).run()
