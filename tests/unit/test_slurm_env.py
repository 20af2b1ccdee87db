"""resilient-run's defaults from a Slurm step's environment (`elastic.node.slurm`): what each
flag takes, that an explicit flag wins, and the errors when a default cannot be had. The
environments are srun's (as printed by a task of ``srun -N 3 --ntasks-per-node=1`` on slurm-wlm
22.05); a real srun runs them in tests/system/test_slurm.py."""

from __future__ import annotations

import os
import stat
from typing import Any

import pytest

from resilient_comm.elastic.node.cli import main, parser
from resilient_comm.elastic.node.slurm import (
    SlurmError,
    apply_defaults,
    defaults,
    expand_hostnames,
    step_from_env,
)

STEP_ENV = {
    "SLURM_JOB_ID": "4711",
    "SLURM_JOBID": "4711",
    "SLURM_STEP_ID": "0",
    "SLURM_STEPID": "0",
    "SLURM_NNODES": "3",
    "SLURM_JOB_NUM_NODES": "3",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_NTASKS": "3",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "SLURM_JOB_NODELIST": "gpu[01-03]",
    "SLURM_STEP_NODELIST": "gpu[01-03]",
}


def _hosts(nodelist: str) -> list[str]:
    assert nodelist == "gpu[01-03]"
    return ["gpu01", "gpu02", "gpu03"]


def _args(*flags: str) -> Any:
    return parser().parse_args([*flags, "train.py"])


@pytest.mark.timeout(30)
def test_no_step_no_defaults() -> None:
    """Outside Slurm, and in a batch script's own shell (a job, no step), nothing is taken."""
    assert step_from_env({}) is None
    batch = {k: v for k, v in STEP_ENV.items() if "STEP" not in k}
    assert step_from_env(batch) is None
    a = _args()
    assert apply_defaults(a, {}) is None and (a.nnodes, a.node_rank, a.rdzv_id, a.nproc_per_node) == (None,) * 4


@pytest.mark.timeout(30)
def test_a_task_of_an_srun_step_takes_nodes_rank_run_id_and_c10d_endpoint() -> None:
    step = step_from_env(STEP_ENV)
    assert step is not None
    d = defaults(step, nnodes=None, node_rank=None, run_id=None, endpoint_needed=True, nproc_per_node=None,
                 hostnames=_hosts)
    assert (d.nnodes, d.node_rank, d.run_id, d.endpoint, d.nproc_per_node) == ((3, 3), 1, "4711", "gpu01:29400", None)
    assert d.describe() == "--nnodes 3 --node-rank 1 --rdzv-id 4711 --rdzv-endpoint gpu01:29400"
    d = defaults(step, nnodes=None, node_rank=None, run_id=None, endpoint_needed=True, nproc_per_node=None,
                 port=12345, hostnames=_hosts)
    assert d.endpoint == "gpu01:12345"  # --master-port alone: Slurm's first host on that port


@pytest.mark.timeout(30)
def test_explicit_flags_win() -> None:
    a = _args("--nnodes", "2:4", "--node-rank", "3", "--rdzv-id", "mine", "--nproc-per-node", "4",
              "--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379,e2:2379")
    apply_defaults(a, STEP_ENV)  # no scontrol needed: nothing asks for the c10d endpoint
    assert (a.nnodes, a.node_rank, a.rdzv_id, a.nproc_per_node, a.rdzv_endpoint) == (
        (2, 4), 3, "mine", 4, "e1:2379,e2:2379")
    a = _args("--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379")
    apply_defaults(a, STEP_ENV)
    assert (a.nnodes, a.node_rank, a.rdzv_id, a.nproc_per_node, a.rdzv_endpoint) == ((3, 3), 1, "4711", None, "e1:2379")
    a = _args("--standalone")
    assert apply_defaults(a, STEP_ENV) is None and a.nnodes is None  # a single node, whatever Slurm says


