"""The stores the control-plane benchmarks run against, and what they read of the processes
behind them: a TCPStore in a process of its own, a 3-member etcd on loopback, a store client
that counts its round trips, CPU time and priority. Shared by `bench control-plane` and
`bench etcd-costs`."""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from resilient_comm.testing.secure_etcd import Certs


class CountingStore:
    """A store client that counts its calls (every one is a round trip to the server)."""

    def __init__(self, store: Any, counter: list[int]) -> None:
        self._s, self.counter = store, counter

    def clone(self) -> CountingStore:
        return CountingStore(self._s.clone(), self.counter)

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._s, name)
        if name == "set_timeout" or not callable(fn):  # (etcd's `answered_sent_at` is a value)
            return fn

        def call(*a: Any, **k: Any) -> Any:
            self.counter[0] += 1
            return fn(*a, **k)

        return call


def serve_store(port_q: Any, stop: Any) -> None:
    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=300), wait_for_workers=False
    )
    port_q.put((store.port, os.getpid()))
    stop.wait()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def own_member_first(spec: str, node: int) -> str:
    """etcd: node `node`'s endpoints with member node % 3 first, as each node of a cluster
    lists its own (or nearest) member first; every client on member 0 would have one member
    answer every request while the others only replicate. A TCPStore's spec as it is."""
    if not spec.startswith("etcd://"):
        return spec
    eps = spec.removeprefix("etcd://").split(",")
    k = node % len(eps)
    return "etcd://" + ",".join(eps[k:] + eps[:k])


@contextlib.contextmanager
def tcpstore() -> Iterator[tuple[str, list[int]]]:
    """A TCPStore in a process of its own: its address and pid."""
    ctx = mp.get_context("spawn")
    port_q, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=serve_store, args=(port_q, stop), daemon=True)
    server.start()
    port, spid = port_q.get(timeout=60)
    try:
        yield f"127.0.0.1:{port}", [spid]
    finally:
        stop.set()
        server.join(10)


@contextlib.contextmanager
def etcd_cluster(members: int = 3, tls: Certs | None = None) -> Iterator[tuple[str, list[int]]]:
    """A 3-member etcd cluster on loopback (Debian's etcd-server): its spec and pids. With
    `tls`, its clients speak TLS and present a certificate of that CA (`testing.secure_etcd`;
    its spec's endpoints say https://)."""
    import shutil
    import subprocess
    import tempfile

    from resilient_comm.testing.cluster import etcd_command, wait_etcd

    if shutil.which("etcd") is None:
        raise SystemExit("control-plane --store etcd needs the etcd binary (Debian: apt install etcd-server)")
    base = 23810 if tls else 23790  # (a TLS cluster started after a plain one finds its ports free)
    ports = {i: ("127.0.0.1", base + i, base + 10 + i) for i in range(members)}
    with tempfile.TemporaryDirectory(prefix="rc-bench-etcd-") as d:
        ps = [
            subprocess.Popen(
                etcd_command(i, ports, d, "rc-bench", tls=tls),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for i in ports
        ]
        try:
            scheme = "https://" if tls else ""
            endpoints = ",".join(f"{scheme}{h}:{c}" for h, c, _ in ports.values())
            wait_etcd(endpoints, 60, tls.security() if tls else None)
            yield f"etcd://{endpoints}", [p.pid for p in ps]
        finally:
            for p in ps:
                p.kill()
                p.wait()


def boost_priority(pids: list[int]) -> bool:
    """Raise the store's and the decider's CPU priority over the emulated agents' (nice -10;
    root only). On a cluster the store has its hosts and the decider its node; here 2,048
    emulated agents would take their CPU (the agents' own load is what is measured)."""
    try:
        for pid in pids:
            os.setpriority(os.PRIO_PROCESS, pid, -10)
        return True
    except PermissionError:
        return False


def await_key(client: Any, key: str, limit_s: float, progress: Callable[[str], None]) -> bytes:
    """The value of `key` once it is written, within `limit_s`. A store too loaded to answer
    the harness's own call for its retry budget (etcd at 16K emulated ranks: 10 s without an
    answer) is asked again: that is the emulation's load on the harness, not the decision."""
    import torch.distributed as dist

    end = time.monotonic() + limit_s
    while True:
        try:
            client.wait([key], datetime.timedelta(seconds=max(1.0, end - time.monotonic())))
            return client.get(key)
        except dist.DistNetworkError as e:
            if time.monotonic() >= end:
                raise
            progress(f"the harness's wait for {key} got no answer ({e}): asking again")
