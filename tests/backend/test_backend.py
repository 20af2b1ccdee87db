"""The c10d backend: typed errors within the op timeout, abort from another thread, Work
semantics, and one clear error per kind of bad input."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch
import torch.distributed as dist

import resilient_comm
from resilient_comm.testing import WorkerContext, run_workers


def _skip_one_collective(ctx: WorkerContext, timeout_s: float) -> dict:
    ctx.init("resilient_tcp", timeout_s=timeout_s)
    store = ctx.store()
    if ctx.rank == ctx.world_size - 1:  # skips the collective, then learns of the failure
        store.wait(["others-done"], datetime.timedelta(seconds=30))
        try:
            dist.all_reduce(torch.ones(4))
            return {"late": "no error"}
        except dist.DistBackendError as e:
            return {"late": type(e).__name__}
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
        return {"error": None}
    except resilient_comm.CommTimeoutError as e:
        res = {
            "elapsed": time.monotonic() - start,
            "error": str(e),
            "attrs": (e.rank, e.group, e.op, e.seq),
        }
    # Still alive and able to compute.
    res["alive"] = float(torch.ones(3).sum())
    res["errored"] = type(resilient_comm.errored()).__name__
    if store.add("done", 1) == ctx.world_size - 1:
        store.set("others-done", "1")
    return res


@pytest.mark.timeout(60)
def test_a_rank_that_skips_a_collective_times_out_everyone_else() -> None:
    timeout_s = 1.5
    results = run_workers(_skip_one_collective, 3, timeout_s, timeout_s=40)
    for r in results[:-1]:
        assert r.ok, r.error
        v = r.value
        assert v["error"] is not None, f"rank {r.rank} got no error"
        assert v["elapsed"] < timeout_s + 0.5, f"rank {r.rank}: {v['elapsed']:.3f} s"
        assert v["attrs"] == (r.rank, "0", "all_reduce", 0)
        assert "Timeout: resilient_tcp all_reduce #0" in v["error"]
        assert v["alive"] == 3.0
        assert v["errored"] == "CommTimeoutError"
    # The first rank to give up waited its whole timeout; the others may hear of it sooner
    # (their op started later), as a timeout.
    assert max(r.value["elapsed"] for r in results[:-1]) >= timeout_s - 0.05
    late = results[-1]
    assert late.ok, late.error
    assert late.value["late"] in ("CommTimeoutError", "PeerFailureError")


def _abort_from_thread(ctx: WorkerContext, async_op: bool) -> dict:
    ctx.init("resilient_tcp", timeout_s=30)
    store = ctx.store()
    dist.barrier()  # the group is up on both ranks
    if ctx.rank == 1:  # never joins the next collective
        store.wait(["aborted"], datetime.timedelta(seconds=30))
        return {}
    aborted_at: list[float] = []

    def abort() -> None:
        aborted_at.append(time.monotonic())
        resilient_comm.abort(reason="test abort")

    work = None
    if async_op:
        work = dist.all_reduce(torch.ones(1 << 16), async_op=True)
        assert not work.is_completed()
        th = threading.Thread(target=abort)
    else:
        # The op runs on this thread (an idle group runs synchronous ops inline): the abort
        # comes from a timer thread, which torch's release of the GIL lets run.
        th = threading.Timer(0.2, abort)
    try:
        th.start()
        if work is not None:
            work.wait()
        else:
            dist.all_reduce(torch.ones(1 << 16))
        res: dict = {"error": None}
    except resilient_comm.CommAbortedError as e:
        res = {"returned_after": time.monotonic() - aborted_at[0], "error": str(e)}
    th.join()
    res["completed"] = work.is_completed() if work is not None else True
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except resilient_comm.CommAbortedError as e:
        res["after"] = (time.monotonic() - start, str(e))
    res["double_abort"] = resilient_comm.abort() is None  # idempotent
    store.set("aborted", "1")
    return res


@pytest.mark.timeout(60)
@pytest.mark.parametrize("async_op", [True, False], ids=["async", "sync"])
def test_abort_from_another_thread_returns_a_blocked_collective_fast(async_op: bool) -> None:
    r0 = run_workers(_abort_from_thread, 2, async_op, timeout_s=40)[0]
    assert r0.ok, r0.error
    v = r0.value
    assert v["error"] is not None, "the collective completed instead of being aborted"
    assert v["returned_after"] < 0.05, f"abort took {1000 * v['returned_after']:.1f} ms to release the op"
    assert "test abort" in v["error"]
    assert v["completed"]
    after_s, after_text = v["after"]
    assert after_s < 0.05 and "test abort" in after_text
    assert v["double_abort"]


def _work_semantics(ctx: WorkerContext) -> dict:
    ctx.init("resilient_tcp", timeout_s=30)
    store = ctx.store()
    res: dict = {}
    t = torch.full((8,), float(ctx.rank + 1))
    fut = dist.all_reduce(t, async_op=True).get_future()
    res["future"] = fut.wait()[0].tolist()
    work = dist.all_reduce(torch.ones(2), async_op=True)
    res["wait"] = work.wait()
    res["completed"] = work.is_completed()
    chained = dist.all_reduce(torch.ones(2), async_op=True).get_future().then(lambda f: f.value()[0] * 10)
    res["then"] = chained.wait().tolist()
    # A wait(timeout) shorter than the op: the op cannot finish (rank 1 holds back), so the
    # wait expires, raises CommTimeoutError and aborts the group, as ProcessGroupNCCL does.
    if ctx.rank == 0:
        work = dist.all_reduce(torch.ones(2), async_op=True)
        start = time.monotonic()
        try:
            work.wait(datetime.timedelta(milliseconds=200))
            res["short_wait"] = "no error"
        except resilient_comm.CommTimeoutError as e:
            res["short_wait"] = (round(time.monotonic() - start, 2), "Work.wait(timeout=200 ms)" in str(e))
        store.set("waited", "1")
    else:
        store.wait(["waited"], datetime.timedelta(seconds=30))
    return res


@pytest.mark.timeout(60)
def test_work_futures_wait_and_wait_timeout() -> None:
    results = run_workers(_work_semantics, 2, timeout_s=40)
    for r in results:
        assert r.ok, r.error
        assert r.value["future"] == [3.0] * 8
        assert r.value["wait"] is True and r.value["completed"]
        assert r.value["then"] == [20.0, 20.0]
    elapsed, named = results[0].value["short_wait"]
    assert 0.15 <= elapsed < 0.5 and named


def _bad_inputs(ctx: WorkerContext) -> dict:
    ctx.init("resilient_tcp", timeout_s=30)
    n = ctx.world_size
    f = torch.ones(4)
    cases = {
        "non_contiguous": lambda: dist.all_reduce(torch.ones(4, 4).t()),
        "unsupported_dtype": lambda: dist.all_reduce(torch.ones(4, dtype=torch.uint32)),
        "band_op": lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.BAND),
        "avg_on_int": lambda: dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist.ReduceOp.AVG),
        "sparse_max": lambda: dist.all_reduce(torch.ones(4).to_sparse(), op=dist.ReduceOp.MAX),
        "gather_list_length": lambda: dist.all_gather([torch.empty(4)] * (n + 1), f),
        "gather_list_numel": lambda: dist.all_gather([torch.empty(5) for _ in range(n)], f),
        "gather_list_dtype": lambda: dist.all_gather([torch.empty(4, dtype=torch.int64) for _ in range(n)], f),
        "into_tensor_size": lambda: dist.all_gather_into_tensor(torch.empty(4 * n + 1), f),
        "reduce_scatter_size": lambda: dist.reduce_scatter_tensor(torch.empty(4), torch.ones(4 * n - 1)),
        "split_sum": lambda: dist.all_to_all_single(torch.empty(4), torch.ones(4), [1] * n, [3] + [0] * (n - 1)),
        "split_negative": lambda: dist.all_to_all_single(torch.empty(4), torch.ones(4), [4] + [0] * (n - 1),
                                                         [-1, 5] + [0] * (n - 2)),
        "rows_not_divisible": lambda: dist.all_to_all_single(torch.empty(4 * n + 1), torch.ones(4 * n + 1)),
        "root_out_of_range": lambda: dist.broadcast(f, src=n + 3),
        # The root passes too short a list; the other rank passes a list it must not pass.
        "gather_list": lambda: dist.gather(f, [torch.empty(4)] * (n - 1 if ctx.rank == 0 else n), dst=0),
        "send_to_self": lambda: dist.send(f, dst=ctx.rank),
        "recv_out_of_range": lambda: dist.recv(f, src=n),
    }
    res = {}
    for name, fn in cases.items():
        try:
            fn()
            res[name] = "no error"
        except (ValueError, RuntimeError) as e:
            res[name] = f"{type(e).__name__}: {e}"
    # None of that reached the wire: the group still works.
    t = torch.ones(4)
    dist.all_reduce(t)
    res["still_works"] = t.tolist()
    return res


EXPECTED_BAD_INPUT: dict[str, str | tuple[str, ...]] = {
    "non_contiguous": "not contiguous",
    "unsupported_dtype": "unsupported dtype UInt32",
    "band_op": "unsupported reduce op",
    "avg_on_int": "AVG needs a floating-point tensor",
    "sparse_max": "sparse tensors reduce with SUM only",
    "gather_list_length": "must be a list of 2 tensors",
    "gather_list_numel": "output tensors have 5 elements but the input has 4",
    "gather_list_dtype": "different dtypes",  # caught by torch before the backend
    "into_tensor_size": "expected world size (2) x input (4)",
    "reduce_scatter_size": "expected world size (2) x output (4)",
    "split_sum": "split sizes add up to 3 but its first dimension is 4",
    "split_negative": "split sizes must not be negative",
    "rows_not_divisible": "does not divide",
    "root_out_of_range": "out of range",
    "gather_list": ("needs a gather_list of 2 tensors", "must NOT be specified on non-destination ranks"),
    "send_to_self": "should not be the same as the rank",  # caught by torch
    "recv_out_of_range": "out of range",
}


@pytest.mark.timeout(60)
def test_bad_inputs_get_one_clear_message_each_and_leave_the_group_usable() -> None:
    for r in run_workers(_bad_inputs, 2, timeout_s=40):
        assert r.ok, r.error
        v = r.value
        assert v.pop("still_works") == [2.0] * 4
        for name, expected in EXPECTED_BAD_INPUT.items():
            if isinstance(expected, tuple):
                expected = expected[min(r.rank, len(expected) - 1)]
            assert expected in v[name], f"rank {r.rank} case {name}: {v[name]}"
            if "resilient_tcp" in v[name]:
                assert f"rank {r.rank}" in v[name], v[name]


def _cross_rank_mismatch(ctx: WorkerContext, case: str) -> tuple[str, str, float]:
    ctx.init("resilient_tcp", timeout_s=20)
    other = ctx.rank == 1
    start = time.monotonic()
    try:
        if case == "dtype":
            dist.all_reduce(torch.ones(8, dtype=torch.int32 if other else torch.float32))
        elif case == "op":
            dist.all_reduce(torch.ones(8), op=dist.ReduceOp.MAX if other else dist.ReduceOp.SUM)
        elif case == "kind":
            if other:
                dist.broadcast(torch.ones(8), src=0)
            else:
                dist.all_reduce(torch.ones(8))
        elif case == "count":
            dist.all_gather_into_tensor(torch.empty(ctx.world_size * (9 if other else 8)), torch.ones(9 if other else 8))
        elif case == "root_alone":  # the root only sends: it learns of the mismatch from a confirmation
            if ctx.rank == 0:
                dist.broadcast(torch.ones(8), src=0)
            else:
                dist.all_reduce(torch.ones(8))
        elif case == "scatter_root":
            if ctx.rank == 0:
                dist.scatter(torch.empty(8), [torch.ones(8)] * ctx.world_size, src=0)
            else:
                dist.all_reduce(torch.ones(8))
        elif case == "gather_leaves":
            if ctx.rank == 0:
                dist.all_reduce(torch.ones(8))
            else:
                dist.gather(torch.ones(8), dst=0)
        elif case == "root":  # same op and size, another root
            dist.broadcast(torch.ones(8), src=1 if other else 0)
        return ("none", "", time.monotonic() - start)
    except dist.DistBackendError as e:
        return (type(e).__name__, str(e), time.monotonic() - start)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["dtype", "op", "kind", "count", "root_alone", "scatter_root", "gather_leaves", "root"])
def test_ranks_that_disagree_get_a_mismatch_error_on_every_rank(case: str) -> None:
    for r in run_workers(_cross_rank_mismatch, 3, case, timeout_s=40):
        assert r.ok, r.error
        kind, text, elapsed = r.value
        if case == "root" and r.rank == 2 and kind == "none":
            continue  # it asked rank 0 for its data and got it; its next op reads rank 1's frame
        assert kind == "CommMismatchError", f"rank {r.rank}: {kind} {text}"
        assert "every rank must call the same collectives" in text, text
        assert elapsed < 5.0, f"rank {r.rank} took {elapsed:.2f} s"


@pytest.mark.parametrize("emulate", ["", "1"])
def test_the_backends_find_their_device_transports_in_one_registry(emulate: str) -> None:
    """The extension registers which library carries which backend's device tensors; the NCCL
    emulator is one entry among them, on only when a run asks for it."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "RESILIENT_COMM_NCCL_EMULATE": emulate}
    out = subprocess.run(
        [sys.executable, "-c", "import json; from resilient_comm import _C; print(json.dumps(_C.device_transports()))"],
        env=env, capture_output=True, text=True, timeout=60, check=True)
    entries = {(t["backend"], t["device"]): t for t in json.loads(out.stdout)}
    assert set(entries) == {("resilient_nccl", "cuda"), ("resilient_nccl", "cpu"), ("resilient_hccl", "privateuseone")}
    assert entries["resilient_nccl", "cuda"] == {"backend": "resilient_nccl", "device": "cuda", "library": "NCCL",
                                                 "grows": True, "enabled": True}
    assert entries["resilient_nccl", "cpu"]["library"] == "NCCL"
    assert entries["resilient_nccl", "cpu"]["enabled"] is (emulate == "1")
    assert entries["resilient_hccl", "privateuseone"]["library"] == "HCCL"
    assert entries["resilient_hccl", "privateuseone"]["grows"] is False, "HCCL has no grow: made afresh"
