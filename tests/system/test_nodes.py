"""Nodes on one machine (network namespaces on a bridge, `testing.cluster`), the membership on a
three-member etcd cluster among them, one resilient-run per node: a node partitioned, the etcd
leader lost (it is node 2's own member, first in its clients' lists: they move on too), node
0's agent lost, a capacity node (--nnodes 3:4) joining late and its spares taking a whole
SIGKILLed node's ranks, and a lost capacity node's spares taken out before a later whole-node
loss shrinks the job, a link that flaps for less than the tolerated outage (nothing happens)
and for longer than the lease (a partition). Each time the job finishes with the right survivors, bit-identical
replicas and no hang; a lost node is decided on through its lease, and the partitioned node is
fenced within its lease + 1 s. Skipped, with the reason, where namespaces or etcd are not
available."""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from resilient_comm.elastic import EXIT_EVICTED, Decision, Membership
from resilient_comm.elastic.membership.etcd.store import EtcdStore
from resilient_comm.elastic.node.launcher import SHUTDOWN_BOUND_S
from resilient_comm.elastic.node.lease import fence_after_s, tolerated_outage_s
from resilient_comm.testing.cluster import NetnsCluster, available
from resilient_comm.testing.harness import end_all, same_state
from resilient_comm.testing.toy import read_events

WHY = available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"multi-node tests need namespaces and etcd: {WHY}")
NODES, PER_NODE, STEPS, HOLD = 4, 2, 24, 8
WORLD = NODES * PER_NODE
LEASE_S = 5.0  # RESILIENT_COMM_NODE_LEASE_MS's default


class Job:
    """The toy on NODES nodes of PER_NODE workers, rank 0 held at step HOLD."""

    def __init__(self, c: NetnsCluster, tmp: str, spares: dict[int, int] | None = None, nnodes: str = str(NODES),
                 late: tuple[int, ...] = (), env: dict[str, str] | None = None, toy: tuple[str, ...] = (),
                 identical: bool = False) -> None:
        """`nnodes`: the launchers' --nnodes; `late`: nodes not started here (`launch` them);
        `toy`: more arguments of the toy; `identical`: no --node-rank (the rendezvous places
        each node: `placed` says where)."""
        self.c, self.tmp, self.spares, self.nnodes, self.toy = c, tmp, spares or {}, nnodes, toy
        self.identical = identical
        self.env = {**os.environ, **(env or {})}
        self.events, self.dump = os.path.join(tmp, "events"), os.path.join(tmp, "dump")
        self.launchers: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, Any] = {}
        for i in range(NODES):
            if i not in late:
                self.launch(i)
        self.store = EtcdStore(c.endpoints(), datetime.timedelta(seconds=120))
        self.m = Membership(self.store, "rc/job/g0")

    def launch(self, i: int) -> None:
        """Start node i's launcher (--spares only where given: a capacity node's default is its own)."""
        self.logs[i] = open(os.path.join(self.tmp, f"node{i}.log"), "wb")  # noqa: SIM115
        spares = ["--spares", str(self.spares[i])] if i in self.spares else []
        self.launchers[i] = self.c.run(i, [
            sys.executable, "-m", "resilient_comm.elastic", "--nnodes", self.nnodes,
            *([] if self.identical else ["--node-rank", str(i)]),
            "--nproc-per-node", str(PER_NODE), *spares, "--rdzv-backend", "etcd", "--rdzv-endpoint", self.c.endpoints(i),
            "--rdzv-id", "job", "-m", "resilient_comm.testing.toy", "--events", self.events, "--steps",
            str(STEPS), "--dump", self.dump, "--hold", f"0:{HOLD}", *self.toy], stdout=self.logs[i], stderr=subprocess.STDOUT,
            env=self.env)

    def held(self, timeout_s: float = 150) -> None:
        """Until rank 0 holds at step HOLD (every node's launcher still running)."""
        deadline = time.monotonic() + timeout_s
        while not self.store.wait_for(f"toy/held/0/{HOLD}", 1.0):
            ended = {i: p.returncode for i, p in self.launchers.items() if p.poll() is not None}
            assert not ended, f"launchers ended before the hold: {ended}: {self.log(min(ended))[-3000:]}"
            assert time.monotonic() < deadline, "rank 0 never reached the held step"

    def go(self) -> None:
        self.store.set(f"toy/go/{HOLD}", "1")

    def wait(self, nodes: list[int], timeout_s: float = 150) -> dict[int, int]:
        deadline = time.monotonic() + timeout_s
        out = {}
        for i in nodes:
            try:
                out[i] = self.launchers[i].wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"node {i}'s launcher did not finish: {self.log(i)[-3000:]}") from None
        return out

    def placed(self, i: int) -> int:
        """The node rank the rendezvous gave namespace i's launcher (from its log)."""
        deadline = time.monotonic() + 60
        while "this node is node " not in self.log(i):
            assert self.launchers[i].poll() is None, f"node {i}'s launcher ended: {self.log(i)[-2000:]}"
            assert time.monotonic() < deadline, f"node {i} has no place: {self.log(i)[-2000:]}"
            time.sleep(0.1)  # polling its log file
        return int(self.log(i).split("this node is node ")[1].split()[0])

    def log(self, i: int) -> str:
        self.logs[i].flush()
        with open(os.path.join(self.tmp, f"node{i}.log")) as f:
            return f.read()

    def decisions(self) -> list[Decision]:
        out = []
        for e in range(self.m.epoch() + 1):
            d = self.m.decision(e)
            assert d is not None
            out.append(d)
        return out

    def finals(self, ranks: list[int]) -> dict[int, dict[str, Any]]:
        return {r: torch.load(os.path.join(self.dump, f"final-{r}.pt"), weights_only=False) for r in ranks}

    def close(self) -> None:
        for p in self.launchers.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in self.logs.values():
            f.close()


