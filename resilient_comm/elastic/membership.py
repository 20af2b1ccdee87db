"""Membership: epochs, join records, decisions and failure reports on a c10d Store.

The store is the launcher's TCPStore (hosted by node 0's ``resilient-run``, never by a
worker, so no worker's death takes it down), or an etcd cluster (`etcd.EtcdStore`, for jobs
that span nodes: no node's loss takes it down). `connect` opens either from the
``RESILIENT_COMM_STORE`` a worker is given (``host:port`` or ``etcd://h1:p1,h2:p2``). Every key lives under a namespace ``ns`` (one per run and
launcher generation)::

    {ns}/epoch                  the latest proposed epoch (a decimal int)
    {ns}/e/{E}/decision         epoch E's decision (JSON), written once, by compare-and-set
    {ns}/e/{E}/joins/{g}        the join records for epoch E of ranks JOIN_GROUP*g .. JOIN_GROUP*g+7,
                                each appended by its rank (one key per node's worth of ranks)
    {ns}/e/{E}/join/{first}.{n} on etcd instead (`Membership.ranged`): the join records of a
                                batch (a node's, written by its agent in one put) of n ranks, the
                                lowest `first`; the decider lists and reads the prefix
    {ns}/e/{E}/world/           store prefix of epoch E's world group when it is built afresh
    {ns}/gone/{rank}            the first evidence that rank is gone (exit or suspicion), by CAS
    {ns}/events/{i}             the i-th event (ranks gone, a decision, the end, a node joining the
                                ring), slot claimed by CAS; every agent waits for the next slot
    {ns}/node/{n}               node n's liveness record (its agent's heartbeat: agent.py)
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
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import hmac
import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar, cast

import torch.distributed as dist

from resilient_comm.elastic.joinkeys import JoinTally, batch_name
from resilient_comm.elastic.policy import Mesh

T = TypeVar("T")
_NO_RECORD = "\x00none"  # never a node record (those are JSON objects)
_MAC = "\n#mac:"  # a sealed value: its text, this, and the hex MAC (Membership._seal)
ENV_TOKEN = "RESILIENT_COMM_TOKEN"


# Keys per call of a many-key read or wait. c10d's TCPStore serves one call of N keys in time
# superlinear in N (measured at 16,384 keys: wait 127 ms, check 96 ms, multi_get 347 ms; in
# 512-key calls 15, 15 and 46 ms), so the decider's reads of every join record go in chunks:
# one 16K-key wait took longer than the decider's 100 ms slice, so it never succeeded.
CHUNK_KEYS = 512
_MIN_WAIT_S = 0.005  # a chunk's wait, at least (one that is there answers at once)

# Join records of JOIN_GROUP consecutive ranks share one key, each rank appending its own
# entry (_ENTRY + sealed record + _END; JSON never holds these control characters): at 16K
# ranks the decider waits for and reads 2,048 keys, not 16,384 (the read was ~1 s of a
# 16K-rank decision on a loaded 2-core machine). Appends are atomic in a TCPStore and a
# compare-and-set loop on etcd, so eight writers per key never lose an entry; bytes that are
# not a whole entry (a stray writer's) cost no other entry.
JOIN_GROUP = 8
_ENTRY, _END = "\x1e", "\x1f"
_JOINS_WITH_PROPOSAL = 64  # join keys put in the proposal's transaction (etcd allows 128 operations)
_JOINS_PER_KEY = 64  # on etcd, join records in one key (a node's batch is its workers': 8)
_ENTRY_RE = re.compile("\x1e([^\x1e\x1f]*)\x1f")


def _chunks(keys: list[str]) -> list[list[str]]:
    return [keys[i:i + CHUNK_KEYS] for i in range(0, len(keys), CHUNK_KEYS)]


_RANK_LISTS = ("members", "lost", "evicted", "joiners", "used_spares", "slots")


def _runs(xs: list[int]) -> str:
    """Consecutive ascending ranks as "a-b": [0, 1, 2, 7, 4, 5] -> "0-2,7,4-5"."""
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def _unruns(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        lo, hi = int(a), int(b or a)
        if hi < lo or hi - lo > 10_000_000:
            raise ValueError(f"bad rank run {part!r}")
        out.extend(range(lo, hi + 1))
    return out


def _dumps(obj: Any) -> str:
    return json.dumps(asdict(obj), sort_keys=True, separators=(",", ":"))


log = logging.getLogger("resilient_comm.membership")
_warned: set[str] = set()  # keys whose malformed value was logged (once each)


def _warn_malformed(key: str, what: str, e: Exception) -> None:
    if key not in _warned and len(_warned) < 10000:
        _warned.add(key)
        log.warning("ignoring the malformed %s at %r: %s", what, key, e)


@functools.cache
def _check(t: str) -> Callable[[object], bool]:
    """Whether a JSON value fits the field annotation `t` of the records below (made once per
    annotation: the decider checks 16K join records at 16K ranks)."""
    if t.endswith(" | None"):
        inner = _check(t[:-7])
        return lambda v: v is None or inner(v)
    if t == "bool":
        return lambda v: v is True or v is False
    if t == "int":
        return lambda v: type(v) is int  # JSON's ints (not bool, a subclass)
    if t == "float":
        return lambda v: type(v) is float or type(v) is int
    if t == "str":
        return lambda v: type(v) is str
    if t.startswith("list[") and t.endswith("]"):
        item = _check(t[5:-1])
        return lambda v: type(v) is list and all(map(item, v))
    if t == "dict[str, int]":
        return lambda v: type(v) is dict and all(type(k) is str and type(x) is int for k, x in v.items())
    raise AssertionError(f"no check for the annotation {t!r}")


@functools.cache
def _fields(cls: type) -> dict[str, tuple[str, Callable[[object], bool]]]:
    return {f.name: (str(f.type), _check(str(f.type))) for f in fields(cls)}


def _record(cls: type[T], d: object) -> T:
    """`cls(**d)` for a JSON object whose fields all have the declared types; else ValueError
    (a value from the store is never trusted to be well-formed)."""
    if type(d) is not dict:
        raise ValueError(f"{cls.__name__}: not a JSON object: {str(d)[:60]!r}")
    types = _fields(cast(type, cls))
    for name, value in d.items():
        if name not in types:
            raise ValueError(f"{cls.__name__}: unknown field {name!r}")
        t, ok = types[name]
        if not ok(value):
            raise ValueError(f"{cls.__name__}.{name}: {str(value)[:40]!r} is not {t}")
    try:
        return cls(**d)
    except TypeError as e:  # a field missing
        raise ValueError(f"{cls.__name__}: {e}") from e


@dataclass(frozen=True)
class Decision:
    """The outcome of an epoch. `members` are launch ranks, in the new rank order."""

    epoch: int
    members: list[int]
    mesh: dict[str, int]
    mode: str  # "init" (fresh group), "shrink" (from the previous epoch's groups), "fail"
    resume_step: int
    lost: list[int] = field(default_factory=list)  # gone: dead or suspected
    evicted: list[int] = field(default_factory=list)  # alive, but leave with a lost rank's replica
    by: int = -1  # the decider's launch rank (-1: the launch itself)
    t: float = 0.0
    failed_at: float = 0.0  # earliest failure time among the lost ranks' evidence (0: unknown)
    note: str = ""  # why, when the mode is "fail"
    joiners: list[int] = field(default_factory=list)  # hot spares that take a lost rank's place here
    sources: list[list[int]] = field(default_factory=list)  # [joiner, donor]: who sends a joiner its state
    restore: str = ""  # "" (nothing to copy), "peer" (joiners copy from `sources`), "checkpoint" (all load)
    ckpt_step: int = -1  # with restore == "checkpoint": the step every member loads
    used_spares: list[int] = field(default_factory=list)  # every spare placed up to this epoch
    slots: list[int] = field(default_factory=list)  # launch rank whose place each member holds ([]: members)
    ckpt_epoch: int = -1  # with a sharded state (reshard.py): the epoch whose mesh wrote that checkpoint

    def mesh_obj(self) -> Mesh:
        return Mesh(**self.mesh)

    def to_json(self) -> str:
        """Rank lists as runs ("0-6143,16384,6145-16383"): at 16K ranks a decision is a few
        hundred bytes, not 100 KB, and every node's agent reads it."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # (asdict deep-copies 16K-rank lists)
        for f in _RANK_LISTS:
            d[f] = _runs(d[f])
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Decision:
        """The decision `text` holds; ValueError if it is not a well-formed one."""
        d = json.loads(text)
        if isinstance(d, dict):
            for f in _RANK_LISTS:
                if isinstance(d.get(f), str):
                    d[f] = _unruns(d[f])
        return _record(cls, d)


