"""Long-lived etcd watch streams for node agents (through a member's JSON gateway). Run by
each node agent (`node`) on etcd.

`PrefixWatch`: the keys put under a prefix, for a thread that waits for one after another
(an agent's events). `DeleteWatch`: one key's delete (an agent's ring successor's record,
which etcd deletes when the node's lease expires). Each stream has a thread and a connection
of its own, TCP keepalive on its socket, and is opened again on the next endpoint when it ends.
On a secured cluster (`etcd.security`) a stream carries the process's login token; a stream
etcd cancels for a stale token is opened again with a new one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from resilient_comm.elastic.membership.etcd.security import EtcdAccessError, token_refused
from resilient_comm.elastic.membership.etcd.store import (
    REQUEST_TIMEOUT_S,
    EtcdStore,
    b64,
    jittered,
    prefix_end,
    unb64,
)

log = logging.getLogger("resilient_comm.etcd")


class _Stream:
    """A watch stream's thread: the stream is opened on the store's current endpoint and, each
    time it ends, on the next (after 0.2 s: an election, a member going away), from `_create`'s
    request, until closed; each chunk goes to `_chunk` (False: the stream ended)."""

    def __init__(self, store: EtcdStore, what: str) -> None:
        self._store = store.clone()  # its own clients: the stream holds one connection
        self._what = what
        self._closed = threading.Event()
        self._resp: Any = None
        self.opened = 0  # streams opened (1 while nothing went wrong)

    def _start(self, name: str) -> None:
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _create(self) -> dict[str, Any]:
        raise NotImplementedError

    def _chunk(self, chunk: dict[str, Any]) -> bool:
        raise NotImplementedError

    def _reopen(self) -> None:
        """End the current stream (its thread opens the next one unless closed)."""
        resp = self._resp
        if resp is None:
            return
        with contextlib.suppress(Exception), _stream_socket(resp) as s:
            s.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked reading the stream
        with contextlib.suppress(Exception):
            resp.close()

    def _run(self) -> None:
        k = self._store.current
        while not self._closed.is_set():
            c = self._store.watch_clients[k]
            pause = 0.2  # between streams: an election, or a member going away
            try:
                # hasleader (gRPC metadata through the gateway): a member that loses its leader
                # ends the stream, rather than holding it open with nothing new to send.
                headers = {"Grpc-Metadata-hasleader": "true"}
                token = self._store.token(k)
                if token is not None:
                    headers["Authorization"] = token
                self._resp = resp = c.session.post(
                    c.get_url("/watch"),
                    json={"create_request": self._create()},
                    stream=True,
                    timeout=(REQUEST_TIMEOUT_S, None),
                    headers=headers,
                )
                self.opened += 1
                _keepalive(resp)
                if self._closed.is_set():
                    break
                for line in resp.iter_lines():
                    if not line.strip():
                        continue
                    chunk = json.loads(line)
                    self._refused(chunk, token, k)
                    if not self._chunk(chunk):
                        break
            except EtcdAccessError as e:  # a login refused: the waiters' reads raise it too
                log.warning("etcd watch of %r cannot be opened: %s", self._what, e)
                pause = 2.0  # a login costs the cluster a bcrypt hash: not five a second
            except Exception as e:
                log.debug("etcd watch of %r on %s:%d ended: %s", self._what, *self._store.endpoints[k], e)
            finally:
                if self._resp is not None:
                    with contextlib.suppress(Exception):
                        self._resp.close()
            k = (k + 1) % len(self._store.watch_clients)
            self._closed.wait(pause)

    def _refused(self, chunk: dict[str, Any], token: str | None, k: int) -> None:
        """A stream etcd cancelled for this client's access: a stale token is renewed (the
        next stream carries the new one); a permission refused is logged (the waiters' reads,
        which raise it, say so to the caller)."""
        result = chunk.get("result")
        reason = str(result.get("cancel_reason") or "") if isinstance(result, dict) else ""
        if not reason:
            return
        if token is not None and token_refused(reason):
            self._store.renew_token(token, k)
        else:
            log.warning("etcd cancelled the watch of %r: %s", self._what, reason)


class PrefixWatch(_Stream):
    """One long-lived watch stream on a key prefix, for a thread that waits for keys one after
    another (a node agent's events): the keys put under the prefix are noted as etcd streams
    them, so a wait is answered the moment its key lands, with no request per wait.

    `EtcdStore.wait_for` opens a watch for each one-second slice (a new connection, a thread
    and a stream at the server, every second, per waiter). Here the stream stays open; what
    guards against a stream that went quiet without an error (its member cut off by a
    partition, which sends no reset) is TCP keepalive on its socket (a dead peer ends it
    within ~5 s; it is then opened again on the next endpoint from the last revision seen), the
    require-leader flag (a member that loses its leader ends its streams), and a read of the
    awaited key every `poll_s` of waiting (a key the stream missed is found, and the waiter goes
    on: the worst case is `poll_s` late, plus a request timeout where the member is gone). The
    stream is then reopened if it is stale: it went past the key's revision without it, or it
    has not reached that revision by the next read. A stream that is merely behind (its
    thread not yet scheduled, the member slow to send) is left open: under load, reopening
    1,024 agents' streams at once was more load. No wait is unbounded: each ends at its
    timeout."""

    def __init__(self, store: EtcdStore, prefix: str, poll_s: float = 2.0) -> None:
        super().__init__(store, prefix)
        self._prefix, self.poll_s = prefix, poll_s
        self._seen: dict[str, bytes] = {}  # key -> the value it was put with (streamed or read)
        self.streamed_at: dict[str, float] = {}  # key -> when its put was streamed (wall clock)
        self._cond = threading.Condition()
        self.missed = 0  # times a read found a key that a stale stream had not brought
        self._behind: tuple[int, float] | None = None  # (a read key's revision not yet streamed, when)
        # What is there already, read at the revision the stream starts after: every key is
        # then either here or streamed, and a wait sends no request (every agent read the
        # next event's key when it began to wait: 1,024 requests right after each event).
        r = self._store.kv_range(prefix, prefix=True)
        self._seen.update(
            (unb64(kv["key"]).decode(errors="replace"), unb64(kv.get("value", "")))
            for kv in r.get("kvs") or []
        )
        self._rev = int(r["header"]["revision"]) + 1
        self._start("rc-etcd-watch")

    def wait_for(self, key: str, timeout_s: float, stop: threading.Event | None = None) -> bool:
        """Block until `key` exists (True), `timeout_s` passes or `stop` is set (False)."""
        deadline = time.monotonic() + timeout_s
        next_read = time.monotonic() + jittered(self.poll_s)
        while True:
            with self._cond:
                if key in self._seen:
                    return True
            if time.monotonic() >= next_read:
                self._stale_after(time.monotonic())
                kvs = self._store.kv_range(key).get("kvs") or []
                if kvs:
                    with self._cond:
                        fresh = key not in self._seen  # read `poll_s` into the wait, not streamed
                        self._seen.setdefault(key, unb64(kvs[0].get("value", "")))
                        rev = int(kvs[0].get("mod_revision", 0))
                        if fresh and rev < self._rev:
                            fresh = False
                            self._stale(f"{key!r} was read, and the stream went past it")
                        elif fresh and self._behind is None:
                            self._behind = (rev, time.monotonic())  # stale if still not there in poll_s
                    return True
                next_read = time.monotonic() + jittered(self.poll_s)
            if deadline <= time.monotonic() or (stop is not None and stop.is_set()) or self._closed.is_set():
                return False
            left = min(deadline, next_read) - time.monotonic()
            with self._cond:
                if key not in self._seen:
                    # Until the next read or the deadline: `stop` comes with a `wake()`. (Looking
                    # at it 4 times a second woke 2,048 emulated agents' threads 8,192 times a
                    # second, and their GIL hand-offs starved the agents' store calls.)
                    self._cond.wait(max(0.0, left))

    def _stale_after(self, t: float) -> None:
        with self._cond:
            # (At the next backstop read: 0.8-1 `poll_s` later.)
            if (
                self._behind is not None
                and self._rev <= self._behind[0]
                and t - self._behind[1] >= self.poll_s / 2
            ):
                self._stale(f"it has not reached revision {self._behind[0]} in {t - self._behind[1]:.1f} s")

    def _stale(self, why: str) -> None:
        """(Under `_cond`.) Count and log a stale stream, and reopen it."""
        self._behind = None
        self.missed += 1
        log.warning("etcd watch of %r is stale (%s): reopening the stream", self._prefix, why)
        self._reopen()

    def value(self, key: str) -> bytes | None:
        """The value `key` was put with, as streamed (or read by a wait): the waiter needs no
        request to read what woke it (at 2,048 nodes, 2,048 requests per event saved)."""
        with self._cond:
            return self._seen.get(key)

    def wake(self) -> None:
        """Wake a `wait_for` so that it looks at its `stop` (set it first)."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        self._closed.set()
        self._reopen()
        with self._cond:
            self._cond.notify_all()

    def _create(self) -> dict[str, Any]:
        return {
            "key": b64(self._prefix),
            "range_end": b64(prefix_end(self._prefix)),
            "start_revision": str(self._rev),
        }

    def _chunk(self, chunk: dict[str, Any]) -> bool:
        """Note one streamed chunk's keys; False: the stream ended (canceled, compacted, error)."""
        result = chunk.get("result")
        if not isinstance(result, dict):
            return False  # {"error": ...}
        if result.get("canceled") or result.get("compact_revision"):
            if result.get("compact_revision"):  # history gone: waiters' reads find the keys
                self._rev = max(self._rev, int(result["compact_revision"]))
            return False
        puts = {}
        for ev in result.get("events") or []:
            kv = ev.get("kv") or {}
            self._rev = max(self._rev, int(kv.get("mod_revision", 0)) + 1)
            if ev.get("type", "PUT") == "PUT":
                puts[unb64(kv.get("key", "")).decode(errors="replace")] = unb64(kv.get("value", ""))
        with self._cond:
            if self._behind is not None and self._rev > self._behind[0]:
                self._behind = None  # it was behind, not stale
            if puts:
                self._seen.update(puts)
                now = time.time()
                self.streamed_at.update((k, now) for k in puts)
                self._cond.notify_all()
        return True


class DeleteWatch(_Stream):
    """A watch stream on one key that calls `on_delete` when the key is deleted: a node
    agent's watch of its ring successor's record, which etcd deletes when the node's lease
    expires. The predecessor hears of the loss then, not at its next read of the record (every
    third of the lease: at a 5 s lease up to 1.7 s later). The member filters the puts out
    (NOPUT): the stream carries nothing while the record is renewed. It is opened again, on
    the next endpoint, from the revision it had reached when it ends; it is a shortcut, not
    the evidence: the predecessor's reads go on, and decide."""

    def __init__(self, store: EtcdStore, key: str, on_delete: Callable[[], None]) -> None:
        super().__init__(store, key)
        self.key, self._on_delete = key, on_delete
        self._rev = 0  # the next revision to stream (0: from now)
        self.created = threading.Event()  # the first stream is watching
        self._start("rc-etcd-delete-watch")

    def close(self) -> None:
        self._closed.set()
        self._reopen()

    def _create(self) -> dict[str, Any]:
        create: dict[str, Any] = {"key": b64(self.key), "filters": ["NOPUT"]}
        if self._rev:
            create["start_revision"] = str(self._rev)
        return create

    def _chunk(self, chunk: dict[str, Any]) -> bool:
        result = chunk.get("result")
        if not isinstance(result, dict) or result.get("canceled") or result.get("compact_revision"):
            return False  # (compacted: the predecessor's next read finds what was missed)
        if result.get("created"):
            self._rev = self._rev or int(result["header"]["revision"]) + 1
            self.created.set()
        deleted = False
        for ev in result.get("events") or []:
            self._rev = max(self._rev, int((ev.get("kv") or {}).get("mod_revision", 0)) + 1)
            deleted |= ev.get("type") == "DELETE"
        if deleted:
            self._on_delete()
        return True


def _stream_socket(resp: Any) -> socket.socket:
    """A duplicate of a streamed response's socket (closing it leaves the stream's own open;
    options and shutdown act on the one socket)."""
    return socket.fromfd(resp.raw._fp.fileno(), socket.AF_INET, socket.SOCK_STREAM)


def _keepalive(resp: Any) -> None:
    """TCP keepalive on a watch stream's socket: a member cut off without a reset ends it in ~5 s."""
    with contextlib.suppress(Exception), _stream_socket(resp) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 2)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)


__all__ = ["DeleteWatch", "PrefixWatch"]