@pytest.fixture
def job(tmp_path: Any, request: pytest.FixtureRequest) -> Any:
    with NetnsCluster(NODES, [0, 1, 2], str(tmp_path)) as c:
        j = Job(c, str(tmp_path), getattr(request, "param", None))
        try:
            yield j
        finally:
            j.close()


# The partition test cuts off the etcd leader's node, on purpose (`NetnsCluster.lead`): the
# followers notice the lost leader after the 1 s election timeout and elect another in 1-2 s
# more, while every healthy agent's keepalives go unanswered. It runs with an 8 s lease: with
# the default 5 s it passed here (node fenced 5.3-5.4 s after the cut, bound 6 s), but in loaded
# full suites the healthy nodes were fenced too while the keepalive went every third of the
# lease behind the record's put (now every sixth on a thread of its own: test_agent's
# slow-record test), and the 6 s bound has little slack on this machine (docs/elastic.md, "Fencing").
PARTITION_LEASE_S = 8.0


@pytest.fixture
def partition_job(tmp_path: Any) -> Any:
    with NetnsCluster(NODES, [0, 1, 2], str(tmp_path)) as c:
        j = Job(c, str(tmp_path), env={"RESILIENT_COMM_NODE_LEASE_MS": str(int(PARTITION_LEASE_S * 1000))})
        try:
            yield j
        finally:
            j.close()


# A slow link's job: a model whose gradients move in frames large enough to be timed
# (csrc/transport/tcp/transfer.h, [Note: link rates]: 1.1 MB, 140 KB per ring step of 8 ranks)
# and fail-slow detection every 4 steps (the judge's defaults otherwise: 8 ranks share 2 cores
# here, a rank's 4-step window wanders over 0.8-1.2 of the typical one's, never under the 0.6
# that counts at once twice in a row).
SLOW_LINK_TOY = ("--features", "64", "--hidden", "2048", "--pace-window", "4", "--burn-ms", "10")


