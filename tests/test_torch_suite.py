"""PyTorch's own distributed test suite on resilient_tcp: every case of a named subset that passes
on gloo passes on resilient_tcp (tests/conformance/torch_distributed_suite.py runs the suite's
gloo cases on any backend; both runs happen here, gloo first).

The subset (SUBSET below) is the suite's collectives, point-to-point, barrier and group cases: the
whole suite takes far longer than CI's budget on a 2-core machine. RC_TORCH_SUITE_K overrides it
(a unittest -k pattern list, comma-separated). Cases that differ by design are listed in
KNOWN_GAPS with the reason; the test fails if one of them starts passing (the list must shrink).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import tempfile

import pytest
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUITE = ROOT / "tests" / "conformance" / "torch_distributed_suite.py"

SUBSET = [
    "test_all_reduce_sum", "test_all_reduce_max", "test_all_reduce_min", "test_all_reduce_product",
    "test_all_reduce_coalesced", "test_all_reduce_complex", "test_broadcast", "test_all_gather",
    "test_reduce_sum", "test_reduce_max", "test_reduce_min", "test_reduce_product", "test_reduce_scatter",
    "test_gather", "test_scatter", "test_send_recv", "test_isend", "test_irecv", "test_batch_isend_irecv",
    "test_barrier", "test_all_to_all",
]

# Cases that pass on gloo and not on resilient_tcp, each with why.
KNOWN_GAPS: dict[str, str] = {}

_LINE = re.compile(r"^(test_\w+) \([\w.]+\) \.\.\. (ok|FAIL|ERROR|skipped|expected failure|unexpected success)")


def _run(backend: str, patterns: list[str], timeout_s: int) -> dict[str, str]:
    env = dict(os.environ, BACKEND="gloo", WORLD_SIZE="3", TEMP_DIR=tempfile.mkdtemp(prefix="rc-suite-"),
               PYTHONUNBUFFERED="1")
    if backend != "gloo":
        env["RC_SUITE_BACKEND"] = backend
    args = [sys.executable, str(SUITE), "-v"]
    for p in patterns:
        args += ["-k", p]
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
    results = {}
    for line in (out.stdout + out.stderr).splitlines():
        m = _LINE.match(line)
        if m:
            results[m.group(1)] = m.group(2)
    assert results, f"no results from the suite on {backend}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return results


@pytest.mark.skipif(not dist.is_gloo_available(), reason="this torch has no gloo to compare with")
@pytest.mark.timeout(1500)
def test_every_case_of_torchs_suite_that_passes_on_gloo_passes_on_resilient_tcp() -> None:
    k = os.environ.get("RC_TORCH_SUITE_K")
    patterns = k.split(",") if k else SUBSET
    gloo = _run("gloo", patterns, 700)
    ours = _run("resilient_tcp", patterns, 700)
    passed_on_gloo = {t for t, r in gloo.items() if r == "ok"}
    print(f"\ntorch's distributed suite, {len(gloo)} cases: {len(passed_on_gloo)} pass on gloo, "
          f"{sum(r == 'ok' for r in ours.values())} on resilient_tcp")
    regressions = sorted(t for t in passed_on_gloo if ours.get(t) != "ok" and t not in KNOWN_GAPS)
    assert not regressions, "pass on gloo, not on resilient_tcp: " + ", ".join(
        f"{t} ({ours.get(t, 'not run')})" for t in regressions)
    mended = sorted(t for t in KNOWN_GAPS if ours.get(t) == "ok")
    assert not mended, f"now passing: drop them from KNOWN_GAPS: {mended}"
