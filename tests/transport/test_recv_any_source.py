"""Receiving from any source (torch's ``dist.recv(t)`` / ``dist.irecv(t)`` with no src) on
resilient_tcp: the message of whichever rank sends first, its source on the Work
(``work._source_rank()``, what ``dist.recv`` returns), tags honoured, both data paths (the
shared-memory ring and the socket), lazily connected groups; and never a hang: a receive that
nothing answers times out with torch's "Timed out" text, one whose senders all died fails at
once, and a device communicator (the NCCL emulator) refuses it at the call, as
ProcessGroupNCCL does.
"""

from __future__ import annotations

import collections
import datetime
import os
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from resilient_comm.testing import WorkerContext, run_workers, start_workers

TIMEOUT_S = 10.0
LARGE = 3 * 1024 * 1024 // 4  # float32 elements: 3 MiB, through the shm ring where there is one


def _attempt(fn: Callable[[], object]) -> tuple[str, float]:
    """Runs fn(): "no error" or "Type: message", and the seconds it took."""
    t0 = time.monotonic()
    try:
        fn()
        return "no error", time.monotonic() - t0
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}", time.monotonic() - t0


def _values(fn: Callable[..., object], world_size: int) -> list:
    res = run_workers(fn, world_size, timeout_s=60)
    assert all(x.ok for x in res), "\n".join(x.error for x in res if not x.ok)
    return [x.value for x in res]


def _senders_worker(ctx: WorkerContext) -> dict:
    """Rank 0 receives two messages (one small, one 3 MiB, in two rounds) from every other rank,
    in whatever order they come, through recv and irecv alternately; then a tag filter: rank 1's
    message with tag 5 is in front on its stream when rank 0 asks any source for tag 6, which
    only rank 2 sends."""
    ctx.init("resilient_tcp", timeout_s=TIMEOUT_S)
    gloo = dist.new_group(backend="gloo")
    r, n = ctx.rank, ctx.world_size
    out: dict = {}
    got: collections.Counter = collections.Counter()
    wrong = []
    for numel in (7, LARGE):  # a round of small messages, then one of 3 MiB ones
        if r == 0:
            for i in range(n - 1):
                buf = torch.full((numel,), -1.0)
                if i % 2 == 0:
                    src = dist.recv(buf, tag=3)
                else:
                    work = dist.irecv(buf, tag=3)
                    work.wait()
                    src = work._source_rank()
                got[src] += 1
                if not torch.equal(buf, torch.full((numel,), float(src))):
                    wrong.append(f"{numel} elements from rank {src}: bytes are not the sender's")
        else:
            dist.send(torch.full((numel,), float(r)), 0, tag=3)
        dist.barrier(group=gloo)  # the round is over on every rank
    out["sources"] = dict(got)
    out["wrong"] = wrong
    dist.barrier(group=gloo)  # the exchange above is over on every rank
    if r == 1:
        dist.isend(torch.full((4,), 1.0), 0, tag=5).wait()
    dist.barrier(group=gloo)  # rank 1's tag-5 message is on its way to rank 0
    if r == 2:
        dist.send(torch.full((4,), 2.0), 0, tag=6)
    if r == 0:
        buf = torch.zeros(4)
        out["tag6_from"] = dist.recv(buf, tag=6)
        out["tag6_ok"] = bool(torch.equal(buf, torch.full((4,), 2.0)))
        buf = torch.zeros(4)
        dist.recv(buf, 1, tag=5)
        out["tag5_ok"] = bool(torch.equal(buf, torch.full((4,), 1.0)))
    dist.all_reduce(torch.ones(1))  # the group is still whole and in step
    dist.destroy_process_group(gloo)
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size,data_path", [(4, "shm"), (3, "socket")], indirect=["data_path"])
def test_recv_from_any_source_gets_every_senders_message_with_its_source(world_size: int, data_path: str) -> None:
    zero = _values(_senders_worker, world_size)[0]
    assert zero["sources"] == {s: 2 for s in range(1, world_size)}, zero
    assert zero["wrong"] == []
    assert zero["tag6_from"] == 2 and zero["tag6_ok"] and zero["tag5_ok"], zero


