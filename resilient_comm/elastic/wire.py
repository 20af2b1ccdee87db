"""The node-local socket between a worker (`detector.Detector`) and its node agent
(`agent.NodeAgent`): its lines, and who may speak on it.

The protocol: ASCII lines of at most `MAX_LINE` bytes.

    worker -> agent   hello <rank> <heartbeat_ms> <silence_floor_ms> <straggler_floor_ms>
                            <slow_factor> <min_silent_reads>
                      hb <seq> <step> <phase> <elapsed_ms> <p99_ms> <comm_ms>
                      bye                   it stops beating on purpose (closing): judged no more
                      join <record>         its join record (compact JSON): the agent writes its
                                            node's together (`joins.JoinBatcher`)
    agent -> worker   ev <event as JSON>     gone events carry their records under "gone"
                      joined|joingone|nojoin <applied> ...   the answer to a join
                      lost <reason>          the agent lost the store: no recovery is possible
                      fence <reason>         cut off from the store majority: leave (Evicted)

Trust: the socket lives in a directory only this user can enter, and a connection is kept
only if its peer (``SO_PEERCRED``) is one of the agent's processes, or a descendant of one,
claiming that process's rank. Anything else -- a stray connection, a malformed line, an
oversized one -- is dropped with a log line; it never reaches the store.
"""

from __future__ import annotations

import socket
import struct

from resilient_comm.elastic.detector import DetectorConfig

MAX_LINE = 1024


def parse_hello(fields: list[str]) -> tuple[int, DetectorConfig]:
    """``hello``'s fields (after the word) -> (rank, the worker's detection config)."""
    if len(fields) != 6:
        raise ValueError(f"hello has {len(fields)} fields, expected 6")
    rank, hb, silence, straggler, factor, reads = fields
    cfg = DetectorConfig(heartbeat_s=float(hb) / 1e3, silence_floor_s=float(silence) / 1e3,
                         straggler_floor_s=float(straggler) / 1e3, slow_factor=float(factor),
                         min_silent_reads=int(reads))
    return int(rank), cfg


def hello_line(rank: int, cfg: DetectorConfig) -> str:
    return (f"hello {rank} {1e3 * cfg.heartbeat_s:g} {1e3 * cfg.silence_floor_s:g} {1e3 * cfg.straggler_floor_s:g} "
            f"{cfg.slow_factor:g} {cfg.min_silent_reads}")


def peer_cred(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
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
        pid = int(stat[stat.rindex(b")") + 2:].split()[1])  # the field after the state: ppid
    return chain


__all__ = ["MAX_LINE", "ancestors", "hello_line", "parse_hello", "peer_cred"]
