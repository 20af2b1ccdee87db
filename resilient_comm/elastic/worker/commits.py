"""One member's side of the commit protocol (`worker.controller`, "Commit protocol"): its
committed step, the update it voted for and has not applied, the snapshot of the step in
flight, and bringing all three to a decision's committed step after a recovery. Runs in a
worker, on its training thread.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from resilient_comm.elastic.membership.protocol import Membership
from resilient_comm.elastic.model.records import Decision
from resilient_comm.elastic.state.provider import Place, Stateful
from resilient_comm.elastic.state.transfer import recv_state, send_state
from resilient_comm.elastic.worker.checkpoints import Checkpoints
from resilient_comm.elastic.worker.commit_vote import commit_vote
from resilient_comm.elastic.worker.errors import RecoveryError

log = logging.getLogger("resilient_comm.elastic")


class Commits:
    """What a member holds of the commit protocol. `committed`: the last step whose update it
    applied (after a vote of every member); `next_step`: the step it runs next; `pending`:
    (step, update) it voted for and has not applied (a member one behind the others holds
    it); `snapshot`: the state at the start of the step in flight (with `snapshot_on`), and
    `dirty`: that step may have changed the state. `emit(event, **info)` is the controller's
    hook; `ckpts` its checkpoints (a save is due at some steps' start)."""

    def __init__(
        self, start_step: int, snapshot_on: bool, ckpts: Checkpoints, emit: Callable[..., None]
    ) -> None:
        self.committed = start_step - 1
        self.next_step = start_step
        self.pending: tuple[int, Callable[[], Any]] | None = None
        self.snapshot: tuple[int, dict[str, Any]] | None = None
        self.dirty = False
        self.kept = False  # the last restore kept the step in flight's computed state
        self.grads_intact = True  # the step in flight's gradients are as its backward left them
        self.snapshot_on = snapshot_on
        self.ckpts = ckpts
        self._emit = emit

    def begin(self, step: int, state: Stateful | None, rank: Callable[[], int], epoch: int) -> None:
        """Step `step` starts: snapshot the state (what a roll back reloads), and save the state
        after step-1's update when a checkpoint is due (as world rank `rank()` of `epoch`)."""
        if not self.snapshot_on:
            self.ckpts.wait_snapshot()  # the forward may change buffers in place (batch-norm statistics)
        if self.snapshot_on:
            assert state is not None
            self.snapshot = (step, copy.deepcopy(state.state_dict()))
        if self.ckpts.due(step, self.committed):
            # The state after step-1's update. The snapshot is a private copy nobody mutates, so
            # the checkpoint's host copy runs while this step computes, without a wait.
            assert state is not None
            self.ckpts.save(
                step - 1, self.snapshot[1] if self.snapshot else state.state_dict(), rank(), epoch
            )
        self.dirty = True

    def commit(
        self,
        step: int,
        apply: Callable[[], Any],
        grads: Sequence[torch.Tensor],
        dp: dist.ProcessGroup,
        dp_size: int,
        world: dist.ProcessGroup,
        device: torch.device,
    ) -> None:
        """Average `grads` over `dp` (of `dp_size` members), vote on `world` (on `device`),
        then apply the update: only once every member voted is the step committed. The
        all_reduce runs on a flat copy: until the average is copied back, a failure leaves
        `grads` as they were (`grads_intact`)."""
        self.grads_intact = True
        if grads:
            flat = _flatten_dense_tensors(list(grads))
            dist.all_reduce(flat, group=dp)
            flat /= dp_size
            self.grads_intact = False
            for t, reduced in zip(grads, _unflatten_dense_tensors(flat, list(grads))):
                t.copy_(reduced)
        self._emit("step.synced", step=step)
        self.pending = (step, apply)
        commit_vote(world, device)
        self.pending = None
        self.committed, self.next_step, self.dirty = step, step + 1, False
        if not self.snapshot_on:
            self.ckpts.wait_snapshot()  # the last checkpoint's host copy, before the update mutates
        apply()

    def restore(
        self,
        d: Decision,
        rank: int,
        state: Stateful | None,
        m: Membership,
        place: Callable[[], Place],
        world: Callable[[], dist.ProcessGroup],
        keep: int | None = None,
    ) -> None:
        """Bring launch rank `rank` to `d`'s committed step: roll forward or back, load the
        agreed checkpoint (as `place()`), or receive the state from a donor (and send it, as a
        donor) over `world()`. `keep`: the step in flight, computed and not yet synced, whose
        state stays as it is when `d` resumes at it and moves no state (`kept`)."""
        top = d.resume_step - 1
        self.kept = (
            keep == d.resume_step
            and d.restore != "checkpoint"
            and not d.sources
            and self.committed == top
            and self.pending is None
        )
        if self.kept:
            self.next_step = d.resume_step  # dirty: the step is still in flight
            return
        self.ckpts.wait_snapshot()  # its host copy must not see the state change under it
        receivers = {j: donor for j, donor in d.sources}
        if d.restore == "checkpoint":
            assert state is not None
            p = place()
            step, sd, how = self.ckpts.load(d, m, p.rank, p.coords, d.mesh_obj())
            state.load_state_dict(sd)
            self.committed = step
            self._emit("recovery.loaded", epoch=d.epoch, step=step, **how)
        elif rank in receivers:
            pass  # its state comes from the donor below
        elif self.committed == top - 1 and self.pending and self.pending[0] == top:
            self.pending[1]()  # roll forward: apply the update every member voted for
            self.committed = top
            self._emit("step.committed", step=top, rolled_forward=True)
        elif self.committed != top:
            raise RecoveryError(f"rank {rank} committed {self.committed}, cannot resume at {d.resume_step}")
        elif self.dirty and self.snapshot is not None:
            assert state is not None and self.snapshot[0] == top + 1
            state.load_state_dict(self.snapshot[1])  # roll back the uncommitted step
        if d.sources:
            self._copy_state(d, rank, state, world())
        self.pending, self.dirty, self.next_step = None, False, d.resume_step

    def rewind(self, step: int) -> None:
        """The state was put back to committed step `step` (a replica comparison found a
        mismatch): the steps after it run again."""
        self.committed, self.next_step = step, step + 1
        self.pending, self.snapshot, self.dirty = None, None, False

    def _copy_state(self, d: Decision, rank: int, state: Stateful | None, world: dist.ProcessGroup) -> None:
        """Donors send their (committed) state to the members in `d.sources`, over the world."""
        for joiner, donor in d.sources:
            if rank == donor:
                assert state is not None
                t0 = time.monotonic()
                n = send_state(state.state_dict(), d.members.index(joiner), world)
                log.info(
                    "rank %d sent its state (%.1f MB) to %d in %.0f ms",
                    rank,
                    n / 1e6,
                    joiner,
                    1e3 * (time.monotonic() - t0),
                )
            elif rank == joiner:
                if state is None:
                    raise RecoveryError(f"spare {rank} has no state provider to load its state into")
                sd = recv_state(d.members.index(donor), world)
                state.load_state_dict(sd)
                self.committed, self.snapshot = d.resume_step - 1, None
                self._emit("recovery.synced", epoch=d.epoch, step=self.committed, donor=donor)


__all__ = ["Commits"]
