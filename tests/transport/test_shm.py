"""The TCP transport's same-host data path (csrc/transport/tcp/shm.h): ranks on one host move
large payloads through shared-memory rings, the socket staying the control and liveness
channel. Shown here with real processes: the rings are set up (and not with
RESILIENT_COMM_SHM=0), a SIGKILL in the middle of a 64 MiB all_reduce on them fails every
survivor within 2 s and the survivors shrink to a working group that still uses them (and the
dead peer's rings are unmapped), a survivor's buffer is never written after its op failed even
while the peer that stalled it goes on, and a malformed offer is a clear error."""

from __future__ import annotations

import signal
import time
import zlib

import pytest
import torch
import torch.distributed as dist

import resilient_comm
from resilient_comm.testing import WorkerContext, all_reduce_until_failure, run_workers, start_workers

MIB = 1 << 20
DETECT_BOUND_S = 2.0


def _ring_maps() -> int:
    """How many shared-memory rings this process has mapped (its own and its peers')."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "resilient_comm-ring" in line)


def _peers_and_sum(ctx: WorkerContext, shm: str) -> dict:
    import os

    os.environ["RESILIENT_COMM_SHM"] = shm  # read when the communicator is built
    ctx.init("resilient_tcp", timeout_s=30)
    x = (torch.arange(4 * MIB) % 1000).float() + ctx.rank  # 16 MiB: through the rings
    dist.all_reduce(x)
    want = sum((torch.arange(4 * MIB) % 1000).float() + r for r in range(ctx.world_size))
    from resilient_comm.api import resilient_backend

    rates = {p: sum(counts) for p, counts in resilient_backend(None).receive_rates()}
    out = {"peers": resilient_comm.shm_peers(), "ok": bool(torch.equal(x, want)), "maps": _ring_maps(),
           "rates": rates}
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shm", ["1", "0"])
def test_same_host_peers_share_rings_unless_turned_off(shm: str) -> None:
    results = run_workers(_peers_and_sum, 3, shm, timeout_s=45)
    for r in results:
        v = r.value
        assert v["ok"], f"rank {r.rank}: wrong all_reduce result"
        others = [p for p in range(3) if p != r.rank]
        assert v["peers"] == (others if shm == "1" else []), v
        # Each pair: our ring, mapped by us, and the peer's.
        assert v["maps"] == (2 * len(others) if shm == "1" else 0), v
        # Large frames through a socket are timed (a slow link shows in them), the rings' not.
        assert (v["rates"] == {}) if shm == "1" else (v["rates"] and set(v["rates"]) <= set(others)), v


def _loop_64mib_until_failure(ctx: WorkerContext) -> dict:
    ctx.init("resilient_tcp", timeout_s=30)
    store = ctx.store()

    def built() -> None:  # (the group is built by its first op)
        assert len(resilient_comm.shm_peers()) == ctx.world_size - 1

    err, failed_at = all_reduce_until_failure(store, ctx.rank, 16 * MIB, announce_after=2, on_announce=built,
                                              catch=(resilient_comm.CommError,))  # 64 MiB
    pg = resilient_comm.shrink([ctx.world_size - 1])
    x = torch.full((4 * MIB,), float(ctx.rank))  # 16 MiB: the rings again
    dist.all_reduce(x)
    del pg
    import gc

    gc.collect()
    return {"failed_at": failed_at, "error": err, "sum": x[0].item(), "exact": bool((x == x[0]).all()),
            "peers": resilient_comm.shm_peers(), "maps": _ring_maps()}


@pytest.mark.timeout(90)
def test_sigkill_mid_64mib_allreduce_on_rings_fails_every_survivor_fast_and_they_shrink() -> None:
    world, victim = 3, 2
    with start_workers(_loop_64mib_until_failure, world, timeout_s=75) as w:
        w.wait_ranks("looping")
        w.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        results = w.join()
    for r in results[:victim]:
        assert r.ok, f"rank {r.rank}: {r.error}"
        v = r.value
        delay = v["failed_at"] - killed_at
        assert delay < DETECT_BOUND_S, f"rank {r.rank} noticed the kill after {delay:.2f} s: {v['error']}"
        assert v["error"].startswith("PeerFailureError: PeerFailure: resilient_tcp all_reduce #"), v["error"]
        assert v["sum"] == 1.0 and v["exact"], v  # ranks 0 + 1
        assert v["peers"] == [1 - r.rank], v  # the survivor pair still moves payloads in shared memory
        # The victim's rings were unmapped with the failed group: only the survivors' pair is left.
        assert v["maps"] == 2, v


def _stalled_peer(ctx: WorkerContext) -> dict:
    """Every rank loops 32 MiB all_reduces; the test SIGSTOPs rank 2 in the middle of one, so
    ranks 0 and 1 time out; then it lets rank 2 go, which carries on with its part of that op
    (its pieces of the rings, its sends) until it fails too. Nothing may touch the survivors'
    buffers after their op failed."""
    ctx.init("resilient_tcp", timeout_s=3)
    store = ctx.store()
    t = torch.full((8 * MIB,), float(ctx.rank + 1))
    i = 0
    try:
        while True:
            dist.all_reduce(t)
            i += 1
            if i == 2:
                store.set(f"looping/{ctx.rank}", "1")
    except resilient_comm.CommError as e:
        err = f"{type(e).__name__}: {e}"
    before = zlib.crc32(t.numpy().tobytes())
    store.set(f"failed/{ctx.rank}", "1")
    if ctx.rank != 2:
        store.wait(["failed/2"])  # rank 2 ran on and finished its op, with an error
    return {"error": err, "unchanged": zlib.crc32(t.numpy().tobytes()) == before}


@pytest.mark.timeout(90)
def test_a_failed_survivors_buffer_is_never_written_afterwards() -> None:
    with start_workers(_stalled_peer, 3, timeout_s=75) as w:
        w.wait_ranks("looping")
        w.kill(2, signal.SIGSTOP)
        w.wait_ranks("failed", ranks=[0, 1])
        w.kill(2, signal.SIGCONT)
        results = w.join()
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error}"
        assert r.value["unchanged"], f"rank {r.rank}'s buffer changed after its all_reduce failed"
    for r in results[:2]:
        assert "Timeout" in r.value["error"] or "rank 2" in r.value["error"], r.value