@pytest.mark.timeout(30)
def test_gpus_bound_by_slurm_set_the_workers_per_node_and_too_many_processes_are_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = {**STEP_ENV, "SLURM_STEP_GPUS": "4,5,6,7", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    a = _args("--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379")
    apply_defaults(a, env)
    assert a.nproc_per_node == 4 and not [r for r in caplog.records if r.levelname == "WARNING"]
    a = _args("--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379", "--nproc-per-node", "4", "--spares", "1")
    apply_defaults(a, env)
    assert ("Slurm bound 4 GPU(s) to this task (4,5,6,7; CUDA_VISIBLE_DEVICES=4,5,6,7) but it starts 4 worker(s) "
            "and 1 spare(s): LOCAL_RANK 4 and up have no device of their own") in caplog.text


@pytest.mark.timeout(30)
def test_more_tasks_than_nodes_is_refused_where_a_default_comes_from_the_step() -> None:
    env = {**STEP_ENV, "SLURM_STEP_NUM_TASKS": "6"}
    a = _args("--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379")
    with pytest.raises(SlurmError, match=r"Slurm step 4711\.0 runs 6 tasks on 3 node\(s\): resilient-run is one "
                                         r"task per node \(srun --ntasks-per-node=1\)"):
        apply_defaults(a, env)
    a = _args("--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379", "--nnodes", "6", "--node-rank", "5")
    apply_defaults(a, env)  # the layout given: the step's is not used
    assert (a.nnodes, a.node_rank) == ((6, 6), 5)


@pytest.mark.timeout(30)
def test_without_scontrol_the_c10d_endpoint_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SlurmError, match=r"no 'scontrol' on PATH to expand the node list 'gpu\[01-03\]' into the "
                                         r"rendezvous host: give --rdzv-endpoint host:port"):
        apply_defaults(_args(), STEP_ENV)


@pytest.mark.timeout(30)
def test_the_node_list_is_expanded_by_scontrol(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """`scontrol show hostnames LIST` is asked (a stand-in that answers as Slurm's does), and
    its failure is reported with its own words."""
    fake = tmp_path / "scontrol"
    fake.write_text('#!/bin/sh\n[ "$1 $2 $3" = "show hostnames gpu[01-03]" ] || { echo "bad: $*" >&2; exit 1; }\n'
                    'printf "gpu01\\ngpu02\\ngpu03\\n"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert expand_hostnames("gpu[01-03]") == ["gpu01", "gpu02", "gpu03"]
    a = _args()
    apply_defaults(a, STEP_ENV)
    assert a.rdzv_endpoint == "gpu01:29400" and a.node_rank == 1
    with pytest.raises(SlurmError, match=r"'scontrol show hostnames n\[1-2\]' failed \(1\): bad: show hostnames n\[1-2\]"):
        expand_hostnames("n[1-2]")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("nodelist,host", [("node07", "node07"), ("a1,b2", "a1")])
def test_a_node_list_without_ranges_needs_no_scontrol(monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
                                                      nodelist: str, host: str) -> None:
    """A single-node step (or plain names) gives node 0's host without scontrol, which would
    need the cluster's slurm.conf (issue #52: it failed on a node without one)."""
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol anywhere
    env = STEP_ENV | {"SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_NODELIST": nodelist, "SLURM_NODEID": "0",
                      "SLURM_STEP_NUM_NODES": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NNODES": "1", "SLURM_NTASKS": "1"}
    a = _args()
    apply_defaults(a, env)
    assert (a.rdzv_endpoint, a.node_rank, a.nnodes) == (f"{host}:29400", 0, (1, 1))


@pytest.mark.timeout(30)
def test_a_bad_number_in_slurms_environment_names_the_variable() -> None:
    with pytest.raises(SlurmError, match=r"SLURM_NODEID='x' is not a whole number"):
        step_from_env({**STEP_ENV, "SLURM_NODEID": "x"})


@pytest.mark.timeout(30)
def test_resilient_run_under_a_bad_step_says_why_and_exits_2(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    for k, v in {**STEP_ENV, "SLURM_STEP_NUM_TASKS": "6"}.items():
        monkeypatch.setenv(k, v)
    assert main(["--rdzv-backend", "etcd", "--rdzv-endpoint", "e1:2379", "train.py"]) == 2
    assert "resilient-run: Slurm step 4711.0 runs 6 tasks on 3 node(s)" in capsys.readouterr().err
