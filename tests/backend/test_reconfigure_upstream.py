"""PyTorch's own reconfigure tests (test/distributed/test_c10d_fault_tolerance.py in torch's
repository, not shipped in the wheel), case by case, on resilient_tcp and, for comparison, on
gloo: the same scenarios, asserted the same way (each member contributes rank + 1 to an
all_reduce), at world size 3 with enable_reconfigure=True and handles exchanged through the
store as lists in rank order.

Cases that do not apply to resilient_tcp: test_reconfigure_after_timeout (nccl2 only there) and
ReconfigureContractTest (a ProcessGroup with two backends: torch's own check, backend-independent).
Where gloo and we differ by design, the test says so: gloo's handle embeds its uuid-less rank
and so does not detect a stale handle; a reused uuid is refused by gloo only on the new rank 0,
by us on every member.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from resilient_comm.testing import WorkerContext, run_workers

pytestmark = pytest.mark.skipif(not hasattr(dist, "_reconfigure"), reason="torch < 2.14 has no reconfigure API")

BACKENDS = ["resilient_tcp", "gloo"]
WORLD = 3
TIMEOUT = datetime.timedelta(seconds=30)


def _init(ctx: WorkerContext, backend: str) -> dist.TCPStore:
    import resilient_comm  # noqa: F401

    store = ctx.store()
    dist.init_process_group(backend, store=store, rank=ctx.rank, world_size=ctx.world_size, timeout=TIMEOUT,
                            enable_reconfigure=True)
    return store


def _reconf(store: dist.TCPStore, uuid: int, me: int, members: list[int]) -> None:
    store.set(f"h{uuid}/{me}", dist._get_reconfigure_handle())
    handles = [store.get(f"h{uuid}/{m}").decode() for m in members]
    dist._reconfigure(uuid, handles, timeout=TIMEOUT).wait()


def _sum(value: float) -> float:
    t = torch.tensor([value])
    dist.all_reduce(t)
    return t.item()


def _basic(ctx: WorkerContext, backend: str) -> dict:
    store = _init(ctx, backend)
    _reconf(store, 100, ctx.rank, [0, 1, 2])
    return {"size": dist.get_world_size(), "rank": dist.get_rank(), "sum": _sum(ctx.rank + 1.0)}


def _send_recv(ctx: WorkerContext, backend: str) -> dict:
    store = _init(ctx, backend)
    _reconf(store, 300, ctx.rank, [0, 1, 2])
    dst, src = (ctx.rank + 1) % WORLD, (ctx.rank - 1) % WORLD
    out, got = torch.tensor([ctx.rank + 1.0]), torch.zeros(1)
    if ctx.rank % 2 == 0:
        dist.send(out, dst)
        dist.recv(got, src)
    else:
        dist.recv(got, src)
        dist.send(out, dst)
    return {"got": got.item(), "want": src + 1.0}


def _shrink(ctx: WorkerContext, backend: str, leaver: int) -> dict:
    store = _init(ctx, backend)
    _reconf(store, 500, ctx.rank, [0, 1, 2])
    if ctx.rank == leaver:
        return {}
    keep = [r for r in range(WORLD) if r != leaver]
    _reconf(store, 501, ctx.rank, keep)
    b = torch.tensor([42.0 if dist.get_rank() == 0 else 0.0])
    dist.broadcast(b, group_src=0)
    return {"size": dist.get_world_size(), "rank": dist.get_rank(), "want_rank": keep.index(ctx.rank),
            "sum": _sum(ctx.rank + 1.0), "want_sum": float(sum(r + 1 for r in keep)), "bcast": b.item()}


def _scale_down_up(ctx: WorkerContext, backend: str) -> dict:
    store = _init(ctx, backend)
    _reconf(store, 600 + ctx.rank, ctx.rank, [ctx.rank])
    alone = (dist.get_world_size(), dist.get_rank(), _sum(ctx.rank + 1.0))
    _reconf(store, 603, ctx.rank, [0, 1, 2])
    together = (dist.get_world_size(), dist.get_rank(), _sum(ctx.rank + 1.0))
    _reconf(store, 604 + ctx.rank, ctx.rank, [ctx.rank])
    again = (dist.get_world_size(), dist.get_rank(), _sum(ctx.rank + 1.0))
    return {"alone": alone, "together": together, "again": again}


def _identity(ctx: WorkerContext, backend: str) -> dict:
    store = _init(ctx, backend)
    _reconf(store, 800, ctx.rank, [0, 1, 2])
    _reconf(store, 801, ctx.rank, [0, 1, 2])
    return {"sum": _sum(ctx.rank + 1.0), "rank": dist.get_rank()}


def _late_join(ctx: WorkerContext, backend: str) -> dict:
    store = _init(ctx, backend)
    if ctx.rank == 0:
        _reconf(store, 900, 0, [0])
    _reconf(store, 901, ctx.rank, [0, 1, 2])
    return {"sum": _sum(ctx.rank + 1.0)}


def _merge_split(ctx: WorkerContext, backend: str) -> dict:
    store = _init(ctx, backend)
    if ctx.rank == 0:
        _reconf(store, 1000, 0, [0])
    else:
        _reconf(store, 1001, ctx.rank, [1, 2])
    part = _sum(ctx.rank + 1.0)
    _reconf(store, 1002, ctx.rank, [0, 1, 2])
    return {"part": part, "sum": _sum(ctx.rank + 1.0)}


def _after_abort(ctx: WorkerContext, backend: str) -> dict:
    store = _init(ctx, backend)
    _reconf(store, 1200, ctx.rank, [0, 1, 2])
    pg = dist.distributed_c10d._get_default_group()
    pg._get_backend(torch.device("cpu")).abort()
    _reconf(store, 1201, ctx.rank, [0, 1, 2])
    return {"error": str(pg._get_backend(torch.device("cpu")).get_error()), "sum": _sum(ctx.rank + 1.0)}


def _reused_uuid(ctx: WorkerContext, backend: str) -> dict:
    store = _init(ctx, backend)
    _reconf(store, 1300 + ctx.rank, ctx.rank, [ctx.rank])
    try:
        dist._reconfigure(1300 + ctx.rank, [dist._get_reconfigure_handle()], timeout=TIMEOUT).wait()
        return {"err": ""}
    except (RuntimeError, ValueError) as e:
        return {"err": str(e)}


def _run(fn, backend: str, *args):  # noqa: ANN001, ANN202
    results = run_workers(fn, WORLD, backend, *args, timeout_s=90)
    for r in results:
        assert r.ok, r.error
    return [r.value for r in results]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reconfigure_basic_then_all_reduce(backend: str) -> None:
    for rank, v in enumerate(_run(_basic, backend)):
        assert v == {"size": 3, "rank": rank, "sum": 6.0}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reconfigure_then_send_recv(backend: str) -> None:
    for v in _run(_send_recv, backend):
        assert v["got"] == v["want"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("leaver", [2, 1], ids=["last", "middle"])
def test_shrink_exclude_a_rank(backend: str, leaver: int) -> None:
    for rank, v in enumerate(_run(_shrink, backend, leaver)):
        if rank == leaver:
            continue
        assert v["size"] == 2 and v["rank"] == v["want_rank"] and v["sum"] == v["want_sum"] and v["bcast"] == 42.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reconfigure_scale_down_up(backend: str) -> None:
    for rank, v in enumerate(_run(_scale_down_up, backend)):
        assert tuple(v["alone"]) == (1, 0, rank + 1.0) and tuple(v["again"]) == (1, 0, rank + 1.0)
        assert tuple(v["together"]) == (3, rank, 6.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reconfigure_identity(backend: str) -> None:
    for rank, v in enumerate(_run(_identity, backend)):
        assert v == {"sum": 6.0, "rank": rank}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reconfigure_late_join(backend: str) -> None:
    for v in _run(_late_join, backend):
        assert v["sum"] == 6.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reconfigure_merge_split(backend: str) -> None:
    for rank, v in enumerate(_run(_merge_split, backend)):
        assert v["part"] == (1.0 if rank == 0 else 5.0) and v["sum"] == 6.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reconfigure_after_abort(backend: str) -> None:
    for v in _run(_after_abort, backend):
        assert v["error"].endswith("SUCCESS") and v["sum"] == 6.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_reconfigure_rejects_reused_uuid(backend: str) -> None:
    for v in _run(_reused_uuid, backend):
        assert "already used" in v["err"], v
