"""torchft's own tests of native process groups, from the installed torchft-nightly, run as they
are (not copied), with our backends as the group's backend:

- reconfigure_test's resize and recover: 3 processes, ``init_process_group(backend,
  enable_reconfigure=True)``, then members [0, 1, 2] -> [2, 0] -> [1, 2, 0] through torchft's
  ``reconfigure_with_store`` (rank 1 sits out the second generation and rejoins with the handle
  it has), then ``pg.abort()`` and a reconfigure of all three; an all_reduce checked after each.
  gloo as the baseline, in the same run.
- manager_integ_test's native DDP recovery, sync and async quorum.
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


INTEG = """
import sys, unittest
from unittest import mock
import torch.distributed as dist
import resilient_comm
from resilient_comm import _C
from torchft import manager_integ_test as mit

made = []

def ours(store, rank, size, enable_reconfigure=False, **_):
    made.append(rank)
    return _C.create_backend(sys.argv[1], store, rank, size, 30.0, f"native{rank}", enable_reconfigure)

names = [n for n in unittest.TestLoader().getTestCaseNames(mit.ManagerIntegTest)
         if n.startswith("test_ddp_recovery") and "native" in n]
assert len(names) == 2, names  # sync and async quorum
# The test builds its native group's CPU backend as dist.ProcessGroupGloo(store, rank, size,
# enable_reconfigure=True): ours is built in its place, everything else is torchft's.
with mock.patch.object(dist, "ProcessGroupGloo", ours):
    result = unittest.TextTestRunner(verbosity=2).run(unittest.TestSuite(mit.ManagerIntegTest(n) for n in names))
print("backends made:", len(made))
sys.exit(0 if result.wasSuccessful() and made else 1)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["resilient_tcp", "resilient_nccl"])
def test_torchfts_manager_recovers_native_ddp_over_our_backend(backend: str) -> None:
    """torchft's manager_integ_test native DDP recovery (its Manager and Lighthouse; one replica
    fails at step 2 and heals from the other), sync and async quorum, with our backend as the
    native group's CPU backend."""
    run = subprocess.run([sys.executable, "-c", INTEG, backend], capture_output=True, text=True, timeout=100,
                         check=False)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    made = int(run.stdout.rsplit("backends made:", 1)[1].split()[0])
    assert made >= 4, "two replicas, two quorums at least: each built on our backend"
    assert "injected failure rank=0 step=2" in run.stderr, "the failure was injected and recovered from"