@pytest.fixture
def slow_link_job(tmp_path: Any) -> Any:
    with NetnsCluster(NODES, [0, 1, 2], str(tmp_path)) as c:
        j = Job(c, str(tmp_path), toy=SLOW_LINK_TOY)
        try:
            yield j
        finally:
            j.close()


@pytest.fixture
def capacity_job(tmp_path: Any) -> Any:
    """--nnodes 3:4: nodes 0 to 2 run the job, node 3 (no etcd member) is spare capacity, not
    started yet. Rank 0 holds at step HOLD while node 3 starts (seconds): its peers, waiting in
    the step's all-reduce, must not take it for a straggler meanwhile."""
    with NetnsCluster(NODES, [0, 1, 2], str(tmp_path)) as c:
        j = Job(c, str(tmp_path), nnodes=f"{NODES - 1}:{NODES}", late=(NODES - 1,),
                env={"RESILIENT_COMM_STRAGGLER_FLOOR_MS": "600000"})
        try:
            yield j
        finally:
            j.close()


@pytest.fixture
def identical_job(tmp_path: Any) -> Any:
    """Four identical commands, --nnodes 3:4 (no --node-rank): the rendezvous makes three of
    them the job and one spare capacity."""
    with NetnsCluster(NODES, [0, 1, 2], str(tmp_path)) as c:
        j = Job(c, str(tmp_path), nnodes=f"{NODES - 1}:{NODES}", identical=True,
                env={"RESILIENT_COMM_STRAGGLER_FLOOR_MS": "600000"})
        try:
            yield j
        finally:
            j.close()


def check_survivors(job: Job, survivors: list[int], placed: tuple[int, ...] = ()) -> dict[int, dict[str, Any]]:
    finals = job.finals(survivors)
    for r in survivors:
        assert finals[r]["members"] == survivors and finals[r]["committed"] == STEPS - 1, (r, finals[r]["members"])
        assert same_state(finals[r]["state"], finals[survivors[0]]["state"]), f"replica {r} differs from {survivors[0]}"
    commits: dict[int, list[int]] = {}
    for e in read_events(job.events):
        if e["event"] == "commit":
            commits.setdefault(e["rank"], []).append(e["step"])
    for r in survivors:
        assert r in placed or commits[r] == list(range(STEPS)), f"rank {r} committed {commits[r]}"
    return finals


def check_fenced(job: Job, node: int, cut: float) -> float:
    """Node `node` fenced itself (its launcher and workers exit EXIT_EVICTED), every other node
    finished; returns the time from `cut` to its last worker's eviction."""
    status = job.wait(list(range(NODES)))
    others = [i for i in range(NODES) if i != node]
    assert status[node] == EXIT_EVICTED and all(status[i] == 0 for i in others), (status, job.log(node)[-3000:])
    evicted = [e for e in read_events(job.events) if e["event"] == "evicted"]
    ranks = list(range(node * PER_NODE, (node + 1) * PER_NODE))
    assert sorted(e["rank"] for e in evicted) == ranks and all("fenced" in e["why"] for e in evicted), evicted
    return max(e["t"] for e in evicted) - cut


@pytest.mark.timeout(300)
def test_a_partitioned_node_is_fenced_within_its_lease_and_the_majority_goes_on(partition_job: Job) -> None:
    job = partition_job
    job.held()
    job.c.lead(1)  # the worst case: the member cut off leads the cluster
    job.c.partition(1)  # node 1 runs ranks 2, 3 and etcd member e1: both cut off
    cut = time.time()
    job.go()
    fenced_after = check_fenced(job, 1, cut)
    print(f"[nodes] partition -> node fenced: {fenced_after:.2f} s")
    assert fenced_after < PARTITION_LEASE_S + 1.0, f"node 1 fenced {fenced_after:.2f} s after the partition"
    ds = job.decisions()
    assert ds[-1].members == [0, 1, 4, 5, 6, 7] and sorted(ds[1].lost) == [2, 3], ds
    print(f"[nodes] partition -> majority's decision published: {ds[1].t - cut:.2f} s")
    assert ds[1].t - cut > fenced_after - 0.5, "the majority decided before the partitioned node was fenced"
    check_survivors(job, [0, 1, 4, 5, 6, 7])
    minority = [e["step"] for e in read_events(job.events) if e["event"] == "commit" and e["rank"] in (2, 3)]
    assert max(minority) < ds[1].resume_step, "the partitioned node committed a step the majority did not"


