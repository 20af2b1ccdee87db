"""torch's own fault-tolerance API (torch >= 2.14) on our backends, through torch's public API
only: ``init_process_group(..., enable_reconfigure=True)``, ``dist._get_reconfigure_handle``,
``dist._reconfigure``. Every case ends with an all_reduce checked against its expected value.

Handles are exchanged through the test's TCPStore (any out-of-band channel will do: the handles
are all the backend needs). Each case runs on resilient_tcp and on resilient_nccl over the NCCL
emulator (RESILIENT_COMM_NCCL_EMULATE=1: CPU tensors on the NCCL code path).
"""

from __future__ import annotations

import datetime
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from resilient_comm.testing import WorkerContext, all_reduce_until_failure, run_workers, start_workers

pytestmark = pytest.mark.skipif(not hasattr(dist, "_reconfigure"), reason="torch < 2.14 has no reconfigure API")

BACKENDS = ["resilient_tcp", "resilient_nccl_emulated"]


def _init(ctx: WorkerContext, backend: str, timeout_s: float | None = None) -> dist.TCPStore:
    import resilient_comm  # noqa: F401

    name = backend
    if backend == "resilient_nccl_emulated":
        os.environ["RESILIENT_COMM_NCCL_EMULATE"] = "1"
        name = "resilient_nccl"
    store = ctx.store()
    kw = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
    dist.init_process_group(name, store=store, rank=ctx.rank, world_size=ctx.world_size, enable_reconfigure=True,
                            **kw)
    return store


def _handles(store: dist.TCPStore, key: str, me: int, members: list[int]) -> list[str]:
    """Publishes this process's handle under `key` and returns the members' (by their ids)."""
    store.set(f"{key}/{me}", dist._get_reconfigure_handle())
    return [store.get(f"{key}/{m}").decode() for m in members]


def _backend() -> object:
    return dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))


def _sum_of(values: list[float]) -> float:
    x = torch.tensor([0.0])
    x.fill_(values[dist.get_rank()])
    dist.all_reduce(x)
    return x.item()


def _run(fn, world: int, *args) -> list:  # noqa: ANN001
    """Runs fn on `world` workers; every worker must succeed; their values, by rank."""
    results = run_workers(fn, world, *args, timeout_s=60)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error}"
    return [r.value for r in results]


def _configure_all(ctx: WorkerContext, store: dist.TCPStore, uuid: int = 1) -> None:
    hs = _handles(store, f"h{uuid}", ctx.rank, list(range(ctx.world_size)))
    dist._reconfigure(uuid, hs).wait()


# --- shrink after a SIGKILL -------------------------------------------------------------------


