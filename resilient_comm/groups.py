"""Changing a group's membership without tearing processes down: shrink, split, grow, join.

- ``shrink(exclude_ranks, group)``: the survivors of a failure (only they call it) get a new
  group without the excluded ranks, renumbered in their old order. Built from the old
  group's address book: no store round trip, about a millisecond of connection set-up.
  The old group is destroyed; shrinking the default group makes the result the new default
  (``torch.distributed.shrink_group`` semantics, which this wraps).
- ``split(color, key, group)``: every member calls it; members with the same color form a
  group, ordered by key. A negative color takes part without joining (returns None).
- ``grow(new_size, store, join_key)`` on every member of the default group, with
  ``join(store, join_key, rank, new_size, existing_size)`` on each joiner (a hot spare),
  builds a larger default group: members keep their ranks, joiners take the ranks after
  them. `store` is a store every process of the job reaches (the launcher's), and
  `join_key` a key prefix unique to this grow, agreed on beforehand (the elastic controller
  derives it from the membership epoch).

The new groups are ordinary ProcessGroups: pass them as ``group=`` to any collective.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from resilient_comm import _C
from resilient_comm.api import checked_group, resilient_backend, short_repr


def _check_exclude(exclude_ranks: list[int], pg: dist.ProcessGroup) -> list[int]:
    size, me = pg.size(), pg.rank()
    if not isinstance(exclude_ranks, (list, tuple)):
        raise ValueError(f"exclude_ranks must be a list of group ranks, got {type(exclude_ranks).__name__}")
    seen: set[int] = set()
    for r in exclude_ranks:
        if not isinstance(r, int) or isinstance(r, bool):
            raise ValueError(f"exclude_ranks holds {r!r}, which is not a rank (an int)")
        if not 0 <= r < size:
            raise ValueError(f"rank {r} in exclude_ranks is out of range for a group of {size}")
        if r in seen:
            raise ValueError(f"rank {r} appears twice in exclude_ranks")
        seen.add(r)
    if me in seen:
        raise ValueError(f"rank {me} is in exclude_ranks: only the survivors call shrink")
    if len(seen) >= size:
        raise ValueError(f"exclude_ranks names all {size} ranks: nobody would be left")
    return sorted(seen)


def shrink(exclude_ranks: list[int], group: dist.ProcessGroup | None = None) -> dist.ProcessGroup:
    """The group without `exclude_ranks` (group ranks). Call on every survivor, never on the
    excluded. If the group has failed, its pending ops are aborted first."""
    pg = checked_group(group, "shrink")
    excluded = _check_exclude(exclude_ranks, pg)
    parent = resilient_backend(pg, "shrink")
    flags = c10d.SHRINK_ABORT if parent.comm_error() is not None else c10d.SHRINK_DEFAULT
    # Not torch.distributed.shrink_group: it clones the store, and a new TCPStore connection can
    # stall 5 s in c10d's reverse-DNS lookup for a log line (pytorch/pytorch#159007). The new
    # group reuses the parent's store instead.
    backend = parent.shrink(excluded, flags, None)
    global_of = c10d.get_process_group_ranks(pg)
    survivors = [g for i, g in enumerate(global_of) if i not in set(excluded)]
    is_default = pg is c10d._get_default_group()
    name = f"{c10d._get_process_group_name(pg)}:shrunk"
    store = _store_of(pg)
    if not is_default:
        dist.destroy_process_group(pg)
    return adopt(
        backend,
        store=store,
        name=name,
        global_ranks=survivors,
        make_default=is_default,
        replaces=pg if is_default else None,
    )


def split(
    color: int, key: int | None = None, group: dist.ProcessGroup | None = None
) -> dist.ProcessGroup | None:
    """Split `group` by color (every member calls it); None where color < 0."""
    pg = checked_group(group, "split")
    key = pg.rank() if key is None else key
    _check_int32("color", color)
    _check_int32("key", key)
    parent = resilient_backend(pg, "split")
    members = _gather_colors(pg, color, key)
    backend = parent.split_by_color(color, key)
    index = _splits_so_far(pg)
    if color < 0:
        return None
    member_ranks = [r for _, r in sorted((k, r) for r, (c, k) in enumerate(members) if c == color)]
    global_of = c10d.get_process_group_ranks(pg)
    return adopt(
        backend,
        store=_store_of(pg),
        name=f"{c10d._get_process_group_name(pg)}:split{index}:{color}",
        global_ranks=[global_of[r] for r in member_ranks],
        make_default=False,
    )


def _check_int32(name: str, value: object) -> None:
    """split's color and key: the communicator holds them as 32-bit ints."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"split: {name} must be an int, got {type(value).__name__} {short_repr(value)}")
    if not -(1 << 31) <= value < 1 << 31:
        raise ValueError(f"split: {name} {value} does not fit in 32 bits")


