"""The membership's records: an epoch's `Decision`, a member's `JoinRecord` and the `Gone`
evidence on a rank, with their JSON forms. Pure data (no store, no I/O): every process of
the job reads and writes them -- node agents and workers through `membership.protocol`, the
decider through `model.decide`.

A value read from the store is never trusted to be well-formed: `from_json` checks every
field's type against its annotation and raises ValueError otherwise.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar, cast

from resilient_comm.elastic.model.policy import Mesh

T = TypeVar("T")

_RANK_LISTS = ("members", "lost", "evicted", "joiners", "used_spares", "slots")


def _runs(xs: list[int]) -> str:
    """Consecutive ascending ranks as "a-b": [0, 1, 2, 7, 4, 5] -> "0-2,7,4-5"."""
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def _unruns(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, text.split(",")):
        a, _, b = part.partition("-")
        lo, hi = int(a), int(b or a)
        if hi < lo or hi - lo > 10_000_000:
            raise ValueError(f"bad rank run {part!r}")
        out.extend(range(lo, hi + 1))
    return out


def _dumps(obj: Any) -> str:
    return json.dumps(asdict(obj), sort_keys=True, separators=(",", ":"))


@functools.cache
def _check(t: str) -> Callable[[object], bool]:
    """Whether a JSON value fits the field annotation `t` of the records below (made once per
    annotation: the decider checks 16K join records at 16K ranks)."""
    if t.endswith(" | None"):
        inner = _check(t[:-7])
        return lambda v: v is None or inner(v)
    if t == "bool":
        return lambda v: v is True or v is False
    if t == "int":
        return lambda v: type(v) is int  # JSON's ints (not bool, a subclass)
    if t == "float":
        return lambda v: type(v) is float or type(v) is int
    if t == "str":
        return lambda v: type(v) is str
    if t.startswith("list[") and t.endswith("]"):
        item = _check(t[5:-1])
        return lambda v: type(v) is list and all(map(item, v))
    if t == "dict[str, int]":
        return lambda v: type(v) is dict and all(type(k) is str and type(x) is int for k, x in v.items())
    raise AssertionError(f"no check for the annotation {t!r}")


@functools.cache
def _fields(cls: type) -> dict[str, tuple[str, Callable[[object], bool]]]:
    return {f.name: (str(f.type), _check(str(f.type))) for f in fields(cls)}


def _record(cls: type[T], d: object) -> T:
    """`cls(**d)` for a JSON object whose fields all have the declared types; else ValueError
    (a value from the store is never trusted to be well-formed)."""
    if type(d) is not dict:
        raise ValueError(f"{cls.__name__}: not a JSON object: {str(d)[:60]!r}")
    types = _fields(cast(type, cls))
    for name, value in d.items():
        if name not in types:
            raise ValueError(f"{cls.__name__}: unknown field {name!r}")
        t, ok = types[name]
        if not ok(value):
            raise ValueError(f"{cls.__name__}.{name}: {str(value)[:40]!r} is not {t}")
    try:
        return cls(**d)
    except TypeError as e:  # a field missing
        raise ValueError(f"{cls.__name__}: {e}") from e


@dataclass(frozen=True)
class Decision:
    """The outcome of an epoch. `members` are launch ranks, in the new rank order."""

    epoch: int
    members: list[int]
    mesh: dict[str, int]
    mode: str  # "init" (fresh group), "shrink" (from the previous epoch's groups), "fail"
    resume_step: int
    lost: list[int] = field(default_factory=list)  # gone: dead or suspected
    evicted: list[int] = field(default_factory=list)  # alive, but leave with a lost rank's replica
    by: int = -1  # the decider's launch rank (-1: the launch itself)
    t: float = 0.0
    failed_at: float = 0.0  # earliest failure time among the lost ranks' evidence (0: unknown)
    note: str = ""  # why, when the mode is "fail"
    joiners: list[int] = field(default_factory=list)  # hot spares that take a lost rank's place here
    sources: list[list[int]] = field(default_factory=list)  # [joiner, donor]: who sends a joiner its state
    restore: str = ""  # "" (nothing to copy), "peer" (joiners copy from `sources`), "checkpoint" (all load)
    ckpt_step: int = -1  # with restore == "checkpoint": the step every member loads
    used_spares: list[int] = field(default_factory=list)  # every spare placed up to this epoch
    slots: list[int] = field(default_factory=list)  # launch rank whose place each member holds ([]: members)
    ckpt_epoch: int = -1  # with a sharded state (reshard.py): the epoch whose mesh wrote that checkpoint

    def mesh_obj(self) -> Mesh:
        return Mesh(**self.mesh)

    def to_json(self) -> str:
        """Rank lists as runs ("0-6143,16384,6145-16383"): at 16K ranks a decision is a few
        hundred bytes, not 100 KB, and every node's agent reads it."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # (asdict deep-copies 16K-rank lists)
        for f in _RANK_LISTS:
            d[f] = _runs(d[f])
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Decision:
        """The decision `text` holds; ValueError if it is not a well-formed one."""
        d = json.loads(text)
        if isinstance(d, dict):
            for f in _RANK_LISTS:
                if isinstance(d.get(f), str):
                    d[f] = _unruns(d[f])
        return _record(cls, d)


@dataclass(frozen=True)
class JoinRecord:
    """What a member brings to an epoch: the groups it holds and how far it got."""

    rank: int
    applied: int  # the epoch whose groups this member holds
    ready: bool  # those groups were built and verified on this member
    committed: int  # last step this member committed (-1: none)
    pending: int | None  # a step it voted for without learning the outcome
    t: float = 0.0

    def to_json(self) -> str:
        return _dumps(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> JoinRecord:
        return _record(cls, json.loads(text))

    def to_entry(self) -> str:
        """The compact form in a join entry: the fields as a JSON array, in their order (at 16K
        ranks the decider parses 16K of them: half the bytes and time of objects)."""
        return json.dumps([self.rank, self.applied, self.ready, self.committed, self.pending, self.t])

    @classmethod
    def from_entry(cls, d: object) -> JoinRecord:
        """A record from its parsed compact form; ValueError unless every field has its type."""
        if type(d) is list and len(d) == 6:
            rank, applied, ready, committed, pending, t = d
            if (
                type(rank) is int
                and type(applied) is int
                and (ready is True or ready is False)
                and type(committed) is int
                and (pending is None or type(pending) is int)
                and type(t) in (int, float)
            ):
                return cls(rank, applied, ready, committed, pending, t)
        raise ValueError(f"not [rank, applied, ready, committed, pending, t]: {str(d)[:60]!r}")


@dataclass(frozen=True)
class Gone:
    """Evidence that a rank is gone. kind: "exit" (the launcher saw the process end; detail
    holds its status), "suspect" (heartbeat silence or a straggler past its bound), "left"
    (the members agreed it leaves: a slow rank, `worker/pace_watch.py`) or "unhealthy" (its
    node failed its health check and left: `node/health.py`)."""

    rank: int
    kind: str
    detail: str
    t: float  # wall time of the failure as best known (exit time, last heartbeat)
    by: str  # "launcher" or "rank N"

    def to_json(self) -> str:
        return _dumps(self)

    @classmethod
    def from_json(cls, text: str | bytes) -> Gone:
        return _record(cls, json.loads(text))

    @classmethod
    def from_dict(cls, d: object) -> Gone:
        return _record(cls, d)


def now() -> float:
    """Wall-clock time, the one clock every process of the job shares (one host; across hosts
    it is as good as their clock sync)."""
    return time.time()


__all__ = ["Decision", "Gone", "JoinRecord", "now"]
