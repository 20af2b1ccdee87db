"""How a node reaches its job: the job's store -- a c10d TCPStore that node 0 hosts and the
others reach as clients, or an etcd cluster that nobody hosts -- the node's place from the
rendezvous when it has no ``--node-rank``, and what its workers are handed to reach the job: the
store's address (with etcd's TLS and login settings: `etcd.security`), the address they publish
for their own connections, and the job token.

Runs in the node agent process (``resilient-run``), made once by its `Launcher`.
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import socket

import torch.distributed as dist

from resilient_comm.elastic.membership.etcd.store import EtcdStore
from resilient_comm.elastic.membership.protocol import Membership, connect
from resilient_comm.elastic.model.env import ENV_STORE, ENV_TOKEN
from resilient_comm.elastic.node import rendezvous

log = logging.getLogger("resilient_comm.launcher")


class StoreError(RuntimeError):
    """The job's store could not be hosted or reached; the message names it and says why."""


class JobConnection:
    """The job's store as this node reaches it (`store`: the launcher's loop's; any other thread
    takes a `client()` of its own), whether this node hosts it, its address, and the job token.
    Making one connects (a client waits for the store up to `timeout`); a store that cannot be
    hosted or reached, or a secured etcd that refuses this node, is a `StoreError`."""

    def __init__(
        self,
        backend: str,
        endpoint: str,
        node_rank: int | None,
        timeout: datetime.timedelta,
        nodes: int,
        run_id: str | None = None,
    ) -> None:
        """`node_rank` None: this node hosts the c10d store if it can bind `endpoint` first;
        `nodes`: the most nodes the job may have (one node makes its own token, and publishes
        no address); `run_id`: the job's, whose keys (``rc/{run_id}/``) a secured etcd must
        let this node read and write (checked here, before the node takes a place)."""
        if backend not in ("c10d", "etcd"):
            raise ValueError(f"--rdzv-backend {backend!r}: c10d (node 0 hosts a TCPStore) or etcd")
        self.backend = backend
        if backend == "etcd":
            etcd = EtcdStore(endpoint, timeout)  # every node is a client: nobody hosts it
            self.store: dist.Store = etcd
            self.hosts, (self.host, self.port) = False, etcd.endpoints[0]
            self.spec = f"etcd://{endpoint}"
            if run_id is not None and (etcd.security.tls or etcd.security.user):
                self._check_etcd(etcd, f"rc/{run_id}/")
        else:
            self.store, self.hosts = self._tcp_store(endpoint, node_rank, timeout)
            self.spec = f"{self.host}:{self.port}"
        # The job token (docs/security.md): the transports' Hellos carry a MAC of it, so a
        # process without it cannot join a communicator. Handed to the workers through their
        # environment, never the store. One node makes its own; several nodes need the same
        # one, which only whoever starts them can give them all (RESILIENT_COMM_TOKEN).
        self.token = os.environ.get(ENV_TOKEN) or (secrets.token_hex(32) if nodes == 1 else "")
        if not self.token:
            log.warning(
                "no job token: set %s to the same secret on every node, or any process that reaches "
                "the workers' ports can join their communicators (docs/security.md)",
                ENV_TOKEN,
            )
        # The address this node's workers publish for TCP connections: the one it reaches the
        # store from (the host name's address can be another interface's, or loopback).
        self.local_addr = _local_address(self.host) if nodes > 1 else None

    def _check_etcd(self, etcd: EtcdStore, prefix: str) -> None:
        """A secured cluster's refusal of this node (its certificate, its login, its role's
        permissions on the job's prefix) as a `StoreError` that names it, at start-up, rather
        than from the first thread that touches the store."""
        from resilient_comm.elastic.membership.etcd.security import EtcdAccessError

        try:
            etcd.check_access(prefix)
        except EtcdAccessError as e:
            raise StoreError(
                f"the job's store at {self.spec} refused this node ({etcd.security.describe()}): {e}"
            ) from e
        except dist.DistError as e:
            raise StoreError(f"could not reach the job's store at {self.spec}: {e}") from e
        log.info(
            "the job's store at %s: %s, access to %s checked", self.spec, etcd.security.describe(), prefix
        )

    def _tcp_store(
        self, endpoint: str, node_rank: int | None, timeout: datetime.timedelta
    ) -> tuple[dist.TCPStore, bool]:
        """The c10d store and whether this node hosts it (node 0; without a node rank, whoever
        can bind the endpoint first)."""
        host, port = endpoint.rsplit(":", 1)
        hosting = node_rank == 0
        store: dist.TCPStore | None = None
        if node_rank is None and _is_local(host):
            try:  # the endpoint is this host's, and nobody bound it yet: this node hosts it
                store = dist.TCPStore(host, int(port), None, True, timeout=timeout, wait_for_workers=False)
                hosting = True
            except (RuntimeError, OSError) as e:  # another node's address, or taken: a client
                log.info("rendezvous: %s:%s is not this node's to host (%s): a client of it", host, port, e)
        if store is None:
            if not hosting:  # a client waits for the store (its node may start later): say so
                log.info("connecting to the job's store at %s:%s (up to %s)", host, port, timeout)
            try:
                store = dist.TCPStore(host, int(port), None, hosting, timeout=timeout, wait_for_workers=False)
            except (RuntimeError, OSError) as e:  # torch's text says why: taken, refused, timed out
                what = "host" if hosting else "reach"
                raise StoreError(f"could not {what} the job's store at {host}:{port} (c10d): {e}") from e
        self.host, self.port = host, store.port
        return store, hosting

    def client(self) -> dist.Store:
        """A new connection to the store (one per thread that uses it)."""
        return connect(self.spec, datetime.timedelta(seconds=60))

    def claim(self, run_id: str, least: int, most: int) -> int:
        """This node's place from the rendezvous (node/rendezvous.py)."""
        alive = None
        if self.backend == "etcd":
            m = Membership(self.store, f"rc/{run_id}/g0")
            alive = lambda n: m.node_record(n) is not None  # noqa: E731 (a leased record: gone with its node)
        try:
            place = rendezvous.claim(
                self.store, run_id, least, most, rendezvous.identity(), self.hosts, alive
            )
        except dist.DistError as e:
            raise StoreError(f"could not reach the job's store at {self.spec} to take a place: {e}") from e
        log.info(
            "rendezvous: this node is node %d (%s)",
            place,
            f"of the job's {least}" if place < least else f"spare capacity: --nnodes {least}:{most}",
        )
        return place

    def worker_env(self) -> dict[str, str]:
        """What a worker reaches the job with: the store's address (and torchrun's agent store on
        c10d; with etcd there is no TCPStore to point at, but its TLS and login settings, the
        password as its file's path: `EtcdSecurity.worker_env`), the token, the address to publish."""
        env = {ENV_STORE: self.spec}
        if isinstance(self.store, EtcdStore):
            env.update(self.store.security.worker_env())
        if self.backend == "c10d":
            env.update(
                {
                    "MASTER_ADDR": self.host,
                    "MASTER_PORT": str(self.port),
                    "TORCHELASTIC_USE_AGENT_STORE": "True",
                }
            )
        if self.token:
            env[ENV_TOKEN] = self.token
        if self.local_addr and "RESILIENT_COMM_HOST" not in os.environ:
            env["RESILIENT_COMM_HOST"] = self.local_addr
        return env


def _is_local(host: str) -> bool:
    """Whether `host` names an address of this host (a TCPStore server listens on every
    address: only the node the endpoint names may host it)."""
    try:
        addr = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def _local_address(host: str) -> str:
    """The local address this host uses to reach `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return str(s.getsockname()[0])


__all__ = ["JobConnection", "StoreError"]
