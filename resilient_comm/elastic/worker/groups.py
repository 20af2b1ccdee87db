"""The controller's process groups: a decision's world and its dp/tp/pp groups, each verified
by one collective. Runs in a worker, on its training thread (`worker.controller`).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import resilient_comm
from resilient_comm.api import resilient_backend
from resilient_comm.elastic.membership.protocol import Membership
from resilient_comm.elastic.model.policy import DIMS
from resilient_comm.elastic.model.records import Decision
from resilient_comm.elastic.worker.errors import RecoveryError
from resilient_comm.groups import adopt


@dataclass(frozen=True)
class Groups:
    """The current process groups. A dimension spanning the whole world is the world group."""

    world: dist.ProcessGroup
    dp: dist.ProcessGroup
    tp: dist.ProcessGroup
    pp: dist.ProcessGroup


def build_groups(
    d: Decision,
    base: Decision | None,
    me: int,
    old: list[dist.ProcessGroup],
    backend: str,
    m: Membership,
    timeout: datetime.timedelta,
    register: Callable[[dist.ProcessGroup], None],
) -> Groups:
    """`d`'s world and dp/tp/pp groups, this process at world rank `me`, each verified by one
    collective. A shrink makes the world from the previous one (`base`'s; the other groups
    this process held, `old`, are destroyed first); else a fresh world meets on the store.
    `register(group)` sees each group as soon as it exists: evidence that lands meanwhile
    aborts it, so that a build with a dead member fails at once."""
    mesh = d.mesh_obj()
    if d.mode == "shrink":
        assert base is not None
        for pg in [g for g in old if g is not c10d._get_default_group()]:
            dist.destroy_process_group(pg)  # shrinking the world would (noisily) do it
        exclude = [i for i, r in enumerate(base.members) if r not in d.members]
        world = shrink_world(exclude, m.world_store(d.epoch), d.epoch)
    else:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group(
            backend, store=m.world_store(d.epoch), rank=me, world_size=len(d.members), timeout=timeout
        )
        world = c10d._get_default_group()
    register(world)
    sub: dict[str, dist.ProcessGroup] = {}
    for dim in DIMS:
        if getattr(mesh, dim) == mesh.size:
            sub[dim] = world
        else:
            group = resilient_comm.split(mesh.group_index(me, dim), key=me, group=world)
            assert group is not None  # colors are never negative here
            register(group)
            sub[dim] = group
    check = torch.tensor([float(d.epoch), float(d.resume_step)], dtype=torch.float64)
    dist.all_reduce(check, op=dist.ReduceOp.MAX, group=world)
    if check.tolist() != [float(d.epoch), float(d.resume_step)]:
        raise RecoveryError(f"members disagree on epoch/resume step: {check.tolist()}")
    for dim in DIMS:
        if sub[dim] is not world:
            one = torch.ones(1)
            dist.all_reduce(one, group=sub[dim])
    return Groups(world=world, dp=sub["dp"], tp=sub["tp"], pp=sub["pp"])


def shrink_world(exclude: list[int], store: dist.Store, epoch: int) -> dist.ProcessGroup:
    """The world without `exclude` (ranks of the current world), as the new default group.

    What ``resilient_comm.shrink`` does, except that the new group is registered on this
    process's store connection: ``torch.distributed.shrink_group`` clones the store, a
    new TCP connection whose set-up in c10d includes a reverse-DNS lookup that can stall
    for the resolver's timeout (5 s) -- see docs/elastic.md.
    """
    old = c10d._get_default_group()
    backend = resilient_backend(old).shrink(exclude, c10d.SHRINK_ABORT, None)
    size = old.size() - len(exclude)
    return adopt(
        backend,
        store=store,
        name=f"elastic-e{epoch}",
        global_ranks=list(range(size)),
        make_default=True,
        replaces=old,
    )


__all__ = ["Groups", "build_groups", "shrink_world"]
