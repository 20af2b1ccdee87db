"""The control plane at scale: N emulated ranks, 8 per node, against one TCPStore.

    resilient-comm bench control-plane                         # N = 64 ... 16384
    resilient-comm bench control-plane --ranks 64,1024 --seconds 5

Each node is a real `NodeAgent` (the code `resilient-run` runs) with its own store
connection and events thread, on the real `Membership`; its 8 workers are emulated: they
beat into the agent (no socket; every ``--worker-heartbeat-ms``, 1 s: the node-local hop is
not what is measured) and, on a failure, do what a controller does: each hands its join
record to its agent, which writes the node's records in one request (`joins.JoinBatcher`,
the real code; a worker told of a later epoch joins it itself). Rank 0's
controller, the decider, runs in a process of its own, as a worker does on its node: it polls
the joins, decides with `decision.decide` and publishes. Agents are spread over ``--procs``
driver processes; the store is served by its own process, whose CPU time is measured. The
store and the decider run at a higher CPU priority than the agents (nice -10, as root;
``--flat-priority`` not): on a cluster each has a host of its own, while here 2,048
emulated agents on 2 cores would take their CPU (measured at 16K ranks: the decider's read
of the joins 1.1 s instead of 0.35 s).

Per N it reports: store operations per second per node in steady state (counted at every
client), the store process's CPU, the achieved node-heartbeat period (drivers that fall
behind show it here, not as fewer operations), driver memory per node, and two failures:
a worker's exit reported by its agent (the pidfd path) and a whole node going silent (the
heartbeat path: its predecessor must notice), each timed to every agent informed and to the
decision published. The baseline, run in the same invocation, is the per-rank store heartbeat
this replaced (every rank writes its key and reads all N every 100 ms), up to
``--baseline-max`` ranks: its achieved period and store load.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import heapq
import json
import math
import multiprocessing as mp
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast
from unittest import mock

from resilient_comm.tools.bench.stores import (
    CountingStore,
    await_key,
    boost_priority,
    cpu_seconds,
    etcd_cluster,
    own_member_first,
    rss_mb,
    tcpstore,
)

KEY = "rc/bench"


def _driver(
    spec: str,
    nodes: list[int],
    nnodes: int,
    per_node: int,
    hb_s: float,
    worker_hb_s: float,
    conn: Any,
    decider: Any,
) -> None:
    """Run the agents of `nodes` and their emulated workers; obey `conn`'s commands. `decider`
    (the driver of node 0): a pipe to the process that plays the decider."""

    from resilient_comm.elastic.membership import protocol as membership
    from resilient_comm.elastic.membership.protocol import Membership
    from resilient_comm.elastic.model.bounds import DetectorConfig
    from resilient_comm.elastic.model.policy import Mesh
    from resilient_comm.elastic.model.records import Decision, Gone, JoinRecord
    from resilient_comm.elastic.node.agent import NodeAgent

    # The emulated workers beat their agent every `worker_hb_s` (1 s), not every 100 ms: the
    # local hop never reaches the store, and on a real cluster each agent has its node's CPUs.
    cfg = DetectorConfig(heartbeat_s=worker_hb_s)
    world = nnodes * per_node
    counter = [0]
    received: list[tuple[int, str, int, float]] = []  # (node, kind, epoch, wall time)
    state: dict[str, Any] = {"applied": 0, "gone": set()}  # what the emulated workers learnt
    lock = threading.Lock()
    silent: set[int] = set()  # nodes stopped by the "silence" command

    class BenchAgent(NodeAgent):
        beats: list[float]
        events_m: Membership
        recorded: threading.Event  # its first record is made (on etcd: its lease granted)

        def record(self) -> str:  # made once per node heartbeat
            self.beats.append(time.monotonic())
            self.recorded.set()
            return super().record()

        def broadcast(self, line: str) -> None:  # what the workers of this node would hear
            ev = json.loads(line.split(" ", 1)[1]) if line.startswith("ev ") else {}
            t = time.time()
            with lock:
                if ev.get("kind") == "decided":
                    received.append((self.node, "decided", ev["epoch"], t))
                    state["applied"] = max(state["applied"], ev["epoch"])  # the members: all not gone
                    return
                if ev.get("kind") != "gone":
                    return
                received.append((self.node, "gone", state["applied"] + 1, t))
                watch = self.events.watch
                at = (
                    watch.streamed_at.get(self.m.key("events", self.events.next_event - 1)) if watch else None
                )
                if at is not None:  # (etcd: when its watch stream brought the event, for RC_BENCH_DEBUG)
                    received.append((self.node, "streamed", state["applied"] + 1, at))
                state["gone"] |= {int(r) for r in ev["ranks"]}
                applied, gone = state["applied"], set(state["gone"])
                if decider is not None and self.node == 0:
                    decider.send(("gone", [int(r) for r in ev["ranks"]]))  # what rank 0's agent forwards
            if self.node in silent:
                return  # a silent node's workers are gone too
            m = self.events_m
            lowest = next(r for r in range(world) if r not in gone)  # the decider
            mine = [r for r in range(self.node * per_node, (self.node + 1) * per_node) if r not in gone]
            # Each worker sends its join record to its agent (`Detector.join`), which writes the
            # node's records in one request (`joins.JoinBatcher`); a worker told that a later
            # epoch is current joins that one itself (`agreement.catch_up`).
            for r in mine:
                self.joins.submit(
                    JoinRecord(r, applied, True, 10 + applied, None, time.time()),
                    functools.partial(self.joined, m, r, r == lowest),
                )

        def joined(self, m: Membership, rank: int, decides: bool, line: str) -> None:
            word, applied_s, epoch_s = line.split(" ", 2)
            if word != "joined":
                print(f"  rank {rank} not joined: {line}", flush=True)
                return
            applied, epoch = int(applied_s), int(epoch_s)
            if epoch != applied + 1:
                m.join(epoch, JoinRecord(rank, applied, True, 10 + applied, None, time.time()))
            if decides and decider is not None:
                with lock:
                    decider.send(("decide", epoch, applied))

    def connect(i: int) -> Membership:
        store = membership.connect(own_member_first(spec, nodes[i // 2]), datetime.timedelta(seconds=120))
        return Membership(cast(Any, CountingStore(store, counter)), KEY)

    # Connections are opened in parallel: on a resolver that drops queries, one c10d
    # connection in ~20 stalls 5 s in a reverse lookup of its peer (docs/elastic.md).
    with ThreadPoolExecutor(64) as pool:
        conns = list(pool.map(connect, range(2 * len(nodes))))[::-1]  # (popped: node order)
    agents: dict[int, BenchAgent] = {}
    beat_due: dict[int, float] = {}
    for n in nodes:
        a = BenchAgent(conns.pop(), n, nnodes, nproc=per_node, config=cfg, node_heartbeat=hb_s)
        a.beats, a.recorded = [], threading.Event()
        a.events_m = conns.pop()
        for r in range(n * per_node, (n + 1) * per_node):
            a.add(r, 0)
            a.hello(r, cfg)
        a.start()
        agents[n] = a
        beat_due[n] = 0.0
        if a.lease_s:
            # etcd: the next agent starts once this one has its lease and first record. All
            # at once, 1,024 agents' first requests (~8 each) queued behind each other on 2
            # cores for longer than the lease, and nodes were fenced before they had started:
            # a harness limit (real agents each have a host), so the starts are paced by the
            # store's own answers.
            a.recorded.wait(a.lease_s)
    if 0 in agents:
        Membership(agents[0].m.store, KEY).start(
            Decision(0, list(range(world)), Mesh(dp=world).as_dict(), "init", 0)
        )
    conn.send("ready")
    seq, measuring = 0, None
    due = [(time.monotonic(), n) for n in agents]  # (next tick, node): a heap
    heapq.heapify(due)
    while True:
        seq += 1
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, n = heapq.heappop(due)
            if n in silent:
                continue
            a = agents[n]
            if now >= beat_due[n]:
                beat_due[n] = now + worker_hb_s
                for p in a.procs.values():
                    if not p.done:
                        a.on_beat(p, f"{seq} 10 compute 5.0 10.0 0.100", now)
            a.tick()
            heapq.heappush(due, (now + a.next_tick_in(), n))
        if conn.poll():
            cmd, arg = conn.recv()
            if cmd == "measure":
                counter[0], measuring = 0, (time.monotonic(), arg, time.process_time())
                for a in agents.values():
                    a.beats.clear()
            elif cmd == "exit":
                a = agents[arg // per_node]
                t0 = time.time()
                a.exited(arg)
                a.m.report_gone(Gone(arg, "exit", "killed by SIGKILL", t0, "launcher"))
                conn.send(t0)
            elif cmd == "silence":
                silent.add(arg)
                if agents[arg].lease_s:
                    agents[arg]._stop.set()  # etcd: its lease thread stops renewing, as on a dead node
                    lease = agents[arg].lease
                    assert lease is not None
                    lease.wake()
                conn.send(time.time())
            elif cmd == "collect":
                with lock:
                    conn.send(list(received))
            elif cmd == "quit":
                for a in agents.values():
                    a._stop.set()
                conn.send("bye")
                # Not joined: hundreds of agents' threads (their HTTP calls, watch streams)
                # would still be running while the interpreter finalizes.
                sys.stdout.flush()
                os._exit(0)
        if measuring and time.monotonic() - measuring[0] >= measuring[1]:
            gaps = [b - a for ag in agents.values() for a, b in zip(ag.beats, ag.beats[1:])]
            conn.send(
                {
                    "ops": counter[0],
                    "seconds": time.monotonic() - measuring[0],
                    "gaps": gaps,
                    "rss_mb": rss_mb(),
                    "cpu_s": time.process_time() - measuring[2],
                }
            )
            measuring = None
        wait = min(due[0][0] - time.monotonic() if due else 0.01, 0.01)
        if wait > 0:
            time.sleep(wait)  # pacing the emulated workers' beats


def _decider(spec: str, conn: Any) -> None:
    """Rank 0's controller as the decider (its own process, as a worker has on a node): told
    of the ranks gone and of each epoch to decide, it polls the joins and publishes."""

    from resilient_comm.elastic.membership.protocol import Membership, connect, join_poll_cap_s
    from resilient_comm.elastic.model.decide import decide

    m = Membership(connect(spec, datetime.timedelta(seconds=120)), KEY)
    known: set[int] = set()
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        if msg[0] == "gone":
            known |= set(msg[1])
            continue
        _, epoch, applied = msg
        base = m.decision(applied)
        assert base is not None
        while m.decision(epoch) is None:
            while conn.poll():
                more = conn.recv()
                if more is None:
                    return  # the bench is over (this epoch was never complete)
                assert more[0] == "gone", more
                known |= set(more[1])
            live = [r for r in base.members if r not in known]
            t_call = time.time()
            complete = m.complete(epoch, base.members, live, wait_s=0.1)  # as the controller's decider reads
            if os.environ.get("RC_BENCH_DEBUG"):
                print(
                    f"  decider: complete() at {t_call:.3f} took {time.time() - t_call:.3f} s:",
                    "done" if complete else "not yet",
                    flush=True,
                )
            if complete is not None:
                seen = time.time()
                d = m.decide(
                    decide(epoch, base, *complete, m.done(base.members), [], lambda n: None, live[0])
                )
                m.post_event({"kind": "decided", "epoch": d.epoch, "joiners": d.joiners})
                m.store.set(
                    f"{KEY}/published/{epoch}",
                    json.dumps(
                        {
                            "published": time.time(),
                            "joined": max(j.t for j in complete[0].values()),
                            "seen": seen,
                        }
                    ),
                )
                break
            if m.watches:
                time.sleep(join_poll_cap_s(len(base.members)))  # etcd: paced as the controller's decider


def _baseline(spec: str, ranks: list[int], world: int, seconds: float, conn: Any) -> None:
    """The replaced design: each rank writes its heartbeat key and reads all N every 100 ms."""
    import torch.distributed as dist

    host, port = spec.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), None, False, timeout=datetime.timedelta(seconds=120))
    keys = [f"{KEY}/hb/{r}" for r in range(world)]
    for r in ranks:
        store.set(keys[r], "0")
    conn.send("ready")
    conn.recv()
    next_at = {r: time.monotonic() for r in ranks}
    periods: list[float] = []
    last = dict(next_at)
    ops, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        r = min(next_at, key=next_at.__getitem__)
        delay = next_at[r] - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # pacing
        t = time.monotonic()
        store.set(keys[r], str(t))
        if store.check(keys):
            store.multi_get(keys)
        ops += 3
        periods.append(t - last[r])
        last[r], next_at[r] = t, max(next_at[r] + 0.1, t)
    conn.send({"ops": ops, "periods": periods[len(ranks) :], "reads": ops // 3 * 2 * world})


_T0 = time.monotonic()


def _ask(pipe: Any, msg: tuple[str, Any], timeout_s: float = 30.0) -> Any:
    """A driver's answer to `msg`; TimeoutError if none comes within `timeout_s` (a collapsed
    emulation is reported, not waited for)."""
    pipe.send(msg)
    if not pipe.poll(timeout_s):
        raise TimeoutError(f"a driver did not answer {msg[0]!r} within {timeout_s:g} s")
    return pipe.recv()


def _progress(what: str) -> None:
    print(f"  [{time.monotonic() - _T0:6.1f} s] {what}", flush=True)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def bench_lease_ms(nodes: int) -> int:
    """The node lease the etcd emulation uses for `nodes` nodes unless told one: the 5 s
    default up to 128 nodes, then 40 ms per node (20 s at 512, 41 s at 1,024, 82 s at 2,048).
    A harness limit, not a recommendation: each agent's steady load is about 24 requests per
    lease, and this 2-core machine, which runs the 3 etcd members and every agent, sustains
    about 600 requests a second of it (at 1,024 nodes with 5 s leases, 4,900 a second fenced
    nodes before they started); on a cluster each agent has a host and etcd members have theirs."""
    return max(5000, 1000 * round(0.040 * nodes))


def run_one(
    n_ranks: int,
    per_node: int,
    procs: int,
    seconds: float,
    baseline_max: int,
    hb_s: float = 0.2,
    worker_hb_s: float = 1.0,
    store: str = "tcp",
    boost: bool = True,
    lease_ms: int | None = None,
) -> dict[str, Any]:
    """One size. `lease_ms` (etcd): the node lease, `bench_lease_ms` if None and
    RESILIENT_COMM_NODE_LEASE_MS is not set (the agents are spawned with it in their
    environment)."""
    with contextlib.ExitStack() as stack:
        if store == "etcd":
            knob = "RESILIENT_COMM_NODE_LEASE_MS"
            if lease_ms is None and not os.environ.get(knob):
                lease_ms = bench_lease_ms(n_ranks // per_node)
            if lease_ms is not None:
                stack.enter_context(mock.patch.dict(os.environ, {knob: str(lease_ms)}))
            spec, spids = stack.enter_context(etcd_cluster())
        else:
            spec, spids = stack.enter_context(tcpstore())
        return _run_one(
            spec, spids, n_ranks, per_node, procs, seconds, baseline_max, hb_s, worker_hb_s, boost
        )


def _run_one(
    spec: str,
    spids: list[int],
    n_ranks: int,
    per_node: int,
    procs: int,
    seconds: float,
    baseline_max: int,
    hb_s: float,
    worker_hb_s: float,
    boost: bool,
) -> dict[str, Any]:
    from resilient_comm.elastic.node.agent import node_lease_s

    ctx = mp.get_context("spawn")
    etcd = spec.startswith("etcd://")
    nnodes = n_ranks // per_node
    procs = max(1, min(procs, nnodes))
    owners = [list(range(nnodes))[i::procs] for i in range(procs)]
    to_decider, decider_end = ctx.Pipe()
    decider = ctx.Process(target=_decider, args=(spec, decider_end), daemon=True)
    decider.start()
    boosted = boost and boost_priority([*spids, cast(int, decider.pid)])
    pipes, drivers = [], []
    for i, nodes in enumerate(owners):
        parent, child = ctx.Pipe()
        d = ctx.Process(
            target=_driver,
            args=(spec, nodes, nnodes, per_node, hb_s, worker_hb_s, child, to_decider if i == 0 else None),
            daemon=True,
        )
        d.start()
        pipes.append(parent)
        drivers.append(d)
    for p in pipes:
        assert p.recv() == "ready"
    assert to_decider.recv() == "ready"
    _progress(f"{nnodes} agents up")
    owner = {n: i for i, nodes in enumerate(owners) for n in nodes}
    time.sleep(max(1.0, seconds / 2))  # warm-up: every agent beats and reads its successor
    cpu0 = sum(map(cpu_seconds, spids))
    for p in pipes:
        p.send(("measure", seconds))
    res = [p.recv() for p in pipes]
    _progress("steady state measured")
    cpu = (sum(map(cpu_seconds, spids)) - cpu0) / max(r["seconds"] for r in res)
    ops = sum(r["ops"] / r["seconds"] for r in res)
    gaps = [g for r in res for g in r["gaps"]]
    beats_s = len(gaps) / nnodes / max(r["seconds"] for r in res)  # node heartbeats per node per second
    row: dict[str, Any] = {
        "store": "etcd" if etcd else "tcp",
        "store_and_decider_boosted": boosted,
        "ranks": n_ranks,
        "nodes": nnodes,
        "node_heartbeat_ms": 1e3 * (node_lease_s() / 3 if etcd else hb_s),
        "worker_heartbeat_ms": 1e3 * worker_hb_s,
        "store_ops_s": ops,
        "ops_s_per_node": ops / nnodes,
        "ops_per_node_beat": ops / nnodes / beats_s if beats_s else float("nan"),
        "store_cpu": cpu,
        "node_beat_p50_ms": 1e3 * _pct(gaps, 0.5),
        "node_beat_p99_ms": 1e3 * _pct(gaps, 0.99),
        "driver_mb_per_node": sum(r["rss_mb"] for r in res) / nnodes,
        "drivers_cpu": sum(r["cpu_s"] for r in res) / max(r["seconds"] for r in res),
    }
    # A worker's exit (rank 8k+3 of the middle node), then a whole node going silent.
    import torch.distributed as dist

    from resilient_comm.elastic.membership.protocol import Membership, connect

    client = connect(spec, datetime.timedelta(seconds=60))
    m = Membership(client, KEY)
    faults = (("exit", 1, nnodes // 2, "exit"), ("silent node", 2, max(1, nnodes // 4), "silence"))
    dpids = [cast(int, d.pid) for d in drivers]
    for i, (label, epoch, node, cmd) in enumerate(faults):
        cpu_at = (sum(map(cpu_seconds, spids)), sum(map(cpu_seconds, dpids)), time.monotonic())
        try:
            t0 = _ask(pipes[owner[node]], (cmd, node * per_node + 3 if cmd == "exit" else node))
            # (A silent node is found at its lease's expiry: up to 4/3 of the lease on etcd.)
            limit_s = 60 + (4 / 3 * node_lease_s() if etcd and cmd == "silence" else 0)
            times = json.loads(await_key(client, f"{KEY}/published/{epoch}", limit_s, _progress))
            deadline = time.monotonic() + 30
            while True:  # every live agent has the decision's event
                got: list[tuple[int, str, int, float]] = []
                for p in pipes:
                    got += _ask(p, ("collect", None))
                heard = {n: t for n, k, e, t in got if k == "gone" and e == epoch}
                told = {n: t for n, k, e, t in got if k == "decided" and e == epoch}
                live = nnodes - (1 if epoch == 2 else 0)
                if len(told) >= live or time.monotonic() > deadline:
                    break
                time.sleep(0.05)  # polling the drivers' logs of received events
        except (
            dist.DistError,
            TimeoutError,
        ) as e:  # reported, not raised: the other sizes and the table go on
            _progress(
                f"{label}: no decision published and told in time ({e}): this size's remaining "
                "faults are skipped"
            )
            for skipped, *_ in faults[i:]:
                row.update(
                    {
                        f"{skipped}: {k}": math.nan
                        for k in (
                            "agents_told",
                            "informed_s",
                            "decision_s",
                            "joined_s",
                            "seen_s",
                            "told_s",
                            "store_cpu_s",
                            "drivers_cpu_s",
                            "window_s",
                        )
                    }
                )
                row[f"{skipped}: false_suspects"] = 0
            break
        published = times["published"]
        # CPU seconds the store and the emulated agents spent from the fault to every agent told
        # (one window, a bound on where the failure's time went on this machine's 2 cores).
        row[f"{label}: store_cpu_s"] = sum(map(cpu_seconds, spids)) - cpu_at[0]
        row[f"{label}: drivers_cpu_s"] = sum(map(cpu_seconds, dpids)) - cpu_at[1]
        row[f"{label}: window_s"] = time.monotonic() - cpu_at[2]
        if os.environ.get("RC_BENCH_DEBUG"):
            late = sorted(heard.items(), key=lambda x: -x[1])[:6]
            streamed = sorted(t - t0 for n, k, e, t in got if k == "streamed" and e == epoch)
            if streamed:
                print(
                    f"  streamed: {len(streamed)} agents' watches brought the event, p50 "
                    f"{streamed[len(streamed) // 2]:.2f} s, max {streamed[-1]:.2f} s",
                    flush=True,
                )
            print(
                "  latest heard:",
                [(n, round(t - t0, 2), owner[n]) for n, t in late],
                "p50",
                round(sorted(heard.values())[len(heard) // 2] - t0, 2),
                flush=True,
            )
            for i in range(len(pipes)):
                ts = sorted(t - t0 for n, t in heard.items() if owner[n] == i)
                print(
                    f"    driver {i}: heard min {ts[0]:.2f} p50 {ts[len(ts) // 2]:.2f} max {ts[-1]:.2f}",
                    flush=True,
                )
        dec = m.decision(epoch)
        assert dec is not None
        expected = (
            {node * per_node + 3} if cmd == "exit" else set(range(node * per_node, (node + 1) * per_node))
        )
        row[f"{label}: false_suspects"] = len(set(dec.lost) - expected)
        if len(told) < live:  # reported, not raised: the other sizes and the table go on
            _progress(
                f"{label}: only {len(told)} of {live} live agents were told of the decision within 30 s"
            )
        row[f"{label}: agents_told"] = len(told)
        row[f"{label}: informed_s"] = max(heard.values(), default=math.nan) - t0
        row[f"{label}: decision_s"] = published - t0
        row[f"{label}: joined_s"] = times["joined"] - t0  # the last join record written
        row[f"{label}: seen_s"] = times["seen"] - t0  # the decider's poll found them all
        row[f"{label}: told_s"] = max(told.values(), default=math.nan) - t0
        _progress(
            f"{label}: every agent heard after {row[f'{label}: informed_s']:.2f} s, the last join "
            f"{row[f'{label}: joined_s']:.2f} s, seen by the decider {row[f'{label}: seen_s']:.2f} s, decision "
            f"published {published - t0:.2f} s, every agent told {row[f'{label}: told_s']:.2f} s; CPU from the "
            f"fault on: store {row[f'{label}: store_cpu_s']:.1f} s, agents {row[f'{label}: drivers_cpu_s']:.1f} s "
            f"in {row[f'{label}: window_s']:.1f} s"
        )
    for p in pipes:
        p.send(("quit", None))
    for p, d in zip(pipes, drivers):
        if not p.poll(30):  # a driver that cannot answer (a collapsed emulation) is not waited for
            _progress(f"driver {d.pid} did not stop within 30 s: killed")
        d.join(10 if p.poll(0) else 0)
        if d.is_alive():
            d.kill()
            d.join(5)
    to_decider.send(None)
    decider.join(10)
    if n_ranks <= baseline_max and not etcd:
        row.update(_run_baseline(ctx, spec, n_ranks, procs, seconds, spids[0]))
    return row


def _run_baseline(ctx: Any, spec: str, n: int, procs: int, seconds: float, spid: int) -> dict[str, Any]:
    pipes, ps = [], []
    for i in range(procs):
        parent, child = ctx.Pipe()
        p = ctx.Process(
            target=_baseline, args=(spec, list(range(n))[i::procs], n, seconds, child), daemon=True
        )
        p.start()
        pipes.append(parent)
        ps.append(p)
    for p in pipes:
        assert p.recv() == "ready"
    cpu0 = cpu_seconds(spid)
    t0 = time.monotonic()
    for p in pipes:
        p.send("go")
    res = [p.recv() for p in pipes]
    took = time.monotonic() - t0
    for p in ps:
        p.join(10)
    periods = [x for r in res for x in r["periods"]]
    return {
        "baseline_period_p50_ms": 1e3 * _pct(periods, 0.5),
        "baseline_period_p99_ms": 1e3 * _pct(periods, 0.99),
        "baseline_ops_s_per_node": sum(r["ops"] for r in res) / took / (n // 8),
        "baseline_store_cpu": (cpu_seconds(spid) - cpu0) / took,
    }


def plot(rows: list[dict[str, Any]], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    xs = [r["ranks"] for r in rows]
    ax[0].plot(xs, [r["ops_s_per_node"] for r in rows], "o-", label="node agents")
    base = [r for r in rows if "baseline_ops_s_per_node" in r]
    periods = ", ".join(f"{r['ranks']}: {r['baseline_period_p50_ms']:.0f}" for r in base)
    ax[0].plot(
        [r["ranks"] for r in base],
        [r["baseline_ops_s_per_node"] for r in base],
        "s--",
        label=f"per-rank heartbeats (replaced)\nbeat period ms (100 wanted): {periods}",
    )
    ax[0].axhline(20, color="grey", lw=0.8, ls=":")
    ax[0].set(xscale="log", yscale="log", xlabel="ranks", ylabel="store ops/s per node", title="steady state")
    ax[0].legend(fontsize=8)
    for label in ("exit", "silent node"):
        ax[1].plot(xs, [r[f"{label}: decision_s"] for r in rows], "o-", label=f"{label}: decision published")
    ax[1].set(xscale="log", xlabel="ranks", ylabel="seconds after the failure", title="failure -> decision")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


_IN_NETNS = "RESILIENT_COMM_BENCH_NETNS"


def _in_netns(argv: list[str]) -> int:
    """Run this benchmark again inside a private network namespace (loopback only). Every c10d
    connection formats its peer's address with a reverse lookup; where the resolver drops
    queries (this VM: ~5%), each one stalls 5 s, in the store's server loop too, and thousands of
    agent connections never finish connecting. In a namespace with no route to the
    resolver the lookup fails at once."""
    import subprocess

    ns = f"rc-bench-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        env = {**os.environ, _IN_NETNS: ns}
        return subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-m",
                "resilient_comm.tools.bench.control_plane",
                *argv,
            ],
            env=env,
            check=False,
        ).returncode
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="resilient-comm bench control-plane", description=__doc__.splitlines()[0]
    )
    p.add_argument("--ranks", default="64,256,1024,4096,16384", help="emulated ranks, comma-separated")
    p.add_argument("--per-node", type=int, default=8)
    p.add_argument("--procs", type=int, default=4, help="driver processes the agents are spread over")
    p.add_argument("--seconds", type=float, default=5.0, help="steady-state window per point")
    p.add_argument(
        "--baseline-max", type=int, default=1024, help="largest N of the per-rank heartbeat baseline"
    )
    p.add_argument("--out", default=None, help="write JSON (and a PNG next to it) here")
    p.add_argument(
        "--node-heartbeat-ms",
        type=float,
        default=200.0,
        help="the agents' node heartbeat (default 200, the knob's default); a longer one lets a "
        "small machine keep thousands of emulated agents on time",
    )
    p.add_argument(
        "--worker-heartbeat-ms",
        type=float,
        default=1000.0,
        help="the emulated workers' beats to their agent (default 1000: the node-local hop is not "
        "what is measured, and the emulation must fit thousands of agents on this machine)",
    )
    p.add_argument(
        "--store",
        choices=("tcp", "etcd"),
        default="tcp",
        help="tcp: one TCPStore (the single-node default); etcd: a 3-member etcd cluster on loopback "
        "(node liveness is then a lease, its record rewritten every third of it; --node-heartbeat-ms "
        "does not apply)",
    )
    p.add_argument(
        "--lease-ms",
        type=int,
        default=None,
        help="etcd: the node lease (default: RESILIENT_COMM_NODE_LEASE_MS if set, else 5000 up to 128 "
        "nodes and 40 ms per node above: what this 2-core emulation of every agent and etcd member "
        "sustains; see bench_lease_ms)",
    )
    p.add_argument(
        "--flat-priority",
        action="store_true",
        help="run the store and the decider at the emulated agents' CPU priority (default, as root: "
        "nice -10, as if on hosts of their own)",
    )
    p.add_argument(
        "--netns",
        choices=("auto", "no"),
        default="auto",
        help="auto: as root, run in a private network namespace (see below); no: here",
    )
    a = p.parse_args(argv)
    if a.netns == "auto" and os.geteuid() == 0 and not os.environ.get(_IN_NETNS):
        return _in_netns(sys.argv[1:] if argv is None else argv)  # run as a module: argv is None
    from resilient_comm.tools.bench.common import machine

    ranks = [int(x) for x in a.ranks.split(",")]
    if any(r % a.per_node or r < 2 * a.per_node for r in ranks):
        p.error(f"--ranks must be multiples of --per-node {a.per_node}, with at least 2 nodes")
    rows = []
    print(
        f"control plane on {a.store}: {ranks} emulated ranks, {a.per_node} per node, {a.procs} drivers, "
        f"{a.seconds:g} s windows"
        + (f", in network namespace {os.environ[_IN_NETNS]}" if os.environ.get(_IN_NETNS) else ""),
        flush=True,
    )
    for n in ranks:
        t0 = time.monotonic()
        rows.append(
            run_one(
                n,
                a.per_node,
                a.procs,
                a.seconds,
                a.baseline_max,
                a.node_heartbeat_ms / 1e3,
                a.worker_heartbeat_ms / 1e3,
                a.store,
                not a.flat_priority,
                a.lease_ms,
            )
        )
        print(f"  {n} ranks done in {time.monotonic() - t0:.0f} s", flush=True)
    head = (
        f"{'ranks':>6} {'nodes':>5} {'hb ms':>5} {'ops/s/node':>10} {'ops/beat':>8} {'store cpu':>9} "
        f"{'beat p50/p99 ms':>15} {'agents cpu':>10} {'MB/node':>7} {'exit->dec s':>11} {'silent->dec s':>13} {'false':>5} "
        f"{'baseline ops/s/node':>19} {'period p50':>10}"
    )
    print(head)
    for r in rows:
        base = (
            f"{r['baseline_ops_s_per_node']:19.0f} {r['baseline_period_p50_ms']:8.0f}ms"
            if "baseline_ops_s_per_node" in r
            else f"{'-':>19} {'-':>10}"
        )
        false = r["exit: false_suspects"] + r["silent node: false_suspects"]
        print(
            f"{r['ranks']:6d} {r['nodes']:5d} {r['node_heartbeat_ms']:5.0f} {r['ops_s_per_node']:10.1f} "
            f"{r['ops_per_node_beat']:8.2f} {100 * r['store_cpu']:8.0f}% {r['node_beat_p50_ms']:7.0f}/"
            f"{r['node_beat_p99_ms']:<7.0f} {100 * r['drivers_cpu']:9.0f}% {r['driver_mb_per_node']:7.1f} {r['exit: decision_s']:11.2f} "
            f"{r['silent node: decision_s']:13.2f} {false:5d} {base}"
        )
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"machine": machine(), "rows": rows, "config": vars(a)}, f, indent=1)
        png = os.path.splitext(a.out)[0] + ".png"
        print(f"wrote {a.out}" + (f" and {png}" if plot(rows, png) else " (no matplotlib: no PNG)"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
