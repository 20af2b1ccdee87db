"""FSDP2 over dp and tensor parallel over tp under the controller, through `ctl.device_mesh`
(resilient_tcp, CPU): dp=2 x tp=2 under resilient-run, `s.commit(apply, grads=())` (FSDP2's
reduce-scatter averages the gradients over dp), the trained parameters equal to one process
training the whole model on the global batch. The fault half of issue 17's FSDP2 test (a
replica lost, re-sharding from a checkpoint) is not built yet: docs/elastic.md, "DeviceMesh".
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

WORKER = '''
import os, sys, torch, torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
sys.path.insert(0, os.path.dirname(__file__))
from model import MLP, batch, STEPS, LR
from resilient_comm.elastic import Controller

ctl = Controller(tp=2)
mesh = ctl.device_mesh
assert mesh.mesh_dim_names == ("dp", "pp", "tp") and tuple(mesh.shape) == (2, 1, 2), mesh
model = MLP()
parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
fully_shard(model, mesh=mesh["dp"])
opt = torch.optim.SGD(model.parameters(), lr=LR)
for s in ctl.steps(STEPS):
    with s:
        model(batch(s.step, ctl.place.coords["dp"])).pow(2).mean().backward()
        s.commit(lambda: (opt.step(), opt.zero_grad()), grads=())
full = {k: v.full_tensor() for k, v in model.state_dict().items()}
if ctl.rank == 0:
    torch.save(full, os.environ["OUT"])
ctl.close()
'''

MODEL = '''
import torch, torch.nn as nn
STEPS, LR = 5, 0.1

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))

def batch(step, dp):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + 10 * step + dp))
'''


@pytest.mark.timeout(120)
def test_fsdp2_over_dp_and_tensor_parallel_over_tp_train_through_the_controllers_device_mesh(
        tmp_path: pathlib.Path) -> None:
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "w.py").write_text(WORKER)
    out = tmp_path / "full.pt"
    run = subprocess.run([sys.executable, "-m", "resilient_comm.elastic", "--nproc-per-node", "4",
                          str(tmp_path / "w.py")], env={**os.environ, "OUT": str(out)}, capture_output=True,
                         text=True, timeout=100, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    got = torch.load(out)

    sys.path.insert(0, str(tmp_path))
    try:
        from model import LR, MLP, STEPS, batch  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("model", None)
    ref = MLP()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(STEPS):  # the dp average of the two replicas' mean losses: the mean over 8
        x = torch.cat([batch(step, 0), batch(step, 1)])
        ref(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert set(got) == {"up.weight", "down.weight"}
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert not torch.equal(got["up.weight"], MLP().up.weight), "training moved the parameters"