def _shrink_after_kill(ctx: WorkerContext, backend: str, victim: int) -> dict:
    store = _init(ctx, backend)  # torch's default timeout: recovery must not depend on it
    _configure_all(ctx, store)
    err, failed = all_reduce_until_failure(store, ctx.rank, 1024)
    survivors = [r for r in range(ctx.world_size) if r != victim]
    hs = _handles(store, "h2", ctx.rank, survivors)
    dist._reconfigure(2, hs).wait()
    total = _sum_of([float(r + 1) for r in survivors])
    return {"err": err, "failed": failed, "done": time.time(), "sum": total, "rank": dist.get_rank(),
            "size": dist.get_world_size(), "path": _backend().last_reconfigure()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_shrink_after_a_sigkill_through_torchs_api_recovers_in_well_under_a_second(backend: str) -> None:
    world, victim = 4, 2
    with start_workers(_shrink_after_kill, world, backend, victim, timeout_s=90) as w:
        for r in range(world):
            w.wait_key(f"looping/{r}")
        killed = time.time()
        w.kill(victim, signal.SIGKILL)
        results = w.join()
    survivors = [r for r in range(world) if r != victim]
    for r in survivors:
        res = results[r]
        assert res.ok, res.error
        v = res.value
        assert "DistBackendError" in v["err"] or "Error" in v["err"], v["err"]
        assert v["sum"] == sum(s + 1 for s in survivors)
        assert v["size"] == 3 and v["rank"] == survivors.index(r)
        # the survivors in their order: the fast path, for the NCCL communicator too
        assert v["path"] == ("shrink,device:shrink" if "nccl" in backend else "shrink"), v
        # kill -> first correct all_reduce, with torch's 30-minute default op timeout
        assert v["done"] - killed < 5.0, (r, v["done"] - killed)


# --- grow by a new process --------------------------------------------------------------------


def _grow(ctx: WorkerContext, backend: str) -> dict:
    store = _init(ctx, backend)
    first = [0, 1, 2]
    if ctx.rank in first:
        hs = _handles(store, "h1", ctx.rank, first)
        dist._reconfigure(1, hs).wait()
        before = _sum_of([1.0, 2.0, 3.0])
        assert dist.get_world_size() == 3
    else:
        before = None
    hs = _handles(store, "h2", ctx.rank, [0, 1, 2, 3])
    dist._reconfigure(2, hs).wait()
    return {"before": before, "after": _sum_of([1.0, 2.0, 3.0, 4.0]), "rank": dist.get_rank(),
            "size": dist.get_world_size(), "path": _backend().last_reconfigure(),
            "again": _sum_of([1.0, 1.0, 1.0, 1.0])}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_grow_by_a_new_process(backend: str) -> None:
    for rank, v in enumerate(_run(_grow, 4, backend)):
        assert v["after"] == 10.0 and v["again"] == 4.0 and v["size"] == 4 and v["rank"] == rank
        assert v["before"] == (6.0 if rank < 3 else None)
        # The old members in their rank order, then a process that built none: a grow. The host
        # communicator is built afresh; the device one (NCCL emulator) grows at its first op,
        # the newcomer joining it (ncclCommGrow).
        assert v["path"] == ("grow,device:grow" if backend == "resilient_nccl_emulated" else "grow"), v


def _grow_own_store(ctx: WorkerContext, backend: str) -> dict:
    """Ranks 0-2 share the job's store; the newcomer (rank 3) inits on a store of its own
    (world size 1) and shares only its handle. Everything after the reconfigure, the device
    communicator's bootstrap included, comes from the handles (the shared store below carries
    only the handles, as any out-of-band channel would)."""
    import resilient_comm  # noqa: F401

    if backend == "resilient_nccl_emulated":
        os.environ["RESILIENT_COMM_NCCL_EMULATE"] = "1"
    name = "resilient_nccl" if backend == "resilient_nccl_emulated" else backend
    shared = ctx.store()
    if ctx.rank < 3:
        dist.init_process_group(name, store=dist.PrefixStore("job", shared), rank=ctx.rank, world_size=3,
                                enable_reconfigure=True)
    else:
        own = dist.HashStore()
        dist.init_process_group(name, store=own, rank=0, world_size=1, enable_reconfigure=True)
    hs = _handles(shared, "h1", ctx.rank, [0, 1, 2, 3])
    dist._reconfigure(1, hs).wait()
    return {"sum": _sum_of([1.0, 2.0, 3.0, 4.0]), "rank": dist.get_rank(), "size": dist.get_world_size(),
            "path": _backend().last_reconfigure()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_newcomer_with_a_store_of_its_own_joins_through_the_handles_alone(backend: str) -> None:
    for rank, v in enumerate(_run(_grow_own_store, 4, backend)):
        assert v["sum"] == 10.0 and v["size"] == 4 and v["rank"] == rank, v
        assert v["path"].startswith("fresh"), v


# --- reorder, and a set of handles ------------------------------------------------------------


def _reorder(ctx: WorkerContext, backend: str) -> dict:
    store = _init(ctx, backend)
    everyone = list(range(ctx.world_size))
    # A set: the backend chooses; processes that never built a communicator sort by init rank.
    store.set(f"s1/{ctx.rank}", dist._get_reconfigure_handle())
    dist._reconfigure(1, {store.get(f"s1/{r}").decode() for r in everyone}).wait()
    rank_after_set = dist.get_rank()
    # A list in reverse: ranks by position.
    hs = _handles(store, "h2", ctx.rank, everyone[::-1])
    dist._reconfigure(2, hs).wait()
    out = [torch.zeros(1) for _ in everyone]
    dist.all_gather(out, torch.tensor([float(ctx.rank)]))
    path = _backend().last_reconfigure()
    # A set of the members but the last: they keep their relative order (a shrink).
    keep = [r for r in everyone[::-1] if r != 0]
    if ctx.rank == 0:
        return {"set_rank": rank_after_set, "rank": dist.get_rank(), "gathered": [t.item() for t in out],
                "path": path}
    store.set(f"s3/{ctx.rank}", dist._get_reconfigure_handle())
    dist._reconfigure(3, {store.get(f"s3/{r}").decode() for r in keep}).wait()
    return {"set_rank": rank_after_set, "rank": dist.get_rank(), "gathered": [t.item() for t in out], "path": path,
            "rank3": dist.get_rank(), "sum3": _sum_of([10.0, 20.0]), "path3": _backend().last_reconfigure()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reordered_list_assigns_ranks_by_position_and_a_set_keeps_the_survivors_order(backend: str) -> None:
    for rank, v in enumerate(_run(_reorder, 3, backend)):
        assert v["set_rank"] == rank
        assert v["rank"] == 2 - rank
        assert v["gathered"] == [2.0, 1.0, 0.0]
        assert v["path"] == "fresh", v  # no device op before it: no device communicator yet
        if rank != 0:
            # after the reorder, init rank 2 is rank 0 and init rank 1 rank 1: kept in that order
            assert v["rank3"] == {2: 0, 1: 1}[rank] and v["sum3"] == 30.0
            assert v["path3"] == ("shrink,device:shrink" if "nccl" in backend else "shrink"), v


# --- the same members again after an abort ----------------------------------------------------


def _after_abort(ctx: WorkerContext, backend: str) -> dict:
    import resilient_comm

    store = _init(ctx, backend)
    _configure_all(ctx, store)
    assert _sum_of([1.0, 2.0, 3.0]) == 6.0
    resilient_comm.abort(reason="a transient error")
    try:
        dist.all_reduce(torch.ones(1))
        refused = ""
    except dist.DistBackendError as e:
        refused = f"{type(e).__name__}: {e}"
    hs = _handles(store, "h2", ctx.rank, list(range(ctx.world_size)))
    dist._reconfigure(2, hs).wait()
    return {"refused": refused, "sum": _sum_of([1.0, 2.0, 3.0]), "error": str(_backend().get_error()),
            "path": _backend().last_reconfigure()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_same_members_again_after_an_abort(backend: str) -> None:
    for v in _run(_after_abort, 3, backend):
        assert "CommAbortedError" in v["refused"] and "a transient error" in v["refused"]
        assert v["sum"] == 6.0 and v["error"].endswith("SUCCESS"), v
        assert v["path"] == ("shrink,device:shrink" if "nccl" in backend else "shrink"), v


# --- a member that never arrives --------------------------------------------------------------


def _missing_member(ctx: WorkerContext, backend: str, timeout_s: float) -> dict:
    from resilient_comm import CommTimeoutError

    store = _init(ctx, backend)
    _configure_all(ctx, store)
    if ctx.rank == 2:  # stays alive, and never takes part
        store.set("h2/2", dist._get_reconfigure_handle())
        store.wait(["released"], datetime.timedelta(seconds=60))
        return {}
    hs = _handles(store, "h2", ctx.rank, [0, 1, 2])
    start = time.monotonic()
    work = dist._reconfigure(2, hs, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        work.wait()
        err = ""
    except CommTimeoutError as e:
        err = str(e)
    elapsed = time.monotonic() - start
    hs = _handles(store, "h3", ctx.rank, [0, 1])
    dist._reconfigure(3, hs).wait()
    total = _sum_of([1.0, 2.0])
    store.add("done", 1)
    if store.add("done", 0) == 2:
        store.set("released", "1")
    return {"err": err, "elapsed": elapsed, "sum": total}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_member_that_never_arrives_fails_the_reconfigure_within_its_timeout(backend: str) -> None:
    timeout_s = 3.0
    for v in _run(_missing_member, 3, backend, timeout_s)[:2]:
        # a CommTimeoutError that names the reconfigure and the rank that never came
        assert "reconfigure" in v["err"] and "rank(s) 2" in v["err"], v
        assert timeout_s - 0.5 < v["elapsed"] < timeout_s + 1.0, v
        assert v["sum"] == 3.0


# --- bad input: stale, foreign, garbage handles; a reused uuid ---------------------------------


def _bad_input(ctx: WorkerContext, backend: str) -> dict:
    store = _init(ctx, backend)
    try:
        dist.all_reduce(torch.ones(1))
        before = ""
    except RuntimeError as e:
        before = str(e)
    everyone = list(range(ctx.world_size))
    first = _handles(store, "h1", ctx.rank, everyone)
    dist._reconfigure(1, first).wait()
    current = _handles(store, "h2", ctx.rank, everyone)
    fields = current[1].split("|")
    fields[-1] = "0123456789abcdef"
    foreign = "|".join(fields)
    cases = {
        "stale": first,
        "garbage": [*current[:1], "not a handle\n\x00", *current[2:]],
        "foreign": [current[0], foreign, *current[2:]],
        "duplicate": [current[0], current[0], *current[1:]],
        "without_me": [h for i, h in enumerate(current) if i != ctx.rank],
        "empty": [],
    }
    errors = {}
    for name, hs in cases.items():
        try:
            dist._reconfigure(10 + len(errors), hs)
            errors[name] = "accepted"
        except ValueError as e:
            errors[name] = str(e)
    # The group is unchanged: same rank, same members, and it still reduces.
    unchanged = _sum_of([1.0, 2.0, 3.0])
    dist._reconfigure(2, current).wait()
    try:
        dist._reconfigure(2, current)
        reused = "accepted"
    except ValueError as e:
        reused = str(e)
    # A peer's handle of the communicator that reconfigure 2 replaced: that peer took part in
    # reconfigure 2 and has a newer one (a peer that sat it out would still be current).
    latest = _handles(store, "h3", ctx.rank, everyone)
    try:
        dist._reconfigure(3, [latest[0], current[1], latest[2]])
        peer_stale = "accepted"
    except ValueError as e:
        peer_stale = str(e)
    return {"before": before, "errors": errors, "unchanged": unchanged, "reused": reused,
            "after": _sum_of([1.0, 2.0, 3.0]), "peer_stale": peer_stale}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_stale_foreign_and_garbage_handles_and_a_reused_uuid_are_value_errors_and_change_nothing(backend: str) -> None:
    for v in _run(_bad_input, 3, backend):
        assert "enable_reconfigure=True" in v["before"] and "_reconfigure" in v["before"], v["before"]
        e = v["errors"]
        assert "is stale" in e["stale"], e
        assert "'not a handle\\x0a\\x00'" in e["garbage"] and "not a handle of this backend" in e["garbage"], e
        assert "is signed with a job token" in e["foreign"], e
        assert "is given twice" in e["duplicate"], e
        assert "is not among the" in e["without_me"], e
        assert "at least one handle" in e["empty"], e
        assert v["unchanged"] == 6.0 and v["after"] == 6.0
        assert "uuid 2 was already used" in v["reused"], v["reused"]
        assert "is stale" in v["peer_stale"], v["peer_stale"]


# --- an op pending on the old membership; abort hooks ------------------------------------------


def _pending_and_hooks(ctx: WorkerContext, backend: str) -> dict:
    store = _init(ctx, backend)
    _configure_all(ctx, store)
    pg = dist.distributed_c10d._get_default_group()
    fired = []
    pg.register_abort_hook(7, lambda: fired.append("hook"))
    out: dict = {}
    if ctx.rank == 0:
        # Rank 1 never joins this all_reduce: it is pending when the reconfigure starts.
        work = dist.all_reduce(torch.ones(1), async_op=True)
        store.set("pending", "1")
        store.wait(["h2/1"])
        hs = _handles(store, "h2", 0, [0, 1])
        start = time.monotonic()
        rc = dist._reconfigure(2, hs)
        try:
            work.wait()
            out["pending"] = "completed"
        except dist.DistBackendError as e:
            out["pending"] = f"{type(e).__name__}: {e}"
        out["pending_s"] = time.monotonic() - start
        rc.wait()
    else:
        store.wait(["pending"])
        hs = _handles(store, "h2", 1, [0, 1])
        dist._reconfigure(2, hs).wait()
    out["sum"] = _sum_of([1.0, 2.0])
    out["hooks_before_abort"] = list(fired)
    import resilient_comm

    resilient_comm.abort(reason="hooked")
    out["hooks"] = list(fired)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["resilient_tcp"])
def test_an_op_pending_when_reconfigure_starts_fails_at_once_and_abort_hooks_run(backend: str) -> None:
    values = _run(_pending_and_hooks, 2, backend)
    for v in values:
        assert v["sum"] == 3.0
        assert v["hooks"][-1:] == ["hook"], v
    v = values[0]
    assert "CommAbortedError" in v["pending"] and "superseded by reconfigure (uuid 2)" in v["pending"], v
    assert v["pending_s"] < 1.0, v
    # A running op is stopped by an abort, which runs the hooks once; one still queued (the
    # backend's worker had not taken it yet: a loaded machine) is dropped without an abort.
    queued = "before it started" in v["pending"]
    assert v["hooks_before_abort"] == ([] if queued else ["hook"]), v