@pytest.mark.timeout(300)
def test_losing_the_etcd_leader_changes_nothing(partition_job: Job) -> None:
    """The member that leads the cluster dies (its node's agent and workers go on): the others
    elect a new leader, which extends every lease, node 2's clients move on from the member
    first in their list, and nobody is fenced or evicted."""
    job = partition_job
    job.held()
    job.c.lead(2)
    t0 = time.monotonic()
    job.c.kill_etcd(2)
    job.go()
    status = job.wait(list(range(NODES)))
    assert status == {i: 0 for i in range(NODES)}, {i: job.log(i)[-2000:] for i in status}
    assert job.m.epoch() == 0, job.decisions()
    assert not [e for e in read_events(job.events) if e["event"] == "evicted"]
    check_survivors(job, list(range(WORLD)))
    print(f"[nodes] etcd leader lost -> job finished {time.monotonic() - t0:.2f} s later")


@pytest.mark.timeout(300)
def test_losing_node_zeros_agent_takes_its_workers_out_and_the_rest_goes_on(job: Job) -> None:
    job.held()
    job.launchers[0].kill()  # node 0's resilient-run only: its workers lose their agent
    lost = time.time()
    job.go()
    status = job.wait([1, 2, 3])
    assert status == {1: 0, 2: 0, 3: 0}, {i: job.log(i)[-2000:] for i in status}
    ds = job.decisions()
    assert ds[-1].members == list(range(2, WORLD)) and sorted(ds[1].lost) == [0, 1], ds
    gone = job.m.gone([0, 1])
    assert all(g.by == "agent 3" and "lease" in g.detail for g in gone.values()), gone
    print(f"[nodes] node 0's agent SIGKILLed -> decision published: {ds[1].t - lost:.2f} s")
    assert ds[1].t - lost < LEASE_S + 3.0, f"decided {ds[1].t - lost:.2f} s after node 0's agent died"
    check_survivors(job, list(range(2, WORLD)))
    assert job.log(0).count("cannot recover: the node agent (resilient-run) is gone") == PER_NODE, job.log(0)[-3000:]


@pytest.mark.timeout(300)
def test_a_capacity_node_joins_late_and_its_spares_take_a_lost_nodes_place(capacity_job: Job) -> None:
    """Node 3 joins the 3:4 job once steps are committed: its launcher runs only spares (two,
    by default), which register; node 2 is SIGKILLed whole, its lease expires, and node 3's
    spares take ranks 4 and 5: the world is kept, the replicas are bit-identical and every
    launcher left exits 0."""
    job, world = capacity_job, (NODES - 1) * PER_NODE
    spares = [world + 3, world + NODES + 3]  # node 3's: W + j * MAX + 3
    job.held()
    job.launch(3)
    job.store.wait([job.m.key("spare", i) for i in range(2)], datetime.timedelta(seconds=120))
    assert sorted(job.m.spares()) == spares
    job.c.kill_node(2)  # ranks 4, 5 (its etcd member stays)
    killed = time.time()
    job.go()
    status = job.wait([0, 1, 3])
    assert status == {0: 0, 1: 0, 3: 0}, {i: job.log(i)[-2000:] for i in status}
    ds = job.decisions()
    assert len(ds) == 2 and ds[0].members == list(range(world)), ds
    d = ds[1]
    assert (sorted(d.lost), sorted(d.joiners), d.restore) == ([4, 5], spares, "peer"), d
    assert d.members[:4] == [0, 1, 2, 3] and sorted(d.members[4:]) == spares and d.slots == list(range(world)), d
    gone = job.m.gone([4, 5])
    assert all(g.kind == "suspect" and g.by == "agent 1" and "lease" in g.detail for g in gone.values()), gone
    print(f"[nodes] whole-node SIGKILL, capacity node's spares placed -> decision published: {d.t - killed:.2f} s")
    assert LEASE_S - 2.0 < d.t - killed < LEASE_S + 3.0, f"decided {d.t - killed:.2f} s after the kill"
    check_survivors(job, d.members, placed=tuple(spares))
    assert "as capacity node 3 (--nnodes 3:4)" in job.log(3), job.log(3)[-2000:]


