"""The membership's keys on a c10d Store: their names under a namespace, their values sealed
with the job token's MAC, and the reads that never block on a missing key.

Shared by `membership.protocol` and `membership.joins`, in every process that touches the
store: node agents (`node`) and workers (`worker`).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Any, cast

import torch.distributed as dist

NO_RECORD = "\x00none"  # never a record's value (those are JSON, or a decimal)
MAC_SEP = "\n#mac:"  # a sealed value: its text, this, and the hex MAC (`Keys.seal`)

# Keys per call of a many-key read or wait. c10d's TCPStore serves one call of N keys in time
# superlinear in N (measured at 16,384 keys: wait 127 ms, check 96 ms, multi_get 347 ms; in
# 512-key calls 15, 15 and 46 ms), so the decider's reads of every join record go in chunks:
# one 16K-key wait took longer than the decider's 100 ms slice, so it never succeeded.
CHUNK_KEYS = 512
MIN_WAIT_S = 0.005  # a chunk's wait, at least (one that is there answers at once)

log = logging.getLogger("resilient_comm.membership")
_warned: set[str] = set()  # keys whose malformed value was logged (once each)


def chunks(keys: list[str]) -> list[list[str]]:
    return [keys[i : i + CHUNK_KEYS] for i in range(0, len(keys), CHUNK_KEYS)]


def warn_malformed(key: str, what: str, e: Exception) -> None:
    """Log a malformed value once per key (a value from the store is never trusted)."""
    if key not in _warned and len(_warned) < 10000:
        _warned.add(key)
        log.warning("ignoring the malformed %s at %r: %s", what, key, e)


def as_int(v: bytes | str) -> int:
    """A decimal value read from the store; ValueError if it is not one."""
    text = v.decode(errors="replace") if isinstance(v, bytes) else v
    if not text.strip().lstrip("-").isdigit() or len(text) > 20:
        raise ValueError(f"{text[:40]!r} is not an integer")
    return int(text)


def as_epoch(key: str, v: bytes | str) -> int:
    """The epoch counter's value; a malformed one is a store error naming the key."""
    try:
        return as_int(v)
    except ValueError as e:
        raise dist.DistStoreError(f"the membership's epoch at {key!r} is malformed: {e}") from e


class Keys:
    """The namespace's keys on one store connection. `token`: the job token; with one, values
    are written sealed (`seal`) and read back only with a valid MAC (`open`)."""

    def __init__(self, store: dist.Store, namespace: str, token: str) -> None:
        self.store = store
        self.ns = namespace.rstrip("/")
        self.token = token
        self._mac_key = hashlib.sha256(b"resilient_comm membership\0" + token.encode()).digest()

    def key(self, *parts: object) -> str:
        return "/".join([self.ns, *map(str, parts)])

    # -- seals ----------------------------------------------------------------------------

    def _mac(self, key: str, text: str) -> str:
        # The one-shot C digest: the decider checks 16K of these at 16K ranks.
        return hmac.digest(self._mac_key, f"{key}\0{text}".encode(), "sha256").hex()[:32]

    def seal(self, key: str, text: str) -> str:
        """The value to write at `key` for `text`: sealed with the token's MAC, if there is one."""
        return text + MAC_SEP + self._mac(key, text) if self.token else text

    def open(self, key: str, value: bytes | str) -> str:
        """The text of a value read at `key`; ValueError if this job has a token and the value
        does not carry its MAC for this key (forged, or another job's)."""
        v = value.decode() if isinstance(value, bytes) else value  # UnicodeDecodeError is a ValueError
        text, sep, mac = v.rpartition(MAC_SEP)
        if not self.token:
            return text if sep else v
        if not sep or not hmac.compare_digest(mac, self._mac(key, text)):
            raise ValueError(
                "it does not carry this job's MAC (not written by a process with the job token: "
                "forged, or another job's)"
            )
        return text

    def valid(self, key: str, value: bytes) -> bool:
        try:
            self.open(key, value)
            return True
        except ValueError:
            return False

    # -- what the store is ----------------------------------------------------------------

    @property
    def ranged(self) -> bool:
        """Whether the store reads every key under a prefix in one request (etcd): the join
        records of one call (a node's batch) are then a key of their own, written with one put
        (not an append's read and compare-and-set, retried while writers race on one key),
        and the decider lists the prefix while it waits and reads it once."""
        return bool(getattr(self.store, "reads_prefixes", False))

    @property
    def watches(self) -> bool:
        """Whether the store is etcd (its waits are watches with a bound, its records may hold
        leases), not a c10d TCPStore (whose waits block until the key lands)."""
        return bool(getattr(self.store, "watches_keys", False))

    # -- reads ----------------------------------------------------------------------------

    def maybe(self, key: str) -> bytes | None:
        """The key's value, None if it is missing: one request on etcd, a check and a read on
        a TCPStore."""
        if self.ranged:
            return cast(Any, self.store).value(key)[0]
        return self.read(key) if self.store.check([key]) else None

    def read(self, key: str) -> bytes:
        """The value of a key that exists, in one round trip on a TCPStore: a compare_set
        expecting a value no record holds (a get is a wait and then the get, a multi_get
        more). Only for a key known to be there: on a missing key c10d's compare_set wakes
        the key's waiters. At 16K ranks every node's agent reads each event."""
        if self.watches:
            return self.store.get(key)
        return self.store.compare_set(key, NO_RECORD, NO_RECORD)

    def present(self, keys: list[str], ranks: list[int]) -> dict[int, bytes]:
        """Values of the keys that exist (get would block on a missing key), read `CHUNK_KEYS`
        at a time."""
        out: dict[int, bytes] = {}
        for at in range(0, len(keys), CHUNK_KEYS):
            ks, rs = keys[at : at + CHUNK_KEYS], ranks[at : at + CHUNK_KEYS]
            if self.store.check(ks):
                out.update(zip(rs, self.store.multi_get(ks)))
                continue
            have = [(r, k) for r, k in zip(rs, ks) if self.store.check([k])]
            if have:
                out.update(zip([r for r, _ in have], self.store.multi_get([k for _, k in have])))
        return out


__all__ = [
    "CHUNK_KEYS",
    "MAC_SEP",
    "MIN_WAIT_S",
    "NO_RECORD",
    "Keys",
    "as_epoch",
    "as_int",
    "chunks",
    "warn_malformed",
]
