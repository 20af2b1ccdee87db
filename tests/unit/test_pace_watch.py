"""One member's side of fail-slow detection (`elastic/worker/pace_watch.py`, `step_timer.py`):
a step's compute timed where it runs (on a device: its events, read without making the host
wait), and a world whose backend gives no receive rates said once. The device is emulated: a
stream on a fake clock whose work ends after its launch returns, as a GPU's does."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient_comm.elastic.model.pace import PaceConfig, PaceVerdict
from resilient_comm.elastic.model.policy import Mesh
from resilient_comm.elastic.worker import pace_watch
from resilient_comm.elastic.worker.pace_watch import PaceWatch
from resilient_comm.elastic.worker.step_timer import EventTimer, HostTimer, StepTimer, step_timer

GPU = torch.device("cuda", 0)  # only named: the fake stream stands in for it


class FakeStream:
    """A device stream on a fake clock (seconds). `launch(s)` queues s seconds of device work
    and returns at once, as a kernel launch does; the host's clock moves by `host(s)` and by
    waiting for an event (`synchronize`, or `vote`: the commit vote waits for the step)."""

    def __init__(self) -> None:
        self.now = 0.0  # the host's clock
        self.tail = 0.0  # when the work queued so far ends on the device
        self.waits = 0  # host waits on an event that had not completed

    def launch(self, s: float) -> None:
        self.tail = max(self.tail, self.now) + s

    def host(self, s: float) -> None:
        self.now += s

    def vote(self) -> None:
        self.now = max(self.now, self.tail)

    def record(self) -> FakeEvent:
        return FakeEvent(self, max(self.tail, self.now))


class FakeEvent:
    def __init__(self, stream: FakeStream, at: float) -> None:
        self.stream, self.at = stream, at

    def query(self) -> bool:
        return self.stream.now >= self.at

    def synchronize(self) -> None:
        if not self.query():
            self.stream.waits += 1
            self.stream.now = self.at

    def elapsed_time(self, other: FakeEvent) -> float:
        return (other.at - self.at) * 1e3


def _step(timer: StepTimer, stream: FakeStream, device_s: float, host_s: float) -> None:
    timer.start()
    stream.launch(device_s)
    stream.host(host_s)
    timer.stop()


@pytest.mark.timeout(10)
def test_the_device_time_is_read_once_the_device_is_done_and_the_host_does_not_wait_for_it() -> None:
    stream = FakeStream()
    timer = EventTimer(stream.record)
    _step(timer, stream, device_s=0.040, host_s=0.002)
    assert timer.take(wait=False) == [] and timer.pending == 1, "the device is still at it"
    assert stream.now == pytest.approx(0.002) and stream.waits == 0, "reading did not wait"
    stream.vote()
    _step(timer, stream, device_s=0.030, host_s=0.001)
    assert timer.take(wait=False) == [pytest.approx(0.040)], "the first step's device time, not its launch's"
    assert timer.pending == 1
    assert timer.take(wait=True) == [pytest.approx(0.030)] and stream.waits == 1, "waited for the last"
    # A host slower than its device: the stream idles until launched, and that counts.
    _step(timer, stream, device_s=0.001, host_s=0.020)
    stream.vote()
    assert timer.take(wait=True) == [pytest.approx(0.020)] and stream.waits == 1, "done by the vote: no wait"


@pytest.mark.timeout(10)
def test_a_step_that_runs_again_or_a_stop_without_a_start_times_nothing_twice() -> None:
    clock = [0.0]
    timer = HostTimer(lambda: clock[0])
    timer.start()
    clock[0] = 5.0  # the step failed and runs again: its first start goes
    timer.start()
    clock[0] = 5.5
    timer.stop()
    timer.stop()
    assert timer.pending == 1 and timer.take(wait=False) == [0.5]
    timer.start()
    timer.clear()
    timer.stop()
    assert timer.take(wait=True) == []


@pytest.mark.timeout(10)
def test_pace_watch_notes_the_device_time_and_judges_a_whole_window(
    monkeypatch: pytest.MonkeyPatch, world: dist.ProcessGroup
) -> None:
    stream = FakeStream()
    made: list[torch.device] = []

    def fake_timer(device: torch.device) -> StepTimer:
        made.append(device)
        return EventTimer(stream.record)

    monkeypatch.setattr(pace_watch, "step_timer", fake_timer)
    watch = PaceWatch(PaceConfig(window=3), 0)
    judged: list[dict[int, float]] = []
    judge = watch.pace.judge

    def seen(step: int, compute_s: dict[int, float], *links: Any) -> PaceVerdict:
        judged.append(compute_s)
        return judge(step, compute_s, *links)

    monkeypatch.setattr(watch.pace, "judge", seen)
    for device_s in (0.040, 0.050, 0.060):
        assert not watch.due()
        watch.step_started(GPU)
        stream.launch(device_s)
        stream.host(0.001)
        watch.step_computed()
        stream.vote()
    assert watch.due() and made == [GPU]
    watch.judge(2, world, [0], Mesh.for_world(1), lambda: 0)
    assert judged == [{0: pytest.approx(0.050)}], "the device's median, not the host's 1 ms"
    assert stream.waits == 0 and not watch.due()


@pytest.mark.timeout(10)
def test_with_the_window_off_nothing_is_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_timer(device: torch.device) -> StepTimer:
        raise AssertionError("no timer where detection is off")

    monkeypatch.setattr(pace_watch, "step_timer", no_timer)
    watch = PaceWatch(PaceConfig(), 0)
    for _ in range(100):
        watch.step_started(GPU)
        watch.step_computed()
    assert not watch.due()


@pytest.mark.timeout(10)
def test_a_world_whose_backend_gives_no_receive_rates_is_said_once(
    world: dist.ProcessGroup, caplog: pytest.LogCaptureFixture
) -> None:
    watch = PaceWatch(PaceConfig(window=1), 0)
    events: list[tuple[str, dict[str, Any]]] = []
    caplog.set_level(logging.WARNING, "resilient_comm.elastic")

    def emit(event: str, **info: Any) -> None:
        events.append((event, info))

    for step in range(3):
        watch.step_started(torch.device("cpu"))
        watch.step_computed()
        assert watch.window_end(step, world, [0], Mesh.for_world(1), lambda: 0, emit) == []
    told = [i for e, i in events if e == "pace.no_link_rates"]
    assert len(told) == 1 and "does not use a resilient_comm backend" in told[0]["error"], events
    said = [r.getMessage() for r in caplog.records if "receive rates" in r.getMessage()]
    assert len(said) == 1 and "ProcessGroupGloo" in said[0] and "slow links go unreported" in said[0], said
    assert [e for e, _ in events].count("pace.window") == 3, "every window is judged still"


@pytest.mark.timeout(10)
def test_step_timer_picks_the_host_clock_on_the_cpu_and_events_elsewhere() -> None:
    assert isinstance(step_timer(torch.device("cpu")), HostTimer)
    assert isinstance(step_timer(GPU), EventTimer), "made without touching the device"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(30)
def test_on_a_gpu_a_step_is_its_kernels_time_not_their_launch() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    timer = step_timer(device)
    torch.cuda.synchronize(device)
    t0 = time.monotonic()
    timer.start()
    torch.cuda._sleep(100_000_000)  # ~50 ms of a kernel at 2 GHz; its launch takes microseconds
    timer.stop()
    host_s = time.monotonic() - t0
    assert timer.take(wait=False) == [], "the kernel still runs: nothing waited for it"
    (device_s,) = timer.take(wait=True)
    print(f"[pace] a 1e8-cycle kernel: launched in {host_s * 1e3:.3f} ms, timed at {device_s * 1e3:.1f} ms")
    assert device_s > 0.01 and device_s > 10 * host_s


@pytest.fixture
def world() -> Iterator[dist.ProcessGroup]:
    """A world of one on gloo: a backend that is not resilient_comm's."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        assert group is not None
        yield group
    finally:
        dist.destroy_process_group()
