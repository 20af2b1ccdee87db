"""Nodes on one machine: network namespaces on a bridge, with an etcd cluster among them.

    with NetnsCluster(nodes=4, etcd_on=[0, 1, 2], workdir=tmp) as c:
        launcher = c.run(1, [sys.executable, "-m", "resilient_comm.elastic", ...])
        c.partition(1)        # its link goes down: nothing exits, no socket errors, silence
        c.kill_etcd(2)        # one etcd member lost

Node i is namespace ``rc<tag>n<i>`` with address ``10.<net>.<tag>.<i+1>/24`` on its ``eth0``, a
veth pair whose other end is on bridge ``rcb<tag>`` (address ``.254``, so the caller in the root
namespace reaches every node). A node's processes are started with ``ip netns exec``. A
namespace has no route to the machine's resolver, so the reverse lookups c10d makes for every
connection fail at once instead of waiting on a resolver that drops queries. Needs root (or
CAP_NET_ADMIN) and, for etcd, Debian's ``etcd-server`` package; `available()` says why not.
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import IO, TYPE_CHECKING, Any, Self

from resilient_comm.testing.secure_etcd import member_flags

if TYPE_CHECKING:
    from resilient_comm.elastic.membership.etcd.security import EtcdSecurity
    from resilient_comm.testing.secure_etcd import Certs

NET = 77  # 10.77.<tag>.0/24
_made = 0  # clusters made by this process (each gets its own tag)


def etcd_command(
    i: int, members: dict[int, tuple[str, int, int]], workdir: str, token: str, tls: Certs | None = None
) -> list[str]:
    """Member i of a new etcd cluster of `members` (id -> address, client port, peer port);
    with `tls`, its clients speak TLS and present a certificate of that CA (`secure_etcd`)."""
    a, client, peer = members[i]
    cluster = ",".join(f"e{j}=http://{h}:{pp}" for j, (h, _, pp) in members.items())
    scheme = "https" if tls else "http"
    return [
        "etcd",
        "--name",
        f"e{i}",
        "--data-dir",
        os.path.join(workdir, f"etcd{i}"),
        "--listen-client-urls",
        f"{scheme}://{a}:{client}",
        "--advertise-client-urls",
        f"{scheme}://{a}:{client}",
        "--listen-peer-urls",
        f"http://{a}:{peer}",
        "--initial-advertise-peer-urls",
        f"http://{a}:{peer}",
        "--initial-cluster",
        cluster,
        "--initial-cluster-token",
        token,
        "--initial-cluster-state",
        "new",
        "--heartbeat-interval",
        "100",
        "--election-timeout",
        "1000",
        *(member_flags(tls) if tls else []),
    ]


def wait_etcd(endpoints: str, timeout_s: float, security: EtcdSecurity | None = None) -> None:
    """Until the cluster at `endpoints` answers a write (a quorum formed)."""
    from resilient_comm.elastic.membership.etcd.store import EtcdStore

    store = EtcdStore(endpoints, datetime.timedelta(seconds=timeout_s), security)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.set("rc/probe", "1")
            return
        except Exception as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the etcd cluster did not form within {timeout_s:g} s: {e}") from e
            time.sleep(0.2)  # polling a cluster that is starting


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def available() -> str | None:
    """None if namespaces and etcd can be used here, else why not."""
    if shutil.which("ip") is None:
        return "no 'ip' command (iproute2)"
    if shutil.which("etcd") is None:
        return "no etcd binary (Debian: apt install etcd-server)"
    probe = f"rcprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"cannot create network namespaces here ({getattr(e, 'stderr', '') or e})".strip()
    subprocess.run(["ip", "netns", "del", probe], check=False)
    return None


class NetnsCluster:
    def __init__(self, nodes: int, etcd_on: list[int], workdir: str, tag: int | None = None) -> None:
        self.nodes, self.etcd_on, self.workdir = nodes, list(etcd_on), workdir
        global _made
        _made += 1
        self.tag = tag if tag is not None else (os.getpid() * 7 + _made) % 250 + 1
        self.bridge = f"rcb{self.tag}"
        self.etcd: dict[int, subprocess.Popen] = {}
        self._logs: list[IO[bytes]] = []
        self._made: list[str] = []

    def ns(self, i: int) -> str:
        return f"rc{self.tag}n{i}"

    def addr(self, i: int) -> str:
        return f"10.{NET}.{self.tag}.{i + 1}"

    def veth(self, i: int) -> str:
        return f"rcv{self.tag}h{i}"

    def endpoints(self, first: int | None = None) -> str:
        """The etcd client endpoints, node `first`'s own member first (what a node lists)."""
        order = sorted(self.etcd_on, key=lambda i: (i != first, i))
        return ",".join(f"{self.addr(i)}:2379" for i in order)

    # -- set-up and tear-down -------------------------------------------------------------

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self, etcd_timeout_s: float = 60.0) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append("bridge")
        _ip("addr", "add", f"10.{NET}.{self.tag}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.nodes):
            _ip("netns", "add", self.ns(i))
            self._made.append(self.ns(i))
            _ip("link", "add", self.veth(i), "type", "veth", "peer", "name", "eth0", "netns", self.ns(i))
            _ip("link", "set", self.veth(i), "master", self.bridge, "up")
            _ip("-n", self.ns(i), "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
            _ip("-n", self.ns(i), "link", "set", "eth0", "up")
            _ip("-n", self.ns(i), "link", "set", "lo", "up")
        members = {i: (self.addr(i), 2379, 2380) for i in self.etcd_on}
        for i in self.etcd_on:
            log = open(os.path.join(self.workdir, f"etcd{i}.log"), "wb")  # noqa: SIM115
            self._logs.append(log)
            self.etcd[i] = self.run(
                i,
                etcd_command(i, members, self.workdir, f"rc{self.tag}"),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.wait_etcd(etcd_timeout_s)

    def wait_etcd(self, timeout_s: float) -> None:
        wait_etcd(self.endpoints(), timeout_s)

    def close(self) -> None:
        for p in self.etcd.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        for f in self._logs:
            f.close()
        for name in reversed(self._made):
            if name == "bridge":
                subprocess.run(["ip", "link", "del", self.bridge], check=False, capture_output=True)
            else:
                i = int(name.rsplit("n", 1)[1])
                subprocess.run(["ip", "link", "del", self.veth(i)], check=False, capture_output=True)
                for pid in subprocess.run(
                    ["ip", "netns", "pids", name], capture_output=True, text=True, check=False
                ).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
        self._made.clear()

    # -- processes and faults -------------------------------------------------------------

    def run(self, i: int, cmd: list[str], **popen: Any) -> subprocess.Popen:
        """Start `cmd` on node i (in its namespace)."""
        return subprocess.Popen(["ip", "netns", "exec", self.ns(i), *cmd], **popen)

    def pids(self, i: int) -> list[int]:
        """Every process of node i."""
        out = subprocess.run(["ip", "netns", "pids", self.ns(i)], capture_output=True, text=True, check=False)
        return [int(p) for p in out.stdout.split()]

    def kill_node(self, i: int, keep_etcd: bool = True) -> None:
        """SIGKILL every process of node i at once (its etcd member too unless `keep_etcd`)."""
        spare = {self.etcd[i].pid} if keep_etcd and i in self.etcd else set()
        for pid in self.pids(i):
            if pid not in spare:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def kill_etcd(self, i: int) -> None:
        self.etcd[i].kill()
        self.etcd[i].wait()

    def lead(self, i: int, timeout_s: float = 10.0) -> None:
        """Make node i's etcd member the cluster's leader (etcd's MoveLeader, through the JSON
        gateway of the current leader), so that a test can cut off the leader on purpose."""
        import etcd3gw

        def client(j: int) -> Any:
            return etcd3gw.client(host=self.addr(j), port=2379, timeout=2.0, api_path="/v3/")

        deadline = time.monotonic() + timeout_s
        while True:
            status = {
                j: client(j).post(client(j).get_url("/maintenance/status"), json={}) for j in self.etcd_on
            }
            ids = {j: st["header"]["member_id"] for j, st in status.items()}
            leader = (
                next(j for j, st in status.items() if st["leader"] == st["header"]["member_id"])
                if any(st["leader"] == st["header"]["member_id"] for st in status.values())
                else None
            )
            if leader == i:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"etcd member e{i} did not become the leader in {timeout_s:g} s (leader: {leader})"
                )
            if leader is not None:
                c = client(leader)
                c.post(c.get_url("/maintenance/transfer-leadership"), json={"targetID": ids[i]})
            time.sleep(0.2)  # polling the members' status until the move shows

    def toy_command(self, i: int, per_node: int, rdzv_id: str, toy: list[str]) -> list[str]:
        """Node i's ``resilient-run`` of the toy (`testing.toy`, arguments `toy`) in a job of
        every node of this cluster, on its etcd (node i's own member first)."""
        return [
            sys.executable, "-m", "resilient_comm.elastic", "--nnodes", str(self.nodes), "--node-rank", str(i),
            "--nproc-per-node", str(per_node), "--rdzv-backend", "etcd", "--rdzv-endpoint", self.endpoints(i),
            "--rdzv-id", rdzv_id, "-m", "resilient_comm.testing.toy", *toy,
        ]  # fmt: skip

    def partition(self, i: int) -> None:
        """Cut node i off: its link goes down; packets are dropped, nothing is refused."""
        _ip("link", "set", self.veth(i), "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self.veth(i), "up")

    def limit(self, i: int, mbit: float) -> None:
        """Node i's link slowed to `mbit` megabits per second each way (a token bucket, `tc
        tbf`, on both ends of its veth; this kernel has no netem): a degraded NIC or a
        flapping optical module's lower rate. Nothing is dropped beyond what the bucket's
        queue (50 ms) cannot hold."""
        rate = f"{mbit:g}mbit"
        burst = str(max(1600, int(mbit * 1e6 / 8 / 250)))  # 4 ms of the rate, at least a frame
        for where in ([], ["-n", self.ns(i)]):
            dev = "eth0" if where else self.veth(i)
            subprocess.run(
                [
                    "tc",
                    *where,
                    "qdisc",
                    "replace",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    burst,
                    "latency",
                    "50ms",
                ],
                check=True,
                capture_output=True,
            )

    def unlimit(self, i: int) -> None:
        """Node i's link back to full speed."""
        for where in ([], ["-n", self.ns(i)]):
            dev = "eth0" if where else self.veth(i)
            subprocess.run(
                ["tc", *where, "qdisc", "del", "dev", dev, "root"], check=False, capture_output=True
            )


__all__ = ["NetnsCluster", "available"]
