"""A worker's checkpoints under the controller (``checkpoint_dir``, ``checkpoint_every``): the
asynchronous writer of this process's current rank, the newest checkpoint complete for a
mesh, and the loads a decision asks for. Runs in a worker, on its training thread
(`worker.controller`); the files are `resilient_comm.checkpoint`'s, and with a state sharded
over dp (``shard_dp``) one directory per epoch, re-sharded on load (`state.reshard`).
"""

from __future__ import annotations

import os
from typing import Any

from resilient_comm.elastic.membership.protocol import Membership
from resilient_comm.elastic.model.policy import Mesh
from resilient_comm.elastic.model.records import Decision
from resilient_comm.elastic.state import reshard
from resilient_comm.elastic.worker.errors import RecoveryError


class Checkpoints:
    """Where the state is saved every `every` committed steps (0: never), keeping `keep`.
    `writer` is the AsyncCheckpointer of the rank last written, or None."""

    def __init__(
        self, directory: str | os.PathLike[str] | None, every: int = 0, keep: int = 3, shard_dp: bool = False
    ) -> None:
        if every < 0 or (every and directory is None):
            raise ValueError(f"checkpoint_every={every} needs checkpoint_dir and must be >= 0")
        if shard_dp and not every:
            raise ValueError(
                "shard_dp=True needs checkpoint_dir and checkpoint_every: a lost dp shard exists "
                "only in a checkpoint"
            )
        self.directory = os.fspath(directory) if directory is not None else None
        self.every, self.keep, self.shard_dp = every, keep, shard_dp
        self.writer: Any = None  # AsyncCheckpointer of this process's current rank
        self._rank = -1

    def due(self, step: int, committed: int) -> bool:
        """Whether the state before `step` (after step-1's update) is to be saved now."""
        return bool(self.every) and step % self.every == 0 and step > 0 and committed == step - 1

    def save(self, step: int, state_dict: dict[str, Any], rank: int, epoch: int) -> None:
        """Save `state_dict` as `step`'s, asynchronously, as rank `rank` of epoch `epoch`."""
        self._writer(rank, epoch).save(step, state_dict)

    def wait_snapshot(self) -> None:
        """Until the last save's host copy is done (the state may change after it)."""
        if self.writer is not None:
            self.writer.wait_snapshot()

    def close(self) -> None:
        """Finish the last save."""
        if self.writer is not None:
            self.writer.wait()
            self.writer.close()
            self.writer = None

    def _writer(self, rank: int, epoch: int) -> Any:
        """The async checkpointer writing rank `rank` (of epoch `epoch`'s mesh, when sharded)."""
        from resilient_comm.checkpoint import AsyncCheckpointer

        assert self.directory is not None
        directory = reshard.epoch_dir(self.directory, epoch) if self.shard_dp else self.directory
        if self.writer is not None and (
            self._rank != rank or self.writer.directory != os.path.abspath(directory)
        ):
            self.close()
        if self.writer is None:
            self.writer, self._rank = AsyncCheckpointer(directory, rank, keep=self.keep), rank
        return self.writer

    def latest(self, world: int) -> int | None:
        """The newest step checkpointed for every rank of a world of `world` (None: none)."""
        if self.directory is None:
            return None
        from resilient_comm.checkpoint import latest_complete

        return latest_complete(self.directory, world)

    def newest_sharded(self, past: list[Decision]) -> tuple[int, int] | None:
        """(Sharded.) (epoch, step) of the newest checkpoint complete for its own epoch's mesh,
        from the decisions `past` (newest first); None: none."""
        assert self.directory is not None
        return reshard.newest(self.directory, past)

    def load(
        self, d: Decision, m: Membership, rank: int, coords: dict[str, int], mesh: Mesh
    ) -> tuple[int, dict[str, Any], dict[str, Any]]:
        """What `d` (restore "checkpoint") gives this member, world rank `rank` at `coords` of
        `mesh`: (the step, the state dict, what to add to the "recovery.loaded" event)."""
        assert self.directory is not None
        if self.shard_dp:
            source = m.decision(d.ckpt_epoch)
            if source is None:
                raise RecoveryError(
                    f"epoch {d.epoch} restores a checkpoint of epoch {d.ckpt_epoch}, which has no decision"
                )
            return (
                d.ckpt_step,
                reshard.load(self.directory, source, d.ckpt_step, coords, mesh),
                {"resharded_from": source.mesh},
            )
        from resilient_comm.checkpoint import AsyncCheckpointer

        reader = (
            self.writer
            if self.writer is not None and self._rank == rank
            else AsyncCheckpointer(self.directory, rank, keep=self.keep)
        )
        step, sd = reader.load(d.ckpt_step)
        if reader is not self.writer:
            reader.close()
        return step, sd, {}


__all__ = ["Checkpoints"]
