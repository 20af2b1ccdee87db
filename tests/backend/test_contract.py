"""The documented API contract on bad input: a clear error of the documented type, nothing sent,
the group untouched (issue #16, items 7 and 8).

- Public calls (shrink, split, abort, errored) given something that is not a group, or a
  color, key or reason of the wrong type: TypeError or ValueError naming the call and the
  argument, checked on real processes, after which the group still reduces and is not errored.
  A split of a group without a resilient_comm backend is refused before its all_gather: one
  rank alone gets the ValueError at once and the group stays usable.
- statesync.unpack: every malformed header (nested past the parser, an integer Python will not
  convert, containers that hold no list, an unhashable dtype, shapes that overflow torch's
  strides, nesting past kMaxDepth) is a StateSyncError with the original error as its cause;
  a state with tensors of mixed element sizes round-trips (the receiver views the payload in
  place, so the sender aligns each tensor).
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import resilient_comm
from resilient_comm.elastic.state.transfer import StateSyncError, digest, kMaxDepth, pack, unpack
from resilient_comm.testing import WorkerContext, run_workers

# -- public calls on real processes -----------------------------------------------------------

_NOT_A_GROUP = "must be a torch.distributed.ProcessGroup or None, got"
rc: Any = resilient_comm  # the calls below are wrong on purpose: no type checker in the way
_BAD_CALLS: dict[str, tuple[Callable[[], Any], str]] = {
    "shrink(None, [1])": (lambda: rc.shrink(None, [1]), f"TypeError: shrink: group {_NOT_A_GROUP} list [1]"),
    "shrink([1], 5)": (lambda: rc.shrink([1], 5), f"TypeError: shrink: group {_NOT_A_GROUP} int 5"),
    "split(0, group=[1])": (lambda: rc.split(0, group=[1]),
                            f"TypeError: split: group {_NOT_A_GROUP} list [1]"),
    "split('a')": (lambda: rc.split("a"), "TypeError: split: color must be an int, got str 'a'"),
    "split(True)": (lambda: rc.split(True), "TypeError: split: color must be an int, got bool True"),
    "split(0, key=2**40)": (lambda: rc.split(0, key=1 << 40),
                            "ValueError: split: key 1099511627776 does not fit in 32 bits"),
    "abort('x')": (lambda: rc.abort("x"), f"TypeError: abort: group {_NOT_A_GROUP} str 'x'"),
    "abort(reason=5)": (lambda: rc.abort(reason=5), "TypeError: abort: reason must be a str, got int 5"),
    "errored(5)": (lambda: rc.errored(5), f"TypeError: errored: group {_NOT_A_GROUP} int 5"),
    # (every rank makes the call: the all_reduce itself is good, and runs)
    "work.wait(-1 s)": (lambda: dist.all_reduce(torch.ones(1), async_op=True).wait(datetime.timedelta(seconds=-1)),
                        "ValueError: Work.wait: timeout must not be negative, got -1000 ms"),
}


def _bad_arguments(ctx: WorkerContext) -> dict[str, Any]:
    ctx.init("resilient_tcp", timeout_s=30)
    out: dict[str, Any] = {}
    for name, (call, _) in _BAD_CALLS.items():
        try:
            call()
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001  (the test reports whatever came out)
            out[name] = f"{type(e).__name__}: {e}"
    x = torch.ones(1)
    dist.all_reduce(x)
    out["sum"], out["errored"] = x.item(), resilient_comm.errored()
    # Only rank 0 splits the gloo group: the refusal must come before anything is sent on it.
    gloo = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5))
    if ctx.rank == 0:
        t0 = time.monotonic()
        try:
            resilient_comm.split(0, group=gloo)
            out["split(gloo)"] = "no error"
        except Exception as e:  # noqa: BLE001
            out["split(gloo)"] = f"{type(e).__name__}: {e}"
        out["split(gloo) s"] = time.monotonic() - t0
    y = torch.ones(1)
    try:
        dist.all_reduce(y, group=gloo)
        out["gloo sum"] = y.item()
    except Exception as e:  # noqa: BLE001
        out["gloo sum"] = f"{type(e).__name__}: {e}"
    return out


@pytest.mark.timeout(90)
def test_bad_arguments_to_the_public_calls_raise_clear_errors_and_leave_the_group_usable() -> None:
    for res in run_workers(_bad_arguments, 2, timeout_s=60):
        assert res.ok, res.error
        v = res.value
        for name, (_, want) in _BAD_CALLS.items():
            assert v[name] == want, f"rank {res.rank} {name}: {v[name]}"
        assert v["sum"] == 2.0 and v["errored"] is None, f"rank {res.rank}: {v['sum']}, {v['errored']}"
        assert v["gloo sum"] == 2.0, f"rank {res.rank}: the gloo group gave {v['gloo sum']}"
        if res.rank == 0:
            refusal = v["split(gloo)"]
            assert refusal.startswith("ValueError: group"), refusal
            assert "does not use a resilient_comm backend" in refusal, refusal
            took = v["split(gloo) s"]
            assert took < 1.0, f"the refusal took {took:.2f} s: it waited on the group"


# -- statesync.unpack on malformed input ------------------------------------------------------


def _nested(depth: int) -> bytes:
    return ('{"l":[' * depth + '{"v":1}' + "]}" * depth).encode()


_MALFORMED: dict[str, tuple[bytes, str, type[BaseException] | None]] = {
    "nested past the parser": (b"[" * 100_000 + b"]" * 100_000, "nests deeper than the JSON parser goes",
                               RecursionError),
    "an integer of 5000 digits": (b'{"v":' + b"7" * 5000 + b"}", "not valid JSON: Exceeds the limit",
                                  ValueError),
    "a dict holding no list": (b'{"d":5}', "'d' holds no list", None),
    "a list holding no list": (b'{"l":5}', "'l' holds no list", None),
    "a tuple holding no list": (b'{"u":{"v":1}}', "'u' holds no list", None),
    "an unhashable dtype": (b'{"t":["float32"],"shape":[1],"at":0,"n":4}', "malformed tensor node", None),
    "a bool offset": (b'{"t":"float32","shape":[1],"at":true,"n":4}', "malformed tensor node", None),
    "a dim past int64": (b'{"t":"float32","shape":[%d,0],"at":0,"n":0}' % (1 << 80),
                         "overflows 64-bit strides", None),
    "strides past int64": (b'{"t":"float32","shape":[%d,%d,0],"at":0,"n":0}' % (1 << 40, 1 << 40),
                           "overflows 64-bit strides", None),
    "nested past kMaxDepth": (_nested(kMaxDepth + 1), f"more than {kMaxDepth} containers deep", None),
    "bytes past the payload": (b'{"t":"float32","shape":[8],"at":0,"n":32}', "do not fit shape [8]", None),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(_MALFORMED))
def test_a_malformed_state_header_is_a_state_sync_error(case: str) -> None:
    header, text, cause = _MALFORMED[case]
    with pytest.raises(StateSyncError) as info:
        unpack(header, torch.zeros(16, dtype=torch.uint8))
    assert text in str(info.value), str(info.value)
    if cause is not None:
        assert isinstance(info.value.__cause__, cause), repr(info.value.__cause__)


@pytest.mark.timeout(30)
def test_tensors_of_mixed_element_sizes_round_trip() -> None:
    # 3 bool bytes, then float32, complex128 and int16 right after: each lands aligned.
    state = {"mask": torch.tensor([True, False, True]), "w": torch.randn(2, 3),
             "c": torch.randn(2, dtype=torch.complex128), "i": torch.arange(5, dtype=torch.int16),
             "deep": _deep_list(kMaxDepth - 1)}
    back = unpack(*pack(state))
    assert digest(back) == digest(state)
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["c"], state["c"])


def _deep_list(depth: int) -> Any:
    node: Any = 1
    for _ in range(depth):
        node = [node]
    return node


@pytest.mark.timeout(30)
def test_a_hand_made_misaligned_tensor_is_copied_out() -> None:
    payload = torch.arange(9, dtype=torch.uint8)
    header = json.dumps({"t": "float32", "shape": [2], "at": 1, "n": 8}).encode()
    assert torch.equal(unpack(header, payload), payload[1:].clone().view(torch.float32))


@pytest.mark.timeout(30)
def test_a_state_that_holds_itself_is_refused_by_the_sender() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(StateSyncError, match=f"nested more than {kMaxDepth} containers deep"):
        pack({"x": loop})
    with pytest.raises(StateSyncError, match="containers deep"):
        pack(_deep_list(kMaxDepth + 1))
