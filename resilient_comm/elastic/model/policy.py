"""Who stays after a failure: the mesh and the shrink policy.

A job's ranks form a mesh of three parallel dimensions, ``world = dp * pp * tp``, laid out with
tensor parallel fastest, then pipeline, then data parallel::

    rank = (dp_index * pp + pp_index) * tp + tp_index

so a *replica* (one dp index: all its pipeline stages and tensor shards) is a contiguous block of
``pp * tp`` ranks. A tensor-parallel or pipeline group cannot lose a member and go on (its
shards or stages would be missing), so the policy treats a replica as atomic: without a hot
spare, **the whole replica holding a lost rank leaves**, and the survivors form a mesh with
fewer replicas and the same ``tp`` and ``pp``. Because replicas are contiguous blocks and
survivors keep their old order, the renumbered survivors are again laid out as above.

With ``tp == pp == 1`` a replica is one rank: exactly the lost ranks leave.

**Hot spares** come first (`plan`): a spare takes a lost rank's place -- same rank, same
tp/pp/dp coordinates -- so the world size and the mesh are kept. A replica is saved only if
*every* lost rank in it gets a spare (a replica with a hole leaves whole, so a spare given to
it would be wasted); replicas that lost fewer ranks are saved first, then the lower-numbered.
What the spares cannot save leaves by the shrink rule above.

Pure (no I/O): the decider, a worker, runs it through `model.decide`.
"""

from __future__ import annotations

from dataclasses import dataclass

DIMS = ("tp", "pp", "dp")


@dataclass(frozen=True)
class Mesh:
    """Sizes of the parallel dimensions. Immutable; a shrink makes a new one."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for dim in DIMS:
            size = getattr(self, dim)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh {dim} size must be a positive int, got {size!r}")

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1) -> Mesh:
        """The mesh of `world_size` ranks with the given tp and pp; dp is what is left."""
        if world_size % (tp * pp):
            raise ValueError(f"world size {world_size} is not a multiple of tp*pp = {tp}*{pp}")
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp))

    @property
    def size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def replica_size(self) -> int:
        return self.tp * self.pp

    def coords(self, rank: int) -> dict[str, int]:
        """{'tp': i, 'pp': j, 'dp': k} of `rank`."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.size}")
        return {"tp": rank % self.tp, "pp": (rank // self.tp) % self.pp, "dp": rank // self.replica_size}

    def replica_of(self, rank: int) -> int:
        return self.coords(rank)["dp"]

    def group_index(self, rank: int, dim: str) -> int:
        """Which `dim` group holds `rank` (the split color): groups along `dim` are numbered by
        the coordinates of the other two dimensions."""
        c = self.coords(rank)
        if dim == "tp":
            return c["dp"] * self.pp + c["pp"]
        if dim == "pp":
            return c["dp"] * self.tp + c["tp"]
        if dim == "dp":
            return c["pp"] * self.tp + c["tp"]
        raise ValueError(f"unknown mesh dimension {dim!r} (one of {DIMS})")

    def group_ranks(self, rank: int, dim: str) -> list[int]:
        """The ranks of the `dim` group holding `rank`, in rank order."""
        color = self.group_index(rank, dim)
        return [r for r in range(self.size) if self.group_index(r, dim) == color]

    def as_dict(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp}


@dataclass(frozen=True)
class Plan:
    """The policy's answer, in the current numbering: who stays and who leaves."""

    stay: tuple[int, ...]  # current ranks that stay, in order (their new ranks are their positions)
    lost: tuple[int, ...]  # ranks that are gone (dead or suspected)
    evicted: tuple[int, ...]  # live ranks that leave with a lost rank's replica
    mesh: Mesh | None  # the survivors' mesh; None when nobody can go on

    replaced: tuple[tuple[int, int], ...] = ()  # (current rank, spare id): the spare takes that place

    @property
    def leaves(self) -> tuple[int, ...]:
        """Ranks that leave the mesh (a replaced rank's place is kept, so it is not here)."""
        filled = {r for r, _ in self.replaced}
        return tuple(sorted(r for r in self.lost + self.evicted if r not in filled))


def plan_shrink(mesh: Mesh, lost: set[int] | list[int] | tuple[int, ...]) -> Plan:
    """The shrink policy: every replica holding a lost rank leaves whole.

    `lost` holds current ranks. When every replica lost a rank, nobody can go on: the plan's
    `stay` is empty and its mesh is None (the job fails, or the launcher restarts it).
    """
    lost_set = set(lost)
    for r in lost_set:
        if not 0 <= r < mesh.size:
            raise ValueError(f"lost rank {r} is outside a mesh of {mesh.size}")
    broken = {mesh.replica_of(r) for r in lost_set}
    stay = tuple(r for r in range(mesh.size) if mesh.replica_of(r) not in broken)
    evicted = tuple(r for r in range(mesh.size) if mesh.replica_of(r) in broken and r not in lost_set)
    survivors = mesh.dp - len(broken)
    new_mesh = Mesh(tp=mesh.tp, pp=mesh.pp, dp=survivors) if survivors > 0 else None
    return Plan(stay=stay, lost=tuple(sorted(lost_set)), evicted=evicted, mesh=new_mesh)


def plan(
    mesh: Mesh, lost: set[int] | list[int] | tuple[int, ...], spares: list[int] | tuple[int, ...] = ()
) -> Plan:
    """The full policy: hot spares (ids, in the order they are to be used) fill lost places
    where that saves a whole replica; what is left follows `plan_shrink`.

    Returns a plan in the current numbering: `stay` keeps the places of replaced ranks (their
    new occupant is given by `replaced`), and `mesh` has the same tp and pp."""
    lost_set = set(lost)
    shrink_all = plan_shrink(mesh, lost_set)  # validates `lost`
    if not spares or not lost_set:
        return shrink_all
    by_replica: dict[int, list[int]] = {}
    for r in sorted(lost_set):
        by_replica.setdefault(mesh.replica_of(r), []).append(r)
    pool = list(spares)
    replaced: list[tuple[int, int]] = []
    for replica in sorted(by_replica, key=lambda k: (len(by_replica[k]), k)):
        holes = by_replica[replica]
        if len(holes) > len(pool):
            continue
        replaced += [(r, pool.pop(0)) for r in holes]
    filled = {r for r, _ in replaced}
    rest = plan_shrink(mesh, lost_set - filled)
    return Plan(
        stay=rest.stay,
        lost=tuple(sorted(lost_set)),
        evicted=rest.evicted,
        mesh=rest.mesh,
        replaced=tuple(sorted(replaced)),
    )


__all__ = ["DIMS", "Mesh", "Plan", "plan", "plan_shrink"]
