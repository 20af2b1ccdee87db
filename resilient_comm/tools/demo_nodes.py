"""`resilient-comm demo --nodes N`: lose a whole node of a multi-node job, keep training.

N nodes (network namespaces on a bridge, `resilient_comm.testing.cluster`; needs root and
etcd) each run ``resilient-run --rdzv-backend etcd`` with 2 workers of the toy model; the
membership is on an etcd cluster with a member on each of the first three nodes. At the start
of a step the last node is SIGKILLed whole: its agent, its workers and its etcd member, so
nothing reports an exit. Its lease expires, its ring predecessor reports its ranks in one
event, the survivors shrink and finish; the demo prints who decided what and each survivor's
recovery timeline.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch


def run_nodes(
    nodes: int, per_node: int, steps: int, kill_step: int, timeout_s: float, timeline_table: Any
) -> int:
    from resilient_comm.elastic import Membership
    from resilient_comm.elastic.membership.etcd.store import EtcdStore
    from resilient_comm.testing.cluster import NetnsCluster, available
    from resilient_comm.testing.toy import read_events

    why = available()
    if why:
        print(
            f"resilient-comm demo --nodes needs network namespaces and etcd (run as root, apt install "
            f"etcd-server): {why}",
            file=sys.stderr,
        )
        return 2
    victim = nodes - 1
    with (
        tempfile.TemporaryDirectory(prefix="resilient-nodes-") as root,
        NetnsCluster(nodes, list(range(min(3, nodes))), root) as c,
    ):
        print(
            f"{nodes} nodes ({', '.join(c.addr(i) for i in range(nodes))}: network namespaces on bridge {c.bridge}), "
            f"etcd members on nodes {', '.join(map(str, c.etcd_on))}; {per_node} workers per node train the toy MLP "
            f"for {steps} steps under resilient-run --rdzv-backend etcd. At step {kill_step} node {victim} is "
            f"SIGKILLed whole (agent, workers, etcd member) ...",
            flush=True,
        )
        events, dump = os.path.join(root, "events"), os.path.join(root, "dump")
        launchers, logs = [], []
        for i in range(nodes):
            logs.append(open(os.path.join(root, f"node{i}.log"), "wb"))  # noqa: SIM115
            launchers.append(
                c.run(
                    i,
                    c.toy_command(
                        i,
                        per_node,
                        "demo",
                        [
                            "--events",
                            events,
                            "--steps",
                            str(steps),
                            "--dump",
                            dump,
                            "--hold",
                            f"0:{kill_step}",
                        ],
                    ),
                    stdout=logs[-1],
                    stderr=subprocess.STDOUT,
                )
            )
        store = EtcdStore(c.endpoints(), datetime.timedelta(seconds=timeout_s))
        started = time.time()
        try:
            while not store.wait_for(f"toy/held/0/{kill_step}", 1.0):
                if any(p.poll() is not None for p in launchers) or time.time() - started > timeout_s:
                    print(
                        "the job did not reach the kill step; logs:", *(_tail(f.name) for f in logs), sep="\n"
                    )
                    return 1
            c.kill_node(victim, keep_etcd=False)
            killed = time.time()
            store.set(f"toy/go/{kill_step}", "1")
            status = [p.wait(timeout=timeout_s) for p in launchers[:victim]]
        finally:
            for p in launchers:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for f in logs:
                f.close()
        if any(status):
            bad = next(i for i, st in enumerate(status) if st)
            print(
                f"a surviving node failed (statuses {status}); node {bad}'s log ends:\n{_tail(logs[bad].name)}"
            )
            return 1
        m = Membership(store, "rc/demo/g0")
        d = m.decision(1)
        assert d is not None
        g = m.gone(d.lost)
        print(f"done in {time.time() - started:.1f} s.\n")
        first = next(iter(g.values()), None)
        if first is not None:
            print(f"node {victim} lost: {first.detail} (reported by {first.by})")
        print(
            f"epoch 1, decided by rank {d.by} {d.t - killed:.2f} s after the kill: ranks {d.lost} lost, "
            f"{len(d.members)} members go on ({d.mode}), resuming at step {d.resume_step}.\n"
        )
        tls = [e["timeline"] for e in read_events(events) if e["event"] == "recovery"]
        print("Recovery timeline of each survivor, ms after the kill:\n")
        print("\n".join(timeline_table(tls, killed)))
        finals = {r: torch.load(os.path.join(dump, f"final-{r}.pt"), weights_only=False) for r in d.members}
        same = all(
            all(
                torch.equal(a, b)
                for a, b in zip(
                    finals[r]["state"]["model"].values(), finals[d.members[0]]["state"]["model"].values()
                )
            )
            for r in d.members
        )
        print(f"\nevery survivor committed all {steps} steps; replicas identical: {same}.")
        return 0 if same else 1


def _tail(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()[-1500:]


__all__ = ["run_nodes"]
