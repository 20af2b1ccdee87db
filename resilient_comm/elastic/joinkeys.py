"""The join records' keys on etcd (`Membership.ranged`): ``{ns}/e/{E}/join/{first}.{n}``
holds the n records of one batch (a node's, written by its agent in one put), the lowest
rank `first`; and the decider's running count of them from the names alone."""

from __future__ import annotations


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


__all__ = ["JoinTally", "batch_name"]
