"""A c10d Store on etcd, for jobs that span nodes: the membership with no single point of failure.
Every process of such a job uses it: node agents and workers (through `membership.protocol`).

    resilient-run --rdzv-backend etcd --rdzv-endpoint h1:2379,h2:2379,h3:2379 ...

etcd (Raft-replicated; leases, watches, transactions) goes on while a majority of its
members is up, so losing any one node -- node 0 included -- does not take the membership
down, as it would with the TCPStore that node 0's ``resilient-run`` hosts. `EtcdStore` speaks
etcd's v3 JSON gateway -- its unary requests over one kept-alive HTTP/1.1 connection per
member (the standard library's ``http.client``; `_Endpoint`), its watches through the
maintained `etcd3gw` client -- and gives the c10d `Store` semantics the membership and the
transports' bootstrap rely on:

- ``set``/``get``/``check``/``multi_get``/``delete_key``/``num_keys``: puts and linearizable
  ranges (a member cut off from the majority cannot answer: the client tries the next
  endpoint). ``get`` of a missing key waits for it, as c10d's does. ``check``, ``multi_get``
  and ``multi_set`` of many keys go in transactions of up to 128 operations (etcd's default
  ``--max-txn-ops``), not one request per key.
- ``compare_set`` and ``add``: transactions (compare on the value or on the revision), with
  c10d's results (``compare_set`` of a missing key with a non-empty expected value returns the
  expected value and sets nothing).
- ``wait``: a watch from the revision of the range that found the key missing, so a put in
  between is never lost. Every wait is bounded by the store's timeout (``DistStoreError``).
  A call that finds no endpoint answering tries them again, round after round, for up to 10 s
  (an election takes one or two), then raises ``DistNetworkError``. No call waits forever.
- Leases for node liveness (`Lease`): a key put with a lease disappears when its holder stops
  refreshing it; that deletion, seen by a watch, is the evidence of a lost node.

The agents' long-lived watch streams (events, the ring successor's record) are in `etcd.watch`.
A secured cluster (TLS, client certificates, etcd's login and roles: `etcd.security`) takes the
same calls; its settings come from the ``RESILIENT_COMM_ETCD_*`` knobs unless given. A refusal
of this client's access is an `EtcdAccessError`, raised at once.

`EtcdStore` is a Python subclass of ``torch.distributed.Store``, so it can back a
``PrefixStore`` given to ``init_process_group`` (the C++ transports call it back). Start a
local single-member etcd for trying things (Debian/Ubuntu: ``apt install etcd-server``)::

    etcd --data-dir /tmp/etcd --listen-client-urls http://127.0.0.1:2379 \\
         --advertise-client-urls http://127.0.0.1:2379
"""

from __future__ import annotations

import base64
import datetime
import functools
import http.client
import json
import logging
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch.distributed as dist

from resilient_comm.elastic.membership.etcd.security import (
    EtcdAccessError,
    EtcdSecurity,
    access_error,
    etcd_message,
    login_for,
    split_scheme,
    tls_error,
    token_refused,
)

T = TypeVar("T")
log = logging.getLogger("resilient_comm.etcd")
REQUEST_TIMEOUT_S = (
    1.0  # connecting to one endpoint, and the first wait for its answer; then the next is tried
)
UNREACHABLE_S = 10.0  # how long a call goes on trying the endpoints before the cluster counts as lost
TXN_OPS = 128  # operations per transaction: etcd's default --max-txn-ops
# Unary requests one process has in flight to one member, at most; the others wait their turn
# in the process, where their answer's wait has not begun. A node's agent has a few; a burst
# of 2,048 emulated nodes' requests (256 per driver process) queued at etcd instead, longer
# than their 1 s wait: each was abandoned and sent again to the next member, and etcd served
# every copy.
INFLIGHT_PER_MEMBER = 16


def b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def parse_endpoints(text: str) -> list[tuple[str, int]]:
    """'h1:2379,h2:2379' (a scheme is accepted: `split_scheme`) -> [(host, port), ...]."""
    out = []
    for part in split_scheme(text)[1].split(","):
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"bad etcd endpoint {part!r} in {text!r} (expected host:port[,host:port...])")
        out.append((host, int(port)))
    if not out:
        raise ValueError("no etcd endpoint given")
    return out


