"""torchft's own test of a native process group that reconfigures (torchft/reconfigure_test.py,
from the installed torchft-nightly, run as it is: not copied), with our backends as the group's
backend: 3 processes, ``init_process_group(backend, enable_reconfigure=True)``, then members
[0, 1, 2] -> [2, 0] -> [1, 2, 0] through torchft's ``reconfigure_with_store`` (rank 1 sits out
the second generation and rejoins with the handle it has), then ``pg.abort()`` and a
reconfigure of all three; an all_reduce checked after each. gloo as the baseline, in the same run.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

pytestmark = [
    pytest.mark.skipif(not hasattr(dist.ProcessGroup, "reconfigure"), reason="torch < 2.14 has no reconfigure API"),
    pytest.mark.skipif(
        importlib.util.find_spec("torchft") is None or importlib.util.find_spec("parameterized") is None,
        reason="torchft (and its test dependency parameterized) is not installed: bash scripts/setup.sh installs them",
    ),
]

WORKER = """
import sys
import resilient_comm  # registers our backends
from torchft.reconfigure_test import _resize_worker
_resize_worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["resilient_tcp", "resilient_nccl", "gloo"])
def test_torchfts_resize_and_recover_passes(backend: str) -> None:
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(rank), str(store.port), backend],
                              stderr=subprocess.PIPE, text=True) for rank in range(3)]
    errors = {rank: p.communicate(timeout=100)[1] for rank, p in enumerate(procs)}
    statuses = [p.returncode for p in procs]
    assert statuses == [0, 0, 0], {r: e[-2500:] for r, e in errors.items()}
    assert time.monotonic() - t0 < 60, "its own timeouts are 15 s: nothing waited one out"
