"""The node agent's end of the node-local channel: a Unix socket its workers connect to, and
who may speak on it. Runs in the node agent (``resilient-run``), in the launcher's loop. The
lines themselves are `model.channel`; what each means to the agent is `node.agent`.

Trust: the socket lives in a directory only this user can enter, and a connection is kept
only if its peer (``SO_PEERCRED``) is one of the agent's processes, or a descendant of one,
claiming that process's rank (`node.agent` checks the hello with `peer_cred` and `ancestors`).
Anything else -- a stray connection, a malformed line, an oversized one -- is dropped with a
log line; it never reaches the store.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Callable
from typing import Any

from resilient_comm.elastic.model.channel import MAX_LINE

log = logging.getLogger("resilient_comm.agent")


def peer_cred(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket."""
    pid, uid, _gid = struct.unpack(
        "3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    )
    return pid, uid


def ancestors(pid: int) -> list[int]:
    """pid and its ancestors up to init (from /proc; stops at a process that is gone)."""
    chain: list[int] = []
    while pid > 1 and len(chain) < 64:
        chain.append(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            break
        pid = int(stat[stat.rindex(b")") + 2 :].split()[1])  # the field after the state: ppid
    return chain


class Conn:
    """A connection on the agent's socket, before and after its hello (`proc`: the agent's
    `view.Proc` it speaks for, once it said hello)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.proc: Any = None


class ChannelServer:
    """The listening socket and its connections, in the caller's event loop:
    `register(fileobj, callback)` / `unregister(fileobj)` (the launcher's selector). Each
    whole line goes to `on_line(conn, line, t)`, which returns why the connection must be
    dropped ("" to keep it); `on_close(conn)` hears of each connection dropped."""

    def __init__(
        self,
        node: int,
        register: Callable[[Any, Callable[[], None]], object],
        unregister: Callable[[Any], object] | None,
        on_line: Callable[[Conn, bytes, float], str],
        on_close: Callable[[Conn], None],
    ) -> None:
        self.node = node
        self._register, self._unregister = register, unregister
        self._on_line, self._on_close = on_line, on_close
        self.conns: list[Conn] = []
        self._dir = tempfile.mkdtemp(prefix="rc-agent-")  # mode 0700: only this user gets in
        self.path = os.path.join(self._dir, "agent.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(256)
        self._listener.setblocking(False)
        register(self._listener, self._accept)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            c = Conn(sock)
            sock.settimeout(1.0)  # a send to a wedged worker gives up (and drops it) after 1 s
            self.conns.append(c)
            self._register(sock, functools.partial(self._readable, c))

    def close(self, c: Conn | None, why: str = "") -> None:
        if c is None or c not in self.conns:
            return
        self.conns.remove(c)
        if why:
            log.warning("node %d: dropped a connection to its agent (%s)", self.node, why)
        if self._unregister is not None:
            self._unregister(c.sock)
        self._on_close(c)
        c.sock.close()

    def close_socket(self, sock: socket.socket) -> None:
        """Drop the connection on `sock` (its process ended)."""
        self.close(next((c for c in self.conns if c.sock is sock), None))

    def _readable(self, c: Conn) -> None:
        try:
            data = c.sock.recv(65536)
        except OSError as e:
            self.close(c, f"recv: {e}")
            return
        if not data:
            self.close(c)  # the process ended or closed it; its exit comes from the pidfd
            return
        c.buf += data
        t = time.monotonic()
        while (end := c.buf.find(b"\n")) >= 0:
            line, c.buf = bytes(c.buf[:end]), c.buf[end + 1 :]
            why = self._on_line(c, line, t)
            if why:
                self.close(c, why)
                return
        if len(c.buf) > MAX_LINE:
            self.close(c, f"a line longer than {MAX_LINE} bytes")

    def shutdown(self) -> None:
        """Close every connection and the socket; remove its directory."""
        for c in list(self.conns):
            self.close(c)
        if self._unregister is not None:
            self._unregister(self._listener)
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)


__all__ = ["ChannelServer", "Conn", "ancestors", "peer_cred"]