def _lazy_worker(ctx: WorkerContext) -> dict:
    """RESILIENT_COMM_TCP_FULL_MESH=2, 5 ranks: each rank connects its ring neighbours only. Rank 0
    hears any source (every other rank is higher and dials it); rank 3 has a lower rank it is not
    connected to (1), and says so at the call instead of waiting."""
    ctx.init("resilient_tcp", timeout_s=TIMEOUT_S)
    r = ctx.rank
    out: dict = {}
    if r == 0:
        got = []
        for _ in range(ctx.world_size - 1):
            buf = torch.zeros(3)
            src = dist.recv(buf)
            got.append((src, buf[0].item()))
        out["got"] = sorted(got)
    else:
        dist.send(torch.full((3,), float(r)), 0)
    if r == 3:
        out["lazy_error"], out["lazy_s"] = _attempt(lambda: dist.recv(torch.zeros(3)))
    dist.all_reduce(torch.ones(1))  # the refusal left the group usable
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(90)
def test_lazily_connected_group_hears_higher_ranks_and_refuses_unconnected_lower_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RESILIENT_COMM_TCP_FULL_MESH", "2")
    values = _values(_lazy_worker, 5)
    assert values[0]["got"] == [(s, float(s)) for s in range(1, 5)]
    err, took = values[3]["lazy_error"], values[3]["lazy_s"]
    # rank 3 dialled rank 0 to send to it, and is a ring neighbour of 2 and 4: rank 1 is missing
    assert "lower rank(s) 1 are not" in err and "RESILIENT_COMM_TCP_FULL_MESH" in err and "pass src" in err, err
    assert took < 1.0, took


def _timeout_worker(ctx: WorkerContext) -> dict:
    """Nobody sends: rank 0's receive times out at the group's 1 s deadline with torch's text."""
    ctx.init("resilient_tcp", timeout_s=TIMEOUT_S)
    quick = dist.new_group(backend="resilient_tcp", timeout=datetime.timedelta(seconds=1))
    gloo = dist.new_group(backend="gloo")
    out: dict = {}
    if ctx.rank == 0:
        out["error"], out["took"] = _attempt(lambda: dist.recv(torch.zeros(2), group=quick))
    dist.barrier(group=gloo)
    dist.all_reduce(torch.ones(1))  # the default group is untouched
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
def test_recv_from_any_source_that_nothing_answers_times_out() -> None:
    zero = _values(_timeout_worker, 3)[0]
    err, took = zero["error"], zero["took"]
    assert "Timed out" in err, err
    assert 0.9 <= took < 2.5, took


def _dying_worker(ctx: WorkerContext) -> dict:
    ctx.init("resilient_tcp", timeout_s=30.0)
    dist.all_reduce(torch.ones(1))  # connected
    if ctx.rank == 1:
        ctx.store().set("waiting/1", "1")
        time.sleep(60)  # SIGKILLed by the test
    ctx.store().set("waiting/0", "1")
    error, took = _attempt(lambda: dist.recv(torch.zeros(2)))
    return {"error": error, "took": took}


@pytest.mark.timeout(60)
def test_recv_from_any_source_fails_at_once_when_every_sender_died() -> None:
    with start_workers(_dying_worker, 2, timeout_s=40) as w:
        w.wait_ranks("waiting")  # rank 0 is in (or about to enter) its receive: either way it must fail
        killed = time.monotonic()
        w.kill(1)
        res = w.join()
    err, took = res[0].value["error"], res[0].value["took"]
    assert "hung up" in err or "rank 1" in err, err
    assert time.monotonic() - killed < 10.0  # far below the 30 s op timeout
    assert took < 10.0, took


def _nccl_emulated_worker(ctx: WorkerContext) -> str:
    os.environ["RESILIENT_COMM_NCCL_EMULATE"] = "1"
    ctx.init("resilient_nccl", timeout_s=TIMEOUT_S)
    msg, _ = _attempt(lambda: dist.recv(torch.zeros(2)))
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()
    return msg


@pytest.mark.timeout(60)
def test_device_communicator_refuses_recv_from_any_source_at_the_call() -> None:
    for msg in _values(_nccl_emulated_worker, 2):
        assert msg.startswith("ValueError") and "any source" in msg and "pass src" in msg, msg
