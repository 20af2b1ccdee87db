"""`resilient-comm bench compare`'s peer stacks end to end: one repetition of each row that
compares us with another stack (torchrun's restart, torch's reconfigure API on gloo, torchft on
its gloo group and on a native group of ours), as small as the bench allows: two ranks, the
kill in the first steps, one step of tail.

Each asserts the row a user reads: the survivors recovered (a finite kill -> commit time, under
a bound that only a hang exceeds) and ended with equal parameters, and the bench's exit status.
What the figures are worth is benchmarks/results/compare.md's business, not these tests'."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import time

import pytest
import torch.distributed as dist

from resilient_comm.tools.bench import compare

# The bench's bound on one run; the pytest timeout leaves room for its start and teardown.
RUN_BOUND_S = 90
# The torchft-fast rows' settings with timeouts short enough for a test yet far above this job's
# millisecond all_reduce on a loaded machine: the Lighthouse drops the victim after its 1 s
# heartbeat timeout (until then the survivor alone is not more than half of the healthy
# replicas), and a quorum that takes longer than 30 s would end the survivor.
TORCHFT_TEST = {
    "pg_timeout": 5, "timeout": 5, "quorum_timeout": 30, "heartbeat_timeout_ms": 1000, "join_timeout_ms": 100,
}  # fmt: skip


def _one_row(tmp_path: pathlib.Path, stack: str, *settings: str) -> None:
    out = tmp_path / "compare.json"
    started = time.monotonic()
    rc = compare.main(
        ["--world", "2", "--reps", "1", "--stacks", stack, "--kill-after", "0", "--tail", "1",
         "--step-ms", "20", "--timeout", str(RUN_BOUND_S), "--json", str(out), *settings]
    )  # fmt: skip
    took = time.monotonic() - started
    result = json.loads(out.read_text())
    [row] = result["rows"]
    [run] = result["runs"]
    assert (row["stack"], row["recovered"], row["equal"]) == (stack, 1, 1), (row, run, took)
    assert 0 < row["median_s"] < RUN_BOUND_S / 2, (row, took)  # a bound on a hang, not a benchmark
    assert rc == 0, (row, run)


@pytest.mark.timeout(150)
def test_torchrun_restarts_every_rank_and_they_train_on(tmp_path: pathlib.Path) -> None:
    # Recovered: every rank's restarted process committed a step (`compare._after`).
    _one_row(tmp_path, "torchrun")


@pytest.mark.timeout(150)
@pytest.mark.skipif(not hasattr(dist, "_reconfigure"), reason="torch's reconfigure API (torch >= 2.14)")
def test_torchs_reconfigure_on_gloo_goes_on_without_the_dead_rank(tmp_path: pathlib.Path) -> None:
    # With two ranks the survivor is the victim's ring neighbour: its receive fails when the
    # victim's socket closes, so the op timeout bounds nothing here but a hang.
    _one_row(tmp_path, "reconfigure-gloo", "--gloo-timeout", "5")


@pytest.mark.timeout(150)
@pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None,
    reason="torchft is not installed: pip install --no-build-isolation -e '.[bench]'",
)
def test_torchft_forms_a_quorum_without_the_dead_replica(tmp_path: pathlib.Path) -> None:
    _one_row(tmp_path, "torchft-fast", "--torchft-fast", json.dumps(TORCHFT_TEST))


@pytest.mark.timeout(150)
@pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None,
    reason="torchft is not installed: pip install --no-build-isolation -e '.[bench]'",
)
def test_torchft_on_a_native_group_of_ours_forms_a_quorum_without_the_dead_replica(
    tmp_path: pathlib.Path,
) -> None:
    # torchft-fast's twin at `TORCHFT_TEST`: a native torch group whose CPU backend is
    # resilient_tcp, which the Manager reconfigures in place at each new quorum.
    _one_row(tmp_path, "torchft-fast-ours", "--torchft-fast", json.dumps(TORCHFT_TEST))
