"""``resilient-run``: a torchrun-compatible launcher that never kills survivors.

    resilient-run --nproc-per-node 4 train.py --lr 0.1
    resilient-run --nnodes 2 --node-rank 0 --rdzv-endpoint host0:29400 --nproc-per-node 8 -m pkg.train
    resilient-run --nnodes 2:3 --node-rank 2 --rdzv-endpoint host0:29400 --nproc-per-node 8 -m pkg.train

What it does, and how it differs from torchrun:

- **Hosts the job's c10d TCPStore** (node 0, at ``--rdzv-endpoint``, default a free local
  port), so no worker's death takes the store down. Workers get torchrun's variables (RANK,
  LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/MASTER_PORT pointing at
  that store, TORCHELASTIC_USE_AGENT_STORE=True, TORCHELASTIC_RESTART_COUNT, ...) plus
  ``RESILIENT_COMM_STORE`` (host:port) and ``RESILIENT_COMM_NAMESPACE`` (the key prefix of
  this run and generation), which `resilient_comm.elastic.Controller` reads.
- **Reports a worker's death at once**: each worker holds a liveness lock the launcher hands
  it (``RESILIENT_COMM_LIVENESS_SLOT``; [Note: the liveness lock]), which the kernel releases
  early in the dying process's exit, tens of ms before its pidfd fires; the launcher records
  the death under ``{ns}/gone/{rank}`` with an event that every node's agent forwards, and logs
  the exit status when the pidfd fires. A worker that holds no lock (a plain script that never
  imported resilient_comm) is reported from its pidfd.
- **Is the node's agent** (`resilient_comm.elastic.node.agent.NodeAgent`): workers beat to it over
  a Unix socket (``RESILIENT_COMM_AGENT``); it judges them, writes one liveness record for the
  node, watches the next node's record, and forwards events to its workers.
- **Never kills survivors** when a worker dies: they recover in-process.
- **Forwards SIGINT/SIGTERM** to every worker (each runs in its own session, so a terminal's
  Ctrl-C reaches a worker once, through the launcher); a second signal sends SIGKILL. Then it
  exits: node 0 of a multi-node job waits at most SHUTDOWN_GRACE_S (3 s) for the other nodes
  to end (a second signal: not at all), even for a node that never arrived.
- **Exits with the workers' status**: the status of the workers that were members of the
  last membership decision (evicted or dead ranks that the job recovered from do not count):
  0 when all of them exited 0, else the first failure's code (128+N for signal N). A plain
  torch script (no controller) is judged on every worker.
- ``--spares K`` (any node): starts K *hot spares* besides the node's workers: the same command
  with ``RESILIENT_COMM_SPARE=1`` and RANK set to a spare id (``WORLD_SIZE`` and up, node n of at
  most N (``--nnodes``'s MAX) taking ``WORLD_SIZE + n``, ``+ N + n``, ...: a lost node's ranks
  can be replaced by spares on any other node). LOCAL_RANK
  (the device a process may use) is ``nproc + j`` for the j-th initial spare (a node with 8
  GPUs runs ``--nproc-per-node 7 --spares 1``), and a refill spare gets the local rank of the
  process whose exit it replaces (that device is free now). A spare's `Controller` waits warm until the membership gives it a lost rank's place.
  Each abnormal exit (a worker's death, a spare's) starts one new spare, up to
  ``--max-spare-starts`` in all (default unlimited), so the pool stays full. Spares that are
  still waiting when every worker has ended are stopped (SIGTERM) and do not count in the
  exit status.
- ``--in-process``: a script not written for the controller restarts in the same processes
  after a failure (`resilient_comm.elastic.worker.inprocess`: its ``__main__`` inside
  ``restartable``; the decorator in the script does the same).
- ``--max-restarts N``: when every worker has ended and the job failed (nobody could recover
  in-process: say every replica lost a rank), start the whole group again, up to N times, in a
  fresh namespace (the script resumes from its own checkpoint, as under torchrun). Single
  node only.
- ``--health-check CMD`` (default ``RESILIENT_COMM_HEALTH_CHECK``; ``builtin:accelerator``
  checks the GPUs/NPUs and NCCL/HCCL): run before the node joins -- a node that fails it takes
  no place, starts nothing and exits 69 -- and every ``--health-check-period`` while it runs:
  a node whose check fails leaves the job as a lost node, at once (node/health.py).

Multi-node: one launcher per node with the same ``--nnodes``, ``--nproc-per-node`` and
``--rdzv-endpoint``. With ``--rdzv-backend c10d`` node 0 hosts the store and outlives the
others' workers; with ``--rdzv-backend etcd`` the membership is on an etcd cluster (the
endpoint lists its members, ``h1:2379,h2:2379,...``), nobody hosts it, each node's liveness is
a lease and a node cut off from the etcd majority is fenced (docs/elastic.md). Workers
publish the address their node reaches the store from (``RESILIENT_COMM_HOST``). A node's
ranks are ``node_rank * nproc_per_node + local_rank``; without ``--node-rank`` the node takes
its rank (a *place*) from the rendezvous, so every node runs the same command, and a job node
waits for the job's MIN nodes (``--rdzv-conf join_timeout=S``) before it starts its workers
(node/rendezvous.py, docs/clusters.md).

``--nnodes MIN:MAX``: nodes 0 to MIN-1 are the job's (``WORLD_SIZE`` = MIN x nproc); a node
ranked MIN to MAX-1 is *spare capacity*, started at any time, before or after the job started:
its launcher runs no workers, only spares (``--spares``, default ``--nproc-per-node``; LOCAL_RANK
0, 1, ...), which the membership places when ranks are lost on any node. Its agent announces
the node (a "node" event) and every agent adds it to the ring. Every process gets
``GROUP_WORLD_SIZE`` = MAX (every node the job may have) and ``GROUP_RANK`` = its node's rank; ``WORLD_SIZE // LOCAL_WORLD_SIZE`` is the number of
nodes with workers. ``N`` and ``N:N`` are the same static job.

This module is the node agent's process (``resilient-run``, ``python -m resilient_comm.elastic``):
`Launcher` supervises the node's processes, its `node.agent.NodeAgent` speaks for them.
"""