@pytest.mark.timeout(300)
def test_a_lost_capacity_node_takes_its_spares_out_and_a_later_loss_shrinks(capacity_job: Job) -> None:
    """Node 3 joins the 3:4 job as spare capacity (two spares registered) and is SIGKILLed
    whole: its predecessor on the ring sees its lease expire and reports its spares gone; no
    member was lost, so no epoch starts. Then node 2 is SIGKILLed: the dead spares must not be
    placed, so ranks 4 and 5 leave and the job finishes on ranks 0-3 with identical replicas."""
    job, world = capacity_job, (NODES - 1) * PER_NODE
    spares = [world + 3, world + NODES + 3]
    job.held()
    job.launch(3)
    job.store.wait([job.m.key("spare", i) for i in range(2)], datetime.timedelta(seconds=120))
    job.c.kill_node(3)
    killed = time.time()
    deadline = time.monotonic() + LEASE_S + 10
    while len(job.m.gone(spares)) < 2:
        assert time.monotonic() < deadline, f"node 3's spares never reported gone: {job.log(2)[-2000:]}"
        time.sleep(0.1)  # pacing a bounded poll of the gone records
    seen = time.time() - killed
    gone = job.m.gone(spares)
    assert all(g.kind == "suspect" and g.by == "agent 2" and "lease" in g.detail for g in gone.values()), gone
    print(f"[nodes] capacity node SIGKILLed -> its spares reported gone: {seen:.2f} s")
    assert LEASE_S - 2.0 < seen < LEASE_S + 3.0, f"reported {seen:.2f} s after the kill"
    assert job.m.epoch() == 0, "a lost spare is no member: nothing to decide"
    job.c.kill_node(2)
    killed = time.time()
    job.go()
    status = job.wait([0, 1])
    assert status == {0: 0, 1: 0}, {i: job.log(i)[-2000:] for i in status}
    ds = job.decisions()
    assert len(ds) == 2 and (sorted(ds[1].lost), ds[1].joiners, ds[1].members) == ([4, 5], [], [0, 1, 2, 3]), ds
    gone = job.m.gone([4, 5])
    assert all(g.kind == "suspect" and g.by == "agent 1" and "lease" in g.detail for g in gone.values()), gone
    print(f"[nodes] whole-node SIGKILL, no spare left -> decision published: {ds[1].t - killed:.2f} s")
    assert LEASE_S - 2.0 < ds[1].t - killed < LEASE_S + 3.0, f"decided {ds[1].t - killed:.2f} s after the kill"
    check_survivors(job, [0, 1, 2, 3])


def _flap(job: Job, node: int, down_s: float) -> float:
    """Node `node`'s link down for `down_s` (while the job trains), then up; returns the cut's time."""
    job.held()
    job.c.partition(node)
    cut = time.time()
    job.go()
    time.sleep(down_s)  # the outage's length is what the test is about, not a synchronisation
    job.c.heal(node)
    return cut


