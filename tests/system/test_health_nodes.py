"""Node health checks across nodes (network namespaces on a bridge, `testing.cluster`, the
membership on three etcd members among them, one resilient-run per node): a node whose check
fails before it joins takes no place and the job starts on the others; a check that starts
failing mid-job takes its node out within its period (well inside period + the lease), the
others go on bit-identical and nobody else is evicted. Skipped, with the reason, where
namespaces or etcd are not available."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from resilient_comm.elastic import Membership
from resilient_comm.elastic.membership.etcd.store import EtcdStore
from resilient_comm.elastic.node.health import EXIT_UNHEALTHY
from resilient_comm.testing.cluster import NetnsCluster, available
from resilient_comm.testing.harness import same_state
from resilient_comm.testing.toy import read_events

WHY = available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"multi-node tests need namespaces and etcd: {WHY}")
NODES, PER_NODE, STEPS, HOLD = 4, 2, 24, 8
LEASE_S = 5.0  # RESILIENT_COMM_NODE_LEASE_MS's default
PERIOD_S = 2.0  # --health-check-period of the mid-job test


class Job:
    """The toy on NODES launchers of PER_NODE workers, rank 0 held at step HOLD (for seconds:
    its peers, waiting in the step's all-reduce, must not take it for a straggler meanwhile);
    `check(i)` is node i's --health-check; `ranked`: pass --node-rank i (else the rendezvous
    places them)."""

    def __init__(self, c: NetnsCluster, tmp: str, nnodes: str, check: Any, ranked: bool) -> None:
        self.c, self.tmp = c, tmp
        self.events, self.dump = os.path.join(tmp, "events"), os.path.join(tmp, "dump")
        self.logs = {i: open(os.path.join(tmp, f"node{i}.log"), "wb") for i in range(NODES)}  # noqa: SIM115
        self.launchers = {
            i: c.run(i, [
                sys.executable, "-m", "resilient_comm.elastic", "--nnodes", nnodes,
                *(["--node-rank", str(i)] if ranked else []), "--nproc-per-node", str(PER_NODE),
                "--health-check", check(i), "--health-check-period", str(PERIOD_S), "--health-check-timeout", "10",
                "--rdzv-backend", "etcd", "--rdzv-endpoint", c.endpoints(i), "--rdzv-id", "job",
                "-m", "resilient_comm.testing.toy", "--events", self.events, "--steps", str(STEPS),
                "--dump", self.dump, "--hold", f"0:{HOLD}"], stdout=self.logs[i], stderr=subprocess.STDOUT,
                env={**os.environ, "RESILIENT_COMM_STRAGGLER_FLOOR_MS": "600000"})
            for i in range(NODES)
        }
        self.store = EtcdStore(c.endpoints(), datetime.timedelta(seconds=120))
        self.m = Membership(self.store, "rc/job/g0")

    def held(self, running: list[int], timeout_s: float = 150) -> None:
        """Until rank 0 holds at step HOLD (the launchers of `running` still running)."""
        deadline = time.monotonic() + timeout_s
        while not self.store.wait_for(f"toy/held/0/{HOLD}", 1.0):
            ended = {i: self.launchers[i].returncode for i in running if self.launchers[i].poll() is not None}
            assert not ended, f"launchers ended before the hold: {ended}: {self.log(min(ended))[-3000:]}"
            assert time.monotonic() < deadline, "rank 0 never reached the held step"

    def go(self) -> None:
        self.store.set(f"toy/go/{HOLD}", "1")

    def wait(self, timeout_s: float = 150) -> dict[int, int]:
        deadline = time.monotonic() + timeout_s
        out = {}
        for i in range(NODES):
            try:
                out[i] = self.launchers[i].wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"node {i}'s launcher did not finish: {self.log(i)[-3000:]}") from None
        return out

    def log(self, i: int) -> str:
        self.logs[i].flush()
        with open(os.path.join(self.tmp, f"node{i}.log")) as f:
            return f.read()

    def check_survivors(self, survivors: list[int]) -> None:
        """Every survivor committed every step with the same members and a bit-identical state."""
        finals = {r: torch.load(os.path.join(self.dump, f"final-{r}.pt"), weights_only=False) for r in survivors}
        for r in survivors:
            assert finals[r]["members"] == survivors and finals[r]["committed"] == STEPS - 1, (r, finals[r]["members"])
            assert same_state(finals[r]["state"], finals[survivors[0]]["state"]), f"replica {r} differs"
        commits: dict[int, list[int]] = {}
        for e in read_events(self.events):
            if e["event"] == "commit":
                commits.setdefault(e["rank"], []).append(e["step"])
        assert all(commits[r] == list(range(STEPS)) for r in survivors), commits

    def close(self) -> None:
        for p in self.launchers.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in self.logs.values():
            f.close()


@pytest.fixture
def cluster(tmp_path: Any) -> Any:
    with NetnsCluster(NODES, [0, 1, 2], str(tmp_path)) as c:
        yield c


@pytest.mark.timeout(300)
def test_a_node_that_fails_its_check_does_not_join_and_the_job_starts_without_it(cluster: NetnsCluster,
                                                                                 tmp_path: Any) -> None:
    """Four launchers, the same command but node 1's check (--nnodes 3:4, places from the
    rendezvous): node 1 fails it, takes no place and exits EXIT_UNHEALTHY saying why; the other
    three take places 0-2 and the job runs on them, no spare capacity registered."""
    job = Job(cluster, str(tmp_path), f"{NODES - 1}:{NODES}", lambda i: "test -e /nonexistent" if i == 1 else "true",
              ranked=False)
    try:
        assert job.launchers[1].wait(60) == EXIT_UNHEALTHY, job.log(1)[-3000:]
        text = job.log(1)
        assert "health check `test -e /nonexistent` failed (exit code 1); it printed nothing" in text, text[-3000:]
        assert "This node does not join the job and started nothing" in text and "started 2 workers" not in text
        job.held([0, 2, 3])
        job.go()
        status = job.wait()
        assert status == {0: 0, 1: EXIT_UNHEALTHY, 2: 0, 3: 0}, {i: job.log(i)[-2000:] for i in status}
        assert job.m.epoch() == 0 and job.m.spares() == []
        assert not [e for e in read_events(job.events) if e["event"] == "evicted"]
        job.check_survivors(list(range((NODES - 1) * PER_NODE)))
    finally:
        job.close()


@pytest.mark.timeout(300)
def test_a_check_that_starts_failing_mid_job_removes_its_node_within_its_period(cluster: NetnsCluster,
                                                                                tmp_path: Any) -> None:
    """Node 2's check (a file's absence) turns while rank 0 holds the job at step HOLD (the
    others wait in its all-reduce, so the job cannot end first): within PERIOD_S (the bound is
    period + lease) node 2 reports ranks 4, 5 gone ("unhealthy", why) and its workers leave.
    Released, the others decide without it, finish bit-identical, and nobody else is evicted;
    node 2's launcher exits EXIT_UNHEALTHY."""
    sick = tmp_path / "sick-node-2"
    job = Job(cluster, str(tmp_path), str(NODES), lambda i: f"test ! -e {tmp_path}/sick-node-{i}", ranked=True)
    try:
        job.held(list(range(NODES)))
        sick.touch()
        turned = time.time()
        deadline = time.monotonic() + PERIOD_S + LEASE_S
        while len(job.m.gone([4, 5])) < 2:
            assert time.monotonic() < deadline, f"node 2 never left: {job.log(2)[-3000:]}"
            time.sleep(0.05)  # pacing a bounded poll of the gone records
        gone = job.m.gone([4, 5])
        assert all(g.kind == "unhealthy" and g.by == "agent 2" for g in gone.values()), gone
        assert all(f"node 2 is unhealthy: health check `test ! -e {sick}` failed (exit code 1)" in g.detail
                   for g in gone.values()), gone
        reported = max(g.t for g in gone.values()) - turned
        assert job.launchers[2].wait(PERIOD_S + LEASE_S) == EXIT_UNHEALTHY, job.log(2)[-3000:]
        evicted = [e for e in read_events(job.events) if e["event"] == "evicted"]
        assert sorted(e["rank"] for e in evicted) == [4, 5], evicted
        out = max(e["t"] for e in evicted) - turned
        print(f"[health] check turned -> node 2 reported its ranks gone: {reported:.2f} s, its workers out: "
              f"{out:.2f} s (period {PERIOD_S:g} s, lease {LEASE_S:g} s)")
        assert reported < PERIOD_S + 1.0, f"reported {reported:.2f} s after the check turned"
        assert out < PERIOD_S + LEASE_S, f"node 2's workers left {out:.2f} s after the check turned"
        assert "leaves the job as a lost node" in job.log(2), job.log(2)[-3000:]
        job.go()
        status = job.wait()
        assert status == {0: 0, 1: 0, 2: EXIT_UNHEALTHY, 3: 0}, {i: job.log(i)[-2000:] for i in status}
        ds = [job.m.decision(e) for e in range(job.m.epoch() + 1)]
        assert len(ds) == 2, f"one decision after the first: nobody else was evicted: {ds}"
        d = ds[1]
        assert d is not None and sorted(d.lost) == [4, 5] and d.members == [0, 1, 2, 3, 6, 7], d
        assert len([e for e in read_events(job.events) if e["event"] == "evicted"]) == 2
        job.check_survivors([0, 1, 2, 3, 6, 7])
    finally:
        job.close()
