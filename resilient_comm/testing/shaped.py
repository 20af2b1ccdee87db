"""A training job shaped like a real one, for the tests that run the controller the way users
do: at its default settings, past every periodic mechanism. Runs in each worker under
``resilient-run`` (``python -m resilient_comm.testing.shaped``).

What makes it real-shaped, where the toy (`testing/toy.py`) is built for exact checks:
- **per-rank RNG**: ``torch.manual_seed(seed + rank)``, consumed by dropout every step, and
  kept in the state (`TrainState`'s default ``rng=True``): it differs between the replicas;
- **a data loader** (`DataLoader` over a `DistributedSampler`, shuffled per epoch) whose
  position (epoch, batch) is the state's extra part: it differs between the replicas too;
- **AdamW**, with weight decay;
- ``--fsdp``: dp=2 x tp=2, FSDP2 over dp (``shard_dp=True``) and tensor parallel over tp
  through the controller's device mesh, checkpointed every ``--ckpt-every`` steps; the state
  is the local shards (parameters and AdamW's moments), re-created on every new mesh.

Faults: ``--kill RANK:STEP`` (SIGKILL at that step's start), ``--flip RANK:STEP`` (one bit of
a parameter, after that step's commit, once). Events go to ``--events`` (JSON lines, as the
toy's), final states to ``--dump`` (``final-RANK.pt``: the full parameters, the optimizer's
state, the data position, the committed step and the members).
"""

from __future__ import annotations

import argparse
import itertools
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from resilient_comm.testing.toy import Events, train_or_leave

FEATURES, HIDDEN, BATCH, SAMPLES = 16, 64, 8, 1024


class DataPosition:
    """A data loader and where it is: (epoch, batches taken in that epoch). Reloading the
    position rebuilds the iterator there, as a resumable loader does."""

    def __init__(self, replicas: int, replica: int) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(SAMPLES, FEATURES, generator=g)
        data = TensorDataset(x, torch.sin(x @ torch.randn(FEATURES, FEATURES, generator=g)))
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            data, num_replicas=replicas, rank=replica, shuffle=True, seed=0
        )
        # Its own generator: every new iterator draws a seed from the loader's generator, by
        # default the global one, which would shift the dropout masks after a reload.
        self.loader = DataLoader(
            data, batch_size=BATCH, sampler=self.sampler, drop_last=True, generator=torch.Generator()
        )
        self.epoch, self.batch = 0, 0
        self._it: Iterator[Any] | None = None

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        while True:
            if self._it is None:
                self.sampler.set_epoch(self.epoch)
                self._it = itertools.islice(iter(self.loader), self.batch, None)
            item = next(self._it, None)
            if item is not None:
                self.batch += 1
                return item[0], item[1]
            self.epoch, self.batch, self._it = self.epoch + 1, 0, None

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.batch, self._it = sd["epoch"], sd["batch"], None


