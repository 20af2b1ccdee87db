"""DDP and FSDP2 on resilient_nccl (CPU tensors) give the same parameters as on gloo: over TCP,
and on the NCCL code path (RESILIENT_COMM_NCCL_EMULATE=1: stream-ordered launches on the NCCL
emulator, 1 ms kernels, DDP's bucket all_reduces and FSDP2's all_gathers/reduce_scatters in
flight while the backward pass goes on)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from resilient_comm.testing import WorkerContext, run_workers

PATHS = {
    "tcp": {},
    "emulated_nccl": {"RESILIENT_COMM_NCCL_EMULATE": "1", "RESILIENT_COMM_NCCL_EMULATE_KERNEL_US": "1000"},
}


def _use(env: dict) -> None:
    import os

    os.environ.update(env)  # read when the group's communicators are made

STEPS = 8
# Ring and recursive-doubling sums add the ranks' gradients in a different order than gloo;
# float32 rounding then differs by a few ulps per step.
ATOL = 1e-5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _train(model: nn.Module, rank: int) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(1000 * step + rank)  # different data per rank
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _ddp(ctx: WorkerContext, env: dict) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    _use(env)
    ctx.init("resilient_nccl")
    gloo = dist.new_group(backend="gloo")
    ours = _train(DDP(_model()), ctx.rank)
    ref = _train(DDP(_model(), process_group=gloo), ctx.rank)

    # A comm hook that averages through Work.get_future(), as DDP hooks do.
    def hook(state, bucket):
        t = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])

    hooked = DDP(_model())
    hooked.register_comm_hook(None, hook)
    with_hook = _train(hooked, ctx.rank)
    diff = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    diff_hook = max((a - b).abs().max().item() for a, b in zip(with_hook, ref))
    moved = max((a - b).abs().max().item() for a, b in zip(ours, [p.detach() for p in _model().parameters()]))
    first = torch.cat([p.flatten() for p in ours])
    gathered = [torch.empty_like(first) for _ in range(ctx.world_size)]
    dist.all_gather(gathered, first)
    same_everywhere = all(torch.equal(first, g) for g in gathered)
    dist.destroy_process_group()
    return {"diff": diff, "diff_hook": diff_hook, "moved": moved, "same_everywhere": same_everywhere}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", sorted(PATHS))
def test_ddp_matches_gloo_and_comm_hooks_work(path: str) -> None:
    for r in run_workers(_ddp, 4, PATHS[path], timeout_s=100):
        assert r.ok, r.error
        v = r.value
        assert v["moved"] > 1e-3, "training did not change the parameters"
        assert v["diff"] < ATOL, f"rank {r.rank}: DDP on resilient_nccl differs from gloo by {v['diff']}"
        assert v["diff_hook"] < ATOL, f"rank {r.rank}: the get_future hook differs by {v['diff_hook']}"
        assert v["same_everywhere"], f"rank {r.rank}: replicas diverged"


def _fsdp2(ctx: WorkerContext, env: dict) -> dict:
    from torch.distributed.fsdp import fully_shard

    _use(env)
    ctx.init("resilient_nccl")
    gloo = dist.new_group(backend="gloo")
    results = {}
    for name, pg in (("ours", None), ("gloo", gloo)):
        from torch.distributed.device_mesh import DeviceMesh

        mesh = DeviceMesh.from_group(pg or dist.group.WORLD, "cpu")
        model = _model()
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params = _train(model, ctx.rank)
        results[name] = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]
    diff = max((a - b).abs().max().item() for a, b in zip(results["ours"], results["gloo"]))
    dist.destroy_process_group()
    return {"diff": diff}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", sorted(PATHS))
def test_fsdp2_fully_shard_matches_gloo(path: str) -> None:
    for r in run_workers(_fsdp2, 2, PATHS[path], timeout_s=100):
        assert r.ok, r.error
        assert r.value["diff"] < ATOL, f"rank {r.rank}: FSDP2 on resilient_nccl differs from gloo by {r.value['diff']}"
