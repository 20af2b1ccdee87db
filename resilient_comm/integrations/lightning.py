"""Lightning DDP under ``resilient-run --in-process``: a rank dies, the survivors re-run the
script in the same processes with a smaller world (or a hot spare in the dead rank's place),
and Lightning must accept that world as it is.

    from resilient_comm.integrations.lightning import ResilientDDPStrategy

    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                        strategy=ResilientDDPStrategy(), max_steps=..., callbacks=[ModelCheckpoint(...)])
    trainer.fit(model, loader, ckpt_path="last")   # a restart resumes from the last checkpoint

Stock Lightning ties three things to the launch's layout that an in-process restart changes:

- ``TorchElasticEnvironment.validate_settings`` requires ``devices * num_nodes == WORLD_SIZE``:
  after a shrink the product is the launch's, the world smaller. `ResilientEnvironment` checks
  only what stays true: this process's device is among the node's ``devices``.
- ``DDPStrategy.root_device`` is ``parallel_devices[LOCAL_RANK]``. The restarter keeps each
  process's ``LOCAL_RANK`` (its launch slot) on purpose: on a GPU it names the device the
  process owns -- its CUDA context, its memory, its NCCL communicator -- and a restart must not
  move it to a dead rank's device. So ``devices`` must be the node's devices (the launch's
  ``--nproc-per-node``, ``LOCAL_WORLD_SIZE``, plus its ``--spares``: a hot spare's slot is
  ``nproc + j``), not the world size; on the CPU every process's device is ``cpu`` whatever
  its slot (a script that passes ``devices=WORLD_SIZE`` works there).
- ``DDPStrategy.distributed_sampler_kwargs`` shards the data by ``num_nodes * devices``: after a
  shrink that leaves shards nobody reads. `ResilientDDPStrategy` shards by the world as it is.

The process group is ``resilient_nccl`` for CUDA devices and ``resilient_tcp`` for the CPU
unless ``process_group_backend`` says otherwise. Lightning's own handling of an exception in
``fit`` (callbacks' ``on_exception``, its teardown, the exception raised again) is what lets the
restarter unwind the script; nothing else of Lightning's is process-wide state that a restart
must reset (``rank_zero_only.rank`` is set again by the strategy). Written for the unified
``lightning`` package (``lightning.pytorch``), 2.x.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.pytorch.strategies import DDPStrategy

from resilient_comm.elastic.model.env import ENV_AGENT


def launch_local_rank() -> int:
    """This process's slot on its node, from the launch (``LOCAL_RANK``; a restart keeps it)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


class ResilientEnvironment(TorchElasticEnvironment):
    """``resilient-run``'s environment: ranks and world size read afresh from the environment
    at every use (the restarter sets them for each incarnation), the local rank the launch's."""

    @staticmethod
    def detect() -> bool:
        return ENV_AGENT in os.environ

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if num_nodes < 1 or num_devices < 1:
            raise ValueError(f"devices={num_devices}, num_nodes={num_nodes}: both must be at least 1")


class ResilientDDPStrategy(DDPStrategy):
    """`DDPStrategy` for worlds that change in-process (module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("cluster_environment", ResilientEnvironment())
        super().__init__(**kwargs)

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        if all(d.type == "cpu" for d in self.parallel_devices):
            return torch.device("cpu")
        slot = launch_local_rank()
        if slot >= len(self.parallel_devices):
            raise ValueError(
                f"this process owns device slot {slot} of its node (LOCAL_RANK) but the Trainer has "
                f"devices={len(self.parallel_devices)}: pass the node's devices (LOCAL_WORLD_SIZE, "
                f"{os.environ.get('LOCAL_WORLD_SIZE', '?')}, plus the node's --spares), not the world size"
            )
        return self.parallel_devices[slot]

    def _get_process_group_backend(self) -> str:
        if self._process_group_backend:
            return self._process_group_backend
        return "resilient_nccl" if self.root_device.type == "cuda" else "resilient_tcp"

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}


__all__ = ["ResilientDDPStrategy", "ResilientEnvironment", "launch_local_rank"]
