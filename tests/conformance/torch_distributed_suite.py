"""PyTorch's own distributed test suite (torch.testing._internal.distributed.distributed_test,
which ships with torch and which upstream runs for gloo and nccl), run as upstream's
test_distributed_spawn.py runs it, with its gloo cases on any backend:

    RC_SUITE_BACKEND=resilient_tcp python tests/conformance/torch_distributed_suite.py test_all_reduce_sum test_barrier

(test names of the suite; none: all of them, which takes hours on 2 cores). RC_SUITE_RESULTS=PATH
writes each case's outcome there as JSON ("ok", "FAIL", "ERROR", "skipped", ...).

The suite picks its cases by the BACKEND name, so BACKEND stays "gloo"; with RC_SUITE_BACKEND set,
every default group it makes (init_process_group with backend "gloo") is made on that backend
instead. Groups a case asks for by name (new_group(backend="gloo")) stay gloo. tests/backend/test_torch_suite.py
runs a subset twice, on gloo and on resilient_tcp, and compares.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import unittest

import torch.distributed as dist

_AS = os.environ.get("RC_SUITE_BACKEND", "")
if _AS:
    from torch.distributed import distributed_c10d

    import resilient_comm  # noqa: F401  (registers the backends)

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

from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


def _cases(suite: unittest.TestSuite) -> list[unittest.TestCase]:
    out = []
    for t in suite:
        out += _cases(t) if isinstance(t, unittest.TestSuite) else [t]
    return out


def main(names: list[str]) -> int:
    loader = unittest.TestLoader()
    if names:
        suite = loader.loadTestsFromNames([f"TestDistBackendWithSpawn.{n}" for n in names], sys.modules[__name__])
    else:
        suite = loader.loadTestsFromTestCase(TestDistBackendWithSpawn)
    outcome = {t.id().rsplit(".", 1)[1]: "ok" for t in _cases(suite)}  # (a run empties the suite)
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    for kind, cases in (("FAIL", result.failures), ("ERROR", result.errors), ("skipped", result.skipped),
                        ("expected failure", result.expectedFailures)):
        for case, detail in cases:
            outcome[case.id().rsplit(".", 1)[1]] = kind
            if kind in ("FAIL", "ERROR"):
                print(f"== {kind} {case.id()}\n{detail[-1500:]}")
    for case in result.unexpectedSuccesses:
        outcome[case.id().rsplit(".", 1)[1]] = "unexpected success"
    if os.environ.get("RC_SUITE_RESULTS"):
        with open(os.environ["RC_SUITE_RESULTS"], "w") as f:
            json.dump(outcome, f, indent=1, sort_keys=True)
    return 0 if result.wasSuccessful() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