@pytest.mark.timeout(300)
def test_a_link_down_for_less_than_the_tolerated_outage_costs_nothing(job: Job) -> None:
    """Node 3 (ranks 6, 7; no etcd member) loses its link for just under the documented bound
    while the job trains: no fence, no eviction, no epoch; the outage is reported."""
    down_s = tolerated_outage_s(LEASE_S) - 0.3
    _flap(job, 3, down_s)
    status = job.wait(list(range(NODES)))
    assert status == {i: 0 for i in range(NODES)}, {i: job.log(i)[-2000:] for i in status}
    assert job.m.epoch() == 0, job.decisions()
    assert not [e for e in read_events(job.events) if e["event"] == "evicted"]
    check_survivors(job, list(range(WORLD)))
    rode = [line for line in job.log(3).splitlines() if "rode out a store outage" in line]
    assert len(rode) == 1, job.log(3)[-3000:]
    silent = float(rode[0].split("no answer for ")[1].split(" s")[0])
    print(f"[nodes] link down {down_s:.2f} s -> no answer for {silent:.2f} s (fences past {fence_after_s(LEASE_S)} s)")
    assert down_s <= silent < fence_after_s(LEASE_S), rode


@pytest.mark.timeout(300)
def test_a_link_down_for_longer_than_the_lease_is_a_partition_and_the_node_stays_out(job: Job) -> None:
    """Node 3's link down for longer than its lease, then up: it fenced itself, the others
    went on without it, and its return changes nothing."""
    cut = _flap(job, 3, LEASE_S + 1.0)
    fenced_after = check_fenced(job, 3, cut)
    print(f"[nodes] link down {LEASE_S + 1.0:.1f} s -> node fenced after {fenced_after:.2f} s")
    assert fenced_after < LEASE_S + 1.0, f"node 3 fenced {fenced_after:.2f} s after the cut"
    ds = job.decisions()
    assert ds[-1].members == list(range(6)) and sorted(ds[1].lost) == [6, 7], ds
    check_survivors(job, list(range(6)))


@pytest.mark.timeout(300)
def test_a_rate_limited_link_is_reported_as_its_nodes_slow_link_not_a_slow_rank(slow_link_job: Job) -> None:
    """Node 3's link cut to 50 Mbit/s each way (tc tbf on its veth) from step HOLD on: the
    members name node 3's link as slow within two windows, nobody is reported slow or evicted,
    and the replicas end bit-identical."""
    job = slow_link_job
    job.held()
    job.c.limit(3, 50)
    try:
        job.go()
        status = job.wait(list(range(NODES)))
    finally:
        job.c.unlimit(3)
    assert status == {i: 0 for i in range(NODES)}, {i: job.log(i)[-2000:] for i in status}
    assert job.m.epoch() == 0, job.decisions()
    events = read_events(job.events)
    links = [e for e in events if e["event"] == "slow_link"]
    assert links and {e["rank"] for e in links} == set(range(WORLD)), "every member judges alike"
    first = min(e["step"] for e in links)
    assert all(list(e["slow"]) == ["3"] for e in links), links
    assert HOLD < first <= HOLD + 3 * 4, f"found after step {first}"
    assert not [e for e in events if e["event"] in ("slow", "evicted")], "a slow link is not a slow rank"
    windows = [e for e in events if e["event"] == "pace" and e["rank"] == 0 and e["step"] > HOLD + 4]
    rates = sorted(w["links"]["3"] for w in windows if "3" in w["links"])
    print(f"[nodes] node 3's link at 50 Mbit/s: slow link reported after step {first}; its relative rate "
          f"per window {rates}; others {sorted(x for w in windows for n, x in w['links'].items() if n != '3')}")
    assert rates and max(rates) < 0.5, rates
    check_survivors(job, list(range(WORLD)))