class EtcdStore(dist.Store):
    """c10d Store semantics on an etcd cluster. One instance per thread that uses it (as a
    c10d client); `clone()` makes another on the same endpoints, with the same settings (and
    the same login: `security.login_for`)."""

    watches_keys = True  # Membership.watches: waits are bounded watches; records may hold leases
    reads_prefixes = True  # Membership: a node's join records under a key of their own, read back by prefix

    def __init__(
        self,
        endpoints: str | list[tuple[str, int]],
        timeout: datetime.timedelta = datetime.timedelta(seconds=300),
        security: EtcdSecurity | None = None,
    ) -> None:
        """`endpoints`: 'h1:2379,h2:2379' (https:// before each: TLS) or (host, port) pairs;
        `security`: TLS and login (default: the ``RESILIENT_COMM_ETCD_*`` knobs)."""
        super().__init__()
        import etcd3gw

        scheme = split_scheme(endpoints)[0] if isinstance(endpoints, str) else None
        if security is None:
            security = EtcdSecurity.from_env(scheme=scheme)
        elif scheme and scheme != security.protocol:
            raise ValueError(
                f"etcd endpoints {endpoints!r} say {scheme}://, the settings {security.protocol}"
            )
        self.security = security
        self._login = login_for(security)
        self.endpoints = parse_endpoints(endpoints) if isinstance(endpoints, str) else list(endpoints)
        self._http = [_Endpoint(h, p, security) for h, p in self.endpoints]  # the unary requests
        self.watch_clients = [
            etcd3gw.client(
                host=h,
                port=p,
                timeout=REQUEST_TIMEOUT_S,
                api_path="/v3/",
                protocol=security.protocol,
                cert_cert=security.cert,
                cert_key=security.key,
            )
            for h, p in self.endpoints
        ]  # the watches (etcd3gw's clients)
        for c in self.watch_clients:
            # No proxy or ~/.netrc from the environment: the endpoints are the cluster's members,
            # and requests looks for both on every call (a file lookup per request).
            c.session.trust_env = False
            if security.tls:
                c.session.verify = security.requests_verify()
        self.current = 0  # the endpoint that answered last: the next call starts there
        self._wait_s = REQUEST_TIMEOUT_S  # how long a request waits for its answer (`_call`)
        self._timeout = timeout
        # When the request that answered the last call was sent (monotonic): a lease that call
        # refreshed lives at least its TTL from then, however long the call spent on endpoints
        # that did not answer.
        self.answered_sent_at = 0.0

    # -- plumbing -------------------------------------------------------------------------

    def clone(self) -> EtcdStore:
        return EtcdStore(self.endpoints, self._timeout, self.security)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout

    def _call(self, what: str, fn: Callable[[int, float], T], unary: bool = True) -> T:
        """fn(endpoint index, seconds to wait for the answer) on the current endpoint, moving
        on to the next one on a connection failure, round after round (an election takes a
        second or two) for at most `UNREACHABLE_S` (or the store's timeout if shorter); then
        a DistNetworkError.

        A request waits `_wait_s` for its answer: `REQUEST_TIMEOUT_S` at first (a member cut
        off is left quickly), doubled by each request that times out (up to what is left of
        the budget: a cluster that is slow, not gone, is waited for), and brought back
        towards it by answers (three times the latency of the last one, at least
        `REQUEST_TIMEOUT_S`). With a fixed 1 s wait, 512 agents starting together made etcd
        answer in over a second; every request was abandoned (and still served) and sent
        again to the next member, and the load only grew until every lease ran out. And it
        waits at least three times the slowest answer any store of this process had in the
        last seconds (`_SLOWEST`; `unary`: a watch's answer is its slice, not a latency): a
        thread that sends one request every few seconds learns from the others that the
        cluster is slow, rather than sending its request three times (a burst of 1,024 nodes'
        requests at 8,192 emulated ranks was sent again and again until nothing was answered).
        Only answers raise it: a member cut off, which answers nothing, is left after 1 s."""
        from etcd3gw import exceptions

        budget = min(UNREACHABLE_S, self._timeout.total_seconds())
        deadline, pause = time.monotonic() + budget, 0.05
        while True:
            errors = []
            for i in range(len(self.watch_clients)):
                k = (self.current + i) % len(self.watch_clients)
                sent = time.monotonic()
                wait_s = max(
                    REQUEST_TIMEOUT_S, min(max(self._wait_s, 3 * _SLOWEST.recent(sent)), deadline - sent)
                )
                ep = self._http[k]
                ep.queued_s = 0.0
                try:
                    try:
                        out = fn(k, wait_s)
                    finally:
                        deadline += ep.queued_s  # a wait for this process's turn says nothing of the cluster
                except exceptions.ConnectionTimeoutError:
                    errors.append(
                        f"{self.endpoints[k][0]}:{self.endpoints[k][1]}: no answer in {wait_s:.3g} s"
                    )
                    self._wait_s = min(2 * self._wait_s, UNREACHABLE_S)
                    continue
                except (exceptions.ConnectionFailedError, exceptions.InternalServerError) as e:
                    errors.append(
                        f"{self.endpoints[k][0]}:{self.endpoints[k][1]}: {type(e).__name__} ({etcd_message(e)})"
                    )
                    continue
                except exceptions.WatchTimedOut:
                    raise  # a watch's slice ended: the caller's loop
                except exceptions.Etcd3Exception as e:  # an answer, and a refusal (an expired lease, ...)
                    refused = access_error(what, e, self.security)  # TLS, login, permissions
                    raise refused or dist.DistStoreError(f"etcd refused {what}: {_refusal(e)}") from e
                self.current, self.answered_sent_at = k, sent
                if unary:  # (its latency from when it left this process, not from its turn's wait)
                    sent = self._http[k].sent_at
                took = time.monotonic() - sent
                self._wait_s = max(REQUEST_TIMEOUT_S, min(self._wait_s, 3 * took))
                if unary:
                    _SLOWEST.note(sent, took)
                return out
            if time.monotonic() + pause > deadline:
                hint = ""
                if not self.security.tls and errors and all("RemoteDisconnected" in e for e in errors):
                    hint = (
                        " (every member closed the connection unanswered, as one that speaks TLS does to "
                        "plain HTTP: https:// endpoints, or protocol=https?)"
                    )
                raise dist.DistNetworkError(
                    f"etcd unreachable for {what} for {budget:g} s: {'; '.join(errors)}{hint}"
                )
            time.sleep(pause)  # back-off between rounds (what ends the loop is an answer or the budget)
            pause = min(0.5, pause * 2)

    def _post(self, path: str, payload: dict[str, Any], what: str) -> dict[str, Any]:
        from etcd3gw import exceptions

        body = json.dumps(payload, separators=(",", ":")).encode()
        turn_s = self._timeout.total_seconds()

        def send(k: int, wait_s: float) -> dict[str, Any]:
            ep = self._http[k]
            token = self.token(k, wait_s)
            try:
                return ep.post(path, body, wait_s, turn_s, token)
            except exceptions.Etcd3Exception as e:
                if token is None or not token_refused(e):
                    raise
            # An expired token: one new login, and the request once more (a second refusal is raised).
            return ep.post(path, body, wait_s, turn_s, self.renew_token(token, k, wait_s))

        return self._call(what, send)

    def api(self, path: str, payload: dict[str, Any], what: str) -> dict[str, Any]:
        """etcd's answer to one request of its v3 JSON API that the store's methods do not
        make (`path`: '/auth/user/add', ...; a test's or a benchmark's set-up of a cluster)."""
        return self._post(path, payload, what)

    def token(self, k: int, wait_s: float = REQUEST_TIMEOUT_S) -> str | None:
        """The login's token for a request (None: no login), logging in through endpoint `k`
        if this process has none yet. A refused login is an `EtcdAccessError`."""
        if self._login is None:
            return None
        return self._login.token(self._authenticate(k, wait_s))

    def renew_token(self, stale: str, k: int, wait_s: float = REQUEST_TIMEOUT_S) -> str:
        """A new token in place of `stale`, which etcd no longer takes (logging in again
        through endpoint `k`, unless another thread already did)."""
        assert self._login is not None
        return self._login.renew(stale, self._authenticate(k, wait_s))

    def _authenticate(self, k: int, wait_s: float) -> Callable[[bytes], dict[str, Any]]:
        turn_s = self._timeout.total_seconds()
        return lambda body: self._http[k].post("/auth/authenticate", body, wait_s, turn_s, None)

    def check_access(self, prefix: str) -> None:
        """Whether this client may read and write the keys under `prefix`, in one request
        that writes nothing: a transaction whose compare never holds, with a put under the
        prefix in the branch not taken and a read of the prefix in the other (etcd checks the
        permissions of both). A refusal is an `EtcdAccessError` naming the cause; a cluster
        that does not answer, a `DistNetworkError`."""
        probe = b64(prefix)
        self._txn(
            [{"key": probe, "result": "LESS", "target": "VERSION", "version": "0"}],
            [{"request_put": {"key": b64(prefix + "access-check"), "value": b64("")}}],
            [
                {
                    "request_range": {
                        "key": probe,
                        "range_end": b64(prefix_end(prefix)),
                        "keys_only": True,
                        "limit": "1",
                    }
                }
            ],
            f"read and write under {prefix!r} (an access check that writes nothing)",
        )

    def close(self) -> None:
        """Close the connections (a store dropped without this closes them when collected)."""
        for e in self._http:
            e.close()

    def kv_range(self, key: str, prefix: bool = False, count_only: bool = False) -> dict[str, Any]:
        """etcd's answer to a range of `key` (every key under it with `prefix`), as JSON."""
        payload: dict[str, Any] = {"key": b64(key)}
        if prefix:
            payload["range_end"] = b64(prefix_end(key))
        if count_only:
            payload["count_only"] = True
        return self._post("/kv/range", payload, f"get {key!r}")

    def _txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]],
        what: str,
    ) -> dict[str, Any]:
        return self._post("/kv/txn", {"compare": compare, "success": success, "failure": failure}, what)

    # -- c10d Store -----------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self._put(key, _bytes(value))

    def _put(self, key: str, value: bytes, lease: int | None = None) -> None:
        payload: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease is not None:
            payload["lease"] = str(lease)
        self._post("/kv/put", payload, f"set {key!r}")

    def value(self, key: str) -> tuple[bytes | None, int]:
        """(the key's value or None, the store revision of the read)."""
        r = self.kv_range(key)
        kvs = r.get("kvs") or []
        return (unb64(kvs[0].get("value", "")) if kvs else None), int(r["header"]["revision"])

    def get(self, key: str) -> bytes:
        value, _ = self.value(key)  # a key that is there: one request
        if value is not None:
            return value
        self.wait([key])
        value, _ = self.value(key)
        if value is None:
            raise dist.DistStoreError(f"etcd key {key!r} was deleted while being read")
        return value

    def _values(self, keys: list[str]) -> list[bytes | None]:
        """The keys' values (None: missing), read by transactions of up to `TXN_OPS` ranges:
        a decider reading 16K join records makes 128 requests, not 16K."""
        out: list[bytes | None] = []
        for i in range(0, len(keys), TXN_OPS):
            chunk = keys[i : i + TXN_OPS]
            r = self._txn(
                [], [{"request_range": {"key": b64(k)}} for k in chunk], [], f"read {len(chunk)} keys"
            )
            responses = r.get("responses") or []
            if len(responses) != len(chunk):
                raise dist.DistStoreError(f"etcd answered {len(responses)} reads for {len(chunk)} keys")
            for resp in responses:
                kvs = (resp.get("response_range") or {}).get("kvs") or []
                out.append(unb64(kvs[0].get("value", "")) if kvs else None)
        return out

    def check(self, keys: list[str]) -> bool:
        return all(v is not None for v in self._values(keys))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        values = self._values(keys)
        missing = [k for k, v in zip(keys, values) if v is None]
        if missing:  # get's semantics: wait for them
            self.wait(missing)
            values = self._values(keys)
        if any(v is None for v in values):
            raise dist.DistStoreError(f"etcd: a key of {keys[:3]}... was deleted while being read")
        return cast(list[bytes], values)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for i in range(0, len(keys), TXN_OPS):
            self._txn(
                [],
                [
                    {"request_put": {"key": b64(k), "value": b64(_bytes(v))}}
                    for k, v in zip(keys[i : i + TXN_OPS], values[i : i + TXN_OPS])
                ],
                [],
                f"set {len(keys[i : i + TXN_OPS])} keys",
            )

    def items(self, prefix: str, page: int = 4096) -> list[tuple[str, bytes]]:
        """Every (key, value) under `prefix`, in key order, read at one revision in pages of
        `page` keys."""
        return [(k, v) for k, v, _ in self.records(prefix, page)]

    def records(self, prefix: str, page: int = 4096) -> list[tuple[str, bytes, int]]:
        """`items`, each with the revision that last wrote it (which of two is the later)."""
        out: list[tuple[str, bytes, int]] = []
        start, end, rev = prefix.encode(), prefix_end(prefix), 0
        while True:
            payload: dict[str, Any] = {"key": b64(start), "range_end": b64(end), "limit": str(page)}
            if rev:
                payload["revision"] = str(rev)
            r = self._post("/kv/range", payload, f"read the keys under {prefix!r}")
            kvs = r.get("kvs") or []
            out += [
                (
                    unb64(kv["key"]).decode(errors="replace"),
                    unb64(kv.get("value", "")),
                    int(kv.get("mod_revision", 0)),
                )
                for kv in kvs
            ]
            if not r.get("more") or not kvs:
                return out
            rev = rev or int(r["header"]["revision"])
            start = unb64(kvs[-1]["key"]) + b"\0"

    def keys_since(self, prefix: str, revision: int = 0) -> tuple[list[str], int]:
        """The names of the keys under `prefix` written after `revision` (one request; no
        values sent, and none of the keys an earlier call saw unless written again), and the
        store's revision at the read: the `revision` of the next call."""
        payload: dict[str, Any] = {
            "key": b64(prefix),
            "range_end": b64(prefix_end(prefix)),
            "keys_only": True,
        }
        if revision:
            payload["min_mod_revision"] = str(revision + 1)
        r = self._post("/kv/range", payload, f"list the keys under {prefix!r}")
        return (
            [unb64(kv["key"]).decode(errors="replace") for kv in r.get("kvs") or []],
            int(r["header"]["revision"]),
        )

    def advance(
        self, key: str, expected: str | bytes, desired: str | bytes, also: list[tuple[str, str | bytes]]
    ) -> tuple[bytes, bool]:
        """`compare_set(key, expected, desired)` and, if `key` then holds `desired` (set now
        or before), the puts `also` -- in one request (a transaction nested in another's
        failure branch). Returns (the key's value, whether `also` was written); a missing key
        reads as `expected` (compare_set's answer). A member that recovers proposes the next
        epoch and joins it in one round trip."""
        if len(also) >= TXN_OPS:
            raise ValueError(f"advance: at most {TXN_OPS - 1} puts in one transaction, not {len(also)}")
        k, want = b64(key), b64(_bytes(desired))
        puts = [{"request_put": {"key": b64(ak), "value": b64(_bytes(av))}} for ak, av in also]
        inner = {
            "compare": [{"key": k, "result": "EQUAL", "target": "VALUE", "value": b64(_bytes(expected))}],
            "success": [{"request_put": {"key": k, "value": want}}, *puts],
            "failure": [{"request_range": {"key": k}}],
        }
        r = self._txn(
            [{"key": k, "result": "EQUAL", "target": "VALUE", "value": want}],
            puts,
            [{"request_txn": inner}],
            f"advance {key!r}",
        )
        if r.get("succeeded"):
            return _bytes(desired), True
        nested = ((r.get("responses") or [{}])[0].get("response_txn")) or {}
        if nested.get("succeeded"):
            return _bytes(desired), True
        kvs = ((nested.get("responses") or [{}])[0].get("response_range") or {}).get("kvs") or []
        return (unb64(kvs[0].get("value", "")) if kvs else _bytes(expected)), False

    def delete_key(self, key: str) -> bool:
        r = self._post("/kv/deleterange", {"key": b64(key)}, f"delete {key!r}")
        return int(r.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        return int(
            self._post(
                "/kv/range", {"key": b64("\0"), "range_end": b64("\0"), "count_only": True}, "count keys"
            ).get("count", 0)
        )

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        exp, want = _bytes(expected), _bytes(desired)
        k = b64(key)
        if not exp:
            compare = [{"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}]
        else:
            compare = [{"key": k, "result": "EQUAL", "target": "VALUE", "value": b64(exp)}]
        r = self._txn(
            compare,
            [{"request_put": {"key": k, "value": b64(want)}}],
            [{"request_range": {"key": k}}],
            f"compare_set {key!r}",
        )
        if r.get("succeeded"):
            return want
        kvs = (r.get("responses") or [{}])[0].get("response_range", {}).get("kvs") or []
        if not kvs:
            return exp  # missing key, non-empty expected value: c10d's TCPStore answers the same
        return unb64(kvs[0].get("value", ""))

    def add(self, key: str, amount: int) -> int:
        return int(self._update(key, lambda v: str(int(v or b"0") + amount).encode(), f"add {key!r}"))

    def append(self, key: str, value: str | bytes) -> None:
        """c10d's append: `value` added to the end of the key's value (created if missing)."""
        more = _bytes(value)
        self._update(key, lambda v: (v or b"") + more, f"append to {key!r}")

    def _update(self, key: str, change: Callable[[bytes | None], bytes], what: str) -> bytes:
        """Write `change(current value or None)` by compare-and-set on the key's revision (or
        its absence), again until no other writer came between: concurrent updates lose
        nothing. Returns the value written."""
        k = b64(key)
        while True:
            kvs = self.kv_range(key).get("kvs") or []
            if kvs:
                current: bytes | None = unb64(kvs[0].get("value", ""))
                compare = [
                    {"key": k, "result": "EQUAL", "target": "MOD", "mod_revision": kvs[0]["mod_revision"]}
                ]
            else:
                current = None
                compare = [{"key": k, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}]
            new = change(current)
            if self._txn(compare, [{"request_put": {"key": k, "value": b64(new)}}], [], what).get(
                "succeeded"
            ):
                return new

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = (timeout or self._timeout).total_seconds()
        deadline = time.monotonic() + limit
        for key in keys:
            if not self.wait_for(key, max(0.0, deadline - time.monotonic())):
                raise dist.DistStoreError(f"etcd: timed out after {limit:g} s waiting for key {key!r}")

    def wait_for(self, key: str, timeout_s: float, stop: threading.Event | None = None) -> bool:
        """Block until `key` exists (True) or `timeout_s` passes (False), by a watch from the
        revision that found it missing; `stop` ends the wait early (False)."""
        from etcd3gw import exceptions

        deadline = time.monotonic() + timeout_s
        while True:
            value, rev = self.value(key)
            if value is not None:
                return True
            left = deadline - time.monotonic()
            if left <= 0 or (stop is not None and stop.is_set()):
                return False
            slice_s = min(left, 1.0)  # re-check the stop flag (and the endpoint) every second
            try:
                self._call(
                    f"watch {key!r}",
                    functools.partial(self._watch_once, key=key, timeout=slice_s, rev=rev + 1),
                    unary=False,
                )
            except exceptions.WatchTimedOut:
                pass

    def _watch_once(self, k: int, wait_s: float, key: str, timeout: float, rev: int) -> Any:
        client = self.watch_clients[k]
        cast(Any, client).timeout = (REQUEST_TIMEOUT_S, wait_s)  # (connect, read): requests takes both
        token = self.token(k, wait_s)
        if token is not None:  # (a token etcd no longer takes is renewed by the next read's request)
            client.session.headers["Authorization"] = token
        return client.watch_once(key, timeout=timeout, start_revision=rev)

    def queue_push(self, key: str, value: str | bytes) -> None:
        raise NotImplementedError("EtcdStore has no queues: the membership waits for event keys by watch")

    # -- leases ---------------------------------------------------------------------------

    def grant(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds; returns its id."""
        return int(self._post("/lease/grant", {"TTL": str(ttl_s), "ID": "0"}, "grant a lease")["ID"])

    def keepalive(self, lease: int) -> int:
        """Refresh `lease`; returns the TTL it has again (0: it had expired)."""
        r = self._post("/lease/keepalive", {"ID": str(lease)}, "keep a lease alive")
        return int(r.get("result", r).get("TTL", 0))

    def put_with_lease(self, key: str, value: str | bytes, lease: int) -> None:
        self._put(key, _bytes(value), lease)


class _Slowest:
    """The slowest answer of the last `window_s` seconds among this process's stores (per
    one-second bucket, so an old peak ages out)."""

    def __init__(self, window_s: int = 5) -> None:
        self._window = window_s
        self._peaks: dict[int, float] = {}
        self._lock = threading.Lock()

    def note(self, t: float, took: float) -> None:
        second = int(t)
        with self._lock:
            if took > self._peaks.get(second, 0.0):
                self._peaks[second] = took
                if len(self._peaks) > 2 * self._window:
                    for old in [b for b in self._peaks if b <= second - self._window]:
                        del self._peaks[old]

    def recent(self, t: float) -> float:
        since = int(t) - self._window
        with self._lock:
            return max((v for b, v in self._peaks.items() if b > since), default=0.0)


_SLOWEST = _Slowest()


class _Endpoint:
    """One member's JSON gateway for unary requests, over one kept-alive HTTP/1.1 connection
    (``http.client``; over TLS with `EtcdSecurity.tls`, the member's certificate and name
    verified). A request costs the client about 0.2 ms of CPU on the 2-core test
    machine, where `requests` (under etcd3gw) spent 0.9 ms on its session's machinery
    (cookies, proxies, hooks, URL parsing): 1,024 emulated nodes' clients on 2 cores ran out of
    CPU on that, and on a training host it is CPU taken from the job. Failures are etcd3gw's
    exceptions, as `EtcdStore._call` expects: no connection (ConnectionFailedError), no answer
    in time (ConnectionTimeoutError; the connection is dropped, so a late answer is never read
    as the next request's), an HTTP error status (its class by code, etcd's JSON message as
    its detail), and a TLS handshake refused for good (`EtcdAccessError`, not tried again)."""

    def __init__(self, host: str, port: int, security: EtcdSecurity) -> None:
        self.host, self.port, self.security = host, port, security
        self._conn: http.client.HTTPConnection | None = None
        self._turn = _turns(host, port)
        self.sent_at = 0.0  # when the last request left (after its turn came)
        self.queued_s = 0.0  # how long the last request waited for its turn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def post(self, path: str, body: bytes, wait_s: float, turn_s: float, token: str | None) -> dict[str, Any]:
        """The answer to one request (with `token`: etcd's login, as its Authorization
        header): sent once one of the process's `INFLIGHT_PER_MEMBER` turns at this member is
        free (waiting for one at most `turn_s`: the store's timeout, not the unreachable
        budget, which the caller extends by this wait), then waited for `wait_s`."""
        from etcd3gw import exceptions

        t0 = time.monotonic()
        got = self._turn.acquire(timeout=turn_s)
        self.sent_at = time.monotonic()
        self.queued_s = self.sent_at - t0
        if not got:
            raise exceptions.ConnectionTimeoutError(
                f"no turn in {turn_s:g} s: {INFLIGHT_PER_MEMBER} requests of this process in flight"
            )
        # (With an Accept header, as every HTTP client sends: without one, etcd 3.4 does not see a
        # request as its gateway's, and takes the CN of the member certificate as its user.)
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token is not None:
            headers["Authorization"] = token
        try:
            return self._post(path, body, wait_s, headers)
        finally:
            self._turn.release()

    def _connection(self) -> http.client.HTTPConnection:
        if self.security.tls:
            return http.client.HTTPSConnection(
                self.host, self.port, timeout=REQUEST_TIMEOUT_S, context=self.security.ssl_context
            )
        return http.client.HTTPConnection(self.host, self.port, timeout=REQUEST_TIMEOUT_S)

    def _refused_tls(self, e: ssl.SSLError) -> None:
        refused = tls_error(e, f"{self.host}:{self.port}", self.security)
        if refused is not None:
            self.close()
            raise refused from e

    def _post(self, path: str, body: bytes, wait_s: float, headers: dict[str, str]) -> dict[str, Any]:
        from etcd3gw import exceptions

        for attempt in range(2):
            kept = self._conn is not None  # a kept-alive connection the member may have closed
            if self._conn is None:
                self._conn = self._connection()
                try:
                    self._conn.connect()
                except ssl.SSLError as e:
                    self._refused_tls(e)
                    self.close()
                    raise exceptions.ConnectionFailedError(f"connecting: {e}") from e
                except TimeoutError as e:
                    self.close()
                    raise exceptions.ConnectionTimeoutError(f"connecting: {e}") from e
                except OSError as e:
                    self.close()
                    raise exceptions.ConnectionFailedError(f"connecting: {e}") from e
            conn = self._conn
            try:
                cast(socket.socket, conn.sock).settimeout(wait_s)
                conn.request("POST", "/v3" + path, body, headers)
                resp = conn.getresponse()
                data = resp.read()
            except ssl.SSLError as e:  # TLS 1.3: a refused client certificate is heard here
                self._refused_tls(e)
                self.close()
                if kept and attempt == 0:
                    continue
                raise exceptions.ConnectionFailedError(f"{type(e).__name__}: {e}") from e
            except TimeoutError as e:
                self.close()
                raise exceptions.ConnectionTimeoutError(f"no answer in {wait_s:.3g} s") from e
            except (http.client.HTTPException, OSError) as e:
                self.close()
                if kept and attempt == 0:
                    continue  # the member closed the idle connection: once more on a new one
                raise exceptions.ConnectionFailedError(f"{type(e).__name__}: {e}") from e
            if resp.will_close:
                self.close()
            if resp.status != 200:
                text = data.decode(errors="replace")
                raise _http_errors().get(resp.status, exceptions.Etcd3Exception)(text, resp.reason)
            return cast(dict[str, Any], json.loads(data))
        raise AssertionError("unreachable")


@functools.cache
def _turns(host: str, port: int) -> threading.BoundedSemaphore:
    """This process's turns at one member (`INFLIGHT_PER_MEMBER`)."""
    return threading.BoundedSemaphore(INFLIGHT_PER_MEMBER)


@functools.cache
def _http_errors() -> dict[int, type[Exception]]:
    """etcd3gw's exception for an HTTP status (what its own client raises)."""
    from etcd3gw import exceptions

    return {
        500: exceptions.InternalServerError,
        503: exceptions.ConnectionFailedError,
        408: exceptions.ConnectionTimeoutError,
        504: exceptions.ConnectionTimeoutError,
        412: exceptions.PreconditionFailedError,
    }


def _refusal(e: Exception) -> str:
    """An etcd refusal in words: the gateway's JSON error ("etcdserver: requested lease not
    found"), not only the HTTP reason ("Not Found")."""
    detail = etcd_message(e) if getattr(e, "detail_text", None) else None
    return f"{type(e).__name__}: {e}" + (f" ({detail})" if detail else "")


def jittered(period: float) -> float:
    """`period` less up to a fifth at random, for a call every agent makes periodically: after
    a stall (an election, a burst) or an event they all saw, their calls would otherwise fall
    due at the same moment, and stay in step."""
    return period * random.uniform(0.8, 1.0)


def prefix_end(prefix: str) -> bytes:
    b = bytearray(prefix.encode())
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


__all__ = ["EtcdAccessError", "EtcdStore", "b64", "jittered", "parse_endpoints", "prefix_end", "unb64"]
