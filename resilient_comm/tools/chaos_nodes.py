"""`resilient-comm chaos`'s trials on several nodes: faults of one node's link.

The nodes are network namespaces on a bridge (`resilient_comm.testing.cluster.NetnsCluster`),
one cluster for every such trial of a run, each node running ``resilient-run --rdzv-backend
etcd`` with `PER_NODE` workers of the toy (ranks ``node * PER_NODE + local``, so its data
streams are those of a single-machine world of the same size). The one etcd member is on node
0, whose link is never the faulty one: a fault then cuts a node off from the store and from
its peers, as a cable or a switch port would, and not the store from everyone. Each trial has
a run id of its own (``--rdzv-id``), so no record of one is read by another.

- **flap**: the link goes down for a drawn time under `tolerated_outage_s` of the node lease,
  once or twice (the second outage after the node's agent was answered again), then comes
  back. The contract: such an outage costs nothing.
- **slow-link**: the link is limited to a drawn rate (`tc tbf`, both ways) for a few seconds,
  then restored. Steps are slower (the model is made larger than the other kinds' so that its
  all-reduce crosses the link in tens of milliseconds at that rate), and nobody is evicted:
  a slow link is neither a dead rank nor a slow one.

Fail-slow detection is on in both (a window of `WINDOW` steps): a stalled or slowed collective
must not be taken for a slow rank. The checks are chaos's: no hang, every launcher exits 0; and
here no membership decision at all (no eviction, no fence), so every rank ends at the last step
with the state of a fault-free run on the same nodes (the reference, made once per run).
"""

from __future__ import annotations

import datetime
import itertools
import os
import random
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import IO, Any

from resilient_comm.tools.chaos_trial import (
    FINGERPRINT_EVERY,
    NODE_KINDS,
    SLOW_BELOW,
    STEP_MS,
    LinkFault,
    Outcome,
    Trial,
)

PER_NODE = 2  # ranks per node (chaos's --nodes help and header say so)
HIDDEN = 512  # the MLP's hidden width here: 86 KB of gradients per all-reduce
WINDOW = 4  # fail-slow detection's window (steps)
FLAP_SHORTEST_S = 0.3
MBITS = (20, 30, 40, 50)  # slow-link's rates
LIMIT_S = (2.0, 4.0)  # slow-link's duration


def unavailable(kind: str) -> str | None:
    """Why `kind` (flap, slow-link) cannot run here, or None."""
    from resilient_comm.testing.cluster import available

    why = available()
    if why is None and kind == "slow-link" and shutil.which("tc") is None:
        why = "no 'tc' command (iproute2)"
    return f"needs root, network namespaces and etcd: {why}" if why else None


def _lease_s() -> float:
    from resilient_comm.elastic.node.agent import node_lease_s

    return node_lease_s()


def _gap_s() -> float:
    """The least time between a link's return and its next outage: a keepalive period and
    the store's answer after a link comes back, with as much again to spare. Two outages
    closer than this are one long one to the fence (it counts from the last answer)."""
    from resilient_comm.elastic.node.lease import ANSWER_AFTER_LINK_S

    return _lease_s() / 6 + 2 * ANSWER_AFTER_LINK_S


def draw(index: int, kind: str, rng: random.Random, nodes: int, steps: int) -> Trial:
    """The link fault of trial `index`: which node, when (a step rank 0 holds at while it
    begins), how long and, for slow-link, how slow."""
    from resilient_comm.elastic.node.lease import tolerated_outage_s

    node = rng.randrange(1, nodes)  # node 0 holds the etcd member
    if kind == "flap":
        longest = tolerated_outage_s(_lease_s()) - 0.5
        first = rng.randrange(2, max(3, steps - 8))
        at = [first] if rng.random() < 0.5 else [first, rng.randrange(first + 2, steps - 2)]
        fault = LinkFault(node, [(s, round(rng.uniform(FLAP_SHORTEST_S, longest), 2)) for s in at])
    elif kind == "slow-link":
        step = rng.randrange(2, steps - 5)
        fault = LinkFault(node, [(step, round(rng.uniform(*LIMIT_S), 2))], float(rng.choice(MBITS)))
    else:
        raise ValueError(f"{kind!r} is not a link fault (flap, slow-link)")
    hold = [a for s, _ in fault.at for a in ("--hold", f"0:{s}")]
    return Trial(index, kind, steps, FINGERPRINT_EVERY, hold, [], link=fault)