def _model() -> nn.Module:
    """The same initial weights on every rank, whatever the rank's own RNG is at."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Dropout(0.1), nn.Linear(FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, FEATURES)
        )


class ShardedState:
    """FSDP2 over dp and tensor parallel over tp: the state is this rank's local shards of the
    parameters and of AdamW's moments, and the data position (the same on every rank: all
    step together). Re-created on every new mesh (`on_mesh`)."""

    def __init__(self, position: DataPosition) -> None:
        self.position = position

    def on_mesh(self, mesh: Any) -> None:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.model = _model()
        parallelize_module(self.model, mesh["tp"], {"1": ColwiseParallel(), "3": RowwiseParallel()})
        fully_shard(self.model, mesh=mesh["dp"])
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01)

    def state_dict(self) -> dict[str, Any]:
        params = dict(self.model.named_parameters())
        moments = {
            name: {k: _local(v).detach().clone() for k, v in self.opt.state[p].items()}
            for name, p in params.items()
            if p in self.opt.state
        }
        return {
            "model": {k: _local(v).detach().clone() for k, v in params.items()},
            "adamw": moments,
            "data": self.position.state_dict(),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for name, p in self.model.named_parameters():
                _local(p).copy_(sd["model"][name])
                if name in sd["adamw"]:
                    self.opt.state[p] = {
                        k: DTensor.from_local(v.clone(), p.device_mesh, p.placements)  # type: ignore[attr-defined]
                        if v.dim()
                        else v.clone()
                        for k, v in sd["adamw"][name].items()
                    }
        self.position.load_state_dict(sd["data"])


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


def _faults(specs: list[str], rank: int) -> set[int]:
    return {int(s.split(":")[1]) for s in specs if int(s.split(":")[0]) == rank}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m resilient_comm.testing.shaped", description=__doc__.split("\n")[0]
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--fsdp", action="store_true", help="dp=2 x tp=2, FSDP2 over dp (shard_dp)")
    p.add_argument("--ckpt", default=None, help="checkpoint directory (needed with --fsdp)")
    p.add_argument("--ckpt-every", type=int, default=25)
    p.add_argument("--kill", action="append", default=[], metavar="RANK:STEP")
    p.add_argument("--flip", action="append", default=[], metavar="RANK:STEP")
    p.add_argument("--events", default=None)
    p.add_argument("--dump", default=None)
    a = p.parse_args(argv)

    from resilient_comm.elastic import Controller, TrainState
    from resilient_comm.elastic.model.env import ENV_SPARE

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    spare = os.environ.get(ENV_SPARE) == "1"
    events = Events(a.events, rank)
    kills, flips = _faults(a.kill, rank), _faults(a.flip, rank)
    tp = 2 if a.fsdp else 1
    dp0 = world // tp
    state: Any

    def hook(event: str, info: dict[str, Any]) -> None:
        if event == "step.start" and info["step"] in kills and not spare:
            events.write("killed", step=info["step"])
            os.kill(os.getpid(), signal.SIGKILL)
        if event == "step.committed":
            events.write("commit", step=info["step"])
            if info["step"] in flips:  # once: a redone step does not flip again
                flips.discard(info["step"])
                with torch.no_grad():
                    _local(next(iter(model_of(state).parameters()))).view(-1)[0:1].view(torch.uint8)[0] ^= (
                        0x10
                    )
                events.write("flip", step=info["step"])
        if event in ("integrity.agreed", "integrity.mismatch", "integrity.off"):
            events.write(event.split(".")[1], **{k: v for k, v in info.items() if k != "ms"})

    def model_of(st: Any) -> nn.Module:
        return st.model

    if a.fsdp:
        ctl = Controller(
            state=lambda place: ShardedState(DataPosition(dp0, place.slot // tp)),
            tp=tp,
            shard_dp=True,
            checkpoint_dir=a.ckpt,
            checkpoint_every=a.ckpt_every,
            hook=hook,
        )
        state = ctl.state
    else:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        state = TrainState(model, opt, extra=DataPosition(dp0, rank if not spare else 0))
        ctl = Controller(state=state, hook=hook, comm_bytes=sum(p.numel() * 4 for p in model.parameters()))
    torch.manual_seed(1000 + rank)  # per-rank RNG: each rank's dropout masks differ

    def train() -> None:
        st: Any
        for s in ctl.steps(a.steps):
            with s:
                st = ctl.state
                m, o, data = (st.model, st.opt, st.position) if a.fsdp else (st.model, st.optimizer, st.extra)
                o.zero_grad(set_to_none=False)
                x, y = data.next()
                nn.functional.mse_loss(m(x), y).backward()
                grads = () if a.fsdp else [q.grad for q in m.parameters()]
                s.commit(o.step, grads=grads)

    if not train_or_leave(events, rank, train):
        return 1
    if ctl.state is None:  # a spare never placed
        events.write("done", committed=ctl.committed, members=ctl.members)
        ctl.close()
        return 0
    end: Any = ctl.state
    params = {k: _full(v) for k, v in end.model.named_parameters()}  # a collective under FSDP2
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        opt_sd = end.opt.state_dict() if a.fsdp else end.optimizer.state_dict()
        data = end.position if a.fsdp else end.extra
        torch.save(
            {
                "params": params,
                "optimizer": opt_sd if not a.fsdp else None,
                "data": data.state_dict(),
                "committed": ctl.committed,
                "members": ctl.members,
                "recoveries": len(ctl.recoveries),
            },
            os.path.join(a.dump, f"final-{rank}.pt"),
        )
    events.write("done", committed=ctl.committed, members=ctl.members)
    ctl.close()
    return 0


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().clone()


if __name__ == "__main__":
    sys.exit(main())
