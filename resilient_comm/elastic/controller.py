"""The elastic controller: wraps the training loop, recovers from failures in-process.

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
(`statesync`: nothing received is unpickled). When no such donor exists and a checkpointer
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
import copy
import dataclasses
import datetime
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

import resilient_comm
from resilient_comm.api import _backend
from resilient_comm.elastic import devicemesh, reshard
from resilient_comm.elastic.agent import ENV_AGENT
from resilient_comm.elastic.agreement import (
    EXIT_EVICTED,
    Evicted,
    RecoveryError,
    await_decision,
    catch_up,
    decide_epoch,
    wait_placed,
)
from resilient_comm.elastic.detector import Detector, DetectorConfig
from resilient_comm.elastic.evidence import Evidence
from resilient_comm.elastic.membership import (
    Decision,
    Gone,
    JoinRecord,
    Membership,
    connect,
    now,
)
from resilient_comm.elastic.metrics import recovery_line
from resilient_comm.elastic.policy import DIMS, Mesh
from resilient_comm.elastic.state import Place, StateFactory, Stateful, TrainState, warm_up
from resilient_comm.elastic.statesync import recv_state, send_state
from resilient_comm.elastic.timeline import Timeline
from resilient_comm.elastic.vote import commit_vote, vote_device
from resilient_comm.groups import _adopt

ENV_STORE = "RESILIENT_COMM_STORE"  # the job's store: host:port (the launcher's) or etcd://h1:p1,h2:p2
ENV_NAMESPACE = "RESILIENT_COMM_NAMESPACE"  # this run's key prefix in it
ENV_SPARE = "RESILIENT_COMM_SPARE"  # "1" in a hot spare (its RANK is a spare id >= WORLD_SIZE)
log = logging.getLogger("resilient_comm.elastic")

@dataclass(frozen=True)
class Groups:
    """The current process groups. A dimension spanning the whole world is the world group."""

    world: dist.ProcessGroup
    dp: dist.ProcessGroup
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup


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

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> bool:
        if et is None:
            if not self.committed:
                raise RuntimeError(f"step {self.step} ended without commit()")
            return False
        if isinstance(ev, dist.DistBackendError):
            self._ctl._recover(ev, op_error=not isinstance(ev, resilient_comm.CommAbortedError))
            return True
        return False


class Controller(Evidence):
    """One per worker process; its methods are for the training thread only."""

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
        the groups, before its state is restored: it re-creates its model over the new mesh."""
        env = os.environ
        missing = [k for k in ("RANK", "WORLD_SIZE", ENV_STORE, ENV_NAMESPACE, ENV_AGENT) if k not in env]
        if missing:
            raise RuntimeError(f"Controller needs {missing} in the environment: start workers with resilient-run")
        if checkpoint_every < 0 or (checkpoint_every and checkpoint_dir is None):
            raise ValueError(f"checkpoint_every={checkpoint_every} needs checkpoint_dir and must be >= 0")
        if shard_dp and not checkpoint_every:
            raise ValueError("shard_dp=True needs checkpoint_dir and checkpoint_every: a lost dp shard exists "
                             "only in a checkpoint")
        self._shard_dp = shard_dp
        self.rank = int(env["RANK"])
        self.is_spare = env.get(ENV_SPARE) == "1"
        world = int(env["WORLD_SIZE"])
        self._state_arg = state
        self._state: Stateful | None = None if callable(state) and not hasattr(state, "state_dict") else state  # type: ignore[assignment]
        self._backend = backend
        self._vote_device = vote_device(backend, device)
        self._timeout = timeout or dist.default_pg_timeout
        self._comm_bytes = comm_bytes
        self._snapshot_on = snapshot and state is not None
        self._hook = hook
        self._max_per_step = max_recoveries_per_step
        self._ckpt_dir = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
        self._ckpt_every, self._ckpt_keep = checkpoint_every, checkpoint_keep
        self._ckpt: Any = None  # AsyncCheckpointer of this process's current rank
        self._ckpt_rank = -1
        store = connect(env[ENV_STORE], self._timeout)
        self._m = Membership(store, env[ENV_NAMESPACE])
        initial = Decision(0, list(range(world)), Mesh.for_world(world, tp, pp).as_dict(), "init", start_step)
        if self.is_spare:
            if self.rank < world:
                raise RuntimeError(f"a spare's id must be >= WORLD_SIZE {world}, got RANK={self.rank}")
            self._decision = self._m.decision(0) or initial
        else:
            self._decision = self._m.start(initial)
            if self._decision.mesh != initial.mesh or self._decision.resume_step != start_step:
                raise ValueError(f"rank {self.rank} starts with mesh {initial.mesh} at step {start_step}, but the "
                                 f"job started with mesh {self._decision.mesh} at step {self._decision.resume_step}")
        self.applied_epoch = 0
        self.committed = start_step - 1
        self.next_step = start_step
        self.recoveries: list[Timeline] = []
        self._ready = False
        self._pending: tuple[int, Callable[[], Any]] | None = None
        self._snapshot: tuple[int, dict[str, Any]] | None = None
        self._dirty = False
        self._step_started = 0.0
        self._timeline: Timeline | None = None
        self._tries: dict[int, int] = {}
        self._groups: Groups | None = None
        self._device_mesh: tuple[Groups | None, Any] | None = None  # (the groups it was built over, it)
        Evidence.__init__(self, self.rank, initial.members)  # _held: the groups of this process
        self._heard: dict[int, tuple[str, float]] = {}  # rank -> (source, arrival) of its first report
        self._idle = False  # a spare that was never placed: nothing to run
        self._detector = Detector(env[ENV_AGENT], self.rank, detector or DetectorConfig.from_env(), self._on_gone,
                                  self._on_store_lost, self._on_fenced)
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
            self._recover(RuntimeError(f"rank {self.rank} started after the job moved past epoch 0"), op_error=False)
            return
        try:
            self._build(self._decision, None)
        except dist.DistBackendError as e:
            self._recover(e, op_error=True)

    def _spare_wait(self) -> None:
        """A hot spare: wait warm until a decision places this spare, then join that epoch
        as a member (build its groups, receive the state); or leave when the job ends."""
        log.info("spare %d waiting warm", self.rank)
        d = wait_placed(self._m, self._detector, self.rank, self._check_fatal)
        if d is None:
            self._idle = True
            self._detector.stop()
            log.info("spare %d: the job ended without needing it", self.rank)
            return
        self._place(d)

    def _place(self, d: Decision) -> None:
        log.info("spare %d takes rank %d's place (epoch %d)", self.rank, d.slots[d.members.index(self.rank)]
                 if d.slots else -1, d.epoch)
        self.committed, self.next_step = -1, d.resume_step
        tl = Timeline(self.rank, "placed as a hot spare")
        tl.mark("failure", d.failed_at or now())
        tl.mark("detected", d.t)
        tl.mark("aborted", d.t)
        tl.mark("agreed")
        try:
            self._build(d, None)
            tl.mark("rebuilt")
            self._restore(d)
        except dist.DistBackendError as e:
            self._recover(e, op_error=True)
            return
        tl.mark("restored")
        self._emit("recovery.restored", epoch=d.epoch, step=self.next_step, members=d.members, place=self.place)
        tl.epoch, tl.resume_step, tl.members, tl.mode = d.epoch, d.resume_step, d.members, d.mode
        self._timeline = tl

    # -- what the training loop sees ------------------------------------------------------

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
            self._device_mesh = (self._groups, devicemesh.build(self._groups, self.mesh, self._vote_device.type))
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
        if self._ckpt is not None:
            self._ckpt.wait()
            self._ckpt.close()
            self._ckpt = None
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- steps and commits ----------------------------------------------------------------

    def _emit(self, event: str, **info: Any) -> None:
        if self._hook is not None:
            self._hook(event, info)

    def _begin(self, step: int) -> None:
        if self._ckpt is not None and not self._snapshot_on:
            self._ckpt.wait_snapshot()  # the forward may change buffers in place (batch-norm statistics)
        if self._snapshot_on:
            assert self._state is not None
            self._snapshot = (step, copy.deepcopy(self._state.state_dict()))
        if self._ckpt_every and step % self._ckpt_every == 0 and step > 0 and self.committed == step - 1:
            # The state after step-1's update. The snapshot is a private copy nobody mutates, so
            # the checkpoint's host copy runs while this step computes, without a wait.
            assert self._state is not None
            self._checkpointer().save(step - 1, self._snapshot[1] if self._snapshot else self._state.state_dict())
        self._dirty = True
        self._step_started = time.monotonic()
        self._detector.progress(step, "compute")
        self._emit("step.start", step=step)

    def _commit(self, step: int, apply: Callable[[], Any], grads: Sequence[torch.Tensor]) -> None:
        self._detector.progress(step, "sync")
        g = self.groups
        if grads:
            flat = _flatten_dense_tensors(list(grads))
            dist.all_reduce(flat, group=g.dp)
            flat /= self.mesh.dp
            for t, reduced in zip(grads, _unflatten_dense_tensors(flat, list(grads))):
                t.copy_(reduced)
        self._emit("step.synced", step=step)
        self._pending = (step, apply)
        commit_vote(g.world, self._vote_device)
        self._pending = None
        self.committed, self.next_step, self._dirty = step, step + 1, False
        if self._ckpt is not None and not self._snapshot_on:
            self._ckpt.wait_snapshot()  # the last checkpoint's host copy, before the update mutates
        apply()
        self._detector.step_done(time.monotonic() - self._step_started)
        if self._timeline is not None:
            self._timeline.mark("first_commit")
            with self._lock:
                for source, at in [self._heard[r] for r in self._timeline.lost if r in self._heard]:
                    self._timeline.via[source] = min(at, self._timeline.via.get(source, at))
            self._timeline.emit()
            self._detector.report(recovery_line(self._timeline))
            self.recoveries.append(self._timeline)
            self._timeline = None
        self._emit("step.committed", step=step)

    # -- failure evidence (detector threads) ----------------------------------------------

    def _note(self, g: Gone) -> None:
        self._heard.setdefault(g.rank, ("exit_report" if g.kind == "exit" else "suspicion", now()))

    def _abort(self, groups: list[dist.ProcessGroup], reason: str) -> None:
        for pg in groups:
            try:
                resilient_comm.abort(pg, reason)
            except (ValueError, RuntimeError):
                pass  # already destroyed by a shrink: nothing left to release

    def _register(self, pg: dist.ProcessGroup, members: list[int]) -> None:
        with self._lock:
            self._held.append(pg)
            doomed = [r for r in members if r in self._evidence]
        if doomed:
            self._abort([pg], f"rank(s) {doomed} gone while the group was being built")

    # -- recovery -------------------------------------------------------------------------

    def _recover(self, cause: BaseException, op_error: bool) -> None:
        """Recover from `cause`; `op_error`: it is a collective's own failure (evidence)."""
        try:
            self._check_fatal()
        except (Evicted, RecoveryError) as e:
            raise e from cause
        tries = self._tries[self.next_step] = self._tries.get(self.next_step, 0) + 1
        if tries > self._max_per_step:
            raise RecoveryError(f"{tries - 1} recoveries at step {self.next_step} without progress") from cause
        tl = Timeline(self.rank, f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}")
        failure, detected = self._failure_times()
        with self._lock:
            groups = list(self._held)
        tl.mark("failure", failure)
        tl.mark("detected", detected)
        if op_error:
            tl.via["op_error"] = now()
            tl.op_error = type(cause).__name__
        self._detector.progress(self.next_step, "recovery")
        self._abort(groups, f"recovering from {tl.cause}")
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
                raise Evicted(f"rank {self.rank} was evicted in epoch {decision.epoch} (its replica lost "
                              f"{decision.lost}); {len(decision.members)} ranks go on")
            try:
                self._build(decision, base)
                tl.mark("rebuilt")
                self._restore(decision)
                break
            except dist.DistBackendError as e:
                cause = e  # a failure during the rebuild or the state copy: on to the next epoch
                with self._lock:
                    groups = list(self._held)
                self._abort(groups, f"rebuild of epoch {decision.epoch} failed")
        if decision.failed_at:
            tl.mark("failure", min(tl.t["failure"], decision.failed_at))
        tl.mark("restored")
        self._emit("recovery.restored", epoch=decision.epoch, step=self.next_step, members=decision.members,
                   place=self.place)
        tl.epoch, tl.resume_step, tl.members, tl.mode = decision.epoch, decision.resume_step, decision.members, decision.mode
        self._timeline = tl

    def _agree(self, deadline: float) -> tuple[Decision, Decision]:
        """Join the current epoch and return (the previous epoch's decision, its decision)."""
        pending = self._pending[0] if self._pending else None
        current, base = catch_up(self._m, self.rank, self.applied_epoch, self._decision,
                                 JoinRecord(self.rank, self.applied_epoch, self._ready, self.committed, pending, now()),
                                 lambda rec: self._join_via_agent(rec, deadline))
        self._emit("recovery.joined", epoch=current)
        with self._lock:
            self._watching = set(base.members)

        return base, await_decision(self._m, self._detector, self.rank, current, base, deadline,
                                    self._timeout.total_seconds(),
                                    lambda joined, gone: self._decide(current, base, joined, gone), self._check_fatal)

    def _decide(self, epoch: int, base: Decision, joined: dict[int, JoinRecord], gone: dict[int, Gone]) -> Decision:
        if not self._shard_dp:
            return decide_epoch(self._m, epoch, base, joined, gone, self._latest_checkpoint, self.rank)
        assert self._ckpt_dir is not None
        past = [d for d in (self._m.decision(e) for e in range(base.epoch, -1, -1)) if d is not None]
        found = reshard.newest(self._ckpt_dir, past)
        d = decide_epoch(self._m, epoch, base, joined, gone, lambda _world: None if found is None else found[1],
                         self.rank, sharded=True)
        return dataclasses.replace(d, ckpt_epoch=found[0]) if found is not None and d.restore == "checkpoint" else d

    def _latest_checkpoint(self, world: int) -> int | None:
        if self._ckpt_dir is None:
            return None
        from resilient_comm.checkpoint import latest_complete

        return latest_complete(self._ckpt_dir, world)

    def _checkpointer(self) -> Any:
        """The async checkpointer writing this process's current rank."""
        from resilient_comm.checkpoint import AsyncCheckpointer

        me = self.place.rank
        assert self._ckpt_dir is not None
        directory = reshard.epoch_dir(self._ckpt_dir, self.applied_epoch) if self._shard_dp else self._ckpt_dir
        if self._ckpt is not None and (self._ckpt_rank != me or self._ckpt.directory != os.path.abspath(directory)):
            self._ckpt.wait()
            self._ckpt.close()
            self._ckpt = None
        if self._ckpt is None:
            self._ckpt, self._ckpt_rank = AsyncCheckpointer(directory, me, keep=self._ckpt_keep), me
        return self._ckpt

    def _build(self, d: Decision, base: Decision | None) -> None:
        """Make `d`'s world and dp/tp/pp groups and verify them with one collective each."""
        with self._lock:
            old, self._held, self._watching = self._held, [], set(d.members)
        self.applied_epoch, self._decision, self._ready = d.epoch, d, False
        me, mesh = d.members.index(self.rank), d.mesh_obj()
        self._resolve_state()
        # Watch the new members from the start of the build: a spare that froze while it waited
        # (it heartbeats, but nobody watched it) is suspected by silence instead of holding the
        # build until the op timeout.
        self._detector.set_members(d.members, self._comm_bytes)
        if d.mode == "shrink":
            assert base is not None
            for pg in [g for g in old if g is not c10d._get_default_group()]:
                dist.destroy_process_group(pg)  # shrinking the world would (noisily) do it
            world = self._shrink_world([i for i, r in enumerate(base.members) if r not in d.members], d.epoch)
        else:
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group(self._backend, store=self._m.world_store(d.epoch), rank=me,
                                    world_size=len(d.members), timeout=self._timeout)
            world = c10d._get_default_group()
        self._register(world, d.members)
        sub: dict[str, dist.ProcessGroup] = {}
        for dim in DIMS:
            if getattr(mesh, dim) == mesh.size:
                sub[dim] = world
            else:
                group = resilient_comm.split(mesh.group_index(me, dim), key=me, group=world)
                assert group is not None  # colors are never negative here
                self._register(group, d.members)
                sub[dim] = group
        check = torch.tensor([float(d.epoch), float(d.resume_step)], dtype=torch.float64)
        dist.all_reduce(check, op=dist.ReduceOp.MAX, group=world)
        if check.tolist() != [float(d.epoch), float(d.resume_step)]:
            raise RecoveryError(f"members disagree on epoch/resume step: {check.tolist()}")
        for dim in DIMS:
            if sub[dim] is not world:
                one = torch.ones(1)
                dist.all_reduce(one, group=sub[dim])
        self._groups = Groups(world=world, dp=sub["dp"], tp=sub["tp"], pp=sub["pp"])
        on_mesh = getattr(self._state, "on_mesh", None)
        if on_mesh is not None:
            on_mesh(self.device_mesh)  # a model over the mesh (FSDP2) is re-created on the new one
        self._ready = True
        self._detector.set_members(d.members, self._comm_bytes)
        self._forget(d.members)

    def _shrink_world(self, exclude: list[int], epoch: int) -> dist.ProcessGroup:
        """The world without `exclude` (ranks of the current world), as the new default group.

        What ``resilient_comm.shrink`` does, except that the new group is registered on this
        process's store connection: ``torch.distributed.shrink_group`` clones the store, a
        new TCP connection whose set-up in c10d includes a reverse-DNS lookup that can stall
        for the resolver's timeout (5 s) -- see docs/elastic.md.
        """
        old = c10d._get_default_group()
        backend = _backend(old).shrink(exclude, c10d.SHRINK_ABORT, None)
        size = old.size() - len(exclude)
        return _adopt(backend, store=self._m.world_store(epoch), name=f"elastic-e{epoch}",
                      global_ranks=list(range(size)), make_default=True, replaces=old)

    def _restore(self, d: Decision) -> None:
        """Bring this member to the decision's committed step: roll forward or back, load the
        agreed checkpoint, or receive the state from a donor (and send it, as a donor)."""
        top = d.resume_step - 1
        if self._ckpt is not None:
            self._ckpt.wait_snapshot()  # its host copy must not see the state change under it
        receivers = {j: donor for j, donor in d.sources}
        if d.restore == "checkpoint" and self._shard_dp:
            assert self._ckpt_dir is not None and self._state is not None
            source = self._m.decision(d.ckpt_epoch)
            if source is None:
                raise RecoveryError(f"epoch {d.epoch} restores a checkpoint of epoch {d.ckpt_epoch}, which has no decision")
            self._state.load_state_dict(reshard.load(self._ckpt_dir, source, d.ckpt_step, self.place.coords, self.mesh))
            self.committed = d.ckpt_step
            self._emit("recovery.loaded", epoch=d.epoch, step=d.ckpt_step, resharded_from=source.mesh)
        elif d.restore == "checkpoint":
            from resilient_comm.checkpoint import AsyncCheckpointer

            assert self._ckpt_dir is not None and self._state is not None
            reader = self._ckpt if self._ckpt is not None and self._ckpt_rank == self.place.rank else \
                AsyncCheckpointer(self._ckpt_dir, self.place.rank, keep=self._ckpt_keep)
            step, sd = reader.load(d.ckpt_step)
            if reader is not self._ckpt:
                reader.close()
            self._state.load_state_dict(sd)
            self.committed = step
            self._emit("recovery.loaded", epoch=d.epoch, step=step)
        elif self.rank in receivers:
            pass  # its state comes from the donor below
        elif self.committed == top - 1 and self._pending and self._pending[0] == top:
            self._pending[1]()  # roll forward: apply the update every member voted for
            self.committed = top
            self._emit("step.committed", step=top, rolled_forward=True)
        elif self.committed != top:
            raise RecoveryError(f"rank {self.rank} committed {self.committed}, cannot resume at {d.resume_step}")
        elif self._dirty and self._snapshot is not None:
            assert self._state is not None and self._snapshot[0] == top + 1
            self._state.load_state_dict(self._snapshot[1])  # roll back the uncommitted step
        if d.sources:
            self._copy_state(d)
        self._pending, self._dirty, self.next_step = None, False, d.resume_step

    def _copy_state(self, d: Decision) -> None:
        """Donors send their (committed) state to the members in `d.sources`, over the world."""
        world = self.groups.world
        for joiner, donor in d.sources:
            if self.rank == donor:
                assert self._state is not None
                t0 = time.monotonic()
                n = send_state(self._state.state_dict(), d.members.index(joiner), world)
                log.info("rank %d sent its state (%.1f MB) to %d in %.0f ms", self.rank, n / 1e6, joiner,
                         1e3 * (time.monotonic() - t0))
            elif self.rank == joiner:
                if self._state is None:
                    raise RecoveryError(f"spare {self.rank} has no state provider to load its state into")
                sd = recv_state(d.members.index(donor), world)
                self._state.load_state_dict(sd)
                self.committed, self._snapshot = d.resume_step - 1, None
                self._emit("recovery.synced", epoch=d.epoch, step=self.committed, donor=donor)

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


__all__ = ["ENV_NAMESPACE", "ENV_SPARE", "ENV_STORE", "EXIT_EVICTED", "Controller", "Evicted", "Groups", "Place",
           "RecoveryError", "Stateful", "Step", "TrainState"]
