"""Join records on the store: after a failure every surviving member joins the next epoch
with a `JoinRecord`, and the decider waits for the live members' records and reads them.

Two layouts (`Keys.ranged`)::

    {ns}/e/{E}/joins/{g}        on a TCPStore: the join records for epoch E of ranks
                                JOIN_GROUP*g .. JOIN_GROUP*g+7, each appended by its rank
                                (one key per node's worth of ranks)
    {ns}/e/{E}/join/{first}.{n} on etcd: the n records of one batch (a node's, written by its
                                agent in one put), the lowest rank `first`; the decider lists
                                the prefix (`JoinTally`, from the keys' names alone) and reads it

Written by node agents (a node's batch) and workers (a rank joining by itself); waited for
and read by the decider, a worker. Part of `membership.protocol.Membership` (`joins`).
"""

from __future__ import annotations

import datetime
import json
import re
import time
from collections.abc import Callable
from typing import Any, cast

import torch.distributed as dist

from resilient_comm.elastic.membership.keys import MAC_SEP, MIN_WAIT_S, Keys, chunks, warn_malformed
from resilient_comm.elastic.model.pacer import Pacer
from resilient_comm.elastic.model.records import JoinRecord

# Join records of JOIN_GROUP consecutive ranks share one key, each rank appending its own
# entry (ENTRY + sealed record + END; JSON never holds these control characters): at 16K
# ranks the decider waits for and reads 2,048 keys, not 16,384 (the read was ~1 s of a
# 16K-rank decision on a loaded 2-core machine). Appends are atomic in a TCPStore and a
# compare-and-set loop on etcd, so eight writers per key never lose an entry; bytes that are
# not a whole entry (a stray writer's) cost no other entry.
JOIN_GROUP = 8
ENTRY, END = "\x1e", "\x1f"
JOINS_WITH_PROPOSAL = 64  # join keys put in the proposal's transaction (etcd allows 128 operations)
_JOINS_PER_KEY = 64  # on etcd, join records in one key (a node's batch is its workers': 8)
_ENTRY_RE = re.compile("\x1e([^\x1e\x1f]*)\x1f")


def batch_name(name: str) -> tuple[int, int]:
    """(first rank, count) from a join key's name on etcd, ``"{first}.{n}"``; (-1, 0) if it
    is not one."""
    first, dot, n = name.partition(".")
    if dot and first.isdigit() and n.isdigit() and len(first) <= 9 and len(n) <= 3 and int(n) > 0:
        return int(first), int(n)
    return -1, 0


class JoinTally:
    """A decider's running count of an epoch's join records on etcd, from the keys' names
    alone (each says how many records it holds): each poll lists only the keys written since
    the last (`EtcdStore.keys_since`), so that at 16K ranks a poll costs what 2,048 names do
    once, not a count of 16K keys every 33 ms. Once the names add up to the live members the
    decider reads the records; if one is still missing (a rank counted in two keys, a
    malformed key), not again until a key is written or a rank is found gone."""

    def __init__(self, epoch: int) -> None:
        self.epoch, self.revision = epoch, 0
        self._counts: dict[str, int] = {}  # key -> records it holds, by its name
        self._read_for: int | None = None  # live members at the last read that found one missing

    def note(self, keys: list[str], revision: int) -> None:
        for k in keys:
            self._counts[k] = batch_name(k.rpartition("/")[2])[1]
        if keys:
            self._read_for = None
        self.revision = max(self.revision, revision)

    def due(self, live: int) -> bool:
        return sum(self._counts.values()) >= live and self._read_for != live

    def read(self, live: int) -> None:
        self._read_for = live