class NodeJob:
    """The toy on every node of `cluster`, one launcher per node, under run id `rdzv`."""

    def __init__(self, cluster: Any, rdzv: str, nodes: int, args: list[str], workdir: str) -> None:
        from resilient_comm.elastic import Membership
        from resilient_comm.elastic.membership.etcd.store import EtcdStore

        os.makedirs(workdir, exist_ok=True)
        self.c, self.nodes, self.workdir = cluster, nodes, workdir
        self.events, self.dump = os.path.join(workdir, "events"), os.path.join(workdir, "dump")
        self.launchers: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, IO[bytes]] = {}
        for i in range(nodes):
            self.logs[i] = open(os.path.join(workdir, f"node{i}.log"), "wb")  # noqa: SIM115
            self.launchers[i] = cluster.run(
                i,
                cluster.toy_command(i, PER_NODE, rdzv, ["--events", self.events, "--dump", self.dump, *args]),
                stdout=self.logs[i],
                stderr=subprocess.STDOUT,
            )
        self.store = EtcdStore(cluster.endpoints(), datetime.timedelta(seconds=30))
        self.m = Membership(self.store, f"rc/{rdzv}/g0")

    def held(self, step: int, deadline: float) -> None:
        """Until rank 0 holds at `step` (TimeoutError past `deadline`, RuntimeError if a
        launcher ended first)."""
        while not self.store.wait_for(f"toy/held/0/{step}", 1.0):
            ended = {i: p.returncode for i, p in self.launchers.items() if p.poll() is not None}
            if ended:
                raise RuntimeError(f"launchers ended before rank 0 held at step {step}: {ended}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not reach step {step}")

    def wait(self, deadline: float) -> dict[int, int]:
        """Every launcher's exit status (TimeoutError past `deadline`)."""
        out = {}
        for i, p in self.launchers.items():
            try:
                out[i] = p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"node {i}'s launcher did not finish") from None
        return out

    def log(self, i: int) -> str:
        with open(os.path.join(self.workdir, f"node{i}.log"), errors="replace") as f:
            return f.read()

    def close(self, held: list[int]) -> None:
        """Kill what still runs; remove the toy's hold keys (they are not under the run id)."""
        for p in self.launchers.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in self.logs.values():
            f.close()
        for step in held:
            for key in (f"toy/held/0/{step}", f"toy/go/{step}"):
                self.store.delete_key(key)
        self.store.close()


