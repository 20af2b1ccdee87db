"""A rank's compute per step, as fail-slow detection compares it (`pace_watch.py`): timed where
the compute runs. On the CPU that is the host's wall time from the step's start to its commit;
on an accelerator, the device's, between two events on the step's current stream. Runs in a
worker, on its training thread.

[Note: timing a step on the device] A GPU step's host code only launches kernels: it returns
long before the device is done, so the host's time from the step's start to the commit is
the launch time, the same on a healthy GPU and on a throttled one. The device's time is read
from two events recorded on the step's current stream, one at the step's start and one at
the commit: their elapsed time is how long the stream took from the one to the other, its
kernels and any gap where it waited for the host to launch more (a slow host slows the
step too). Reading it must not make the training thread wait for the device, which the
host runs ahead of: the end event is only *recorded* at the commit, and a step's time is read
at a later commit, once both its events are found complete (`query`, which does not block).
The window's judgement needs every step's time: it synchronizes the ends not read yet, in
practice the last step's alone, which has completed already: the timer's device is the one
the commit vote runs on, and the host polls the vote to its end, which the device orders
after the step's gradients (`commit_vote.py`). A step that starts while the device still
runs the previous step's update starts when the stream reaches it: the update is in neither
step's compute, as on the host. Work the step puts on other streams counts as far as the
current stream waits for it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, Self, TypeVar

import torch


class StepTimer(Protocol):
    """Times steps one after the other: `start` at a step's start, `stop` at its commit (a
    `stop` with no `start` since the last one times nothing; a second `start` discards the
    first, as a step that runs again does). Called from the training thread only."""

    @property
    def pending(self) -> int:
        """Steps stopped whose time `take` has not returned yet."""
        ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def take(self, wait: bool) -> list[float]:
        """The times (seconds) of the steps stopped since the last `take`, oldest first: those
        that can be read without waiting, or all of them with `wait`."""
        ...

    def clear(self) -> None:
        """Forget every step started or stopped."""
        ...


class HostTimer:
    """A `StepTimer` on the host's monotonic clock: the compute of a CPU step."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._started: float | None = None
        self._times: list[float] = []

    @property
    def pending(self) -> int:
        return len(self._times)

    def start(self) -> None:
        self._started = self._clock()

    def stop(self) -> None:
        if self._started is not None:
            self._times.append(self._clock() - self._started)
            self._started = None

    def take(self, wait: bool) -> list[float]:
        times, self._times = self._times, []
        return times

    def clear(self) -> None:
        self._started, self._times = None, []


class DeviceEvent(Protocol):
    """What `EventTimer` needs of an event recorded on a stream (`torch.Event`'s methods)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, other: Self) -> float: ...  # milliseconds from this event to `other`


E = TypeVar("E", bound=DeviceEvent)


class EventTimer(Generic[E]):
    """A `StepTimer` of events on a device's stream ([Note: timing a step on the device]).
    `record()` returns a new timing event recorded on the current stream."""

    def __init__(self, record: Callable[[], E]) -> None:
        self._record = record
        self._started: E | None = None
        self._steps: deque[tuple[E, E]] = deque()  # stopped, not taken: oldest first

    @property
    def pending(self) -> int:
        return len(self._steps)

    def start(self) -> None:
        self._started = self._record()

    def stop(self) -> None:
        if self._started is not None:
            self._steps.append((self._started, self._record()))
            self._started = None

    def take(self, wait: bool) -> list[float]:
        times = []
        while self._steps:
            begin, end = self._steps[0]
            if wait:
                end.synchronize()
                begin.synchronize()  # done already where both are on one stream
            elif not (end.query() and begin.query()):
                break  # the later steps' ends come later still
            times.append(begin.elapsed_time(end) / 1e3)
            self._steps.popleft()
        return times

    def clear(self) -> None:
        self._started = None
        self._steps.clear()


def step_timer(device: torch.device) -> StepTimer:
    """The timer of the compute on `device`: the host's clock on the CPU, the device's events
    elsewhere (any accelerator torch has events and streams for: CUDA, an NPU, ...)."""
    if device.type == "cpu":
        return HostTimer()

    def record() -> torch.Event:
        event = torch.Event(device, enable_timing=True)
        event.record(torch.accelerator.current_stream(device))
        return event

    return EventTimer(record)


__all__ = ["DeviceEvent", "EventTimer", "HostTimer", "StepTimer", "step_timer"]
