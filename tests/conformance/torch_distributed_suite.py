"""PyTorch's own distributed test suite (torch.testing._internal.distributed.distributed_test,
which ships with torch and which upstream runs for gloo and nccl), run as upstream's
test_distributed_spawn.py runs it, with its gloo cases on any backend:

    BACKEND=gloo WORLD_SIZE=3 RC_SUITE_BACKEND=resilient_tcp python tests/conformance/torch_distributed_suite.py -v -k all_reduce

The suite picks its cases by the BACKEND name, so BACKEND stays "gloo"; with RC_SUITE_BACKEND set,
every default group it makes (init_process_group with backend "gloo") is made on that backend
instead. Groups a case asks for by name (new_group(backend="gloo")) stay gloo. tests/test_torch_suite.py
runs a subset twice, on gloo and on resilient_tcp, and compares.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch.distributed as dist

_AS = os.environ.get("RC_SUITE_BACKEND", "")
if _AS:
    import resilient_comm  # noqa: F401  (registers the backends)
    from torch.distributed import distributed_c10d

    _init = distributed_c10d.init_process_group

    def _init_as(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if kwargs.get("backend") == "gloo":
            kwargs["backend"] = _AS
        elif args and args[0] == "gloo":
            args = (_AS, *args[1:])
        return _init(*args, **kwargs)

    distributed_c10d.init_process_group = _init_as
    dist.init_process_group = _init_as

os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "3")
if "TEMP_DIR" not in os.environ:
    os.environ["TEMP_DIR"] = tempfile.mkdtemp(prefix="rc-suite-")

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    sys.exit(run_tests())
