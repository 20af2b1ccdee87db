"""all_reduce of sparse COO tensors on resilient_tcp: gloo's result (the same sum, coalesced,
written back into the input), identical on every rank; bad input fails alike on every rank
with an error naming the shapes, and leaves the group usable.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from resilient_comm.testing import WorkerContext, run_workers


def _sparse_input(rank: int, dense_tail: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    shape = (6, 5, 3) if dense_tail else (6, 5)
    nnz = 2 + rank  # a different nnz on every rank, with duplicate indices inside one rank
    idx = torch.stack([torch.randint(0, 6, (nnz,), generator=g), torch.randint(0, 5, (nnz,), generator=g)])
    val = torch.randn((nnz, 3) if dense_tail else (nnz,), generator=g, dtype=torch.float64)
    return torch.sparse_coo_tensor(idx, val, shape)


def _worker(ctx: WorkerContext) -> dict:
    ctx.init("resilient_tcp", timeout_s=20)
    gloo = dist.new_group(backend="gloo")
    out: dict = {"diffs": []}
    for dense_tail in (False, True):
        ours = _sparse_input(ctx.rank, dense_tail)
        ref = _sparse_input(ctx.rank, dense_tail)
        dist.all_reduce(ours)
        dist.all_reduce(ref, group=gloo)
        if not torch.allclose(ours.to_dense(), ref.to_dense()):
            out["diffs"].append(f"dense_tail={dense_tail}: differs from gloo's")
        gathered = [torch.zeros(ours.to_dense().shape, dtype=torch.float64) for _ in range(ctx.world_size)]
        dist.all_gather(gathered, ours.to_dense())
        if not all(torch.equal(gathered[0], x) for x in gathered):
            out["diffs"].append(f"dense_tail={dense_tail}: ranks disagree bitwise")
    empty = torch.sparse_coo_tensor(torch.zeros((2, 0), dtype=torch.long), torch.zeros(0), (4, 4))
    dist.all_reduce(empty)
    out["empty_nnz"] = empty._nnz()
    try:
        dist.all_reduce(_sparse_input(ctx.rank, dense_tail=False), op=dist.ReduceOp.MAX)
        out["max"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["max"] = f"{type(e).__name__}: {e}"
    # rank 1 passes another shape: every rank fails with both shapes named
    bad = _sparse_input(ctx.rank, dense_tail=(ctx.rank == 1))
    try:
        dist.all_reduce(bad)
        out["mismatch"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["mismatch"] = f"{type(e).__name__}: {e}"
    t = torch.ones(2)
    dist.all_reduce(t)  # the group is still in step
    out["after"] = t.tolist()
    dist.destroy_process_group()
    return out


@pytest.mark.timeout(60)
def test_sparse_all_reduce_matches_gloo_and_refuses_bad_input() -> None:
    n = 3
    res = run_workers(_worker, n, timeout_s=45)
    assert all(x.ok for x in res), "\n".join(x.error for x in res if not x.ok)
    for x in res:
        v = x.value
        assert v["diffs"] == [], v
        assert v["empty_nnz"] == 0
        assert v["max"].startswith("ValueError") and "SUM only" in v["max"], v["max"]
        assert "every rank must pass the same shape" in v["mismatch"] and "[6, 5, 3]" in v["mismatch"] \
            and "[6, 5]" in v["mismatch"], v["mismatch"]
        assert v["after"] == [float(n), float(n)]
