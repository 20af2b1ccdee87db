"""What each kind of membership request costs a 3-member etcd cluster (Debian's etcd-server,
on loopback), in etcd CPU per request.

    resilient-comm bench etcd-costs                  # 1,024 requests of each kind, 3 rounds
    resilient-comm bench etcd-costs --requests 4096 --watchers 1024
    resilient-comm bench etcd-costs --tls             # and the same on a secured cluster

The requests are the ones the control plane makes (`etcd.EtcdStore`, the JSON gateway):

    put        a plain put of 800 bytes (a node's eight join records in one value)
    txn-1      `advance`: the epoch's compare-and-set with one join record, nested in another
               transaction's failure branch (each rank joining by itself)
    txn-8      the same with eight join records, one key each (a node agent's batch,
               `joins.JoinBatcher`, until 2026-12-05)
    txn-batch  the same with the eight records in one key (a node agent's batch now:
               ``e/{E}/join/{first}.{n}``)
    get        a linearizable read of one key (a successor's record, a keepalive's proof)
    keepalive  one lease keepalive
    fan-out    one put streamed to ``--watchers`` watch streams (an event reaching every agent):
               the CPU is per watcher

Clients are ``--procs`` processes of 8 threads, each thread with its own connections, so
raft batches what arrives together as it would from many hosts. The figure is the three
members' CPU time (utime + stime from /proc) over the requests made: the median of
``--rounds`` rounds, and its ratio to a plain put measured in the same run. This machine's
cores are shared by the clients and the members, so the figure is what a failure's requests
cost the cluster, not how fast one member is.

``--tls`` measures the same on a second cluster, secured as production clusters are
(`testing.secure_etcd`: TLS on the client URLs, a client certificate required, auth enabled,
the clients logged in as a user whose role covers ``cost/`` only), after the plain one, and
prints the ratio of each figure to the plain cluster's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
from typing import Any, cast

from resilient_comm.tools.bench.stores import cpu_seconds, etcd_cluster, own_member_first

KINDS = ("put", "txn-1", "txn-8", "txn-batch", "get", "keepalive", "fan-out")
THREADS = 8


def _client(spec: str, idx: int, watchers: int, conn: Any, env: dict[str, str]) -> None:
    """A client process; `env`: the cluster's TLS and login knobs (`EtcdSecurity.worker_env`)."""
    from resilient_comm.elastic.membership.etcd.security import EtcdSecurity
    from resilient_comm.elastic.membership.etcd.store import EtcdStore
    from resilient_comm.elastic.membership.etcd.watch import PrefixWatch

    st = EtcdStore(
        own_member_first(spec, idx).removeprefix("etcd://"),
        datetime.timedelta(seconds=60),
        EtcdSecurity.from_env(env),
    )
    stores = [st.clone() for _ in range(THREADS)]
    watches = [PrefixWatch(st, "cost/events/", 600.0) for _ in range(watchers)]
    leases = [s.grant(600) for s in stores]
    record = "[1,0,true,7,null,1796400000.123456]" + "x" * 64  # about one sealed join entry

    def one(kind: str, s: Any, lease: int, n: int) -> None:
        key = f"cost/{idx}/{n}"
        if kind == "put":
            s.set(key, record * 8)
        elif kind in ("txn-1", "txn-8"):
            k = 1 if kind == "txn-1" else 8
            s.advance("cost/epoch", "1", "2", [(f"{key}/{j}", record) for j in range(k)])
        elif kind == "txn-batch":
            s.advance("cost/epoch", "1", "2", [(f"{key}/0.8", record * 8)])
        elif kind == "get":
            s.value("cost/epoch")
        elif kind == "keepalive":
            s.keepalive(lease)

    conn.send("ready")
    while True:
        cmd, kind, arg = conn.recv()
        if cmd == "quit":
            conn.send("bye")
            os._exit(0)  # (the watch threads are daemons blocked in reads)
        if cmd == "watch":
            done: list[float] = []

            def wait(pw: Any, arg: Any = arg, done: list[float] = done) -> None:
                pw.wait_for(arg, 30.0)
                done.append(time.time())

            ts = [threading.Thread(target=wait, args=(pw,)) for pw in watches]
            for t in ts:
                t.start()
            conn.send("armed")
            for t in ts:
                t.join()
            conn.send(done)
            continue

        def run(i: int, kind: Any = kind, arg: Any = arg) -> None:
            for n in range(i, arg, THREADS):
                one(kind, stores[i], leases[i], n)

        ts = [threading.Thread(target=run, args=(i,)) for i in range(THREADS)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        conn.send("done")


Rows = dict[str, list[tuple[float, float, float]]]  # kind -> per round (etcd ms/req, client ms/req, s)


def _measure(a: argparse.Namespace, tls: bool) -> Rows:
    """Every kind's figures on a new cluster (secured with `tls`), a.rounds times."""
    import tempfile

    from resilient_comm.elastic.membership.etcd.security import EtcdSecurity
    from resilient_comm.elastic.membership.etcd.store import EtcdStore
    from resilient_comm.testing import secure_etcd

    ctx = mp.get_context("spawn")
    rows: Rows = {k: [] for k in KINDS}
    with contextlib.ExitStack() as stack:
        security, certs = EtcdSecurity(), None
        if tls:
            if (why := secure_etcd.why_not()) is not None:
                raise SystemExit(f"etcd-costs --tls: {why}")
            d = stack.enter_context(tempfile.TemporaryDirectory(prefix="rc-bench-certs-"))
            certs = secure_etcd.make_certs(d)
        spec, spids = stack.enter_context(etcd_cluster(tls=certs))
        if certs is not None:
            endpoints = spec.removeprefix("etcd://")
            secure_etcd.enable_auth(endpoints, certs, "bench-root", {"bench": ("bench-pw", ["cost/"])})
            security = certs.security(
                "job", "bench", secure_etcd.password_file(certs.directory, "bench", "bench-pw")
            )
        admin = EtcdStore(spec.removeprefix("etcd://"), datetime.timedelta(seconds=60), security)
        admin.set("cost/epoch", "2")  # every advance finds the epoch proposed, as all but the first member do
        pipes, procs = [], []
        for i in range(a.procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_client,
                args=(spec, i, a.watchers // a.procs, child, security.worker_env()),
                daemon=True,
            )
            proc.start()
            pipes.append(parent)
            procs.append(proc)
        for pipe in pipes:
            if not pipe.poll(120) or pipe.recv() != "ready":
                raise SystemExit("a client process did not start within 120 s")
        cpids = [cast(int, proc.pid) for proc in procs]

        def cpu() -> tuple[float, float]:  # (the members', the clients') CPU seconds so far
            return sum(map(cpu_seconds, spids)), sum(map(cpu_seconds, cpids))

        for r in range(a.rounds):
            for kind in KINDS:
                key = f"cost/events/{r}"
                if kind == "fan-out":  # every watcher waits for the key before the clock starts
                    for pipe in pipes:
                        pipe.send(("watch", kind, key))
                    for pipe in pipes:
                        assert pipe.recv() == "armed"
                (c0, d0), t0 = cpu(), time.monotonic()
                if kind == "fan-out":
                    admin.set(key, "x" * 200)
                    n = max(1, sum(len(pipe.recv()) for pipe in pipes))
                else:
                    for pipe in pipes:
                        pipe.send(("run", kind, a.requests // a.procs))
                    for pipe in pipes:
                        assert pipe.recv() == "done"
                    n = a.requests // a.procs * a.procs
                took = time.monotonic() - t0
                c1, d1 = cpu()
                rows[kind].append((1e3 * (c1 - c0) / n, 1e3 * (d1 - d0) / n, took))
            print(f"  {'TLS' if tls else 'plain'}: round {r + 1} of {a.rounds} done", flush=True)
        for pipe in pipes:
            pipe.send(("quit", None, None))
            pipe.poll(10)
    return rows


def _medians(rows: Rows, kind: str) -> tuple[float, float, float]:
    return cast(
        tuple[float, float, float], tuple(statistics.median(x[i] for x in rows[kind]) for i in range(3))
    )


def _x(value: float, plain: float) -> str:
    """`value` as a multiple of the plain cluster's (a figure too small to measure: '-')."""
    return f"{value / plain:.2f}" if plain > 0 else "-"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="resilient-comm bench etcd-costs", description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1024, help="requests of each kind per round (all clients)")
    p.add_argument("--watchers", type=int, default=512, help="watch streams for fan-out (all clients)")
    p.add_argument("--procs", type=int, default=4, help="client processes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--tls",
        action="store_true",
        help="also measure a cluster with TLS, client certificates and auth (needs openssl), after the plain one",
    )
    a = p.parse_args(argv)
    print(
        f"etcd request costs: {a.requests} requests of each kind, {a.watchers} watchers, {a.procs} client "
        f"processes x {THREADS} threads, {a.rounds} rounds",
        flush=True,
    )
    plain = _measure(a, tls=False)
    base = _medians(plain, "put")[0]
    print(
        f"{'request':>10} {'etcd CPU ms/req':>15} {'x put':>6} {'client CPU ms/req':>17} {'wall s/round':>12}"
    )
    for kind in KINDS:
        e, c, w = _medians(plain, kind)
        unit = " (per watcher)" if kind == "fan-out" else ""
        print(f"{kind:>10} {e:15.3f} {e / base:6.2f} {c:17.3f} {w:12.2f}{unit}")
    if a.tls:
        secured = _measure(a, tls=True)
        print("TLS + client certificates + auth, against the plain cluster of the same run:")
        print(
            f"{'request':>10} {'etcd CPU ms/req':>15} {'x plain':>8} {'client CPU ms/req':>17} {'x plain':>8} "
            f"{'wall s/round':>12} {'x plain':>8}"
        )
        for kind in KINDS:
            (e0, c0, w0), (e, c, w) = _medians(plain, kind), _medians(secured, kind)
            unit = " (per watcher)" if kind == "fan-out" else ""
            print(
                f"{kind:>10} {e:15.3f} {_x(e, e0):>8} {c:17.3f} {_x(c, c0):>8} {w:12.2f} {_x(w, w0):>8}{unit}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
