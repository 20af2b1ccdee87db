"""State sharded over data parallel (FSDP2): checkpoints per epoch and re-sharding on load.
Runs in a worker (`worker.checkpoints`, for ``Controller(shard_dp=True)``).

With ``Controller(shard_dp=True)`` a rank's state is its *local shards* (``DTensor.to_local()``
of FSDP2's parameters and optimizer state), and a dp rank's shard exists on that rank only: a
lost replica's shards cannot come from a peer, and a spare in a lost place cannot take a donor's
(another replica holds another shard). So every recovery restores from a checkpoint, and the
checkpoint may have been written by a mesh of another dp size.

Layout: the checkpoints written while epoch ``e``'s groups are current go to
``{checkpoint_dir}/epoch-{e}/`` (`epoch_dir`), one file per rank of that epoch's world, so
each directory holds one mesh's shards; which mesh is in epoch ``e``'s decision. `newest`
finds the newest step complete for its own mesh, from the newest epoch back. `load` gives a
member of a new mesh its shards: for its (pp, tp) position, the files of every old dp index
in order, each tensor of one or more dimensions concatenated along dim 0 (FSDP2 shards dim 0
in contiguous chunks, the last ones shorter or empty) and cut again into the new dp size's
chunks (`torch.chunk`, as FSDP2 does); a 0-dimensional tensor and anything that is not a
tensor (an optimizer's step count, hyperparameters) from the first old dp index.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from resilient_comm.checkpoint import CheckpointError, latest_complete, rank_file, verify
from resilient_comm.elastic.model.policy import Mesh
from resilient_comm.elastic.model.records import Decision


def epoch_dir(checkpoint_dir: str, epoch: int) -> str:
    return os.path.join(checkpoint_dir, f"epoch-{epoch}")


def newest(checkpoint_dir: str, decisions: Iterable[Decision]) -> tuple[int, int] | None:
    """(epoch, step) of the newest checkpoint complete for the mesh that wrote it, looking at
    the epochs of `decisions` (newest first); None if there is none."""
    for d in decisions:
        if d.mode == "fail" or not d.members:
            continue
        step = latest_complete(epoch_dir(checkpoint_dir, d.epoch), d.mesh_obj().size)
        if step is not None:
            return d.epoch, step
    return None


def _rank(mesh: Mesh, dp: int, pp: int, tp: int) -> int:
    return (dp * mesh.pp + pp) * mesh.tp + tp


def _chunk(t: torch.Tensor, parts: int, i: int) -> torch.Tensor:
    chunks = torch.chunk(t, parts, dim=0)
    return chunks[i].clone() if i < len(chunks) else t.new_empty((0, *t.shape[1:]))


def _merge(trees: list[Any], parts: int, i: int, where: str) -> Any:
    first = trees[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return first
        if any(not isinstance(t, torch.Tensor) or t.shape[1:] != first.shape[1:] for t in trees):
            raise CheckpointError(
                f"{where}: the old dp shards do not line up: "
                f"{[tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in trees]}"
            )
        return _chunk(torch.cat(trees, dim=0), parts, i)
    if isinstance(first, dict):
        if any(not isinstance(t, dict) or t.keys() != first.keys() for t in trees):
            raise CheckpointError(f"{where}: the old dp shards hold different keys")
        return {k: _merge([t[k] for t in trees], parts, i, f"{where}.{k}") for k in first}
    if isinstance(first, (list, tuple)):
        if any(not isinstance(t, type(first)) or len(t) != len(first) for t in trees):
            raise CheckpointError(f"{where}: the old dp shards hold different sequences")
        merged = [_merge([t[j] for t in trees], parts, i, f"{where}[{j}]") for j in range(len(first))]
        return type(first)(merged)
    return first


def load(
    checkpoint_dir: str, source: Decision, step: int, coords: dict[str, int], mesh: Mesh
) -> dict[str, Any]:
    """The state of the member at `coords` of `mesh`, from the checkpoint at `step` written by
    `source`'s mesh (which must have the same tp and pp)."""
    old = source.mesh_obj()
    if (old.tp, old.pp) != (mesh.tp, mesh.pp):
        raise CheckpointError(
            f"cannot re-shard a checkpoint of mesh {old} onto {mesh}: tp and pp must be kept"
        )
    directory = epoch_dir(checkpoint_dir, source.epoch)
    trees = []
    for dp in range(old.dp):
        r = _rank(old, dp, coords["pp"], coords["tp"])
        why = verify(directory, step, r)
        if why is not None:
            raise CheckpointError(f"re-sharding step {step} of epoch {source.epoch}: rank {r}: {why}")
        trees.append(torch.load(rank_file(directory, step, r), map_location="cpu", weights_only=True))
    return _merge(trees, mesh.dp, coords["dp"], f"step {step}")


__all__ = ["epoch_dir", "load", "newest"]