@pytest.mark.timeout(300)
def test_identical_commands_make_a_job_of_three_nodes_and_one_of_capacity(identical_job: Job) -> None:
    """The same ``resilient-run --nnodes 3:4`` on four nodes: their node ranks are a
    permutation of 0..3 (3: capacity, spares only); a job node SIGKILLed whole hands its ranks
    to the capacity node's spares, and the job ends whole."""
    job, world = identical_job, (NODES - 1) * PER_NODE
    places = {i: job.placed(i) for i in range(NODES)}
    assert sorted(places.values()) == list(range(NODES)), places
    capacity = next(i for i, n in places.items() if n == NODES - 1)
    spares = [world + NODES - 1, world + 2 * NODES - 1]  # place 3's: W + j * MAX + 3
    job.held()
    job.store.wait([job.m.key("spare", i) for i in range(2)], datetime.timedelta(seconds=120))
    assert sorted(job.m.spares()) == spares
    victim = next(i for i, n in places.items() if n == 2)  # node 2: ranks 4, 5
    job.c.kill_node(victim)
    killed = time.time()
    job.go()
    status = job.wait([i for i in range(NODES) if i != victim])
    assert set(status.values()) == {0}, {i: job.log(i)[-2000:] for i in status}
    d = job.decisions()[-1]
    assert (sorted(d.lost), sorted(d.joiners)) == ([4, 5], spares), d
    print(f"[nodes] identical commands: places {places}; node 2 lost, capacity spares placed after "
          f"{d.t - killed:.2f} s")
    check_survivors(job, d.members, placed=tuple(spares))
    assert "spare capacity: --nnodes 3:4" in job.log(capacity), job.log(capacity)[-2000:]


@pytest.mark.timeout(300)
def test_identical_commands_on_the_c10d_store_host_it_where_the_endpoint_is(tmp_path: Any) -> None:
    """The same ``resilient-run --nnodes 2:3 --rdzv-backend c10d`` on three nodes, the endpoint
    on node 0: node 0 hosts the store (place 0), the others draw 1 and 2 (2: capacity); node 1
    SIGKILLed whole hands its ranks to the capacity node's spares."""
    nodes, world = 3, 2 * PER_NODE
    with NetnsCluster(nodes, [0], str(tmp_path)) as c:
        endpoint = f"{c.addr(0)}:29400"
        events, dump = str(tmp_path / "events"), str(tmp_path / "dump")
        logs = {i: open(tmp_path / f"node{i}.log", "wb") for i in range(nodes)}  # noqa: SIM115
        env = {**os.environ, "RESILIENT_COMM_STRAGGLER_FLOOR_MS": "600000"}
        procs = {i: c.run(i, [sys.executable, "-m", "resilient_comm.elastic", "--nnodes", "2:3", "--nproc-per-node",
                              str(PER_NODE), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "job",
                              "-m", "resilient_comm.testing.toy", "--events", events, "--steps", str(STEPS), "--dump",
                              dump, "--hold", f"0:{HOLD}"], stdout=logs[i], stderr=subprocess.STDOUT, env=env)
                 for i in range(nodes)}

        def log(i: int) -> str:
            logs[i].flush()
            return (tmp_path / f"node{i}.log").read_text()

        try:
            store = dist_store(c.addr(0), 29400)
            m = Membership(store, "rc/job/g0")
            store.wait([f"toy/held/0/{HOLD}", m.key("spare", 0), m.key("spare", 1)], datetime.timedelta(seconds=150))
            places = {i: int(log(i).split("this node is node ")[1].split()[0]) for i in range(nodes)}
            assert places[0] == 0 and sorted(places.values()) == [0, 1, 2], places
            spares = sorted(m.spares())
            assert spares == [world + 2, world + 2 + nodes], spares  # place 2's: W + j * MAX + 2
            victim = next(i for i, n in places.items() if n == 1)
            c.kill_node(victim)
            store.set(f"toy/go/{HOLD}", "1")
            for i in range(nodes):
                if i != victim:
                    assert procs[i].wait(150) == 0, log(i)[-3000:]
            # The store went with node 0: the members are in their final states.
            members = sorted([0, 1, *spares])
            finals = {r: torch.load(os.path.join(dump, f"final-{r}.pt"), weights_only=False) for r in members}
            assert all(sorted(f["members"]) == members and f["committed"] == STEPS - 1 for f in finals.values())
            assert all(same_state(f["state"], finals[0]["state"]) for f in finals.values())
            print(f"[nodes] c10d, identical commands: places {places}; node place 1 lost, spares {spares} placed")
        finally:
            end_all(procs.values(), logs.values())