from __future__ import annotations

import datetime
import logging
import os
import resource
import selectors
import signal
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from typing import IO

import torch.distributed as dist

from resilient_comm import _C
from resilient_comm.api import liveness_slot
from resilient_comm.elastic.membership.protocol import Membership
from resilient_comm.elastic.model.env import (
    ENV_AGENT,
    ENV_NAMESPACE,
    ENV_SPARE,
    EXIT_EVICTED,
)
from resilient_comm.elastic.model.records import Gone, now
from resilient_comm.elastic.node import rendezvous
from resilient_comm.elastic.node.agent import NodeAgent
from resilient_comm.elastic.node.connection import JobConnection
from resilient_comm.elastic.node.health import (
    EXIT_UNHEALTHY,
    HealthCheck,
    HealthMonitor,
)
from resilient_comm.elastic.node.job_view import JobView
from resilient_comm.elastic.node.rendezvous import JOIN_TIMEOUT_S

# Node 0, shutting down on a signal: how long it waits for the other nodes to end before it
# leaves (and takes the store they share with it).
SHUTDOWN_GRACE_S = 3.0  # within SHUTDOWN_BOUND_S of the signal, with the workers' own ends
SHUTDOWN_BOUND_S = 5.0  # a launcher exits within this of a SIGTERM or SIGINT, in any state (tested)
# A node that failed its health check mid-job: how long its processes have to leave once told
# (a controller's does at once) before they are killed (a plain script never hears it).
LEAVE_GRACE_S = 5.0

log = logging.getLogger("resilient_comm.launcher")

# The detail of a death reported from the worker's liveness lock (its status is not known yet).
DIED = "died (its liveness lock; the exit status follows)"


# [Note: the teardown yields] A process killed by SIGKILL is torn down by the kernel in its own
# threads' context, after its liveness lock told us (the robust-futex walk comes before
# `exit_mmap`): for a torch process 40-100 ms of CPU that, on a small node, takes a core from
# the survivors' recovery (bench recovery, 4 ranks on 2 cores: 30 ms median with it, 23 ms
# with the teardown demoted). The launcher makes the dead process's threads SCHED_IDLE for
# TEARDOWN_YIELD_S, then puts them back, so the teardown -- which frees the device memory and
# ports a replacement may need -- is delayed by that much at most. Putting a thread back from
# SCHED_IDLE needs CAP_SYS_NICE or an RLIMIT_NICE of 20; without either the launcher leaves
# the teardown alone rather than starve it.
TEARDOWN_YIELD_S = 0.1
_CAP_SYS_NICE = 23


