"""FSDP2 over dp and tensor parallel over tp under the controller, through `ctl.device_mesh`
(resilient_tcp, CPU): dp=2 x tp=2 under resilient-run, `s.commit(apply, grads=())` (FSDP2's
reduce-scatter averages the gradients over dp), the trained parameters equal to one process
training the whole model on the global batch. Then with faults (``shard_dp=True``, a
checkpoint every 2 steps): a rank SIGKILLed -> its replica leaves, the survivors re-shard the
newest checkpoint onto dp=1 and finish, equal to a fault-free run continued on the surviving
replica from that checkpoint; with a hot spare the world stays dp=2 and the result equals the
fault-free run.
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
STEPS, LR = 10, 0.1

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
    ref = _reference(tmp_path, {10**9: [0, 1]})  # every step on both replicas' batches
    assert set(got) == {"up.weight", "down.weight"}
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


SHARDED = '''
import os, signal, sys, torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
sys.path.insert(0, os.path.dirname(__file__))
from model import MLP, batch, STEPS, LR
from resilient_comm.elastic import EXIT_EVICTED, Controller, Evicted

KILL_STEP, VICTIM = 7, 3


class State:
    """FSDP2 + TP model whose state is its local shards; re-created on every new mesh."""

    def on_mesh(self, mesh):
        self.model = MLP()
        parallelize_module(self.model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(self.model, mesh=mesh["dp"])
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR)

    def state_dict(self):
        return {k: v.to_local().detach().clone() for k, v in self.model.state_dict().items()}

    def load_state_dict(self, sd):
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                v.to_local().copy_(sd[k])


loaded = []
ctl = Controller(state=lambda place: State(), tp=2, shard_dp=True, checkpoint_dir=os.environ["CKPT"],
                 checkpoint_every=2, hook=lambda ev, info: loaded.append(info) if ev == "recovery.loaded" else None)
spare = os.environ.get("RESILIENT_COMM_SPARE") == "1"
try:
    for s in ctl.steps(STEPS):
        with s:
            if s.step == KILL_STEP and ctl.slot == VICTIM and not spare:
                os.kill(os.getpid(), signal.SIGKILL)
            st = ctl.state
            st.model(batch(s.step, ctl.slot // 2)).pow(2).mean().backward()
            s.commit(lambda: (st.opt.step(), st.opt.zero_grad()), grads=())
except Evicted:
    sys.exit(EXIT_EVICTED)  # the victim's replica leaves
if ctl.state is None:
    sys.exit(0)  # a spare that was never placed
full = {k: v.full_tensor() for k, v in ctl.state.model.state_dict().items()}
if ctl.place.rank == 0:
    torch.save({"full": full, "loaded": [i["step"] for i in loaded], "members": ctl.members,
                "mesh": ctl.mesh.as_dict(), "resharded_from": [i["resharded_from"] for i in loaded]},
               os.environ["OUT"])
ctl.close()
'''


# The checkpoints saved before the kill at step 7 (every 2 steps). Which is the newest complete
# one depends on the disk: a save is skipped while its predecessor is still being written
# (`AsyncCheckpointer`, if_busy="skip"), and under CI's load steps 3 and 5 were (1 loaded).
SAVED = (1, 3, 5)


def _reference(tmp_path: pathlib.Path, streams_until: dict[int, list[int]]) -> dict[str, torch.Tensor]:
    """One process, the whole model: step s on the batches of the streams given for the first
    key >= s (the mean over them: FSDP2's dp average of each replica's mean)."""
    sys.path.insert(0, str(tmp_path))
    try:
        from model import LR, MLP, STEPS, batch  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("model", None)
    ref = MLP()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(STEPS):
        streams = streams_until[min(k for k in streams_until if k >= step)]
        ref(torch.cat([batch(step, d) for d in streams])).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return ref.state_dict()


def _run_sharded(tmp_path: pathlib.Path, spares: int) -> dict:
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "w.py").write_text(SHARDED)
    out = tmp_path / "out.pt"
    env = {**os.environ, "OUT": str(out), "CKPT": str(tmp_path / "ckpt")}
    run = subprocess.run([sys.executable, "-m", "resilient_comm.elastic", "--nproc-per-node", "4", "--spares",
                          str(spares), str(tmp_path / "w.py")], env=env, capture_output=True, text=True, timeout=150,
                         check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "worker 3 (pid" in run.stderr and "killed by SIGKILL" in run.stderr, run.stderr[-3000:]
    return torch.load(out)


@pytest.mark.timeout(180)
def test_fsdp2_losing_a_replica_reshards_the_checkpoint_onto_the_survivors(tmp_path: pathlib.Path) -> None:
    got = _run_sharded(tmp_path, spares=0)
    assert got["members"] == [0, 1] and got["mesh"] == {"tp": 2, "pp": 1, "dp": 1}, got
    assert len(got["loaded"]) == 1 and got["resharded_from"] == [{"tp": 2, "pp": 1, "dp": 2}], got
    c = got["loaded"][0]
    assert c in SAVED, f"a complete checkpoint from before step 7: {c}"
    ref = _reference(tmp_path, {c: [0, 1], 10**9: [0]})
    for k, v in ref.items():
        torch.testing.assert_close(got["full"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.timeout(180)
def test_fsdp2_with_a_spare_keeps_dp2_and_equals_the_fault_free_run(tmp_path: pathlib.Path) -> None:
    got = _run_sharded(tmp_path, spares=1)
    assert sorted(got["members"]) == [0, 1, 2, 4] and got["mesh"] == {"tp": 2, "pp": 1, "dp": 2}, got
    assert len(got["loaded"]) == 1 and got["loaded"][0] in SAVED, got
    ref = _reference(tmp_path, {10**9: [0, 1]})
    for k, v in ref.items():
        torch.testing.assert_close(got["full"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_reshard_concatenates_the_old_dp_shards_and_cuts_the_new_dp_chunks(tmp_path: pathlib.Path) -> None:
    """Uneven FSDP2-style shards (torch.chunk along dim 0) of a dp=2 mesh re-cut for dp=1 and
    dp=3; 0-d tensors and non-tensors come from the first shard; mismatched shards are an error."""
    from resilient_comm.checkpoint import AsyncCheckpointer, CheckpointError, manifest_file
    from resilient_comm.elastic import Decision, Mesh
    from resilient_comm.elastic.state.reshard import epoch_dir, load, newest

    full = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3)
    d0 = Decision(0, [0, 1], Mesh(dp=2).as_dict(), "init", 0)
    for r, shard in enumerate(torch.chunk(full, 2)):
        with AsyncCheckpointer(epoch_dir(str(tmp_path), 0), r) as ck:
            ck.save(3, {"w": shard.clone(), "step": torch.tensor(4.0 + r), "lr": 0.1 * (r + 1)})
    assert newest(str(tmp_path), [Decision(1, [0], Mesh(dp=1).as_dict(), "shrink", 0), d0]) == (0, 3)
    one = load(str(tmp_path), d0, 3, {"dp": 0, "pp": 0, "tp": 0}, Mesh(dp=1))
    assert torch.equal(one["w"], full) and one["step"].item() == 4.0 and one["lr"] == 0.1
    three = [load(str(tmp_path), d0, 3, {"dp": i, "pp": 0, "tp": 0}, Mesh(dp=3))["w"] for i in range(3)]
    assert [tuple(t.shape) for t in three] == [(2, 3), (2, 3), (1, 3)] and torch.equal(torch.cat(three), full)
    with pytest.raises(CheckpointError, match="tp and pp must be kept"):
        load(str(tmp_path), d0, 3, {"dp": 0, "pp": 0, "tp": 0}, Mesh(tp=2))
    os.remove(manifest_file(epoch_dir(str(tmp_path), 0), 3, 1))  # rank 1's shard lost: never a partial state
    assert newest(str(tmp_path), [d0]) is None
    with pytest.raises(CheckpointError, match="step 3 of epoch 0: rank 1: no manifest"):
        load(str(tmp_path), d0, 3, {"dp": 0, "pp": 0, "tp": 0}, Mesh(dp=1))


def test_a_sharded_decision_never_takes_a_donor_and_fails_clearly_without_a_checkpoint() -> None:
    from resilient_comm.elastic import Decision, Gone, JoinRecord, Mesh
    from resilient_comm.elastic.model.decide import decide

    base = Decision(0, [0, 1, 2, 3], Mesh(tp=2, dp=2).as_dict(), "init", 0)
    joined = {r: JoinRecord(r, 0, True, 6, None) for r in (0, 1, 2)}
    gone = {3: Gone(3, "exit", "killed by SIGKILL", 1.0, "launcher")}
    plain = decide(1, base, joined, gone, {}, [9], lambda w: None, 0)
    assert (plain.restore, plain.sources) == ("peer", [[9, 1]]), "replicated dp: the spare copies its dp peer"
    d = decide(1, base, joined, gone, {}, [9], lambda w: 5, 0, sharded=True)
    assert (d.members, d.restore, d.ckpt_step, d.resume_step, d.sources) == ([0, 1, 2, 9], "checkpoint", 5, 6, [])
    shrink = decide(1, base, joined, gone, {}, [], lambda w: 5, 0, sharded=True)
    assert (shrink.members, shrink.restore, shrink.mesh) == ([0, 1], "checkpoint", {"tp": 2, "pp": 1, "dp": 1})
    none = decide(1, base, joined, gone, {}, [], lambda w: None, 0, sharded=True)
    assert none.mode == "fail" and "sharded over dp and no checkpoint is complete" in none.note, none
