"""resilient_comm: a torch.distributed backend whose collectives fail fast instead of hanging.

``import resilient_comm`` registers three c10d backends:

- ``resilient_tcp``: CPU tensors over resilient_comm's own TCP transport.
- ``resilient_nccl``: CPU tensors over TCP; CUDA tensors over NCCL, loaded at run time
  (RESILIENT_COMM_NCCL_LIB, the libnccl torch loaded, or the nvidia-nccl wheel), stream-ordered
  as ProcessGroupNCCL (docs/nccl.md). With RESILIENT_COMM_NCCL_EMULATE=1, CPU tensors go through
  the NCCL communicator on the NCCL emulator instead: the NCCL code path without a GPU.
- ``resilient_hccl`` (where torch_npu is installed): CPU tensors over TCP; NPU tensors over
  HCCL, loaded at run time (RESILIENT_COMM_HCCL_LIB or libhccl.so); never run on Ascend
  hardware yet (docs/hccl.md).

Every collective runs with a deadline (the process group's timeout unless the op passes
its own). When a peer dies, every surviving rank gets a ``torch.distributed.DistBackendError``
within milliseconds, ring neighbour or not, and the process stays alive to recover.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
from collections.abc import Callable
from typing import Any, ClassVar

import torch  # noqa: F401  (loads libtorch before our extension)
import torch.distributed as dist

from resilient_comm import _C
from resilient_comm.api import abort, errored, shm_peers, tainted
from resilient_comm.config import knobs
from resilient_comm.errors import (
    CommAbortedError,
    CommError,
    CommMismatchError,
    CommTimeoutError,
    PeerFailureError,
)
from resilient_comm.groups import grow, join, shrink, split
from resilient_comm.nccl_lib import nccl_wheel_candidates

__all__ = [
    "BACKENDS",
    "CommAbortedError",
    "CommError",
    "CommMismatchError",
    "CommTimeoutError",
    "PeerFailureError",
    "abort",
    "errored",
    "grow",
    "join",
    "knobs",
    "shm_peers",
    "shrink",
    "split",
    "tainted",
]
__version__ = "0.1.0"

# resilient_hccl needs torch_npu (it registers the "npu" device); offered only where it is installed.
_NPU = importlib.util.find_spec("torch_npu") is not None
BACKENDS = ("resilient_tcp", "resilient_nccl") + (("resilient_hccl",) if _NPU else ())


class BackendCreation:
    """What an in-process restart (`resilient_comm.elastic.worker.inprocess`) asks of every backend that
    ``init_process_group``/``new_group`` create: a store key prefix per incarnation (the script
    rendezvous afresh on the same store each time it is re-entered) and hooks that see each new
    backend at once (its bootstrap runs in the background, so a hook can abort it while it waits
    for a dead peer)."""

    prefix = ""
    hooks: ClassVar[list[Callable[[Any], None]]] = []


def _creator(backend_name: str):
    def create(dist_opts, _backend_opts):
        store = dist_opts.store
        if BackendCreation.prefix:
            store = dist.PrefixStore(BackendCreation.prefix, store)
        backend = _C.create_backend(
            backend_name,
            store,
            dist_opts.group_rank,
            dist_opts.group_size,
            dist_opts.timeout.total_seconds(),
            str(dist_opts.group_id),
            # torch >= 2.14: init_process_group(..., enable_reconfigure=True) connects nothing
            # until the first dist._reconfigure (docs/reconfigure.md).
            bool(getattr(dist_opts, "enable_reconfigure", False)),
        )
        for hook in list(BackendCreation.hooks):
            hook(backend)
        return backend

    create.__name__ = f"create_{backend_name}"
    return create


def _register() -> None:
    devices = {"resilient_tcp": ["cpu"], "resilient_nccl": ["cpu", "cuda"], "resilient_hccl": ["cpu", "npu"]}
    for name in BACKENDS:
        if name.upper() in dist.Backend._plugins:  # re-import (e.g. importlib.reload)
            continue
        dist.Backend.register_backend(name, _creator(name), extended_api=True, devices=devices[name])


_register()
_C.set_nccl_candidates(nccl_wheel_candidates())
# [Note: the liveness lock] (csrc/common/liveness.h): a worker of resilient-run holds the lock
# its node agent watches from the start; any other process takes one with its first TCP
# communicator. A normal exit releases it, so that only a death is reported as one.
if os.environ.get(_C.LIVENESS_SLOT_ENV):
    _C.liveness_hold()
atexit.register(_C.liveness_release)
