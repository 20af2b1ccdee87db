"""In-process restart for scripts not written for the controller. Runs in each worker of
``resilient-run --in-process``, or of a script whose function is ``@restartable``.

    from resilient_comm.elastic import restartable

    @restartable
    def main():
        dist.init_process_group(backend="resilient_tcp")   # or resilient_nccl
        step = load_checkpoint()
        ...

or, for a script left as it is, ``resilient-run --in-process train.py`` (which runs the script
as ``__main__`` inside `restartable`, through `inprocess_main`, re-executing its top level on
every restart; the modules it imports stay imported).

Under ``resilient-run`` each worker runs ``fn``. When a member fails (its exit, a silent
heartbeat, an op error), every survivor's ``fn`` is unwound: the groups the script made are
aborted, so its next (or current) collective raises, and the exception leaves ``fn``. Then, in
the same process: every process group is destroyed, the survivors agree on the new membership
through the job's store (`rejoin`: the dead leave, or a hot spare of ``--spares`` takes a
dead rank's place), and ``fn`` is called again with ``RANK``/``WORLD_SIZE`` set for the new
world. The script re-runs its own set-up, rendezvous afresh (``env://`` on the launcher's
store, under a key prefix of its own per incarnation) and loads its own checkpoint. No process
restart, no re-import, no CUDA context or NCCL library load again.

What counts as a fault: a ``torch.distributed.DistError`` (``CommError``, a store or network
error) raised out of ``fn``, or any exception once failure evidence on a member is in. Any
other exception is the script's own and propagates (the process fails; the others recover
without it). After ``max_restarts`` restarts without the job finishing, `RecoveryError`. An
evicted process (its node fenced, or reported gone while it lived) exits with `EXIT_EVICTED`.
When ``fn`` returns, its process waits until every member's ``fn`` returned, and is re-entered
too if a late failure makes the others restart (they need it in their collectives).

The script's collectives must be on a resilient_comm backend (``resilient_tcp`` on the CPU,
``resilient_nccl``): gloo cannot be aborted (a survivor blocked on a stopped peer waits for
gloo's timeout) and its bootstrap keys do not follow the incarnation prefix. Outside
``resilient-run`` a restartable function runs once, as a plain call.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch.distributed as dist

import resilient_comm
from resilient_comm.elastic.membership.protocol import Membership, connect
from resilient_comm.elastic.model.bounds import DetectorConfig
from resilient_comm.elastic.model.channel import recovery_line
from resilient_comm.elastic.model.env import ENV_AGENT, ENV_NAMESPACE, ENV_SPARE, ENV_STORE, EXIT_EVICTED
from resilient_comm.elastic.model.policy import Mesh
from resilient_comm.elastic.model.records import Decision, JoinRecord, now
from resilient_comm.elastic.model.timeline import Timeline
from resilient_comm.elastic.worker.detector import Detector
from resilient_comm.elastic.worker.errors import Evicted, RecoveryError
from resilient_comm.elastic.worker.evidence import Evidence
from resilient_comm.elastic.worker.rejoin import await_decision, catch_up, decide_epoch, wait_placed

log = logging.getLogger("resilient_comm.elastic")
R = TypeVar("R")


class Restarter(Evidence):
    """One per worker process: runs ``fn`` and re-enters it after each recovery."""

    def __init__(self, max_restarts: int = 10, timeout: datetime.timedelta | None = None) -> None:
        env = os.environ
        self.rank = int(env["RANK"])
        self.is_spare = env.get(ENV_SPARE) == "1"
        world = int(env["WORLD_SIZE"])
        self.max_restarts = max_restarts
        self._timeout = timeout or dist.default_pg_timeout
        self._m = Membership(connect(env[ENV_STORE], self._timeout), env[ENV_NAMESPACE])
        Evidence.__init__(self, self.rank, [])  # _held: the backends the script made in this incarnation
        self.applied_epoch = 0
        self.restarts = 0
        self._decision = Decision(0, list(range(world)), Mesh.for_world(world).as_dict(), "init", 0)
        self._detector = Detector(
            env[ENV_AGENT],
            self.rank,
            DetectorConfig.from_env(),
            self._on_gone,
            self._on_store_lost,
            self._on_fenced,
        )

    # -- evidence (detector threads) and the script's groups ------------------------------

    def _on_create(self, backend: Any) -> None:
        self._hold(backend, self._watching)

    def _abort(self, backends: list[Any], reason: str) -> None:
        for b in backends:
            b.abort_with_reason(reason)  # returns at once; any number of times

    # -- the loop -------------------------------------------------------------------------

    def run(self, fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any]) -> R | None:
        """``fn(*args, **kwargs)`` until it returns on every member; None on a spare never placed."""
        self._detector.start()
        resilient_comm.BackendCreation.hooks.append(self._on_create)
        try:
            if self.is_spare:
                if self.rank < len(self._decision.members):
                    raise RuntimeError(
                        f"a spare's id must be >= WORLD_SIZE {len(self._decision.members)}, "
                        f"got RANK={self.rank}"
                    )
                self._decision = self._m.decision(0) or self._decision
                self._detector.progress(-1, "spare")
                placed = wait_placed(self._m, self._detector, self.rank, self._check_fatal)
                if placed is None:
                    return None
                self._decision, self.applied_epoch = placed, placed.epoch
            else:
                self._decision = self._m.start(self._decision)
            return self._loop(fn, args, kwargs)
        finally:
            resilient_comm.BackendCreation.hooks.remove(self._on_create)
            resilient_comm.BackendCreation.prefix = ""
            self._detector.stop()

    def _loop(self, fn: Callable[..., R], args: tuple[Any, ...], kwargs: dict[str, Any]) -> R:
        tl: Timeline | None = None
        if self._m.epoch() > self.applied_epoch:  # started after the job moved on: catch up first
            tl = self._recover(RuntimeError(f"rank {self.rank} started after epoch {self.applied_epoch}"))
        while True:
            self._enter(self._decision, tl)
            try:
                result = fn(*args, **kwargs)
            except Exception as e:
                with self._lock:
                    known = bool(self._evidence) or bool(self._fenced or self._fatal)
                if not (isinstance(e, dist.DistError) or known):
                    raise
                cause: BaseException = e
            else:
                if self._finish():
                    return result
                cause = RuntimeError("a member is recovering after this one finished")
            self.restarts += 1
            if self.restarts > self.max_restarts:
                raise RecoveryError(
                    f"rank {self.rank}: {self.max_restarts} in-process restarts and the job has not finished"
                ) from cause
            tl = self._recover(cause)

    def _enter(self, d: Decision, tl: Timeline | None) -> None:
        """Set the environment of `d`'s world and call the script with it."""
        me = d.members.index(self.rank)
        os.environ.update(
            {
                "RANK": str(me),
                "WORLD_SIZE": str(len(d.members)),
                "ROLE_RANK": str(me),
                "ROLE_WORLD_SIZE": str(len(d.members)),
            }
        )
        resilient_comm.BackendCreation.prefix = f"rc-incarnation/{d.epoch}/"
        reset_framework_state()
        with self._lock:
            self._watching = set(d.members)
            self._take_held()
        self._detector.set_members(d.members, 0)
        self._detector.progress(d.epoch, "run")
        if tl is not None:
            tl.mark("restored")
            tl.epoch, tl.members, tl.mode = d.epoch, d.members, "restart"
            tl.emit()
            self._detector.report(recovery_line(tl))
            log.warning(
                "rank %d: in-process restart %d: epoch %d, world %d (was rank %d of the launch), %.0f ms "
                "after the failure",
                me,
                self.restarts,
                d.epoch,
                len(d.members),
                self.rank,
                1e3 * (tl.t["restored"] - tl.t["failure"]),
            )

    def _teardown(self, reason: str) -> None:
        with self._lock:
            backends = list(self._held)
        self._abort_held(backends, reason, again=True)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()  # every group of the script's incarnation
            except Exception as e:
                log.warning("rank %d: destroying the process groups after a failure: %s", self.rank, e)
        with self._lock:
            self._take_held()

    def _recover(self, cause: BaseException) -> Timeline:
        """Unwound from `cause`: tear down, agree on the next membership; the timeline so far."""
        self._check_fatal()
        tl = Timeline(
            self.rank, f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        )
        failure, detected = self._failure_times()
        tl.mark("failure", failure)
        tl.mark("detected", detected)
        if isinstance(cause, dist.DistBackendError) and not isinstance(
            cause, resilient_comm.CommAbortedError
        ):
            tl.via["op_error"], tl.op_error = now(), type(cause).__name__
        self._detector.progress(self.applied_epoch, "recovery")
        self._teardown(f"recovering from {tl.cause}")
        tl.mark("aborted")
        deadline = time.monotonic() + self._timeout.total_seconds()
        try:
            current, base = catch_up(
                self._m,
                self.rank,
                self.applied_epoch,
                self._decision,
                JoinRecord(self.rank, self.applied_epoch, False, -1, None, now()),
                lambda rec: self._join_via_agent(rec, deadline),
            )
            with self._lock:
                self._watching = set(base.members)
            d = await_decision(
                self._m,
                self._detector,
                self.rank,
                current,
                base,
                deadline,
                self._timeout.total_seconds(),
                lambda joined, gone: decide_epoch(
                    self._m, current, base, joined, gone, lambda _world: None, self.rank
                ),
                self._check_fatal,
            )
        except (dist.DistStoreError, dist.DistNetworkError) as e:
            self._store_failed(e)
        tl.attempts, tl.lost = current - self.applied_epoch, d.lost
        tl.mark("agreed", max(now(), tl.t["aborted"]))
        if d.mode == "fail":
            raise RecoveryError(f"epoch {d.epoch}: {d.note}") from cause
        if self.rank not in d.members:
            raise Evicted(
                f"rank {self.rank} was evicted in epoch {d.epoch} (lost {d.lost}); "
                f"{len(d.members)} ranks go on"
            )
        self._decision, self.applied_epoch = d, d.epoch
        self._forget(d.members)
        if d.failed_at:
            tl.mark("failure", min(tl.t["failure"], d.failed_at))
        return tl

    def _finish(self) -> bool:
        """``fn`` returned: wait until it returned on every member of this epoch (True), or a
        recovery started after it (False: join it and run again)."""
        self._detector.progress(self.applied_epoch, "done")
        # Who returned, per epoch (not the membership's own done records: the decision reads
        # those as committed steps).
        finished = Membership(self._m.store, self._m.key("restartable", self.applied_epoch))
        finished.set_done(self.rank, 0)
        return self._wait_all_done(finished.done)