def _may_restore_policy() -> bool:
    """Whether this process may put another thread back from SCHED_IDLE (`sched_setscheduler`
    checks `can_nice`: CAP_SYS_NICE, or RLIMIT_NICE allowing nice 0)."""
    try:
        if resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20:
            return True
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
        return bool(int(caps.split()[1], 16) >> _CAP_SYS_NICE & 1)
    except (OSError, StopIteration, ValueError):
        return False


def _set_policy(tids: list[int], policy: int) -> list[int]:
    """Set the scheduling policy of `tids` (threads that are gone meanwhile are skipped);
    returns those it was set for."""
    done = []
    for tid in tids:
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
            done.append(tid)
        except OSError:
            pass
    return done


def _yield_teardown(pid: int) -> None:
    """[Note: the teardown yields] `pid` died: its threads run SCHED_IDLE for TEARDOWN_YIELD_S."""
    if not _MAY_RESTORE:
        return
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return
    idle = _set_policy(tids, os.SCHED_IDLE)
    if idle:
        restore = threading.Timer(TEARDOWN_YIELD_S, _restore_teardown, (pid, idle))
        restore.daemon = True
        restore.start()


def _restore_teardown(pid: int, tids: list[int]) -> None:
    """Put back the threads of `pid` (a zombie until the launcher reaps it: its number is not
    reused) that are still its own (a thread that has exited is not listed under it)."""
    _set_policy([t for t in tids if os.path.exists(f"/proc/{pid}/task/{t}")], os.SCHED_OTHER)


_MAY_RESTORE = _may_restore_policy()


@dataclass
class Worker:
    """One process of the node (a worker or a spare), in a session of its own (a terminal's
    Ctrl-C reaches it once, through the launcher), watched through its pidfd. Used on the
    launcher's loop; `send` also from a signal handler."""

    rank: int
    proc: subprocess.Popen
    pidfd: int
    log: IO[bytes] | None
    status: int | None = None  # shell-style: code, or 128+signal
    spare: bool = False  # started as a hot spare
    local_rank: int = 0
    # Its liveness lock, watched (None: not watched, or no longer); and when its death was
    # reported from it, before the kernel's teardown let the pidfd fire.
    live: _C.LivenessWatch | None = None
    died_at: float | None = None
    # Whether the launcher's report of its end was the first (nobody had reported it gone),
    # and how it ended where that was an error of its own (`Launcher._own_error`).
    reported_first: bool = False
    own_error: str | None = None

    @classmethod
    def start(
        cls,
        cmd: list[str],
        env: dict[str, str],
        rank: int,
        local_rank: int,
        spare: bool,
        log_path: str | None,
    ) -> Worker:
        """`cmd` as process `rank`, its output to `log_path` (None: the launcher's own)."""
        out: IO[bytes] | None = None
        if log_path:
            os.makedirs(os.path.dirname(log_path), exist_ok=True)
            out = open(log_path, "wb")  # noqa: SIM115 (closed by `reap`)
        slot = liveness_slot()
        proc = subprocess.Popen(
            cmd,
            env=env | (slot[1] if slot else {}),
            start_new_session=True,
            stdout=out,
            stderr=subprocess.STDOUT if out else None,
            pass_fds=(slot[0],) if slot else (),
        )
        live = None
        if slot:
            live = _C.LivenessWatch(slot[0], proc.pid)
            os.close(slot[0])
        return cls(rank, proc, os.pidfd_open(proc.pid), out, spare=spare, local_rank=local_rank, live=live)

    def send(self, sig: int) -> None:
        """`sig` to the process, if it still runs."""
        if self.status is None:
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except (ProcessLookupError, OSError):
                pass  # ended meanwhile; the selector reports it

    def reap(self) -> int:
        """Once its pidfd is readable (unregistered from any selector): its return code (the
        status, shell-style, in `status`); its pidfd and log closed."""
        returncode = self.proc.wait()
        self.status = shell_status(returncode)  # first: `send` (a signal handler) stops using the pidfd
        os.close(self.pidfd)
        if self.log is not None:
            self.log.close()
        return returncode