class NodeBench:
    """The nodes (started at the first trial, kept for the run) and the fault-free reference
    on them (made once)."""

    def __init__(self, nodes: int, steps: int, workdir: str, timeout_s: float) -> None:
        self.nodes, self.steps, self.workdir, self.timeout_s = nodes, steps, workdir, timeout_s
        self.world = nodes * PER_NODE
        self._cluster: Any = None
        self._reference: Any = None

    def __enter__(self) -> NodeBench:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._cluster is not None:
            self._cluster.close()
            self._cluster = None

    def args(self, extra: list[str]) -> list[str]:
        """The toy's arguments in every run on the nodes."""
        return [
            "--steps",
            str(self.steps),
            "--step-ms",
            str(STEP_MS),
            "--hidden",
            str(HIDDEN),
            "--fingerprint-every",
            str(FINGERPRINT_EVERY),
            "--pace-window",
            str(WINDOW),
            "--pace-slow-below",
            str(SLOW_BELOW),
            *extra,
        ]

    def cluster(self) -> Any:
        if self._cluster is None:
            from resilient_comm.testing.cluster import NetnsCluster

            os.makedirs(self.workdir, exist_ok=True)
            c = NetnsCluster(self.nodes, [0], self.workdir)
            try:
                c.start()
            except BaseException:
                c.close()
                raise
            self._cluster = c
        return self._cluster

    def reference(self) -> Any:
        """The final state of a fault-free run on these nodes (a run with any membership
        decision of its own, on a loaded machine, is not one: it is run again)."""
        import torch

        if self._reference is None:
            for attempt in range(3):
                name = f"reference-{attempt}"
                job = NodeJob(
                    self.cluster(),
                    f"chaos-{name}",
                    self.nodes,
                    self.args([]),
                    os.path.join(self.workdir, name),
                )
                try:
                    status = job.wait(time.monotonic() + self.timeout_s)
                    path = os.path.join(job.dump, "final-0.pt")
                    if set(status.values()) == {0} and job.m.epoch() == 0 and os.path.exists(path):
                        self._reference = torch.load(path, weights_only=False)["state"]
                        break
                finally:
                    job.close([])
            else:
                raise RuntimeError(
                    f"the fault-free run on {self.nodes} nodes failed 3 times (logs in {self.workdir})"
                )
        return self._reference

    def run_trial(self, t: Trial, workdir: str) -> Outcome:
        """Trial `t` (flap or slow-link) on the nodes: the fault from rank 0's hold at each of
        its steps, for its time; then the checks."""
        import torch

        from resilient_comm.testing.harness import same_state
        from resilient_comm.testing.toy import read_events

        assert t.link is not None
        out = Outcome(t.index, t.kind, t.args, t.steps)
        try:
            want = self.reference()
        except (RuntimeError, TimeoutError, OSError) as e:
            out.fail(f"no reference: {e}")
            return out
        c, fault = self.cluster(), t.link
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        job = NodeJob(c, f"chaos-trial-{t.index}", self.nodes, self.args(t.args), workdir)
        spans: list[tuple[float, float]] = []  # when the fault was on (wall clock, as the events)
        try:
            for step, secs in fault.at:
                job.held(step, deadline)
                if spans and (rest := _gap_s() - (time.time() - spans[-1][1])) > 0:
                    time.sleep(rest)  # the gap between two outages is part of the fault
                (c.limit(fault.node, fault.mbit) if fault.mbit else c.partition(fault.node))
                on = time.time()
                job.store.set(f"toy/go/{step}", "1")
                try:
                    time.sleep(secs)  # the fault's duration (what the trial is about), not a synchronisation
                finally:
                    (c.unlimit(fault.node) if fault.mbit else c.heal(fault.node))
                spans.append((on, time.time()))
            status = job.wait(deadline)
        except TimeoutError as e:
            out.hang = True
            out.fail(f"hang: {e} within {self.timeout_s:.0f} s")
            return out
        except RuntimeError as e:
            out.fail(str(e))
            return out
        finally:
            out.seconds = time.monotonic() - t0
            job.close([s for s, _ in fault.at])
        bad = {i: s for i, s in status.items() if s != 0}
        out.status = next(iter(bad.values()), 0)
        if bad:
            out.fail(f"launcher exit status {bad}")
        events = read_events(job.events)
        decisions = [job.m.decision(e) for e in range(1, job.m.epoch() + 1)]
        gone = sorted({r for d in decisions if d is not None for r in (*d.lost, *d.evicted)})
        evicted = sorted({e["rank"] for e in events if e["event"] == "evicted"})
        out.false_evictions = sorted({*gone, *evicted})
        if out.false_evictions:
            out.fail(f"false eviction of {out.false_evictions}")
        if decisions:
            out.fail(f"{len(decisions)} membership decision(s), none was due")
        finals = {}
        for r in range(self.world):
            path = os.path.join(job.dump, f"final-{r}.pt")
            if not os.path.exists(path):
                out.fail(f"rank {r} left no final state")
                continue
            finals[r] = torch.load(path, weights_only=False)
            if finals[r]["committed"] != self.steps - 1:
                out.fail(f"rank {r} ended at step {finals[r]['committed']}, not {self.steps - 1}")
        if finals and not decisions:
            first = finals[min(finals)]["state"]
            if any(not same_state(f["state"], first) for f in finals.values()):
                out.divergent = True
                out.fail("replicas differ")
            elif not same_state(first, want):
                out.divergent = True
                out.fail("the final state differs from the fault-free reference")
        out.note = _effect(t, job, events, spans)
        return out


def _effect(t: Trial, job: NodeJob, events: list[dict[str, Any]], spans: list[tuple[float, float]]) -> str:
    """What the fault did: how the steps went while it lasted, what the node's agent and the
    fail-slow detection said."""
    assert t.link is not None
    commits = sorted(e["t"] for e in events if e["event"] == "commit" and e["rank"] == 0)
    gaps = list(itertools.pairwise(commits))
    inside = [b - a for a, b in gaps if any(x <= b <= y for x, y in spans)]
    outside = [b - a for a, b in gaps if not any(x <= b <= y for x, y in spans)]
    said = [
        f"{len(inside)} steps while it lasted (median {_ms(inside)}), else median {_ms(outside)}, "
        f"longest {_ms(inside + outside, max)}"
    ]
    rode = job.log(t.link.node).count("rode out a store outage")
    if rode:
        said.append(f"node {t.link.node}'s agent rode out {rode} store outage(s)")
    slow = sorted({r for e in events if e["event"] == "slow" for r in e["slow"]})
    if slow:
        said.append(f"ranks {slow} judged slow (none left)")
    links = sorted({n for e in events if e["event"] == "slow_link" for n in e["slow"]})
    if links:
        said.append(f"slow link reported: node {', '.join(links)}")
    return "; ".join(said)


def _ms(gaps: list[float], how: Callable[[list[float]], float] = statistics.median) -> str:
    return f"{how(gaps) * 1e3:.0f} ms" if gaps else "-"


__all__ = ["NODE_KINDS", "PER_NODE", "NodeBench", "NodeJob", "draw", "unavailable"]
