"""A Kubeflow Trainer pod's environment, and nothing else, starts a two-node job: two network
namespace nodes (`testing.cluster`) each run ``resilient-run SCRIPT ARGS`` with no flag, with the
PET_* variables Kubeflow Trainer's torch plugin gives a TrainJob's pods (the facts and their
source: tests/unit/test_kubeflow_env.py) and Kubernetes' JOB_COMPLETION_INDEX. Node 0 hosts the
c10d store at PET_MASTER_ADDR:PET_MASTER_PORT; the toy trains a few steps on 2 x 2 workers and
both launchers exit 0 with identical replicas, within a time bound. Skipped, with the reason,
where namespaces cannot be made."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from resilient_comm.testing import toy
from resilient_comm.testing.cluster import NetnsCluster, available
from resilient_comm.testing.harness import end_all, same_state

WHY = available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"multi-node tests need namespaces and etcd: {WHY}")
NODES, PER_NODE, STEPS = 2, 2, 6
RESILIENT_RUN = os.path.join(os.path.dirname(sys.executable), "resilient-run")
BOUND_S = 90.0  # start to both launchers' exit; 10.7 s here (two cores, four workers)


@pytest.mark.timeout(180)
def test_a_trainjobs_pet_variables_alone_start_a_two_node_job(tmp_path: Any) -> None:
    dump = str(tmp_path / "dump")
    token = secrets.token_hex(32)
    # The c10d test needs no etcd, but NetnsCluster waits for one member.
    with NetnsCluster(NODES, [0], str(tmp_path)) as c:
        logs = {i: open(tmp_path / f"node{i}.log", "wb") for i in range(NODES)}  # noqa: SIM115
        start = time.monotonic()
        procs = {
            i: c.run(i, [RESILIENT_RUN, toy.__file__, "--steps", str(STEPS), "--dump", dump],
                     stdout=logs[i], stderr=subprocess.STDOUT,
                     env={k: v for k, v in os.environ.items() if not k.startswith(("PET_", "SLURM_"))}
                     | {"PET_NNODES": str(NODES), "PET_NPROC_PER_NODE": str(PER_NODE), "PET_NODE_RANK": str(i),
                        "PET_MASTER_ADDR": c.addr(0), "PET_MASTER_PORT": "29500", "JOB_COMPLETION_INDEX": str(i),
                        "RESILIENT_COMM_TOKEN": token})
            for i in range(NODES)
        }  # fmt: skip
        try:
            status = {}
            for i, p in procs.items():
                try:
                    status[i] = p.wait(max(1.0, BOUND_S - (time.monotonic() - start)))
                except subprocess.TimeoutExpired:
                    status[i] = None
            took = time.monotonic() - start
        finally:
            end_all(procs.values(), logs.values())
    text = {i: (tmp_path / f"node{i}.log").read_text(errors="replace") for i in range(NODES)}
    assert status == {0: 0, 1: 0}, {i: text[i][-3000:] for i in status}
    print(f"[kubeflow] PET_* only: 2 nodes x {PER_NODE} workers, {STEPS} steps, both launchers exited 0 in {took:.1f} s")
    assert took < BOUND_S
    for i in range(NODES):
        assert (f"torchrun's environment (PET_*): --nproc-per-node {PER_NODE} --nnodes {NODES} --master-addr "
                f"{c.addr(0)} --master-port 29500 --node-rank {i}") in text[i], text[i][-3000:]
        assert f"store {c.addr(0)}:29500" in text[i], text[i][-3000:]  # node 0's, at PET_MASTER_*
    world = list(range(NODES * PER_NODE))
    finals = {r: torch.load(os.path.join(dump, f"final-{r}.pt"), weights_only=False) for r in world}
    for r in world:
        assert finals[r]["members"] == world and finals[r]["committed"] == STEPS - 1, (r, finals[r]["members"])
        assert same_state(finals[r]["state"], finals[0]["state"]), f"replica {r} differs from 0"
