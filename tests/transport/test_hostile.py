"""What a stray or hostile process on the same host (loopback only) can do to a build: a
connection that never sends its Hello (a port scanner, a load balancer's health check, a
half-open socket), one that sends garbage, one that connects and closes. None of them may
stall or fail a build of the real members: Hellos are read side by side, each bounded, and a
foreign one is dropped (issue #16). Listeners are bound to the address they publish."""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient_comm.testing import WorkerContext, run_workers

OP_TIMEOUT_S = 30.0


def _listening_ports() -> list[tuple[str, int]]:
    """The TCP listeners of this process: (address, port), from /proc."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = []
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN, ours
                hexip, hexport = fields[1].split(":")
                ip = socket.inet_ntoa(bytes.fromhex(hexip)[::-1])
                out.append((ip, int(hexport, 16)))
    return out


def _strays_then_split(ctx: WorkerContext) -> dict:
    import resilient_comm

    ctx.init("resilient_tcp", timeout_s=OP_TIMEOUT_S)
    dist.all_reduce(torch.ones(4))
    store = ctx.store()
    strays: list[socket.socket] = []
    listeners = _listening_ports()
    if ctx.rank == 0:
        for ip, port in listeners:  # what a scanner would find
            target = ("127.0.0.1" if ip == "0.0.0.0" else ip, port)
            for payload in (None, b"GET / HTTP/1.0\r\n\r\n", b"\x00" * 64, b"close"):
                s = socket.create_connection(target, timeout=5)
                if payload == b"close":
                    s.close()
                    continue
                if payload:
                    s.sendall(payload)
                strays.append(s)  # kept open: idle, or after its garbage
        store.set("strays/ready", "1")
    store.wait(["strays/ready"])
    # A split builds its connections afresh: rank 1 dials rank 0, whose listener holds the
    # strays ahead of it in its backlog.
    t0 = time.monotonic()
    sub = resilient_comm.split(0)
    x = torch.full((3,), float(ctx.rank + 1))
    dist.all_reduce(x, group=sub)
    took = time.monotonic() - t0
    dist.destroy_process_group()
    for s in strays:
        s.close()
    return {"took": took, "sum": x.tolist(), "strays": len(strays), "listeners": listeners}


@pytest.mark.timeout(120)
def test_stray_idle_and_garbage_connections_never_stall_or_fail_a_build() -> None:
    for r in run_workers(_strays_then_split, 2, timeout_s=90):
        assert r.ok, r.error
        v = r.value
        assert v["sum"] == [3.0, 3.0, 3.0], v
        # Before: the build read the idle connection's Hello first, until the op timeout (30 s).
        assert v["took"] < 1.5, f"rank {r.rank}: the split took {v['took']:.2f} s with stray connections open"
        if r.rank == 0:
            assert v["strays"] >= 3, v
        # Bound to the published address (127.0.0.1 here), not to every interface.
        assert v["listeners"] and all(ip != "0.0.0.0" for ip, _ in v["listeners"]), v["listeners"]


@pytest.mark.timeout(120)
def test_forged_membership_records_from_a_process_without_the_token_change_nothing(tmp_path: Any) -> None:
    """Issue #16, item 5: a process that reaches the launcher's store but lacks the job token
    forges a gone record for a live rank, its event, and a decision event. The job's records
    carry a MAC keyed by the token (resilient-run makes one per single-node job), so every
    forgery reads as malformed: no recovery, nobody evicted, every rank at the last step.
    Before, the forged record evicted rank 2."""
    from dataclasses import asdict

    from resilient_comm.elastic import Gone, Membership
    from resilient_comm.testing.toy import ToyJob

    dump = tmp_path / "dump"
    job = ToyJob(4, ["--steps", "30", "--step-ms", "20", "--mark", "0:5", "--dump", str(dump)], str(tmp_path),
                 quiet=True).start()
    assert job.launcher.token, "resilient-run makes a token for a single-node job"
    client = job.launcher.client()
    client.wait(["toy/at/0/5"], datetime.timedelta(seconds=60))
    stranger = Membership(client, job.launcher.namespace, token="")
    forged = Gone(2, "suspect", "heartbeat silent for 9.9 s (forged)", time.time(), "rank 0")
    client.compare_set(stranger.key("gone", 2), "", forged.to_json())
    stranger.post_event({"kind": "gone", "ranks": [2], "gone": [asdict(forged)]})
    stranger.post_event({"kind": "decision", "epoch": 1})
    assert job.wait(90) == 0
    m = Membership(client, job.launcher.namespace)
    assert m.epoch() == 0, f"a recovery ran: {m.decision(m.epoch())}"
    for r in range(4):
        final = torch.load(dump / f"final-{r}.pt", weights_only=False)
        assert final["committed"] == 29 and final["members"] == [0, 1, 2, 3], (r, final["members"])