def describe_status(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def shell_status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


class Launcher:
    """Starts and watches one node's workers. `run()` (or `start()` then `wait()`) returns
    the exit status; `forward(sig)` may be called from a signal handler or another thread."""

    def __init__(
        self,
        cmd: list[str],
        nproc: int,
        *,
        nnodes: int = 1,
        node_rank: int | None = 0,
        endpoint: str = "127.0.0.1:0",
        max_restarts: int = 0,
        run_id: str | None = None,
        log_dir: str | None = None,
        env: dict[str, str] | None = None,
        store_timeout: datetime.timedelta = datetime.timedelta(minutes=30),
        spares: int | None = None,
        max_spare_starts: int | None = None,
        rdzv_backend: str = "c10d",
        max_nodes: int | None = None,
        metrics_port: int | None = None,
        join_timeout_s: float = JOIN_TIMEOUT_S,
        health_check: HealthCheck | None = None,
        ignore_worker_errors: bool = False,
    ) -> None:
        """`nnodes` and `max_nodes` are ``--nnodes MIN:MAX`` (`max_nodes` None: MAX = MIN);
        `node_rank` None: this node's place comes from the rendezvous (node/rendezvous.py);
        `spares` None: none on an initial node, `nproc` on a capacity node; `metrics_port`:
        serve this node's Prometheus metrics there (0: any free port; metrics.py);
        `health_check`: run every period while the node runs, the node leaving the job when it
        fails (`main` runs it once before making the launcher: node/health.py);
        `ignore_worker_errors`: a worker's error of its own that the job went on without is no
        failure of the job (`_status`)."""
        max_nodes = nnodes if max_nodes is None else max_nodes
        if nproc < 1:
            raise ValueError(f"--nproc-per-node {nproc}: must be at least 1")
        if not 1 <= nnodes <= max_nodes:
            raise ValueError(f"--nnodes {nnodes}:{max_nodes}: needs 1 <= MIN <= MAX")
        self.assigned = node_rank is None and max_nodes > 1  # the rendezvous gives the place
        self.join_timeout_s = join_timeout_s
        # Every node of a job must use the same run id: a multi-node job without one takes
        # "default" (as torchrun's "none"; jobs sharing a store then need --rdzv-id).
        self.run_id = run_id or ("default" if max_nodes > 1 else uuid.uuid4().hex[:8])
        if max_restarts and max_nodes > 1:
            raise ValueError("--max-restarts needs a single node (restarting several nodes is not supported)")
        if node_rank is not None:  # a static layout is checked before any store is reached
            _check_place(node_rank, nnodes, max_nodes, nproc, spares, max_spare_starts)
        self.conn = JobConnection(rdzv_backend, endpoint, node_rank, store_timeout, max_nodes, self.run_id)
        self.store = self.conn.store
        if node_rank is None:
            node_rank = self.conn.claim(self.run_id, nnodes, max_nodes) if self.assigned else 0
            _check_place(node_rank, nnodes, max_nodes, nproc, spares, max_spare_starts)
        self.capacity = node_rank >= nnodes  # joins as spare capacity: no workers of its own, only spares
        spares = (nproc if self.capacity else 0) if spares is None else spares
        self.cmd, self.nproc, self.nnodes, self.node_rank = cmd, nproc, nnodes, node_rank
        self.max_nodes, self.ignore_worker_errors = max_nodes, ignore_worker_errors
        self.max_restarts, self.log_dir, self.extra_env = max_restarts, log_dir, dict(env or {})
        self.generation = 0
        self.spares, self.max_spare_starts, self.spare_starts = spares, max_spare_starts, 0
        self._next_spare = 0
        self._ending = False
        self._events_seen = 0  # the agent's events the ending logic has looked at (capacity node)
        self.workers: list[Worker] = []
        self._sel = selectors.DefaultSelector()
        self.agent: NodeAgent | None = None
        self._reaped = False
        self._shutting_down = False
        self._signals = 0
        self._last_signal = 0
        self.job = JobView(self.membership, self._cut_off)
        self.metrics = None
        if metrics_port is not None:
            from resilient_comm.elastic.node.metrics import NodeMetrics

            self.metrics = NodeMetrics(node_rank, metrics_port, world=self.world_size)
        self.health = HealthMonitor(health_check) if health_check is not None else None
        self.unhealthy: str | None = None  # why this node left the job: its health check failed
        self._kill_at: float | None = None  # when its processes still running are killed

    @property
    def namespace(self) -> str:
        return f"rc/{self.run_id}/g{self.generation}"

    @property
    def world_size(self) -> int:
        """The job's ranks: those of its initial nodes (a capacity node adds only spares)."""
        return self.nproc * self.nnodes

    @property
    def port(self) -> int:
        """The store's port (c10d: where another node reaches it)."""
        return self.conn.port

    @property
    def token(self) -> str:
        return self.conn.token

    def client(self) -> dist.Store:
        """A new connection to the store (one per thread that uses it)."""
        return self.conn.client()

    def membership(self) -> Membership:
        return Membership(self.store, self.namespace, token=self.token)

    def _env(self, rank: int, local_rank: int, spare: bool = False) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(local_rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.nproc),
                "GROUP_RANK": str(self.node_rank),
                "GROUP_WORLD_SIZE": str(self.max_nodes),
                "ROLE_NAME": "default",
                "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": str(self.world_size),
                "TORCHELASTIC_RESTART_COUNT": str(self.generation),
                "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
                "TORCHELASTIC_RUN_ID": self.run_id,
                ENV_NAMESPACE: self.namespace,
                ENV_AGENT: self._agent().path,
                **self.conn.worker_env(),
            }
        )
        if spare:
            env[ENV_SPARE] = "1"
        if "OMP_NUM_THREADS" not in os.environ and self.nproc > 1:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun: N workers must not each take every core
        env.update(self.extra_env)
        return env

    def start(self) -> None:
        """Start this node's workers and spares (a new generation after a restart)."""
        self.workers, self._next_spare, self._ending, self._events_seen = [], 0, False, 0
        if self.assigned:  # the place's earlier holders' spares keep their ids
            self._next_spare = rendezvous.first_spare(self.store, self.run_id, self.node_rank)
        if self.agent is not None:
            self.agent.stop()
        self.agent = NodeAgent(
            self.membership(),
            self.node_rank,
            self.max_nodes,
            nproc=self.nproc,
            present=range(self.nnodes),
            register=lambda f, cb: self._sel.register(f, selectors.EVENT_READ, cb),
            unregister=self._sel.unregister,
        )
        self.agent.metrics = self.metrics
        self.agent.start()
        if self.capacity:
            self.agent.announce()  # on the ring before any of its spares can be placed
        workers = 0 if self.capacity else self.nproc
        for local_rank in range(workers):
            self._spawn(self.node_rank * self.nproc + local_rank, local_rank)
        for j in range(self.spares):
            self._start_spare(workers + j)  # the devices after the workers'
        log.info(
            "started %d workers%s%s (generation %d, store %s:%d, namespace %s): %s",
            workers,
            f" and {self.spares} spares" if self.spares else "",
            f" as capacity node {self.node_rank} (--nnodes {self.nnodes}:{self.max_nodes})"
            if self.capacity
            else "",
            self.generation,
            self.conn.host,
            self.port,
            self.namespace,
            " ".join(self.cmd),
        )
        if self.health is not None:
            self.health.start()  # (once: a restart's generation keeps the same monitor)

    def _spawn(self, rank: int, local_rank: int, spare: bool = False) -> Worker:
        log_path = os.path.join(self.log_dir, str(self.generation), f"{rank}.log") if self.log_dir else None
        w = Worker.start(self.cmd, self._env(rank, local_rank, spare), rank, local_rank, spare, log_path)
        self._agent().add(rank, w.proc.pid)
        self._sel.register(w.pidfd, selectors.EVENT_READ, lambda: self._reap(w))
        if w.live is not None:
            self._sel.register(w.live.fileno(), selectors.EVENT_READ, lambda: self._noticed(w))
        self.workers.append(w)
        return w

    def _start_spare(self, local_rank: int) -> None:
        """Start one spare with the next free id: world size and up, interleaved by node (node n
        of at most N gives ids W + n, W + N + n, ...), so every node's agent starts spares of its
        own, a capacity node too."""
        spare_id = self.world_size + self._next_spare * self.max_nodes + self.node_rank
        self._next_spare += 1
        if self.assigned:
            rendezvous.spare_started(self.store, self.run_id, self.node_rank)
        self.spare_starts += 1
        w = self._spawn(spare_id, local_rank, spare=True)
        log.info("started spare %d (pid %d, local rank %d)", spare_id, w.proc.pid, local_rank)

    def _waiting_spares(self) -> list[Worker]:
        placed = self.job.placed()
        return [w for w in self.workers if w.spare and w.status is None and w.rank not in placed]

    def wait(self) -> int:
        """Watch the workers until all have ended (restarting the group if allowed); returns
        the exit status."""
        while True:
            while any(w.status is None for w in self.workers):
                self._serve()
                news = self.capacity and self._agent().events_read != self._events_seen
                if self._reaped or news:
                    self._reaped, self._events_seen = False, self._agent().events_read
                    self._stop_idle_spares()
            status = EXIT_UNHEALTHY if self.unhealthy else self._status()
            if status == 0 or self.unhealthy or self._shutting_down or self.generation >= self.max_restarts:
                if self.health is not None:
                    self.health.stop()
                self._node_done()
                self._agent().stop()
                return status
            self.generation += 1
            log.warning(
                "the job failed (status %d) with no survivor to go on; restart %d of %d",
                status,
                self.generation,
                self.max_restarts,
            )
            self.start()

    def _agent(self) -> NodeAgent:
        assert self.agent is not None, "start() first"
        return self.agent

    def _cut_off(self) -> str | None:
        """Why this node can no longer use the store (its agent fenced it, or lost the store)
        or has left the job (its health check failed: its agent reported every process gone):
        then nothing is asked of it -- each call would only wait out the store's retry budget
        (10 s on etcd) while the workers' exits wait to be reaped."""
        return None if self.agent is None else self.agent.fenced or self.agent.store_lost

    def _serve(self) -> None:
        """One turn of the loop: exits (pidfds), the agent's socket, the agent's tick, the
        health check's verdict."""
        agent = self._agent()
        for key, _ in self._sel.select(agent.next_tick_in()):
            key.data()
        agent.tick()
        if self.health is not None and self.health.failed is not None:
            self._leave(self.health.failed)

    def _leave(self, failed: str) -> None:
        """The node's health check failed: it leaves the job as a lost node, through its agent
        (`NodeAgent.leave`: its processes told to stop and reported gone in one event, so the
        others decide without it now, a spare taking their place where one waits); whatever
        still runs `LEAVE_GRACE_S` later is killed. Called at every turn of the loop."""
        if self.unhealthy is None:
            self.unhealthy = f"node {self.node_rank} is unhealthy: {failed}"
            self._agent().leave(self.unhealthy)
            self._kill_at = time.monotonic() + LEAVE_GRACE_S
        elif self._kill_at is not None and time.monotonic() >= self._kill_at:
            self._kill_at = None
            for w in self.workers:
                if w.status is None:
                    log.warning("killing %d (pid %d): still running after its node left", w.rank, w.proc.pid)
                    w.send(signal.SIGKILL)

    def run(self) -> int:
        waiting = self.assigned and not self.capacity
        if waiting and not rendezvous.wait_for_nodes(
            self.store, self.run_id, self.nnodes, self.join_timeout_s, lambda: self._shutting_down
        ):
            log.warning("shut down by %s while waiting for the job's nodes", self._signal_name())
            return 128 + self._last_signal
        self.start()
        return self.wait()

    def _signal_name(self) -> str:
        return signal.Signals(self._last_signal).name if self._last_signal else "a signal"

    def _noticed(self, w: Worker) -> None:
        """`w`'s liveness lock has its verdict ([Note: the liveness lock]): a death is reported
        now, tens of ms before the kernel's teardown of the process lets its pidfd fire (the
        exit status is logged then); a normal exit or an exec waits for the pidfd as before."""
        live = self._unwatch(w)
        if live is None or live.verdict != "died" or self._shutting_down or self._ending or self._cut_off():
            return  # (a shutdown's ends, a spare no longer needed: reported, or not, at their exit)
        t, at = now(), time.monotonic()
        _yield_teardown(w.proc.pid)
        self._agent().exited(w.rank)
        if self._report_end(w, DIED, t):
            w.died_at = at

    def _unwatch(self, w: Worker) -> _C.LivenessWatch | None:
        live, w.live = w.live, None
        if live is not None:
            self._sel.unregister(live.fileno())
        return live

    def _reap(self, w: Worker) -> None:
        self._sel.unregister(w.pidfd)
        self._unwatch(w)
        returncode = w.reap()
        t = now()
        self._reaped = True
        self._agent().exited(w.rank)
        what = describe_status(returncode)
        if w.died_at is not None:
            log.info(
                "%s %d (pid %d): %s, %.1f ms after its death was reported from its liveness lock",
                "spare" if w.spare else "worker",
                w.rank,
                w.proc.pid,
                what,
                1e3 * (time.monotonic() - w.died_at),
            )
            if w.reported_first and w.status is not None:  # (an os._exit(1) leaves its lock held too)
                w.own_error = self._own_error(w, w.status, what)
        elif not self._report_end(w, what, t):
            return
        if (
            self.spares
            and not self._shutting_down
            and w.status not in (0, EXIT_EVICTED)
            and not self._ending
            and (self.max_spare_starts is None or self.spare_starts < self.spares + self.max_spare_starts)
        ):
            self._start_spare(w.local_rank)  # the pool stays full; it takes the freed device

    def _report_end(self, w: Worker, what: str, t: float) -> bool:
        """Reports `w`'s end to the membership (`what`: how it ended); whether it was reported
        as a running member's end (not during a shutdown, not a spare no longer needed, nor by a
        node cut off from the store)."""
        if self._shutting_down:
            # A planned departure: the others learn it now instead of waiting out this node's
            # lease (and when every node is being cancelled, nobody waits for anything).
            log.info("worker %d (pid %d) ended during shutdown: %s", w.rank, w.proc.pid, what)
            if not self._cut_off() and not (self._ending and w.spare):
                try:
                    self.membership().report_gone(
                        Gone(
                            w.rank,
                            "exit",
                            f"{what}: its node shut down ({self._signal_name()})",
                            t,
                            "launcher",
                        )
                    )
                except dist.DistError as e:
                    log.warning("worker %d: could not report its end: the store failed (%s)", w.rank, e)
            return False
        if self._ending and w.spare:
            log.info("spare %d (pid %d) ended: %s", w.rank, w.proc.pid, what)
            return False
        if self._cut_off():
            log.warning("worker %d (pid %d): %s; not reported: %s", w.rank, w.proc.pid, what, self._cut_off())
            return False
        try:
            first = self.membership().report_gone(Gone(w.rank, "exit", what, t, "launcher"))
        except dist.DistError as e:
            log.error(
                "worker %d (pid %d): %s; could not report it: the store failed (%s)",
                w.rank,
                w.proc.pid,
                what,
                e,
            )
            return False
        w.reported_first = first
        if first and w.status is not None:
            w.own_error = self._own_error(w, w.status, what)
        log.log(
            logging.INFO if w.status == 0 else logging.WARNING,
            "%s %d (pid %d): %s; reported to the membership",
            "spare" if w.spare else "worker",
            w.rank,
            w.proc.pid,
            what,
        )
        return True

    def _own_error(self, w: Worker, status: int, what: str) -> str | None:
        """How `w` ended, where that was an error of its own: a non-zero exit (not a signal,
        not `EXIT_EVICTED`) of a member of the latest decision that nobody had reported gone
        before (the caller's report was the first). A rank that was suspected, left, or was
        evicted with its replica exits because of the job's decision, not of its own error; one
        killed by a signal is a fault the others recover from."""
        if status <= 0 or status >= 128 or status == EXIT_EVICTED:
            return None
        d = self.job.last_decision()
        if d is not None and w.rank not in d.members:
            return None
        return what

    def _stop_idle_spares(self) -> None:
        """Once every worker (and placed spare) has ended, the waiting spares are not needed. A
        capacity node has no workers of its own: its spares wait until the job is over."""
        if self._ending or not any(w.spare for w in self.workers):
            return
        waiting = self._waiting_spares()
        if all(w.status is not None for w in self.workers if w not in waiting) and (
            not self.capacity or self.job.over()
        ):
            self._ending = True
            for w in waiting:
                w.send(signal.SIGTERM)

    def _status(self) -> int:
        """The status of this node's workers that belong to the last membership decision. Once
        the job finished, a member killed by a signal is no failure: every member had committed
        the last step (its vote counted) or been counted gone by the others, so the job is
        whole (a scheduler must not see a finished job as failed). Its own non-zero exit still
        counts (an error after training, say in saving the model, is the user's to see)."""
        d = self.job.last_decision()
        members = None if d is None or d.mode == "fail" else set(d.members)
        judged = [
            w for w in self.workers if (members is None and not w.spare) or (members and w.rank in members)
        ]
        killed = [w for w in judged if w.status is not None and (w.proc.returncode or 0) < 0]
        if killed and members is not None and self.job.finished():
            for w in killed:
                log.info(
                    "worker %d was %s after the job finished: not a failure",
                    w.rank,
                    describe_status(w.proc.returncode),
                )
            judged = [w for w in judged if w not in killed]
        status = next((w.status for w in judged if w.status), 0) or 0
        own = [w for w in self.workers if w.own_error is not None]
        if status == 0 and own and not self.ignore_worker_errors:
            w = own[0]
            log.error(
                "%s %d (pid %d) ended with an error of its own (%s) and the job went on without it: "
                "exit status %d (--ignore-worker-errors: 0)",
                "spare" if w.spare else "worker",
                w.rank,
                w.proc.pid,
                w.own_error,
                w.status,
            )
            status = w.status or 1
        return status

    def _node_done(self) -> None:
        """Node 0 hosts the store: it waits for every other node on the ring -- initial, or a
        capacity node that announced itself -- to end (or for its loss, which its agent goes on
        watching for) before leaving."""
        key = f"rc/{self.run_id}/node-done/"
        agent = self._agent()
        agent.finish()
        if self.conn.backend != "c10d" or (self._cut_off() and not self.unhealthy):
            return  # nobody hosts an etcd cluster: no node waits for the others
        # (A node that left unhealthy still reaches the store: node 0 hosts it for the others.)
        try:
            self.store.set(key + str(self.node_rank), "1")
        except dist.DistError as e:
            log.error("could not record this node's end: the store failed (%s)", e)
            return
        if self.node_rank != 0:
            return
        shutdown_at: float | None = None
        while True:
            # the ring is read again each turn: a node may announce itself meanwhile
            missing = sorted(n for n in agent.ring() - {0} if not self.store.check([key + str(n)]))
            if not missing:
                return
            if self._shutting_down:
                # A signal (scancel, a pod's deletion, Ctrl-C) ends this node even when another
                # never arrived or never ends: it waits a short grace for them, then leaves (a
                # second signal: at once). Their store goes with it.
                shutdown_at = time.monotonic() if shutdown_at is None else shutdown_at
                waited = time.monotonic() - shutdown_at
                if waited >= SHUTDOWN_GRACE_S or self._signals > 1:
                    log.warning(
                        "shutting down: leaving without node(s) %s, which had not ended after %.1f s; "
                        "the store this node hosts goes with it",
                        ", ".join(map(str, missing)),
                        waited,
                    )
                    return
            self._serve()

    def forward(self, sig: int) -> None:
        """Pass a signal to every live worker; the second signal is SIGKILL."""
        self._signals += 1
        self._last_signal = sig if self._signals == 1 else self._last_signal
        self._shutting_down = True
        sig = signal.SIGKILL if self._signals > 1 else sig
        for w in self.workers:
            w.send(sig)


def _check_place(
    node_rank: int, nnodes: int, max_nodes: int, nproc: int, spares: int | None, max_spare_starts: int | None
) -> None:
    """A usage error (ValueError) where node `node_rank` of ``--nnodes nnodes:max_nodes`` with
    these spares cannot run."""
    if not 0 <= node_rank < max_nodes:
        raise ValueError(
            f"--node-rank {node_rank} is out of range: --nnodes {nnodes}:{max_nodes} numbers "
            f"the nodes 0 to {max_nodes - 1}"
        )
    capacity = node_rank >= nnodes
    spares = (nproc if capacity else 0) if spares is None else spares
    if spares < 0 or (max_spare_starts is not None and max_spare_starts < 0):
        raise ValueError(f"bad spares: --spares {spares}, --max-spare-starts {max_spare_starts}")
    if capacity and not spares:
        raise ValueError(
            f"node {node_rank} is a capacity node (--nnodes {nnodes}:{max_nodes}: nodes {nnodes} to "
            f"{max_nodes - 1} run only spares) and --spares 0 leaves it nothing to run"
        )
