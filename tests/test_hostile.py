"""What a stray or hostile process on the same host (loopback only) can do to a build: a
connection that never sends its Hello (a port scanner, a load balancer's health check, a
half-open socket), one that sends garbage, one that connects and closes. None of them may
stall or fail a build of the real members: Hellos are read side by side, each bounded, and a
foreign one is dropped (issue #16). Listeners are bound to the address they publish."""

from __future__ import annotations

import os
import socket
import time

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