def dist_store(host: str, port: int) -> Any:
    """A client of a c10d store (the launchers' TCPStore) from the test."""
    return torch.distributed.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=150))


def _sigterm(job: Job, node: int) -> float:
    """SIGTERM to node `node`'s launcher (scancel, a pod's deletion); returns how long it took to
    exit, after asserting its status: its workers' (killed by SIGTERM)."""
    signalled = time.monotonic()
    job.launchers[node].send_signal(signal.SIGTERM)
    status = job.wait([node], timeout_s=30)[node]
    took = time.monotonic() - signalled
    assert status == 128 + signal.SIGTERM, job.log(node)[-2000:]
    assert "ended during shutdown: killed by SIGTERM" in job.log(node), job.log(node)[-2000:]
    return took


@pytest.mark.timeout(300)
def test_sigterm_to_a_running_nodes_launcher_is_a_planned_departure(job: Job) -> None:
    """Node 3's launcher gets SIGTERM while the job trains: it exits within the bound, its
    ranks are reported gone at once (no lease to wait out), and the others go on with 6."""
    job.held()
    took = _sigterm(job, 3)
    signalled = time.time() - took
    job.go()
    status = job.wait([0, 1, 2])
    assert status == {0: 0, 1: 0, 2: 0}, {i: job.log(i)[-2000:] for i in status}
    ds = job.decisions()
    assert sorted(ds[-1].lost) == [6, 7] and ds[-1].members == list(range(6)), ds[-1]
    gone = job.m.gone([6, 7])
    assert all(g.kind == "exit" and "its node shut down (SIGTERM)" in g.detail for g in gone.values()), gone
    print(f"[nodes] SIGTERM to a running node: its launcher exited in {took:.2f} s; decided "
          f"{ds[-1].t - signalled:.2f} s after the signal (lease {LEASE_S} s)")
    assert took < SHUTDOWN_BOUND_S and ds[-1].t - signalled < LEASE_S - 1.0, "decided before any lease ran out"
    check_survivors(job, list(range(6)))


@pytest.mark.timeout(300)
def test_sigterm_during_a_recovery_exits_within_the_bound_and_the_rest_go_on(job: Job) -> None:
    """Node 2 SIGKILLed whole (its lease must run out: a recovery of seconds); meanwhile node
    3's launcher gets SIGTERM: it exits within the bound, and nodes 0 and 1 end with 4 ranks."""
    job.held()
    job.c.kill_node(2)
    job.go()
    deadline = time.monotonic() + 60  # until the survivors are inside the recovery
    while not [e for e in read_events(job.events) if e["event"] == "aborted"]:
        assert time.monotonic() < deadline, "no recovery began"
        time.sleep(0.05)  # polling the events file
    took = _sigterm(job, 3)
    print(f"[nodes] SIGTERM during a recovery: the launcher exited in {took:.2f} s")
    assert took < SHUTDOWN_BOUND_S
    status = job.wait([0, 1])
    assert status == {0: 0, 1: 0}, {i: job.log(i)[-2000:] for i in status}
    check_survivors(job, [0, 1, 2, 3])


@pytest.mark.timeout(300)
def test_a_job_cancelled_on_every_node_at_once_ends_everywhere_within_the_bound(job: Job) -> None:
    """scancel: SIGTERM to every node's launcher at once while the job trains."""
    job.held()
    signalled = time.monotonic()
    for p in job.launchers.values():
        p.send_signal(signal.SIGTERM)
    status = job.wait(list(range(NODES)), timeout_s=30)
    took = time.monotonic() - signalled
    print(f"[nodes] SIGTERM to every node: all {NODES} launchers exited within {took:.2f} s")
    assert took < SHUTDOWN_BOUND_S, {i: job.log(i)[-1500:] for i in range(NODES)}
    assert all(s == 128 + signal.SIGTERM for s in status.values()), status