def reset_framework_state() -> None:
    """Forget the process-wide state that training frameworks keep of the last incarnation's
    world, before the script runs again: Accelerate's ``PartialState``, ``AcceleratorState``
    and ``GradientState`` (singletons holding the old world size, rank and process group; a
    new ``Accelerator`` would otherwise reuse them). Only where the script imported them:
    nothing is imported here. (Lightning keeps no such state: `integrations.lightning`.)"""
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()


@overload
def restartable(fn: Callable[..., R]) -> Callable[..., R]: ...
@overload
def restartable(
    *, max_restarts: int = 10, timeout: datetime.timedelta | None = None
) -> Callable[[Callable[..., R]], Callable[..., R]]: ...
def restartable(
    fn: Callable[..., R] | None = None, *, max_restarts: int = 10, timeout: datetime.timedelta | None = None
) -> Any:
    """Make `fn` restart in-process after a failure (module docstring). ``@restartable`` or
    ``@restartable(max_restarts=N, timeout=...)``; `timeout` bounds each agreement (default
    torch's process-group timeout). An evicted process exits with status `EXIT_EVICTED`."""
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")

    def wrap(f: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(f)
        def run(*args: Any, **kwargs: Any) -> R:
            if ENV_AGENT not in os.environ:
                log.warning(
                    "restartable: not under resilient-run (no %s): %s runs once, without in-process restart",
                    ENV_AGENT,
                    getattr(f, "__qualname__", f),
                )
                return f(*args, **kwargs)
            try:
                return Restarter(max_restarts, timeout).run(f, args, kwargs)  # type: ignore[return-value]
            except Evicted as e:
                log.warning("%s: exiting", e)
                raise SystemExit(EXIT_EVICTED) from e

        return run

    return wrap(fn) if fn is not None else wrap


__all__ = ["Restarter", "reset_framework_state", "restartable"]