_split_counts: dict[str, int] = {}


def _splits_so_far(pg: dist.ProcessGroup) -> int:
    """How many splits of `pg` came before this one (every member counts alike)."""
    name = c10d._get_process_group_name(pg)
    _split_counts[name] = _split_counts.get(name, 0) + 1
    return _split_counts[name] - 1


def _gather_colors(pg: dist.ProcessGroup, color: int, key: int) -> list[tuple[int, int]]:
    mine = torch.tensor([color, key], dtype=torch.int64)
    out = torch.empty(2 * pg.size(), dtype=torch.int64)
    dist.all_gather_into_tensor(out, mine, group=pg)
    return [(int(out[2 * i]), int(out[2 * i + 1])) for i in range(pg.size())]


def _store_of(pg: dist.ProcessGroup) -> dist.Store:
    return c10d._world.pg_map[pg][1]


def grow(new_size: int, store: dist.Store, join_key: str) -> dist.ProcessGroup:
    """Every member of the default group calls this while the joiners call join(); returns
    the new, larger default group (members keep their ranks)."""
    pg = c10d._get_default_group()
    if new_size <= pg.size():
        raise ValueError(f"grow: new_size {new_size} must exceed the current size {pg.size()}")
    backend = resilient_backend(pg, "grow").grow(new_size, store, join_key)
    new_pg = adopt(
        backend,
        store=store,
        name=f"grown:{join_key}",
        global_ranks=list(range(new_size)),
        make_default=True,
        replaces=pg,
    )
    return new_pg


def join(
    store: dist.Store,
    join_key: str,
    rank: int,
    new_size: int,
    existing_size: int,
    timeout: datetime.timedelta = datetime.timedelta(minutes=10),
    device: torch.device | None = None,
) -> dist.ProcessGroup:
    """A joiner's (hot spare's) side of grow(): becomes rank `rank` of the new default group.

    The group's backend is the members'. If their group carries CUDA tensors, its NCCL
    communicator grows too (ncclCommGrow where NCCL has it) and the joiner joins it on `device`
    (default: the current CUDA device)."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    backend = _C.join_backend(
        store, join_key, rank, new_size, existing_size, timeout.total_seconds(), f"grown:{join_key}", device
    )
    return adopt(
        backend, store=store, name=f"grown:{join_key}", global_ranks=list(range(new_size)), make_default=True
    )


def adopt(
    backend: _C.ResilientBackend,
    *,
    store: dist.Store,
    name: str,
    global_ranks: list[int],
    make_default: bool,
    replaces: dist.ProcessGroup | None = None,
) -> dist.ProcessGroup:
    """Wrap `backend` in a ProcessGroup registered with torch.distributed, as
    torch.distributed.shrink_group does for the groups it makes."""
    if replaces is not None:
        c10d._destroy_all_other_groups(exclude_group=replaces)
        dist.destroy_process_group(replaces)
    pg = dist.ProcessGroup(dist.PrefixStore(f"{name}/", store), backend.rank(), backend.size())
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.CUSTOM, backend)
    pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)
    pg._set_group_name(name)  # type: ignore[arg-type]  # torch 2.13 stubs want a GroupName NewType
    pg._set_group_desc(name)
    if make_default:
        c10d._update_default_pg(pg)
    c10d._register_pg_in_world(
        pg,
        backend_name="resilient_tcp",
        store=store,
        group_name=name,  # type: ignore[arg-type]
        backend_config="cpu:resilient_tcp",
        rank_mapping={g: i for i, g in enumerate(global_ranks)},
    )
    return pg


__all__ = ["grow", "join", "shrink", "split"]
