"""The decision of an epoch: who stays, who takes which place, where each member's state
comes from, and from which step the job resumes. A pure function of what the decider read
from the membership (docs/elastic.md, "Policy", "Hot spares" and "Commit protocol"). Run by
the decider, a worker (`worker.rejoin.await_decision`); pure, so it is unit-tested alone.

Rules, in order:

1. `policy.plan`: hot spares fill lost places where that saves a whole replica; what they
   cannot save leaves (a lost rank's whole replica). No replica left: mode "fail".
2. The resume step is C + 1, C the highest step committed by a joiner or a finished member.
   A member is *current* if it committed C, or committed C-1 and holds C pending (it rolls
   forward). Every other member -- a placed spare, or a member placed earlier whose copy
   failed -- needs a state: from a *donor*, a current member with the same tp/pp coordinates
   (same dp group) in the new mesh.
3. If some member has no donor: with a checkpoint complete for the whole new mesh, every
   member loads it (restore "checkpoint", resume after it); else the spares are dropped and
   the plan is made again without them; a member still without a donor fails the epoch
   rather than let replicas diverge.
4. Mode "shrink" (of the previous epoch's groups) when members leave, nobody joins and every
   member holds verified groups of the previous epoch; else "init" (a fresh world).
"""

from __future__ import annotations

from collections.abc import Callable

from resilient_comm.elastic.model.policy import plan
from resilient_comm.elastic.model.records import Decision, Gone, JoinRecord, now


def decide(
    epoch: int,
    base: Decision,
    joined: dict[int, JoinRecord],
    gone: dict[int, Gone],
    done: dict[int, int],
    spares: list[int],
    latest_checkpoint: Callable[[int], int | None],
    by: int,
    *,
    sharded: bool = False,
) -> Decision:
    """Epoch `epoch`'s decision from the previous one (`base`), the join records of the members
    that joined, the failure evidence, the steps finished members committed, the spares
    available (in the order they are to be used), and the newest checkpoint complete for a
    mesh of a given size (None: none). `by` is the decider's launch rank. `sharded`: the state
    is sharded over dp (FSDP2), so no member is a donor and every member needs a state: the
    whole job loads the checkpoint (re-sharded by each member)."""
    lost = [i for i, r in enumerate(base.members) if r not in joined]
    mesh0 = base.mesh_obj()
    top = max([j.committed for j in joined.values()] + list(done.values()))
    failed_at = min([gone[base.members[i]].t for i in lost if base.members[i] in gone], default=0.0)
    slots0 = base.slots or base.members

    def current(r: int) -> bool:  # holds the committed step, or the pending one
        return r in joined and (
            joined[r].committed == top or (joined[r].committed == top - 1 and joined[r].pending == top)
        )

    for pool in (spares, []):
        p = plan(mesh0, lost, pool)
        evicted = [base.members[i] for i in p.evicted]
        lost_ranks = [base.members[i] for i in p.lost]
        if p.mesh is None:
            return Decision(
                epoch,
                [],
                base.mesh,
                "fail",
                top + 1,
                lost_ranks,
                evicted,
                by,
                now(),
                failed_at,
                f"no replica survived (lost {lost_ranks})",
            )
        fill = dict(p.replaced)
        members = [fill.get(i, base.members[i]) for i in p.stay]
        slots = [slots0[i] for i in p.stay]
        joiners = [fill[i] for i in p.stay if i in fill]
        needers = list(members) if sharded else [r for r in members if not current(r)]
        sources: list[list[int]] = []
        for r in needers:
            peers = [members[j] for j in p.mesh.group_ranks(members.index(r), "dp")]
            donor = next((q for q in peers if q not in needers), None)
            if donor is None:
                break
            sources.append([r, donor])
        restore, resume = ("peer" if needers else ""), top + 1
        ckpt_step: int | None = -1
        if len(sources) < len(needers):  # someone has no donor: the whole job loads a checkpoint
            ckpt_step = latest_checkpoint(p.mesh.size)
            if ckpt_step is None and joiners:
                continue  # the spares cannot be given a state: shrink without them
            if ckpt_step is None and sharded:
                return Decision(
                    epoch,
                    [],
                    base.mesh,
                    "fail",
                    top + 1,
                    lost_ranks,
                    evicted,
                    by,
                    now(),
                    failed_at,
                    "the state is sharded over dp and no checkpoint is complete: nothing holds "
                    f"the shards of {lost_ranks}",
                )
            if ckpt_step is None:
                stray = [joined[r] for r in needers if r in joined]
                return Decision(
                    epoch,
                    [],
                    base.mesh,
                    "fail",
                    top + 1,
                    lost_ranks,
                    evicted,
                    by,
                    now(),
                    failed_at,
                    f"members {needers} are behind step {top} ({stray}) and no member "
                    "or checkpoint holds their shard",
                )
            sources, restore, resume = [], "checkpoint", ckpt_step + 1
        mode = "init"
        if (
            p.leaves
            and not joiners
            and all(joined[r].applied == epoch - 1 and joined[r].ready for r in members)
        ):
            mode = "shrink"
        used = sorted(set(base.used_spares) | set(joiners))
        return Decision(
            epoch,
            members,
            p.mesh.as_dict(),
            mode,
            resume,
            lost_ranks,
            evicted,
            by,
            now(),
            failed_at,
            "",
            joiners,
            sources,
            restore,
            -1 if ckpt_step is None else ckpt_step,
            used,
            slots,
        )
    raise AssertionError("unreachable: the plan without spares always decides")


__all__ = ["decide"]