@dataclass(frozen=True)
class JoinRecord:
    """What a member brings to an epoch: the groups it holds and how far it got."""

    rank: int
    applied: int  # the epoch whose groups this member holds
    ready: bool  # those groups were built and verified on this member
    committed: int  # last step this member committed (-1: none)
    pending: int | None  # a step it voted for without learning the outcome
    t: float = 0.0

    def to_json(self) -> str:
        return _dumps(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> JoinRecord:
        return _record(cls, json.loads(text))

    def to_entry(self) -> str:
        """The compact form in a join entry: the fields as a JSON array, in their order (at 16K
        ranks the decider parses 16K of them: half the bytes and time of objects)."""
        return json.dumps([self.rank, self.applied, self.ready, self.committed, self.pending, self.t])

    @classmethod
    def from_entry(cls, d: object) -> JoinRecord:
        """A record from its parsed compact form; ValueError unless every field has its type."""
        if type(d) is list and len(d) == 6:
            rank, applied, ready, committed, pending, t = d
            if (type(rank) is int and type(applied) is int and (ready is True or ready is False)
                    and type(committed) is int and (pending is None or type(pending) is int)
                    and type(t) in (int, float)):
                return cls(rank, applied, ready, committed, pending, t)
        raise ValueError(f"not [rank, applied, ready, committed, pending, t]: {str(d)[:60]!r}")


@dataclass(frozen=True)
class Gone:
    """Evidence that a rank is gone. kind: "exit" (the launcher saw the process end; detail
    holds its status) or "suspect" (heartbeat silence or a straggler past its bound)."""

    rank: int
    kind: str
    detail: str
    t: float  # wall time of the failure as best known (exit time, last heartbeat)
    by: str  # "launcher" or "rank N"

    def to_json(self) -> str:
        return _dumps(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> Gone:
        return _record(cls, json.loads(text))

    @classmethod
    def from_dict(cls, d: object) -> Gone:
        return _record(cls, d)


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
        self.store = store
        self.ns = namespace.rstrip("/")
        self._token = os.environ.get(ENV_TOKEN, "") if token is None else token
        self._mac_key = hashlib.sha256(b"resilient_comm membership\0" + self._token.encode()).digest()
        self._tally: JoinTally | None = None  # (etcd) the decider's count of an epoch's join records

    def clone(self, timeout: datetime.timedelta | None = None) -> Membership:
        """The same keys through a new connection (for another thread)."""
        store = self.store.clone()  # type: ignore[attr-defined]  # every c10d store has it; the stubs lag
        if timeout is not None:
            store.set_timeout(timeout)
        return Membership(store, self.ns, token=self._token)

    def _mac(self, key: str, text: str) -> str:
        # The one-shot C digest: the decider checks 16K of these at 16K ranks.
        return hmac.digest(self._mac_key, f"{key}\0{text}".encode(), "sha256").hex()[:32]

    def _seal(self, key: str, text: str) -> str:
        """The value to write at `key` for `text`: sealed with the token's MAC, if there is one."""
        return text + _MAC + self._mac(key, text) if self._token else text

    def _open(self, key: str, value: bytes | str) -> str:
        """The text of a value read at `key`; ValueError if this job has a token and the value
        does not carry its MAC for this key (forged, or another job's)."""
        v = value.decode() if isinstance(value, bytes) else value  # UnicodeDecodeError is a ValueError
        text, sep, mac = v.rpartition(_MAC)
        if not self._token:
            return text if sep else v
        if not sep or not hmac.compare_digest(mac, self._mac(key, text)):
            raise ValueError("it does not carry this job's MAC (not written by a process with the job token: "
                             "forged, or another job's)")
        return text

    def key(self, *parts: object) -> str:
        return "/".join([self.ns, *map(str, parts)])

    # -- epochs and decisions -------------------------------------------------------------

    def start(self, initial: Decision) -> Decision:
        """Record epoch 0 (every rank calls this with the same decision; the first wins)."""
        self.store.compare_set(self.key("epoch"), "", "0")
        k = self.key("e", 0, "decision")
        return self._decision(k, self.store.compare_set(k, "", self._seal(k, initial.to_json())))

    def epoch(self) -> int:
        k = self.key("epoch")
        return _epoch(k, self.store.get(k))

    def propose(self, applied: int) -> int:
        """Propose epoch applied+1 if the current epoch is `applied`; returns the current epoch."""
        k = self.key("epoch")
        return _epoch(k, self.store.compare_set(k, str(applied), str(applied + 1)))

    def decision(self, epoch: int) -> Decision | None:
        k = self.key("e", epoch, "decision")
        v = self._maybe(k)
        return None if v is None else self._decision(k, v)

    def decide(self, decision: Decision) -> Decision:
        """Publish `decision` unless one exists; returns the one that holds."""
        k = self.key("e", decision.epoch, "decision")
        return self._decision(k, self.store.compare_set(k, "", self._seal(k, decision.to_json())))

    def _decision(self, key: str, v: bytes | str) -> Decision:
        """A decision read back; a malformed one is an error naming the key (the decision is
        the authority on membership: it cannot be skipped)."""
        try:
            return Decision.from_json(self._open(key, v))
        except ValueError as e:
            raise dist.DistStoreError(f"the decision at {key!r} is malformed: {e}") from e

    @property
    def ranged(self) -> bool:
        """Whether the store reads every key under a prefix in one request (etcd): the join
        records of one call (a node's batch) are then a key of their own, written with one put
        (not an append's read and compare-and-set, retried while writers race on one key),
        and the decider lists the prefix while it waits and reads it once."""
        return bool(getattr(self.store, "reads_prefixes", False))

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
        puts = self._batch_puts(applied + 1, records)
        head, rest = puts[:_JOINS_WITH_PROPOSAL], puts[_JOINS_WITH_PROPOSAL:]
        value, joined = cast(Any, self.store).advance(k, str(applied), str(applied + 1), head)
        if joined and rest:
            self.store.multi_set([k for k, _ in rest], [v for _, v in rest])
        return _epoch(k, value)

    def join(self, epoch: int, record: JoinRecord) -> None:
        self.join_many(epoch, [record])

    def _entry(self, epoch: int, rec: JoinRecord) -> str:
        """A join record as stored: one whole entry, sealed over its own rank's name."""
        k = self._join_mac_key(epoch, rec.rank)
        return _ENTRY + self._seal(k, rec.to_entry()) + _END

    def _batch_puts(self, epoch: int, records: list[JoinRecord]) -> list[tuple[str, str]]:
        """(`ranged`.) The keys and values that hold `records`: by rank, up to `_JOINS_PER_KEY`
        a key named for its lowest rank and its count. A node's batch is one put: at 16K ranks
        a failure's joins cost etcd 2,048 one-put transactions (1.00 ms of its CPU each on this
        machine, against 1.34 ms with a key per record: `bench etcd-costs`), and the decider
        reads 2,048 values."""
        recs = sorted(records, key=lambda r: r.rank)
        out = []
        for i in range(0, len(recs), _JOINS_PER_KEY):
            part = recs[i:i + _JOINS_PER_KEY]
            out.append((self.key("e", epoch, "join", f"{part[0].rank}.{len(part)}"),
                        "".join(self._entry(epoch, rec) for rec in part)))
        return out

    def join_many(self, epoch: int, records: list[JoinRecord]) -> None:
        """Append each record to its group's key: one call per group (a benchmark's emulated
        workers of a node join in one call, with the bytes each would append); on a `ranged`
        store, put the records' keys (`_batch_puts`; one transaction per 128 keys)."""
        if self.ranged:
            puts = self._batch_puts(epoch, records)
            self.store.multi_set([k for k, _ in puts], [v for _, v in puts])
            return
        entries: dict[int, list[str]] = {}
        for rec in records:
            entries.setdefault(rec.rank // JOIN_GROUP, []).append(self._entry(epoch, rec))
        for g, es in entries.items():
            cast(Any, self.store).append(self.key("e", epoch, "joins", g), "".join(es))  # the stubs lag

    def _join_mac_key(self, epoch: int, rank: int) -> str:
        # What a join entry's MAC is over: the rank's own name, so that an entry cannot be
        # passed off as another rank's or another epoch's.
        return self.key("e", epoch, "join", rank)

    def complete(self, epoch: int, base: list[int], live: list[int],
                 wait_s: float = 0.0) -> tuple[dict[int, JoinRecord], dict[int, Gone]] | None:
        """What the decider of `epoch` needs once every `live` member of `base` has joined:
        their join records and the evidence on the others; None until then. On a TCPStore a
        wait of up to `wait_s` that the store answers when the last group's key lands (no
        polling of absent keys), then the groups read; a group whose key is there but not yet
        each live rank's entry (its node's workers append within milliseconds of each other)
        is read again every 5 ms within `wait_s`. On etcd (`ranged`) a listing of the keys
        written since the last poll (each names how many records it holds: `JoinTally`), and
        once they hold as many as there are live members, one read (the caller paces its
        polls)."""
        end = time.monotonic() + wait_s
        if self.ranged:  # etcd: the keys' names while some records are missing, then one read
            tally = self._tally if self._tally is not None and self._tally.epoch == epoch else JoinTally(epoch)
            self._tally = tally
            tally.note(*cast(Any, self.store).keys_since(self.key("e", epoch, "join") + "/", tally.revision))
            if not tally.due(len(live)):
                return None
        else:
            keys = [self.key("e", epoch, "joins", g) for g in sorted({r // JOIN_GROUP for r in live})]
            if wait_s > 0 and not self.watches:
                try:
                    for part in _chunks(keys):  # a chunk already there answers at once
                        self.store.wait(part, datetime.timedelta(seconds=max(end - time.monotonic(), _MIN_WAIT_S)))
                except dist.DistStoreError:
                    return None  # not all yet: the caller looks at who is live again
            elif not all(self.store.check(part) for part in _chunks(keys)):
                return None
        joined = self.joined(epoch, live, there=True)
        while missing := [r for r in live if r not in joined]:
            if self._tally is not None and self.ranged:
                self._tally.read(len(live))  # not read again until a key is written or a rank is gone
            if self.watches or time.monotonic() + _MIN_WAIT_S > end:
                return None
            time.sleep(_MIN_WAIT_S)  # pacing the re-read of the few groups with an entry to come
            joined.update(self.joined(epoch, missing, there=True))
        alive = set(live)
        return joined, self.gone([r for r in base if r not in alive])

    def joined(self, epoch: int, ranks: list[int], *, there: bool = False) -> dict[int, JoinRecord]:
        """The join records of `ranks` for `epoch` that exist (a rank that joined twice: its
        last). An entry that is malformed, not sealed for its rank, or in another rank's group
        is logged and counts as not there: that rank's own entry still counts when it lands.
        `there`: every group's key is known to exist (read without a check first). On a
        `ranged` store every key under the epoch's prefix is read: a key whose name is not
        `{first}.{n}`, or that does not hold n whole entries, is logged and skipped, and so is
        an entry whose rank is not `first` (the key's first) or above it (the others)."""
        bodies: list[str] = []  # the entries as written
        # The key of each; the group it must be of, or (ranged) the rank it must be (the key's
        # first entry) or be above (-1 - first); and the revision that wrote it (ranged).
        owner: list[tuple[str, int, int]] = []
        if self.ranged:
            prefix = self.key("e", epoch, "join") + "/"
            for key, v, rev in cast(Any, self.store).records(prefix):
                first, n = batch_name(key[len(prefix):])
                text = v.decode(errors="replace")
                found = _ENTRY_RE.findall(text)
                if first < 0 or len(found) != n or text.count(_ENTRY) != n:
                    _warn_malformed(key, "join record", ValueError(
                        f"not {n} whole entries" if first >= 0 else "not a batch's key ({first rank}.{count})"))
                    continue
                bodies += found
                owner += [(key, first, rev)] + [(key, -1 - first, rev)] * (n - 1)
        else:
            groups = sorted({r // JOIN_GROUP for r in ranks})
            keys = [self.key("e", epoch, "joins", g) for g in groups]
            got = (dict(zip(groups, [v for part in _chunks(keys) for v in self.store.multi_get(part)])) if there
                   else self._present(keys, groups))
            for g, v in got.items():
                text = v.decode(errors="replace")
                found = _ENTRY_RE.findall(text)
                if len(found) != text.count(_ENTRY):
                    _warn_malformed(self.key("e", epoch, "joins", g), "join entry", ValueError("not a whole entry"))
                bodies += found
                owner += [(self.key("e", epoch, "joins", g), g, 0)] * len(found)
        all_text = ",".join(bodies)
        texts = [b.rpartition(_MAC)[0] or b for b in bodies] if _MAC in all_text else bodies
        # One parse for all (at 16K members, one per record costs the decider ~0.3 s); only if
        # that fails, one by one.
        try:
            parsed: list[Any] = json.loads("[" + (",".join(texts) if texts is not bodies else all_text) + "]")
        except ValueError:
            parsed = []
        if len(parsed) != len(bodies):
            parsed = [None] * len(bodies)
        want, out, written = set(ranks), {}, {}
        ranged = self.ranged
        for (key, g, rev), body, text, d in zip(owner, bodies, texts, parsed):
            try:
                rec = JoinRecord.from_entry(d if d is not None else json.loads(text))
                if not ranged and rec.rank // JOIN_GROUP != g:
                    raise ValueError(f"rank {rec.rank} is not of this group")
                if ranged and (rec.rank != g if g >= 0 else rec.rank <= -1 - g):
                    raise ValueError(f"rank {rec.rank} is not of this key")
                if self._token:
                    self._open(self._join_mac_key(epoch, rec.rank), body)
            except ValueError as e:
                _warn_malformed(key, "join entry", e)
                continue
            if rec.rank in want and rev >= written.get(rec.rank, 0):  # (a group's: in the order appended)
                out[rec.rank], written[rec.rank] = rec, rev
        return out

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
            mine = self._seal(k, g.to_json())
            held = self.store.compare_set(k, "", mine)
            if held.decode(errors="replace") != mine and self._token and not self._valid(k, held):
                log.warning("replacing the gone record at %r: it does not carry this job's MAC (forged?)", k)
                try:
                    held = self.store.compare_set(k, held.decode(), mine)
                except UnicodeDecodeError:
                    self.store.set(k, mine)  # not text: nobody of the job wrote it (a race is harmless)
                    held = mine.encode()
            if held.decode(errors="replace") == mine:
                first.append(g)
        if first:  # the evidence goes with the event: no agent reads it back
            self.post_event({"kind": "gone", "ranks": [g.rank for g in first], "gone": [asdict(g) for g in first],
                             **({"node": node} if node is not None else {})})
        return [g.rank for g in first]

    def gone(self, ranks: list[int]) -> dict[int, Gone]:
        """The evidence recorded on `ranks` (a malformed record is logged and ignored)."""
        out = {}
        if self.ranged:  # one read of every gone record (a few), not a check per rank
            prefix, want = self.key("gone", ""), set(ranks)
            found = {}
            for k, v in cast(Any, self.store).items(prefix):
                if k[len(prefix):].isdigit() and int(k[len(prefix):]) in want:
                    found[int(k[len(prefix):])] = v
        else:
            found = self._present([self.key("gone", r) for r in ranks], ranks)
        for r, v in found.items():
            try:
                out[r] = Gone.from_json(self._open(self.key("gone", r), v))
            except ValueError as e:
                _warn_malformed(self.key("gone", r), "gone record", e)
        return out

    def post_event(self, payload: dict[str, Any]) -> int:
        """Append an event; returns its index. Slots are claimed by compare-and-set. Writing
        the slot is what wakes every agent (`wait_event`): the poster's cost does not grow
        with the number of nodes."""
        raw = json.dumps(payload, sort_keys=True)
        i = 0
        while self.store.compare_set(k := self.key("events", i), "", text := self._seal(k, raw)).decode(
                errors="replace") != text:
            i += 1
        return i

    @property
    def watches(self) -> bool:
        """Whether the store is etcd (its waits are watches with a bound, its records may hold
        leases), not a c10d TCPStore (whose waits block until the key lands)."""
        return bool(getattr(self.store, "watches_keys", False))

    def event(self, i: int, value: bytes | None = None) -> dict[str, Any] | None:
        """The i-th event, None if there is none yet; a malformed one reads as kind
        "malformed" (logged), so that readers go past it. `value`: the slot's value as a
        watch brought it (not read again)."""
        k = self.key("events", i)
        if value is None and (value := self._maybe(k)) is None:
            return None
        try:
            ev = json.loads(self._open(k, value))
            if not isinstance(ev, dict) or not isinstance(ev.get("kind"), str):
                raise ValueError("not a JSON object with a kind")  # noqa: TRY004
            return ev
        except ValueError as e:
            _warn_malformed(k, "event", e)
            return {"kind": "malformed", "detail": str(e)}

    def _maybe(self, key: str) -> bytes | None:
        """The key's value, None if it is missing: one request on etcd, a check and a read on
        a TCPStore."""
        if self.ranged:
            return cast(Any, self.store).value(key)[0]
        return self._read(key) if self.store.check([key]) else None

    def _read(self, key: str) -> bytes:
        """The value of a key that exists, in one round trip on a TCPStore: a compare_set
        expecting a value no record holds (a get is a wait and then the get, a multi_get
        more). Only for a key known to be there: on a missing key c10d's compare_set wakes
        the key's waiters. At 16K ranks every node's agent reads each event."""
        if self.watches:
            return self.store.get(key)
        return self.store.compare_set(key, _NO_RECORD, _NO_RECORD)

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
        self.store.compare_set(self.key("events", i), _NO_RECORD, _NO_RECORD)

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
            v = self.store.compare_set(key, _NO_RECORD, _NO_RECORD)
            return None if v == _NO_RECORD.encode() else v.decode()
        value, _ = cast(Any, self.store).value(key)
        return None if value is None else bytes(value).decode()

    def register_spare(self, spare_id: int) -> None:
        i = self.store.add(self.key("spare", "n"), 1) - 1
        k = self.key("spare", i)
        self.store.set(k, self._seal(k, str(spare_id)))

    def spares(self) -> list[int]:
        """Ids of every spare that ever registered, in registration order. A malformed id is
        logged and ignored; the ids are read a chunk at a time, and a chunk with none there
        ends the list (a counter far ahead of the registrations costs one chunk of reads)."""
        k = self.key("spare", "n")
        n = self.store.add(k, 0) if self.store.check([k]) else 0
        out = []
        for at in range(0, n, CHUNK_KEYS):
            idx = list(range(at, min(n, at + CHUNK_KEYS)))
            got = self._present([self.key("spare", i) for i in idx], idx)
            if not got:
                break
            for i, v in got.items():
                try:
                    out.append(_int(self._open(self.key("spare", i), v)))
                except ValueError as e:
                    _warn_malformed(self.key("spare", i), "spare id", e)
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
        self.store.set(k, self._seal(k, str(committed)))

    def done(self, ranks: list[int]) -> dict[int, int]:
        """The step each finished rank of `ranks` committed. A counter says when nobody has
        finished (the common case, answered in one call whatever the number of ranks)."""
        if not self.store.add(self.key("done", "n"), 0):
            return {}
        out = {}
        for r, v in self._present([self.key("done", r) for r in ranks], ranks).items():
            try:
                out[r] = _int(self._open(self.key("done", r), v))
            except ValueError as e:
                _warn_malformed(self.key("done", r), "finished step", e)
        return out

    def _valid(self, key: str, value: bytes) -> bool:
        try:
            self._open(key, value)
            return True
        except ValueError:
            return False

    def _present(self, keys: list[str], ranks: list[int]) -> dict[int, bytes]:
        """Values of the keys that exist (get would block on a missing key), read `CHUNK_KEYS`
        at a time."""
        out: dict[int, bytes] = {}
        for at in range(0, len(keys), CHUNK_KEYS):
            ks, rs = keys[at:at + CHUNK_KEYS], ranks[at:at + CHUNK_KEYS]
            if self.store.check(ks):
                out.update(zip(rs, self.store.multi_get(ks)))
                continue
            have = [(r, k) for r, k in zip(rs, ks) if self.store.check([k])]
            if have:
                out.update(zip([r for r, _ in have], self.store.multi_get([k for _, k in have])))
        return out


def _int(v: bytes | str) -> int:
    text = v.decode(errors="replace") if isinstance(v, bytes) else v
    if not text.strip().lstrip("-").isdigit() or len(text) > 20:
        raise ValueError(f"{text[:40]!r} is not an integer")
    return int(text)


def _epoch(key: str, v: bytes | str) -> int:
    try:
        return _int(v)
    except ValueError as e:
        raise dist.DistStoreError(f"the membership's epoch at {key!r} is malformed: {e}") from e


def join_poll_cap_s(members: int) -> float:
    """The longest pause between a decider's polls of the join keys where it must poll (etcd):
    each poll sends every member's key, so at 16K members at most one per 33 ms."""
    return max(0.005, 2e-6 * members)


def connect(spec: str, timeout: datetime.timedelta) -> dist.Store:
    """A client of the job's store: ``host:port`` (the launcher's TCPStore) or
    ``etcd://h1:p1,h2:p2`` (an etcd cluster)."""
    if spec.startswith("etcd://"):
        from resilient_comm.elastic.etcd import EtcdStore

        return EtcdStore(spec.removeprefix("etcd://"), timeout)
    host, sep, port = spec.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bad store address {spec!r} (host:port or etcd://host:port[,host:port...])")
    return dist.TCPStore(host, int(port), None, False, timeout=timeout)


def now() -> float:
    """Wall-clock time, the one clock every process of the job shares (one host; across hosts
    it is as good as their clock sync)."""
    return time.time()


__all__ = ["Decision", "Gone", "JoinRecord", "Membership", "connect", "now"]
