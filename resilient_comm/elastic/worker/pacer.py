"""Back-off for a worker's polling loops: the commit vote's completion, the decider's polls of
the join keys, a finished member's wait for the others. Runs in a worker."""

from __future__ import annotations

import time


class Pacer:
    """Back-off for polling loops (pacing only: what ends a loop is a key or a bound)."""

    def __init__(self, first_s: float = 0.0005, cap_s: float = 0.005) -> None:
        self._d, self._cap = first_s, cap_s

    def wait(self) -> None:
        time.sleep(self._d)
        self._d = min(self._cap, self._d * 1.5)


__all__ = ["Pacer"]
