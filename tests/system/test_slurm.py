"""``srun resilient-run`` on a real Slurm (Debian's slurm-wlm, `testing.slurm`): slurmctld on the
bridge, one slurmd per network-namespace node, an etcd member on each node. One task per node
takes its node count, node rank and run id from Slurm's environment; a whole node (its slurmd,
its slurmstepd, its launcher and workers) is SIGKILLed while the toy is held; the others
shrink and finish bit-identical, srun exits 0 (``--no-kill``: a lost node does not end the
job; ``--kill-on-bad-exit=0``: nor does one task's failure) and Slurm records the job as
COMPLETED with exit code 0:0 on the nodes left. Skipped, with the reason, where Slurm cannot be
started (not root, no slurm-wlm or munge, no namespaces, no etcd)."""

from __future__ import annotations

import datetime
import os
import secrets
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from resilient_comm.elastic import Membership
from resilient_comm.elastic.membership.etcd.store import EtcdStore
from resilient_comm.testing.cluster import NetnsCluster
from resilient_comm.testing.harness import same_state
from resilient_comm.testing.slurm import SlurmCluster, available
from resilient_comm.testing.toy import read_events

WHY = available()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"the Slurm test needs a Slurm it can start: {WHY}")
NODES, PER_NODE, STEPS, HOLD = 3, 2, 24, 8
LEASE_S = 5.0  # RESILIENT_COMM_NODE_LEASE_MS's default
RESILIENT_RUN = os.path.join(os.path.dirname(sys.executable), "resilient-run")


@pytest.fixture
def slurm(tmp_path: Any) -> Any:
    with NetnsCluster(NODES, [0, 1, 2], str(tmp_path)) as c, SlurmCluster(c, str(tmp_path)) as s:
        yield s


@pytest.mark.timeout(300)
def test_srun_trains_through_a_lost_node_and_slurm_reports_success(slurm: SlurmCluster, tmp_path: Any) -> None:
    s, c, tmp = slurm, slurm.c, str(tmp_path)
    events, dump = os.path.join(tmp, "events"), os.path.join(tmp, "dump")
    store = EtcdStore(c.endpoints(), datetime.timedelta(seconds=120))
    out_path = os.path.join(tmp, "srun.log")
    with open(out_path, "wb") as out:
        srun = s.client(
            ["srun", "--nodes", str(NODES), "--ntasks-per-node=1", "--no-kill", "--kill-on-bad-exit=0",
             "--job-name", "rc-train", RESILIENT_RUN, "--nproc-per-node", str(PER_NODE), "--rdzv-backend",
             "etcd", "--rdzv-endpoint", c.endpoints(), "-m", "resilient_comm.testing.toy", "--events", events,
             "--steps", str(STEPS), "--dump", dump, "--hold", f"0:{HOLD}"],
            stdout=out, stderr=subprocess.STDOUT, cwd=tmp,
            env={**s.env(), "RESILIENT_COMM_TOKEN": secrets.token_hex(32)},
        )

    def log() -> str:
        with open(out_path, errors="replace") as f:
            return f.read()

    try:
        deadline = time.monotonic() + 150
        while not store.wait_for(f"toy/held/0/{HOLD}", 1.0):
            assert srun.poll() is None, f"srun ended ({srun.returncode}) before the hold: {log()[-3000:]}"
            assert time.monotonic() < deadline, f"rank 0 never reached the held step: {log()[-3000:]}"
        job_id = s.query("squeue", "--noheader", "--name", "rc-train", "--format=%i").strip()
        assert job_id.isdigit(), job_id
        c.kill_node(2)  # node 2's slurmd, slurmstepd, resilient-run and ranks 4, 5 (its etcd member stays)
        killed = time.time()
        store.set(f"toy/go/{HOLD}", "1")
        try:
            status = srun.wait(150)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"srun did not finish: {log()[-3000:]}; {s.logs()}") from None
        ended = time.time()
    finally:
        if srun.poll() is None:
            srun.kill()
            srun.wait()
    text = log()
    assert status == 0, f"srun exited {status}: {text[-3000:]}"
    for rank in range(NODES):  # each launcher took its place and the run id from Slurm
        assert f"Slurm step {job_id}.0: --nnodes {NODES} --node-rank {rank} --rdzv-id {job_id}" in text, text[-3000:]
    assert f"Node failure on {s.node(2)}" in text, text[-3000:]

    job = s.job(job_id)
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), job
    assert s.node(2) not in job["NodeList"] and job["NumNodes"] == str(NODES - 1), job
    print(f"[slurm] job {job_id}: JobState={job['JobState']} ExitCode={job['ExitCode']} NodeList={job['NodeList']}")

    m = Membership(store, f"rc/{job_id}/g0")  # the run id is the job id
    d = m.decision(m.epoch())
    assert d is not None and d.members == [0, 1, 2, 3] and sorted(d.lost) == [4, 5], d
    survivors = d.members
    finals = {r: torch.load(os.path.join(dump, f"final-{r}.pt"), weights_only=False) for r in survivors}
    for r in survivors:
        assert finals[r]["members"] == survivors and finals[r]["committed"] == STEPS - 1, (r, finals[r]["members"])
        assert same_state(finals[r]["state"], finals[0]["state"]), f"replica {r} differs from 0"
    commits = [e for e in read_events(events) if e["event"] == "commit"]
    for r in survivors:
        assert [e["step"] for e in commits if e["rank"] == r] == list(range(STEPS)), f"rank {r}'s commits"
    first = min(e["t"] for e in commits if e["t"] > killed) - killed
    print(f"[slurm] node SIGKILLed -> first committed step: {first:.2f} s; srun ended {ended - killed:.2f} s after the kill")
    # ranks 0-3 wait in step HOLD's all-reduce for ranks 4, 5 until node 2's lease expires
    assert LEASE_S - 2.0 < first < LEASE_S + 5.0, f"the first step after the kill committed {first:.2f} s later"
