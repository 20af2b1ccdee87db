"""The node-local channel between a worker (`worker.detector.Detector`) and its node agent
(`node.agent.NodeAgent`): its lines. Pure (formatting and parsing): both ends import it, the
worker to write its lines, the agent to read them; the agent's end of the socket, and who
may speak on it, is `node.channel`.

The protocol: ASCII lines of at most `MAX_LINE` bytes.

    worker -> agent   hello <rank> <heartbeat_ms> <silence_floor_ms> <straggler_floor_ms>
                            <slow_factor> <min_silent_reads>
                      hb <seq> <step> <phase> <elapsed_ms> <p99_ms> <comm_ms>
                      bye                   it stops beating on purpose (closing): judged no more
                      join <record>         its join record (compact JSON): the agent writes its
                                            node's together (`node.join_batcher.JoinBatcher`)
                      rec <cause> ...       a finished recovery, for the node's metrics
                                            (`recovery_line`)
    agent -> worker   ev <event as JSON>     gone events carry their records under "gone"
                      joined|joingone|nojoin <applied> ...   the answer to a join
                      lost <reason>          the agent lost the store: no recovery is possible
                      fence <reason>         cut off from the store majority: leave (Evicted)
"""

from __future__ import annotations

import re

from resilient_comm.elastic.model.bounds import DetectorConfig
from resilient_comm.elastic.model.timeline import PHASES, SOURCES, Timeline

MAX_LINE = 1024
_TOKEN = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def parse_hello(fields: list[str]) -> tuple[int, DetectorConfig]:
    """``hello``'s fields (after the word) -> (rank, the worker's detection config)."""
    if len(fields) != 6:
        raise ValueError(f"hello has {len(fields)} fields, expected 6")
    rank, hb, silence, straggler, factor, reads = fields
    cfg = DetectorConfig(
        heartbeat_s=float(hb) / 1e3,
        silence_floor_s=float(silence) / 1e3,
        straggler_floor_s=float(straggler) / 1e3,
        slow_factor=float(factor),
        min_silent_reads=int(reads),
    )
    return int(rank), cfg


def hello_line(rank: int, cfg: DetectorConfig) -> str:
    return (
        f"hello {rank} {1e3 * cfg.heartbeat_s:g} {1e3 * cfg.silence_floor_s:g} {1e3 * cfg.straggler_floor_s:g} "
        f"{cfg.slow_factor:g} {cfg.min_silent_reads}"
    )


def recovery_line(tl: Timeline) -> str:
    """What a worker sends its agent when a recovery finished: ``rec <cause> <op error kind or
    -> <first evidence or -> <world size> <phase>=<seconds>...`` (one ASCII line)."""
    cause = _token(tl.cause.split(":", 1)[0])
    first = min(tl.via, key=lambda s: tl.via[s]) if tl.via else "-"
    phases = " ".join(f"{p}={ms / 1e3:.6f}" for p, ms in tl.durations_ms().items())
    return f"rec {cause} {_token(tl.op_error or '-')} {_token(first)} {len(tl.members)} {phases}".rstrip()


def parse_recovery(fields: list[str]) -> tuple[str, str, str, int, dict[str, float]]:
    """The fields of a ``rec`` line after the word; ValueError if malformed."""
    if len(fields) < 4:
        raise ValueError("rec needs a cause, an op error kind, a source and a world size")
    cause, op_error, source, world = fields[:4]
    if not all(_TOKEN.fullmatch(x) for x in (cause, op_error, source)):
        raise ValueError("rec: a cause, kind or source that is not a short token")
    if source not in (*SOURCES, "-"):
        raise ValueError(f"rec: unknown evidence source {source!r}")
    n = int(world)
    if not 0 <= n <= 1 << 24:
        raise ValueError(f"rec: world size {n} out of range")
    phases: dict[str, float] = {}
    for f in fields[4:]:
        name, sep, value = f.partition("=")
        if not sep or name not in (*PHASES, "total"):
            raise ValueError(f"rec: {f[:40]!r} is not <phase>=<seconds>")
        s = float(value)
        if not 0 <= s < 1e6:
            raise ValueError(f"rec: phase {name} of {s} s")
        phases[name] = s
    return cause, op_error, source, n, phases


def _token(text: str) -> str:
    t = re.sub(r"[^A-Za-z0-9_.:-]", "_", text.strip())[:64]
    return t or "-"


__all__ = ["MAX_LINE", "hello_line", "parse_hello", "parse_recovery", "recovery_line"]
