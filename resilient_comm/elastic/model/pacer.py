"""Back-off for polling loops: the commit vote's completion, the decider's polls and re-reads
of the join keys, a finished member's wait for the others. Pure (but for `wait`'s sleep)."""

from __future__ import annotations

import time


class Pacer:
    """Back-off for polling loops (pacing only: what ends a loop is a key or a bound)."""

    def __init__(self, first_s: float = 0.0005, cap_s: float = 0.005) -> None:
        self._d, self._cap = first_s, cap_s

    @property
    def next_s(self) -> float:
        """The next pause."""
        return self._d

    def wait(self) -> None:
        """Sleep the next pause, then lengthen it."""
        time.sleep(self._d)
        self.skip()

    def skip(self) -> None:
        """Lengthen the next pause without sleeping (the caller spent this one waiting elsewhere)."""
        self._d = min(self._cap, self._d * 1.5)


__all__ = ["Pacer"]
