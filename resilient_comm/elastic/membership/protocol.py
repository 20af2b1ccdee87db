"""Membership: epochs, join records, decisions and failure reports on a c10d Store.

The store is the launcher's TCPStore (hosted by node 0's ``resilient-run``, never by a
worker, so no worker's death takes it down), or an etcd cluster (`etcd.store.EtcdStore`, for
jobs that span nodes: no node's loss takes it down). `connect` opens either from the
``RESILIENT_COMM_STORE`` a worker is given (``host:port`` or ``etcd://h1:p1,h2:p2``). Every
key lives under a namespace ``ns`` (one per run and launcher generation)::

    {ns}/epoch                  the latest proposed epoch (a decimal int)
    {ns}/e/{E}/decision         epoch E's decision (JSON), written once, by compare-and-set
    {ns}/e/{E}/joins/{g}        the join records for epoch E (`membership.joins`; on etcd
    {ns}/e/{E}/join/{first}.{n}   a node's batch under a key of its own)
    {ns}/e/{E}/world/           store prefix of epoch E's world group when it is built afresh
    {ns}/gone/{rank}            the first evidence that rank is gone (exit or suspicion), by CAS
    {ns}/events/{i}             the i-th event (ranks gone, a decision, the end, a node joining the
                                ring), slot claimed by CAS; every agent waits for the next slot
    {ns}/node/{n}               node n's liveness record (its agent's heartbeat: `node.ring`)
    {ns}/done/{rank}            rank finished training at this committed step
    {ns}/spare/n, {ns}/spare/{i}  hot spares waiting warm: a counter, and the i-th one's id
    {ns}/finished               every member finished: waiting spares leave (event "finished")

Rules that make the protocol safe (the controller follows them):

- **Epochs are a chain.** Epoch 0 is the launch (every rank, written by CAS at start-up). A
  member that holds the groups of epoch D and sees a failure proposes D+1 with
  ``compare_set(epoch, D, D+1)``; if the epoch is already past D it joins the current one.
  So an epoch is proposed only after the previous one was decided.
- **Exactly one decision per epoch**: ``compare_set(decision, "", value)``; whoever loses the
  race reads the winner's decision and follows it.
- **The decider** is the lowest-ranked member of epoch E-1 that is not gone. It waits until
  every member of E-1 has either joined E or is gone, then publishes. If it dies meanwhile,
  its death makes the next one the decider.
- **Members of a decision are joiners of that epoch**, so every member of epoch E applied
  E's decision; a rank absent from a decision after the epoch it last applied has been
  evicted and must leave.
- **Events have no holes**: a poster claims slot i with compare-and-set, so a poster killed
  mid-post never leaves a slot that readers wait on forever. Writing the slot is the post:
  every node's agent waits for the next slot's key, and the store answers all its waiters
  at once. Agents forward events to their workers: no key is read per rank per event.

Every process that touches the store runs it: node agents (`node`) and workers (`worker`).
The records themselves are `model.records`; the keys' names, seals and non-blocking reads
`membership.keys`; the join records `membership.joins`.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, cast

import torch.distributed as dist

from resilient_comm.elastic.membership.joins import JOINS_WITH_PROPOSAL, JoinKeys
from resilient_comm.elastic.membership.keys import (
    CHUNK_KEYS,
    NO_RECORD,
    Keys,
    as_epoch,
    as_int,
    warn_malformed,
)
from resilient_comm.elastic.model.env import ENV_TOKEN
from resilient_comm.elastic.model.records import Decision, Gone, JoinRecord

log = logging.getLogger("resilient_comm.membership")


class Membership:
    """Typed access to the membership keys. One instance per thread that uses it (a c10d
    store client serialises its calls, and a blocking wait would hold up the others)."""

    def __init__(self, store: dist.Store, namespace: str, *, token: str | None = None) -> None:
        """`token`: the job token (default: ``RESILIENT_COMM_TOKEN``). With one, the records
        that decide membership -- decisions, join records, gone records, events, spare ids,
        finished steps -- are written sealed with a MAC keyed by it and over their key, and a
        record read back without a valid one is treated as malformed: a process without the
        token cannot forge one (docs/security.md). Without one, seals are neither made nor
        checked (a reader such as a test or a benchmark can still read sealed records)."""
        self.k = Keys(store, namespace, os.environ.get(ENV_TOKEN, "") if token is None else token)
        self.store, self.ns = self.k.store, self.k.ns
        self.joins = JoinKeys(self.k)  # the join records (the decider's tally of them: etcd)

    def clone(self, timeout: datetime.timedelta | None = None) -> Membership:
        """The same keys through a new connection (for another thread)."""
        store = self.store.clone()
        if timeout is not None:
            store.set_timeout(timeout)
        return Membership(store, self.ns, token=self.k.token)

    def key(self, *parts: object) -> str:
        return self.k.key(*parts)

    # -- epochs and decisions -------------------------------------------------------------

    def start(self, initial: Decision) -> Decision:
        """Record epoch 0 (every rank calls this with the same decision; the first wins)."""
        self.store.compare_set(self.key("epoch"), "", "0")
        k = self.key("e", 0, "decision")
        return self._decision(k, self.store.compare_set(k, "", self.k.seal(k, initial.to_json())))

    def epoch(self) -> int:
        k = self.key("epoch")
        return as_epoch(k, self.store.get(k))

    def propose(self, applied: int) -> int:
        """Propose epoch applied+1 if the current epoch is `applied`; returns the current epoch."""
        k = self.key("epoch")
        return as_epoch(k, self.store.compare_set(k, str(applied), str(applied + 1)))

    def decision(self, epoch: int) -> Decision | None:
        k = self.key("e", epoch, "decision")
        v = self.k.maybe(k)
        return None if v is None else self._decision(k, v)

    def decide(self, decision: Decision) -> Decision:
        """Publish `decision` unless one exists; returns the one that holds."""
        k = self.key("e", decision.epoch, "decision")
        return self._decision(k, self.store.compare_set(k, "", self.k.seal(k, decision.to_json())))

    def _decision(self, key: str, v: bytes | str) -> Decision:
        """A decision read back; a malformed one is an error naming the key (the decision is
        the authority on membership: it cannot be skipped)."""
        try:
            return Decision.from_json(self.k.open(key, v))
        except ValueError as e:
            raise dist.DistStoreError(f"the decision at {key!r} is malformed: {e}") from e

    @property
    def ranged(self) -> bool:
        """Whether the store reads every key under a prefix in one request (etcd; `Keys.ranged`)."""
        return self.k.ranged

    def propose_join(self, applied: int, records: list[JoinRecord]) -> int:
        """`propose(applied)`, and `records` joined to epoch applied+1 if that is then the
        current epoch (on etcd in the same request: every member's first round trip after a
        failure does both). Returns the current epoch; a later one (a decision was missed)
        is not joined: the caller catches up, then joins it."""
        k = self.key("epoch")
        if not self.ranged or not records:
            current = self.propose(applied)
            if current == applied + 1 and records:
                self.join_many(current, records)
            return current
        puts = self.joins.batch_puts(applied + 1, records)
        head, rest = puts[:JOINS_WITH_PROPOSAL], puts[JOINS_WITH_PROPOSAL:]
        value, joined = cast(Any, self.store).advance(k, str(applied), str(applied + 1), head)
        if joined and rest:
            cast(Any, self.store).multi_set([k for k, _ in rest], [v for _, v in rest])
        return as_epoch(k, value)

    def join(self, epoch: int, record: JoinRecord) -> None:
        self.join_many(epoch, [record])

    def join_many(self, epoch: int, records: list[JoinRecord]) -> None:
        """Write `records` for `epoch` (`JoinKeys.join_many`: one call per group, or on etcd
        one put per batch)."""
        self.joins.join_many(epoch, records)

    def complete(
        self,
        epoch: int,
        base: list[int],
        live: list[int],
        wait_s: float = 0.0,
        news: Callable[[float], bool] | None = None,
    ) -> tuple[dict[int, JoinRecord], dict[int, Gone]] | None:
        """What the decider of `epoch` needs once every `live` member of `base` has joined:
        their join records (`JoinKeys.wait_all`, waiting up to `wait_s`, a wait that `news`
        may end) and the evidence on the others; None until then."""
        joined = self.joins.wait_all(epoch, live, wait_s, news)
        if joined is None:
            return None
        alive = set(live)
        return joined, self.gone([r for r in base if r not in alive])

    def joined(self, epoch: int, ranks: list[int], *, there: bool = False) -> dict[int, JoinRecord]:
        """The join records of `ranks` for `epoch` that exist (`JoinKeys.joined`)."""
        return self.joins.joined(epoch, ranks, there=there)

    def world_store(self, epoch: int) -> dist.Store:
        """Where epoch `epoch`'s world group meets when it is built afresh."""
        return dist.PrefixStore(self.key("e", epoch, "world") + "/", self.store)

    # -- failures and events --------------------------------------------------------------

    def report_gone(self, gone: Gone) -> bool:
        """Record `gone` unless the rank is already recorded; on success post an event.
        Returns whether this report was the first."""
        return bool(self.report_gone_many([gone]))

    def report_gone_many(self, gones: list[Gone], node: int | None = None) -> list[int]:
        """Record each of `gones` unless its rank is already recorded, and post one event for
        the ranks this call recorded first (a lost node's processes: one report). Returns them."""
        first = []
        for g in gones:
            k = self.key("gone", g.rank)
            mine = self.k.seal(k, g.to_json())
            held = self.store.compare_set(k, "", mine)
            if held.decode(errors="replace") != mine and self.k.token and not self.k.valid(k, held):
                log.warning("replacing the gone record at %r: it does not carry this job's MAC (forged?)", k)
                try:
                    held = self.store.compare_set(k, held.decode(), mine)
                except UnicodeDecodeError:
                    self.store.set(k, mine)  # not text: nobody of the job wrote it (a race is harmless)
                    held = mine.encode()
            if held.decode(errors="replace") == mine:
                first.append(g)
        if first:  # the evidence goes with the event: no agent reads it back
            self.post_event(
                {
                    "kind": "gone",
                    "ranks": [g.rank for g in first],
                    "gone": [asdict(g) for g in first],
                    **({"node": node} if node is not None else {}),
                }
            )
        return [g.rank for g in first]

    def gone(self, ranks: list[int]) -> dict[int, Gone]:
        """The evidence recorded on `ranks` (a malformed record is logged and ignored)."""
        out = {}
        if self.ranged:  # one read of every gone record (a few), not a check per rank
            prefix, want = self.key("gone", ""), set(ranks)
            found = {}
            for k, v in cast(Any, self.store).items(prefix):
                if k[len(prefix) :].isdigit() and int(k[len(prefix) :]) in want:
                    found[int(k[len(prefix) :])] = v
        else:
            found = self.k.present([self.key("gone", r) for r in ranks], ranks)
        for r, v in found.items():
            try:
                out[r] = Gone.from_json(self.k.open(self.key("gone", r), v))
            except ValueError as e:
                warn_malformed(self.key("gone", r), "gone record", e)
        return out

    def post_event(self, payload: dict[str, Any]) -> int:
        """Append an event; returns its index. Slots are claimed by compare-and-set. Writing
        the slot is what wakes every agent (`wait_event`): the poster's cost does not grow
        with the number of nodes."""
        raw = json.dumps(payload, sort_keys=True)
        i = 0
        while (
            self.store.compare_set(k := self.key("events", i), "", text := self.k.seal(k, raw)).decode(
                errors="replace"
            )
            != text
        ):
            i += 1
        return i

    @property
    def watches(self) -> bool:
        """Whether the store is etcd (its waits are bounded watches; `Keys.watches`)."""
        return self.k.watches

    def event(self, i: int, value: bytes | None = None) -> dict[str, Any] | None:
        """The i-th event, None if there is none yet; a malformed one reads as kind
        "malformed" (logged), so that readers go past it. `value`: the slot's value as a
        watch brought it (not read again)."""
        k = self.key("events", i)
        if value is None and (value := self.k.maybe(k)) is None:
            return None
        try:
            ev = json.loads(self.k.open(k, value))
            if not isinstance(ev, dict) or not isinstance(ev.get("kind"), str):
                raise ValueError("not a JSON object with a kind")
            return ev
        except ValueError as e:
            warn_malformed(k, "event", e)
            return {"kind": "malformed", "detail": str(e)}

    def wait_event(self, i: int) -> None:
        """Block until the i-th event exists (the store's timeout bounds the wait). A TCPStore
        answers all of a key's waiters when it is written, so every node's agent, each waiting
        on the next slot, wakes from the poster's one write."""
        self.store.wait([self.key("events", i)])

    def wake_event_waiters(self, i: int) -> None:
        """End every `wait_event(i)` now without writing the event: c10d's compare_set wakes a
        key's waiters even when it sets nothing. For an agent that stops: its events thread
        must not be left blocked in the store's C++ wait when the interpreter exits (a
        daemon thread unwound there terminates the process). Each waiter finds no event and
        waits again, so this costs one read per node: for an agent's stop, not the job's end
        (the events thread ends by itself on the "finished" event)."""
        self.store.compare_set(self.key("events", i), NO_RECORD, NO_RECORD)

    # -- node records, spares and the end -------------------------------------------------

    def node_beat(self, node: int, record: str) -> None:
        self.store.set(self.key("node", node), record)

    def node_record(self, node: int) -> str | None:
        """Node's record, or None if it has none. On a TCPStore one round trip: a compare_set
        expecting a value no record holds returns the record, or that value when there is none
        (its get is two: a wait, then the get). Only for keys nobody waits on: c10d's
        compare_set wakes a key's waiters even when it sets nothing. On etcd one range, which
        never waits: a leased record can vanish between a check and a get, whose wait would
        then block the lease thread past its lease (and fence a healthy node)."""
        key = self.key("node", node)
        if not self.watches:
            v = self.store.compare_set(key, NO_RECORD, NO_RECORD)
            return None if v == NO_RECORD.encode() else v.decode()
        value, _ = cast(Any, self.store).value(key)
        return None if value is None else bytes(value).decode()

    def register_spare(self, spare_id: int) -> None:
        i = self.store.add(self.key("spare", "n"), 1) - 1
        k = self.key("spare", i)
        self.store.set(k, self.k.seal(k, str(spare_id)))

    def spares(self) -> list[int]:
        """Ids of every spare that ever registered, in registration order. A malformed id is
        logged and ignored; the ids are read a chunk at a time, and a chunk with none there
        ends the list (a counter far ahead of the registrations costs one chunk of reads)."""
        k = self.key("spare", "n")
        n = self.store.add(k, 0) if self.store.check([k]) else 0
        out = []
        for at in range(0, n, CHUNK_KEYS):
            idx = list(range(at, min(n, at + CHUNK_KEYS)))
            got = self.k.present([self.key("spare", i) for i in idx], idx)
            if not got:
                break
            for i, v in got.items():
                try:
                    out.append(as_int(self.k.open(self.key("spare", i), v)))
                except ValueError as e:
                    warn_malformed(self.key("spare", i), "spare id", e)
        return out

    def announce_node(self, node: int) -> None:
        """A capacity node (``--nnodes MIN:MAX``, MIN <= node < MAX) joins the agents' ring."""
        self.post_event({"kind": "node", "node": node})

    def set_finished(self) -> None:
        self.store.set(self.key("finished"), "1")

    def finished(self) -> bool:
        return bool(self.store.check([self.key("finished")]))

    def set_done(self, rank: int, committed: int) -> None:
        if not self.store.check([self.key("done", rank)]):
            self.store.add(self.key("done", "n"), 1)
        k = self.key("done", rank)
        self.store.set(k, self.k.seal(k, str(committed)))

    def done(self, ranks: list[int]) -> dict[int, int]:
        """The step each finished rank of `ranks` committed. A counter says when nobody has
        finished (the common case, answered in one call whatever the number of ranks)."""
        if not self.store.add(self.key("done", "n"), 0):
            return {}
        out = {}
        for r, v in self.k.present([self.key("done", r) for r in ranks], ranks).items():
            try:
                out[r] = as_int(self.k.open(self.key("done", r), v))
            except ValueError as e:
                warn_malformed(self.key("done", r), "finished step", e)
        return out


def join_poll_cap_s(members: int) -> float:
    """The longest pause between a decider's polls of the join keys where it must poll (etcd):
    each poll sends every member's key, so at 16K members at most one per 33 ms."""
    return max(0.005, 2e-6 * members)


def connect(spec: str, timeout: datetime.timedelta) -> dist.Store:
    """A client of the job's store: ``host:port`` (the launcher's TCPStore) or
    ``etcd://h1:p1,h2:p2`` (an etcd cluster; TLS and the login from the ``RESILIENT_COMM_ETCD_*``
    knobs, which ``resilient-run`` sets in its workers: `etcd.security`)."""
    if spec.startswith("etcd://"):
        from resilient_comm.elastic.membership.etcd.store import EtcdStore

        return EtcdStore(spec.removeprefix("etcd://"), timeout)
    host, sep, port = spec.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bad store address {spec!r} (host:port or etcd://host:port[,host:port...])")
    return dist.TCPStore(host, int(port), None, False, timeout=timeout)


__all__ = ["Membership", "connect", "join_poll_cap_s"]
