"""Rejoining after a failure: agreeing on the next epoch's membership through the store.
Runs in a worker; the `Controller` and `restartable` share it.

A member that recovers (`catch_up`) proposes the next epoch and joins it (one request on
etcd), or, where the epoch has moved on, reads the decisions of the epochs it missed (leaving
with `Evicted` if one of them left it out) and then joins; then
(`await_decision`) the *decider* -- the lowest live member of the previous decision -- waits
for every live member's join and publishes the decision (`decide_epoch`, by the rules of
`model.decide`), while the others
wait for the agent's news of it (or of a death that makes them the decider). Every wait is
bounded by the recovery's deadline (`RecoveryError`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable

import torch.distributed as dist

from resilient_comm.elastic.membership.protocol import Membership, join_poll_cap_s
from resilient_comm.elastic.model.decide import decide
from resilient_comm.elastic.model.pacer import Pacer
from resilient_comm.elastic.model.records import Decision, Gone, JoinRecord
from resilient_comm.elastic.worker.checkpoints import Checkpoints
from resilient_comm.elastic.worker.detector import Detector
from resilient_comm.elastic.worker.errors import Evicted, RecoveryError

log = logging.getLogger("resilient_comm.elastic")


def catch_up(
    m: Membership,
    rank: int,
    applied: int,
    base: Decision,
    record: JoinRecord,
    via: Callable[[JoinRecord], tuple[str, str] | None] | None = None,
) -> tuple[int, Decision]:
    """Propose the epoch after `applied`, join the current epoch with `record`, and return
    (the current epoch, the decision of the one before it). `Evicted` if `rank` was reported
    gone or a decision it missed left it out (then it has not joined). The usual case -- the
    current epoch is the one proposed -- is one round trip on etcd (`Membership.propose_join`).
    `via`: the node agent's join (`Detector.join`), which writes a node's records together (one
    transaction per node, not per rank); where it does not answer, this rank joins itself."""
    answer = via(record) if via is not None else None
    if answer is not None and answer[0] == "gone":
        raise Evicted(answer[1])
    if answer is not None and answer[0] == "failed":  # (what this rank's own call would have met)
        raise dist.DistNetworkError(f"rank {rank}: its node agent could not join it: {answer[1]}")
    if answer is not None:
        current = int(answer[1])
    else:
        me = m.gone([rank])
        if me:
            raise Evicted(f"rank {rank} was reported gone: {me[rank].detail}")
        current = m.propose_join(applied, [record])
    if current == applied + 1:
        return current, base
    for e in range(applied + 1, current):
        d = m.decision(e)
        if d is None:
            raise RecoveryError(f"epoch {current} was proposed but epoch {e} has no decision")
        if rank not in d.members:
            raise Evicted(f"rank {rank} was evicted in epoch {e} (lost {d.lost}, evicted {d.evicted})")
        base = d
    m.join(current, record)
    return current, base


def join_wait_s(deadline: float) -> float:
    """How long a rank waits for its agent to answer its join (`catch_up`'s `via`): the agent
    batches for `node.join_batcher.join_window_s`, then its store calls are slow ones under load; joining
    directly meanwhile would double the load it is there to save."""
    return max(1.0, min(30.0, deadline - time.monotonic()))


def decide_epoch(
    m: Membership,
    epoch: int,
    base: Decision,
    joined: dict[int, JoinRecord],
    gone: dict[int, Gone],
    latest_checkpoint: Callable[[int], int | None],
    by: int,
    *,
    sharded: bool = False,
) -> Decision:
    """`decide` with the spares that wait (`waiting_spares`)."""
    spares = waiting_spares(m, base)
    return decide(
        epoch, base, joined, gone, m.done(base.members), spares, latest_checkpoint, by, sharded=sharded
    )


def waiting_spares(m: Membership, base: Decision) -> list[int]:
    """The spares that registered, were never placed (by `base` or before) and are not gone."""
    candidates = [r for r in m.spares() if r not in set(base.used_spares)]
    return [r for r in candidates if r not in m.gone(candidates)]


def decide_with_checkpoints(
    m: Membership,
    epoch: int,
    base: Decision,
    joined: dict[int, JoinRecord],
    gone: dict[int, Gone],
    ckpts: Checkpoints,
    by: int,
) -> Decision:
    """`decide_epoch` with this member's checkpoints: the newest complete for a mesh's size;
    with a state sharded over dp, the newest complete for its own epoch's mesh, whose epoch
    the decision names (every member loads it, re-sharded)."""
    if not ckpts.shard_dp:
        return decide_epoch(m, epoch, base, joined, gone, ckpts.latest, by)
    past = [d for d in (m.decision(e) for e in range(base.epoch, -1, -1)) if d is not None]
    found = ckpts.newest_sharded(past)
    d = decide_epoch(
        m, epoch, base, joined, gone, lambda _world: None if found is None else found[1], by, sharded=True
    )
    return (
        dataclasses.replace(d, ckpt_epoch=found[0]) if found is not None and d.restore == "checkpoint" else d
    )


def enter(m: Membership, rank: int, initial: Decision, spare: bool) -> Decision:
    """The decision a process starts from: a member records epoch 0 (`initial`: the same on
    every member, else ValueError), a hot spare reads it (its id must be past the world)."""
    if spare:
        if rank < len(initial.members):
            raise RuntimeError(f"a spare's id must be >= WORLD_SIZE {len(initial.members)}, got RANK={rank}")
        return m.decision(0) or initial
    d = m.start(initial)
    if d.mesh != initial.mesh or d.resume_step != initial.resume_step:
        raise ValueError(
            f"rank {rank} starts with mesh {initial.mesh} at step {initial.resume_step}, but the "
            f"job started with mesh {d.mesh} at step {d.resume_step}"
        )
    return d


def await_decision(
    m: Membership,
    detector: Detector,
    rank: int,
    epoch: int,
    base: Decision,
    deadline: float,
    timeout_s: float,
    make: Callable[[dict[int, JoinRecord], dict[int, Gone]], Decision],
    check_fatal: Callable[[], None],
) -> Decision:
    """The decision of `epoch`: published by this member if it is the decider (`make` builds it
    from the join records and the evidence), else read once the agent's news says it is there."""
    pace = Pacer(cap_s=join_poll_cap_s(len(base.members)))
    # The decider's waits for the joins start short: right after a failure the news of the
    # dead rank may still be on its way, and a wait that counts on that rank's join lasts
    # its whole slice (a fixed 100 ms slice made about half the recoveries 100 ms slower).
    wait_s = 0.005
    while True:
        news = detector.news()
        check_fatal()
        d = m.decision(epoch)
        if d is not None:
            return d
        live = [r for r in base.members if r not in detector.gone()]
        if time.monotonic() > deadline:
            raise RecoveryError(f"no decision for epoch {epoch} before the deadline (waiting on {live})")
        if live and live[0] == rank:
            # Every live member's join at once (Membership.complete); the wait is short: a
            # rank lost meanwhile changes who is live.
            complete = m.complete(
                epoch,
                base.members,
                live,
                wait_s=min(wait_s, timeout_s),
                news=functools.partial(_news_within, detector, news),
            )
            wait_s = min(0.1, 2 * wait_s)
            if complete is not None:
                d = m.decide(make(*complete))
                m.post_event({"kind": "decided", "epoch": d.epoch, "joiners": d.joiners})
                return d
            if m.watches:
                pace.wait()
        else:
            detector.wait_news(news, min(1.0, max(0.0, deadline - time.monotonic())))


def _news_within(detector: Detector, seen: int, pause_s: float) -> bool:
    return detector.wait_news(seen, pause_s) != seen


def wait_placed(
    m: Membership, detector: Detector, rank: int, check_fatal: Callable[[], None]
) -> Decision | None:
    """A hot spare: register, then wait warm until a decision places it (that decision), or
    the job ends (None)."""
    m.register_spare(rank)
    log.info("spare %d waiting warm", rank)
    seen = 0
    while True:
        news = detector.news()
        check_fatal()
        if m.finished():
            log.info("spare %d: the job ended without needing it", rank)
            return None
        for e in range(seen + 1, m.epoch() + 1):
            d = m.decision(e)
            if d is None:
                break
            seen = e
            if rank in d.joiners:
                slot = d.slots[d.members.index(rank)] if d.slots else -1
                log.info("spare %d takes rank %d's place (epoch %d)", rank, slot, d.epoch)
                return d
        # Woken by the agent's events (a decision, the end); a second without any: look again.
        detector.wait_news(news, 1.0)


__all__ = [
    "await_decision",
    "catch_up",
    "decide_epoch",
    "decide_with_checkpoints",
    "enter",
    "join_wait_s",
    "wait_placed",
]
