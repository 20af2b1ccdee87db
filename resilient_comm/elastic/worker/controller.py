"""The elastic controller: wraps the training loop, recovers from failures in-process. Runs in
each worker (a training process started by ``resilient-run``).

Usage, in a worker started by ``resilient-run``::

    ctl = Controller(state=trainer, tp=1, comm_bytes=grad_bytes)
    for s in ctl.steps(total_steps):
        with s:                                     # a CommError inside -> recovery, then the
            loss = trainer.forward_backward(s.step) #   loop goes on at ctl.next_step
            s.commit(trainer.optimizer_step, grads=trainer.grads())
    ctl.close()

``ctl.groups`` holds the current world, dp, tp and pp groups (read it every step: a recovery
replaces them). ``state`` is anything with ``state_dict()``/``load_state_dict()`` (a module,
or an object bundling model and optimizer).

**Commit protocol.** ``s.commit(apply, grads)`` averages `grads` over the DP group, then every
member *votes*: an all_reduce(MIN) of 1 on the world (on the device communicator in a GPU job:
``device``, by default the current CUDA device on resilient_nccl; the host waits for the
vote to complete, `commit_vote`). A member reaches its vote only after
every collective of its step succeeded, so a vote result of 1 on any member means every member
of the epoch completed the step's collectives. Only then ``apply()`` (the optimizer update)
runs and the step is *committed*. The invariant, for any two members of an epoch::

    committed(a) and committed(b) differ by at most 1, and a member one behind holds the
    pending step: it voted, so its reduced gradients are complete and its update not applied.

(A member cannot start step s+1's collectives before every member finished the vote of s.)
On recovery, the epoch's decision sets ``resume_step = C + 1`` with C the highest step
committed by any joiner (or by a member that already finished). A member at C-1 applies its
pending update (roll forward: the step is not redone); a member that had started step C+1
reloads the snapshot taken at that step's start (roll back: compute side effects such as
batch-norm statistics are undone). So every member resumes from the same committed step, at
most the one in-flight step is redone, and no step is applied twice.

**Recovery**: abort this process's groups (bounded: abort returns at once) -> join the next
epoch (`membership`) -> the decision (`policy`: shrink, whole replicas leave) -> rebuild the
world (shrink of the previous world, or a fresh group when a previous build was interrupted)
and split it into the dp/tp/pp groups, verified by one collective -> restore -> resume. A
failure during a recovery just starts the next epoch. A rank absent from a decision raises
`Evicted`; when no replica survives, `RecoveryError`. Each recovery leaves a `Timeline`.

**Hot spares** (``resilient-run --spares K``): a spare process runs the same script; its
`Controller` registers it with the membership and blocks, warm, until a decision gives it a
lost rank's place (same rank, same tp/pp/dp coordinates: the world size and mesh are kept;
`slot` says whose place, for data streams). The groups are then built afresh with the
spare at that rank, the survivors restore the committed step as above, and the spare --
like any member behind the committed step -- receives the state of a *donor*, a member with
the same tp/pp coordinates in another replica, over the new world group as tensors
(`state/transfer.py`: nothing received is unpickled). When no such donor exists and a checkpointer
is configured, every member loads the newest checkpoint complete for the whole mesh instead
(the job resumes after that step); with neither, the spare is not used and the policy
shrinks. When the job ends, waiting spares leave: `steps()` yields nothing on them.

**Checkpoints** (``checkpoint_dir``, ``checkpoint_every``): the state after every
``checkpoint_every``-th committed step is saved asynchronously (`resilient_comm.checkpoint`),
from the step-start snapshot (a private copy: its host copy runs while the next step computes,
nothing waits); with ``snapshot=False``, from the live state, and the next step waits for the
host copy before it starts (its forward may change buffers in place).

**Data parallel after a shrink**: every surviving replica keeps its per-rank batch (and its
data stream); the global batch shrinks with the DP size and gradients are averaged over the
survivors. The learning rate is not rescaled (``ctl.dp_size`` is there for who wants to).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from types import TracebackType
from typing import Any, Self

import torch
import torch.distributed as dist

import resilient_comm
from resilient_comm.elastic.membership.protocol import Membership, connect
from resilient_comm.elastic.model.bounds import DetectorConfig
from resilient_comm.elastic.model.env import ENV_AGENT, ENV_NAMESPACE, ENV_SPARE, ENV_STORE
from resilient_comm.elastic.model.pace import PaceConfig
from resilient_comm.elastic.model.policy import Mesh
from resilient_comm.elastic.model.records import Decision, Gone, JoinRecord, now
from resilient_comm.elastic.model.timeline import Timeline
from resilient_comm.elastic.state import devicemesh
from resilient_comm.elastic.state.provider import Place, StateFactory, Stateful, warm_up
from resilient_comm.elastic.worker.checkpoints import Checkpoints
from resilient_comm.elastic.worker.commit_vote import vote_device
from resilient_comm.elastic.worker.commits import Commits
from resilient_comm.elastic.worker.detector import Detector
from resilient_comm.elastic.worker.errors import Evicted, RecoveryError
from resilient_comm.elastic.worker.evidence import Evidence
from resilient_comm.elastic.worker.gray import GrayChecks
from resilient_comm.elastic.worker.groups import Groups, build_groups
from resilient_comm.elastic.worker.rejoin import (
    await_decision,
    catch_up,
    decide_with_checkpoints,
    enter,
    wait_placed,
    waiting_spares,
)
from resilient_comm.elastic.worker.timelines import Timelines

log = logging.getLogger("resilient_comm.elastic")


class _Redo(Exception):
    """A recovery ran before this step's sync and the step must run again (the decision
    moved the state); `Step.__exit__` swallows it, the recovery being done."""


class Step:
    """One training step; use as a context manager and call `commit` inside it."""

    def __init__(self, ctl: Controller, step: int) -> None:
        self.step = step
        self._ctl = ctl
        self.committed = False

    def __enter__(self) -> Self:
        self._ctl._begin(self.step)
        return self

    def commit(self, apply: Callable[[], Any], grads: Sequence[torch.Tensor] = ()) -> None:
        """Average `grads` over the DP group, agree, then run `apply` (the update)."""
        self._ctl._commit(self.step, apply, grads)
        self.committed = True

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if et is None:
            if not self.committed:
                raise RuntimeError(f"step {self.step} ended without commit()")
            return False
        if isinstance(ev, dist.DistBackendError):
            self._ctl._recover(ev, op_error=not isinstance(ev, resilient_comm.CommAbortedError))
            return True
        return isinstance(ev, _Redo)


class Controller(Evidence):
    """One per worker process; its methods are for the training thread only."""

    _keep: int | None = None  # a step whose computed state a recovery may keep (`_recover_keeping`)
    _total = 0  # the steps of the run (`steps`)

    def __init__(
        self,
        state: Stateful | StateFactory | None = None,
        *,
        tp: int = 1,
        pp: int = 1,
        backend: str = "resilient_tcp",
        timeout: datetime.timedelta | None = None,
        start_step: int = 0,
        comm_bytes: int = 0,
        detector: DetectorConfig | None = None,
        snapshot: bool = True,
        hook: Callable[[str, dict[str, Any]], None] | None = None,
        max_recoveries_per_step: int = 5,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 0,
        checkpoint_keep: int = 3,
        device: torch.device | str | None = None,
        warmup: Callable[[], Any] | None = None,
        shard_dp: bool = False,
        fingerprint_every: int | None = None,
        pace: PaceConfig | None = None,
    ) -> None:
        """`state`: the state provider (``state_dict``/``load_state_dict``: a module, a
        `TrainState`, ...), or a factory called with this process's `Place` once it is known
        (a hot spare learns its place only when it is given one: a pipeline stage's model
        depends on it). On a hot spare the constructor blocks until the spare is placed or
        the job ends. `device`: where the commit vote runs (`vote_device`). `warmup`: called once
        before the state is made, on a spare before it registers as waiting, so that being placed
        costs only the state transfer: the imports, loads and compilation the factory needs.
        `shard_dp`: the state is sharded over dp (FSDP2): every recovery restores the newest
        checkpoint, re-sharded onto the new mesh (`reshard`; needs `checkpoint_every`). A state
        provider with an ``on_mesh(device_mesh)`` method has it called after every build of
        the groups, before its state is restored: it re-creates its model over the new mesh.
        `fingerprint_every`: the dp replicas compare a fingerprint of their replicated state
        after every this many committed steps, the last one and each one checkpointed, and on a
        mismatch every member goes back to the newest state they agreed on (`integrity`;
        0: never; None: ``RESILIENT_COMM_FINGERPRINT_EVERY``; off under `shard_dp`).
        `pace`: fail-slow detection (`model/pace.py`: the window, thresholds and margin; None:
        ``RESILIENT_COMM_PACE_WINDOW`` and the defaults)."""
        env = os.environ
        missing = [k for k in ("RANK", "WORLD_SIZE", ENV_STORE, ENV_NAMESPACE, ENV_AGENT) if k not in env]
        if missing:
            raise RuntimeError(
                f"Controller needs {missing} in the environment: start workers with resilient-run"
            )
        self.rank = int(env["RANK"])
        self.is_spare = env.get(ENV_SPARE) == "1"
        world = int(env["WORLD_SIZE"])
        self._state_arg = state
        self._state: Stateful | None = None if callable(state) and not hasattr(state, "state_dict") else state  # type: ignore[assignment]
        self._backend = backend
        self._vote_device = vote_device(backend, device)
        self._timeout = timeout or dist.default_pg_timeout
        self._comm_bytes = comm_bytes
        self._hook = hook
        self._max_per_step = max_recoveries_per_step
        self._ckpts = Checkpoints(checkpoint_dir, checkpoint_every, checkpoint_keep, shard_dp)
        self._commits = Commits(start_step, snapshot and state is not None, self._ckpts, self._emit)
        self.gray = GrayChecks(fingerprint_every, pace, shard_dp, self.rank, self._emit)
        store = connect(env[ENV_STORE], self._timeout)
        self._m = Membership(store, env[ENV_NAMESPACE])
        initial = Decision(0, list(range(world)), Mesh.for_world(world, tp, pp).as_dict(), "init", start_step)
        self._decision = enter(self._m, self.rank, initial, self.is_spare)
        self.applied_epoch = 0
        self._timelines = Timelines(self.rank)
        self.recoveries: list[Timeline] = self._timelines.done
        self._ready = False
        self._step_started = 0.0
        self._tries: dict[int, int] = {}
        self._groups: Groups | None = None
        self._device_mesh: tuple[Groups | None, Any] | None = None  # (the groups it was built over, it)
        Evidence.__init__(self, self.rank, initial.members)  # _held: the groups of this process
        self._idle = False  # a spare that was never placed: nothing to run
        self._detector = Detector(
            env[ENV_AGENT],
            self.rank,
            detector or DetectorConfig.from_env(),
            self._on_gone,
            self._on_store_lost,
            self._on_fenced,
        )
        atexit.register(self._detector.stop)  # also when the script never calls close()
        if self.is_spare:
            self._watching = set()
            self._detector.progress(-1, "spare")
            self._detector.start()
            warm_up(warmup)
            self._spare_wait()
            return
        self._detector.start()
        warm_up(warmup)
        self._detector.set_members(initial.members, comm_bytes)
        self._resolve_state()
        if self._m.epoch() != 0:
            self._recover(
                RuntimeError(f"rank {self.rank} started after the job moved past epoch 0"), op_error=False
            )
            return
        try:
            self._build(self._decision, None)
        except dist.DistBackendError as e:
            self._recover(e, op_error=True)

    def _spare_wait(self) -> None:
        """A hot spare: wait warm until a decision places this spare, then join that epoch
        as a member (build its groups, receive the state); or leave when the job ends."""
        d = wait_placed(self._m, self._detector, self.rank, self._check_fatal)
        if d is None:
            self._idle = True
            self._detector.stop()
            return
        self._place(d)

    def _place(self, d: Decision) -> None:
        self._commits.committed, self._commits.next_step = -1, d.resume_step
        tl = self._timelines.placed(d)
        try:
            self._build(d, None)
            tl.mark("rebuilt")
            self._restore(d)
        except dist.DistBackendError as e:
            self._recover(e, op_error=True)
            return
        self._timelines.restored(tl, d)
        self._emit(
            "recovery.restored", epoch=d.epoch, step=self.next_step, members=d.members, place=self.place
        )

    # -- what the training loop sees ------------------------------------------------------

    @property
    def committed(self) -> int:
        """The last step committed here (-1: none)."""
        return self._commits.committed

    @property
    def next_step(self) -> int:
        """The step this member runs next (a recovery may move it back, or on)."""
        return self._commits.next_step

    @property
    def groups(self) -> Groups:
        assert self._groups is not None
        return self._groups

    @property
    def mesh(self) -> Mesh:
        return self._decision.mesh_obj()

    @property
    def device_mesh(self) -> Any:
        """The current groups as a torch DeviceMesh, dims ("dp", "pp", "tp") (devicemesh.py):
        `fully_shard(m, mesh=ctl.device_mesh["dp"])`. A new one after every recovery."""
        if self._groups is None:
            raise RuntimeError("no groups yet: the device mesh exists once this process is a member")
        if self._device_mesh is None or self._device_mesh[0] is not self._groups:
            g = self._groups
            self._device_mesh = (g, devicemesh.build(g.dp, g.pp, g.tp, self.mesh, self._vote_device.type))
        return self._device_mesh[1]

    @property
    def members(self) -> list[int]:
        """Launch ranks of the current members, in rank order."""
        return list(self._decision.members)

    @property
    def dp_size(self) -> int:
        return self.mesh.dp

    @property
    def place(self) -> Place:
        """This process's rank in the current world, its slot and mesh coordinates."""
        d = self._decision
        if self.rank not in d.members:
            raise RuntimeError(f"process {self.rank} is not a member (a spare that was never placed)")
        me = d.members.index(self.rank)
        return Place(me, d.slots[me] if d.slots else d.members[me], d.mesh_obj().coords(me))

    @property
    def slot(self) -> int:
        """The launch rank whose place this process holds (see `Place`)."""
        return self.place.slot

    @property
    def state(self) -> Stateful | None:
        """The state provider (made by the factory once the place was known)."""
        return self._state

    def _resolve_state(self) -> None:
        if self._state is None and self._state_arg is not None:
            self._state = self._state_arg(self.place)  # type: ignore[operator]

    def steps(self, total: int) -> Iterator[Step]:
        """Steps until every member committed step total-1 (recoveries move `next_step`; a
        member that finished helps any late recovery before it returns)."""
        self._total = total
        while not self._idle:
            if self.next_step < total:
                yield Step(self, self.next_step)
            elif self._finish(total):
                return

    def run(self, total: int, train_step: Callable[[Step], Any]) -> None:
        """`train_step(s)` for every step, each ending in ``s.commit(...)``."""
        for s in self.steps(total):
            with s:
                train_step(s)

    def close(self) -> None:
        """Stop the detector threads, finish the last checkpoint, destroy the process groups."""
        self._detector.stop()
        self._ckpts.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- steps and commits ----------------------------------------------------------------

    def _emit(self, event: str, **info: Any) -> None:
        if self._hook is not None:
            self._hook(event, info)

    def _begin(self, step: int) -> None:
        self._commits.begin(step, self._state, lambda: self.place.rank, self.applied_epoch)
        self._step_started = time.monotonic()
        self.gray.step_started(self.committed, self._state, self._commits.snapshot, self._vote_device)
        self._detector.progress(step, "compute")
        self._emit("step.start", step=step)

    def _commit(self, step: int, apply: Callable[[], Any], grads: Sequence[torch.Tensor]) -> None:
        self.gray.step_computed()  # its own work, before any wait
        with self._lock:
            lost = sorted(r for r in self._decision.members if r in self._evidence)
        if lost:
            self._recover_keeping(
                step, RuntimeError(f"rank(s) {lost} reported gone while step {step} computed"), False
            )
        while True:
            self._detector.progress(step, "sync")
            g = self.groups
            try:
                self._commits.commit(step, apply, grads, g.dp, self.mesh.dp, g.world, self._vote_device)
                break
            except dist.DistBackendError as e:
                if not self._commits.grads_intact:
                    raise  # the step runs again (`Step.__exit__`)
                self._recover_keeping(step, e, not isinstance(e, resilient_comm.CommAbortedError))
        self._detector.step_done(time.monotonic() - self._step_started)
        self._timelines.first_commit(self._lock, self._detector.report)
        self._emit("step.committed", step=step)
        after = self.gray.after_commit(
            step,
            last=step == self._total - 1,
            checkpoint=self._ckpts.due(step + 1, step),
            state=self._state,
            world=self.groups.world,
            members=self.members,
            mesh=self.mesh,
            spares=lambda: len(waiting_spares(self._m, self._decision)),
        )
        if after.back_to is not None:  # the steps since the agreed state run again
            self._commits.rewind(after.back_to)
        elif after.leave:  # they left (`Evicted`); the others recover on purpose: nothing failed
            # Every member records them gone at once: the decision need not wait for their
            # launchers to see them exit (a throttled rank takes seconds to tear down).
            why = f"slow: left after step {step}"
            self._m.report_gone_many([Gone(r, "left", why, now(), f"rank {self.rank}") for r in after.leave])
            self._recover(RuntimeError(f"planned: slow rank(s) {after.leave} {why}"), op_error=False)

    def _recover_keeping(self, step: int, cause: BaseException, op_error: bool) -> None:
        """[Note: keeping the computed step] A failure that reaches a member before its step's
        gradients were touched -- reported while the step computed (its launcher's report, a
        heartbeat), or failing the gradients' all_reduce, which runs on a flat copy -- leaves
        those gradients intact. With pure data parallelism (tp = pp = 1), when the decision
        resumes at this step and moves no state (no checkpoint load, no spare to copy to), the
        step's computation stands and its sync runs again on the new groups: bit for bit what
        the redone step would compute (same parameters, same batch per slot), without its
        compute. A member whose all_reduce had finished (its gradients averaged) redoes the
        step, and so does everyone when the decision moves state (`_Redo`)."""
        mesh = self.mesh
        self._keep = step if mesh.tp == 1 and mesh.pp == 1 else None
        try:
            self._recover(cause, op_error=op_error)
        finally:
            kept, self._keep = self._commits.kept, None
        if not (kept and self.next_step == step):
            raise _Redo()

    # -- failure evidence (detector threads) ----------------------------------------------

    def _note(self, g: Gone) -> None:
        self._timelines.heard(g)

    def _abort(self, groups: list[dist.ProcessGroup], reason: str) -> None:
        for pg in groups:
            try:
                resilient_comm.abort(pg, reason)
            except (ValueError, RuntimeError):
                pass  # already destroyed by a shrink: nothing left to release

    # -- recovery -------------------------------------------------------------------------

    def _recover(self, cause: BaseException, op_error: bool) -> None:
        """Recover from `cause`; `op_error`: it is a collective's own failure (evidence)."""
        try:
            self._check_fatal()
        except (Evicted, RecoveryError) as e:
            raise e from cause
        tries = self._tries[self.next_step] = self._tries.get(self.next_step, 0) + 1
        if tries > self._max_per_step:
            raise RecoveryError(
                f"{tries - 1} recoveries at step {self.next_step} without progress"
            ) from cause
        tl = self._timelines.start(cause, *self._failure_times(), op_error)
        with self._lock:
            groups = list(self._held)
        self._detector.progress(self.next_step, "recovery")
        self._abort_held(groups, f"recovering from {tl.cause}", again=True)
        tl.mark("aborted")
        self._emit("recovery.aborted")
        deadline = time.monotonic() + self._timeout.total_seconds()
        while True:
            tl.attempts += 1
            try:
                base, decision = self._agree(deadline)
            except (dist.DistStoreError, dist.DistNetworkError) as e:
                self._store_failed(e)
            tl.mark("agreed")
            tl.lost += decision.lost
            self._emit("recovery.agreed", epoch=decision.epoch, members=decision.members)
            if decision.mode == "fail":
                raise RecoveryError(f"epoch {decision.epoch}: {decision.note}") from cause
            if self.rank not in decision.members:
                raise Evicted(
                    f"rank {self.rank} was evicted in epoch {decision.epoch} (its replica lost "
                    f"{decision.lost}); {len(decision.members)} ranks go on"
                )
            try:
                self._build(decision, base)
                tl.mark("rebuilt")
                self._restore(decision)
                break
            except dist.DistBackendError as e:
                cause = e  # a failure during the rebuild or the state copy: on to the next epoch
                with self._lock:
                    groups = list(self._held)
                self._abort_held(groups, f"rebuild of epoch {decision.epoch} failed", again=True)
        if decision.failed_at:
            tl.mark("failure", min(tl.t["failure"], decision.failed_at))
        self._timelines.restored(tl, decision)
        self._emit(
            "recovery.restored",
            epoch=decision.epoch,
            step=self.next_step,
            members=decision.members,
            place=self.place,
        )

    def _agree(self, deadline: float) -> tuple[Decision, Decision]:
        """Join the current epoch and return (the previous epoch's decision, its decision)."""
        pending = self._commits.pending[0] if self._commits.pending else None
        current, base = catch_up(
            self._m,
            self.rank,
            self.applied_epoch,
            self._decision,
            JoinRecord(self.rank, self.applied_epoch, self._ready, self.committed, pending, now()),
            lambda rec: self._join_via_agent(rec, deadline),
        )
        self._emit("recovery.joined", epoch=current)
        with self._lock:
            self._watching = set(base.members)

        return base, await_decision(
            self._m,
            self._detector,
            self.rank,
            current,
            base,
            deadline,
            self._timeout.total_seconds(),
            lambda joined, gone: self._decide(current, base, joined, gone),
            self._check_fatal,
        )

    def _decide(
        self, epoch: int, base: Decision, joined: dict[int, JoinRecord], gone: dict[int, Gone]
    ) -> Decision:
        return decide_with_checkpoints(self._m, epoch, base, joined, gone, self._ckpts, self.rank)

    def _build(self, d: Decision, base: Decision | None) -> None:
        """Make `d`'s world and dp/tp/pp groups and verify them with one collective each."""
        with self._lock:
            old, self._watching = self._take_held(), set(d.members)
        self.applied_epoch, self._decision, self._ready = d.epoch, d, False
        self.gray.forget(d.members)  # the replicas, their shards and the members may have changed
        self._resolve_state()
        # Watch the new members from the start of the build: a spare that froze while it waited
        # (it heartbeats, but nobody watched it) is suspected by silence instead of holding the
        # build until the op timeout.
        self._detector.set_members(d.members, self._comm_bytes)
        self._groups = build_groups(
            d,
            base,
            d.members.index(self.rank),
            old,
            self._backend,
            self._m,
            self._timeout,
            lambda pg: self._hold(pg, d.members),
        )
        on_mesh = getattr(self._state, "on_mesh", None)
        if on_mesh is not None:
            on_mesh(self.device_mesh)  # a model over the mesh (FSDP2) is re-created on the new one
        self._ready = True
        self._detector.set_members(d.members, self._comm_bytes)
        self._forget(d.members)

    def _restore(self, d: Decision) -> None:
        """Bring this member to the decision's committed step (`Commits.restore`)."""
        self._commits.restore(
            d, self.rank, self._state, self._m, lambda: self.place, lambda: self.groups.world, self._keep
        )

    # -- the end --------------------------------------------------------------------------

    def _finish(self, total: int) -> bool:
        """Wait until every live member committed the last step. False if a recovery moved the
        job back (the caller then runs the remaining steps)."""
        self._detector.progress(self.committed, "done")
        self._m.set_done(self.rank, self.committed)
        if self._wait_all_done(self._m.done):
            return True
        self._recover(RuntimeError("a member is recovering after this one finished"), op_error=False)
        return self.next_step >= total and self._finish(total)


__all__ = ["Controller", "Step"]