class JoinKeys:
    """An epoch's join records through `keys` (one store connection). Holds the decider's
    `JoinTally` of the epoch it waits for (etcd)."""

    def __init__(self, keys: Keys) -> None:
        self.k = keys
        self._tally: JoinTally | None = None

    def mac_key(self, epoch: int, rank: int) -> str:
        # What a join entry's MAC is over: the rank's own name, so that an entry cannot be
        # passed off as another rank's or another epoch's.
        return self.k.key("e", epoch, "join", rank)

    def entry(self, epoch: int, rec: JoinRecord) -> str:
        """A join record as stored: one whole entry, sealed over its own rank's name."""
        k = self.mac_key(epoch, rec.rank)
        return ENTRY + self.k.seal(k, rec.to_entry()) + END

    def batch_puts(self, epoch: int, records: list[JoinRecord]) -> list[tuple[str, str]]:
        """(`ranged`.) The keys and values that hold `records`: by rank, up to `_JOINS_PER_KEY`
        a key named for its lowest rank and its count. A node's batch is one put: at 16K ranks
        a failure's joins cost etcd 2,048 one-put transactions (1.00 ms of its CPU each on this
        machine, against 1.34 ms with a key per record: `bench etcd-costs`), and the decider
        reads 2,048 values."""
        recs = sorted(records, key=lambda r: r.rank)
        out = []
        for i in range(0, len(recs), _JOINS_PER_KEY):
            part = recs[i : i + _JOINS_PER_KEY]
            out.append(
                (
                    self.k.key("e", epoch, "join", f"{part[0].rank}.{len(part)}"),
                    "".join(self.entry(epoch, rec) for rec in part),
                )
            )
        return out

    def join_many(self, epoch: int, records: list[JoinRecord]) -> None:
        """Append each record to its group's key: one call per group (a benchmark's emulated
        workers of a node join in one call, with the bytes each would append); on a `ranged`
        store, put the records' keys (`batch_puts`; one transaction per 128 keys)."""
        if self.k.ranged:
            puts = self.batch_puts(epoch, records)
            cast(Any, self.k.store).multi_set([k for k, _ in puts], [v for _, v in puts])
            return
        entries: dict[int, list[str]] = {}
        for rec in records:
            entries.setdefault(rec.rank // JOIN_GROUP, []).append(self.entry(epoch, rec))
        for g, es in entries.items():
            cast(Any, self.k.store).append(self.k.key("e", epoch, "joins", g), "".join(es))  # the stubs lag

    def wait_all(
        self, epoch: int, live: list[int], wait_s: float = 0.0, news: Callable[[float], bool] | None = None
    ) -> dict[int, JoinRecord] | None:
        """The join records of every `live` member once all have joined `epoch`; None until
        then. On a TCPStore a wait of up to `wait_s` that the store answers when the last
        group's key lands (no polling of absent keys), then the groups read; a group whose key
        is there but not yet each live rank's entry (its node's workers append within
        milliseconds of each other) is read again, 0.5 ms after the first read and then
        less often (5 ms at most), within `wait_s`; the pause ends at once, and None is
        returned, where `news(pause_s)` says that news came (a rank lost meanwhile changes
        who is live: right after a death its report lands while the decider waits here for
        the dead rank's join). On etcd
        (`ranged`) a listing of the keys written since the last poll (each names how many
        records it holds: `JoinTally`), and once they hold as many as there are live members,
        one read (the caller paces its polls)."""
        end = time.monotonic() + wait_s
        if self.k.ranged:  # etcd: the keys' names while some records are missing, then one read
            tally = (
                self._tally if self._tally is not None and self._tally.epoch == epoch else JoinTally(epoch)
            )
            self._tally = tally
            tally.note(
                *cast(Any, self.k.store).keys_since(self.k.key("e", epoch, "join") + "/", tally.revision)
            )
            if not tally.due(len(live)):
                return None
        else:
            keys = [self.k.key("e", epoch, "joins", g) for g in sorted({r // JOIN_GROUP for r in live})]
            if wait_s > 0 and not self.k.watches:
                try:
                    for part in chunks(keys):  # a chunk already there answers at once
                        self.k.store.wait(
                            part, datetime.timedelta(seconds=max(end - time.monotonic(), MIN_WAIT_S))
                        )
                except dist.DistStoreError:
                    return None  # not all yet: the caller looks at who is live again
            elif not all(self.k.store.check(part) for part in chunks(keys)):
                return None
        joined = self.joined(epoch, live, there=True)
        pace = Pacer(cap_s=MIN_WAIT_S)  # pacing the re-read of the few groups with an entry to come
        while missing := [r for r in live if r not in joined]:
            if self._tally is not None and self.k.ranged:
                self._tally.read(len(live))  # not read again until a key is written or a rank is gone
            if self.k.watches or time.monotonic() + pace.next_s > end:
                return None
            if news is None:
                pace.wait()
            elif news(pace.next_s):
                return None
            else:
                pace.skip()
            joined.update(self.joined(epoch, missing, there=True))
        return joined

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
        if self.k.ranged:
            prefix = self.k.key("e", epoch, "join") + "/"
            for key, v, rev in cast(Any, self.k.store).records(prefix):
                first, n = batch_name(key[len(prefix) :])
                text = v.decode(errors="replace")
                found = _ENTRY_RE.findall(text)
                if first < 0 or len(found) != n or text.count(ENTRY) != n:
                    warn_malformed(
                        key,
                        "join record",
                        ValueError(
                            f"not {n} whole entries"
                            if first >= 0
                            else "not a batch's key ({first rank}.{count})"
                        ),
                    )
                    continue
                bodies += found
                owner += [(key, first, rev)] + [(key, -1 - first, rev)] * (n - 1)
        else:
            groups = sorted({r // JOIN_GROUP for r in ranks})
            keys = [self.k.key("e", epoch, "joins", g) for g in groups]
            got = (
                dict(zip(groups, [v for part in chunks(keys) for v in self.k.store.multi_get(part)]))
                if there
                else self.k.present(keys, groups)
            )
            for g, v in got.items():
                text = v.decode(errors="replace")
                found = _ENTRY_RE.findall(text)
                if len(found) != text.count(ENTRY):
                    warn_malformed(
                        self.k.key("e", epoch, "joins", g), "join entry", ValueError("not a whole entry")
                    )
                bodies += found
                owner += [(self.k.key("e", epoch, "joins", g), g, 0)] * len(found)
        all_text = ",".join(bodies)
        texts = [b.rpartition(MAC_SEP)[0] or b for b in bodies] if MAC_SEP in all_text else bodies
        # One parse for all (at 16K members, one per record costs the decider ~0.3 s); only if
        # that fails, one by one.
        try:
            parsed: list[Any] = json.loads("[" + (",".join(texts) if texts is not bodies else all_text) + "]")
        except ValueError:
            parsed = []
        if len(parsed) != len(bodies):
            parsed = [None] * len(bodies)
        want: set[int] = set(ranks)
        out: dict[Any, Any] = {}
        written: dict[Any, Any] = {}
        ranged = self.k.ranged
        for (key, g, rev), body, text, d in zip(owner, bodies, texts, parsed):
            try:
                rec = JoinRecord.from_entry(d if d is not None else json.loads(text))
                if not ranged and rec.rank // JOIN_GROUP != g:
                    raise ValueError(f"rank {rec.rank} is not of this group")
                if ranged and (rec.rank != g if g >= 0 else rec.rank <= -1 - g):
                    raise ValueError(f"rank {rec.rank} is not of this key")
                if self.k.token:
                    self.k.open(self.mac_key(epoch, rec.rank), body)
            except ValueError as e:
                warn_malformed(key, "join entry", e)
                continue
            if rec.rank in want and rev >= written.get(rec.rank, 0):  # (a group's: in the order appended)
                out[rec.rank], written[rec.rank] = rec, rev
        return out


__all__ = ["JOIN_GROUP", "JoinKeys", "JoinTally", "batch_name"]
