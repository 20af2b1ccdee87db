"""Node ranks from the rendezvous: the same ``resilient-run`` command on every node.

A scheduler runs one identical command per node (Slurm's ``srun``, a Kubernetes JobSet), so
nobody can type a node rank per host. Without ``--node-rank`` each node's launcher takes a
*place* from the job's store, before anything else of the job is there:

- **c10d**: the launcher that can bind the endpoint (the host it names, first come) hosts the
  store and is node 0; every other node is a client and draws 1, 2, ... from a counter.
- **etcd**: nobody hosts it; every node draws 0, 1, ... from a counter (etcd's transactions make
  the draw atomic).

The first MIN places are the job's nodes; MIN to MAX-1 are spare capacity (``--nnodes
MIN:MAX``, docs/elastic.md). A place is the node's for the job's life: its ranks are
``place * nproc + local_rank`` as with ``--node-rank``. A node that arrives when every place
was handed out (a node restarted after a loss) takes a *capacity* place whose holder is gone
(on etcd: its leased liveness record expired), never a job place: the ranks of a lost job node
were decided on, and only spares can take their place. With the c10d store, whose records hold
no lease, places are never handed out twice.

Keys, under ``rc/{run_id}/rdzv/`` (outside the generations' namespaces: places outlive a
restart): ``count`` (the counter), ``place/{n}`` (its holder: host, pid and a random tag),
``place/{n}/spares`` (spares the place's launchers started so far: a returning node numbers its
own after them, so no spare id is used twice).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections.abc import Callable

import torch.distributed as dist

log = logging.getLogger("resilient_comm.launcher")

# torchrun's name (its --rdzv-conf join_timeout, default 600 s): how long a job node waits for
# MIN nodes to arrive before it fails with the list of those that did.
JOIN_TIMEOUT_S = 600.0


class RendezvousError(RuntimeError):
    """No place for this node, or too few nodes arrived in time."""


def prefix(run_id: str) -> str:
    return f"rc/{run_id}/rdzv/"


def identity() -> str:
    """Who holds a place: host, pid and a random tag (two launchers never share one)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def claim(
    store: dist.Store,
    run_id: str,
    least: int,
    most: int,
    me: str,
    hosts_store: bool,
    alive: Callable[[int], bool] | None,
) -> int:
    """This node's place (its node rank). `hosts_store`: it hosts the c10d store (place 0, the
    others count from 1); `alive(n)`: on etcd, whether place n's holder still lives (the
    counter then starts at 0; None: the c10d store, whose places are never reused)."""
    p = prefix(run_id)
    if hosts_store:
        store.set(p + "place/0", me)
        return 0
    n = store.add(p + "count", 1) - (1 if alive is not None else 0)
    if n < most:
        store.set(p + f"place/{n}", me)
        return n
    if alive is not None:
        for k in range(least, most):  # a capacity place whose holder is gone
            held = store.get(p + f"place/{k}").decode(errors="replace")
            if not alive(k) and store.compare_set(p + f"place/{k}", held, me).decode(errors="replace") == me:
                log.info("rendezvous: capacity place %d was free (its node is gone): this node takes it", k)
                return k
    capacity = (
        f"its {most - least} capacity place(s) are held by live nodes"
        if most > least
        else "--nnodes MIN:MAX with MAX > MIN gives a node that comes back a capacity place"
    )
    raise RendezvousError(
        f"no place for this node: the job's {least} node place(s) were all taken ({n + 1} nodes arrived "
        f"so far) and {capacity}"
    )


def first_spare(store: dist.Store, run_id: str, place: int) -> int:
    """The number of spares this place's launchers started before this one."""
    key = prefix(run_id) + f"place/{place}/spares"
    return store.add(key, 0)


def spare_started(store: dist.Store, run_id: str, place: int) -> None:
    store.add(prefix(run_id) + f"place/{place}/spares", 1)


def wait_for_nodes(
    store: dist.Store, run_id: str, least: int, timeout_s: float, stop: Callable[[], bool]
) -> bool:
    """Until the job's `least` places are held (True), `stop()` says to give up (False), or the
    timeout passes (RendezvousError naming the places that are missing). A progress line every
    10 s."""
    p = prefix(run_id)
    start = last = time.monotonic()
    log.info("rendezvous: waiting for the job's %d nodes (join_timeout %g s)", least, timeout_s)
    while True:
        held = [n for n in range(least) if store.check([p + f"place/{n}"])]
        if len(held) == least:
            return True
        now = time.monotonic()
        missing = [n for n in range(least) if n not in held]
        if now - start >= timeout_s:
            raise RendezvousError(
                f"only {len(held)} of the job's {least} nodes arrived in {timeout_s:g} s (missing: node place(s) "
                f"{missing}); start the others or lower --nnodes (--rdzv-conf join_timeout=S waits longer)"
            )
        if now - last >= 10.0:
            log.info(
                "rendezvous: %d of %d nodes here, waiting for %s (%.0f s)",
                len(held),
                least,
                missing,
                now - start,
            )
            last = now
        if stop():
            return False
        time.sleep(0.2)  # polling the store's keys (a wait on several keys cannot be cut short)


__all__ = [
    "JOIN_TIMEOUT_S",
    "RendezvousError",
    "claim",
    "first_spare",
    "identity",
    "spare_started",
    "wait_for_nodes",
]
