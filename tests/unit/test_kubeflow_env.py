"""resilient-run's defaults from torchrun's PET_* variables (`elastic.node.torchrun_env`), as
Kubeflow Trainer v2 sets them: the environment of a TrainJob's pod -> the launcher it makes (its
`Launcher`'s arguments, through `cli.main`); an explicit flag wins; a bad value is an error
naming the variable; every flag resilient-run shares with torchrun reads the variable torchrun
reads; PET_* wins over Slurm's step, flag by flag. A real two-node job on PET_* alone runs in
tests/system/test_kubeflow.py.

The environment, as Kubeflow Trainer's source sets it (kubeflow/trainer at commit
8c0f5059bd51ec3ba6d6a6a7b2e1471de7bc13b3, 2026-08-21; facts only, nothing copied):

- pkg/runtime/framework/plugins/torch/torch.go, ``Torch.EnforceMLPolicy``: into the trainer's
  container named "node" it upserts PET_NNODES = the trainer pod set's count (the TrainJob's
  ``trainer.numNodes``, else the runtime's ``mlPolicy.numNodes``; 1 when unset);
  PET_NPROC_PER_NODE = ``trainer.numProcPerNode`` when given, else "auto", which becomes
  max(1, the CPU request (else limit) of ``resourcesPerNode``) when no GPU is requested;
  PET_NODE_RANK from the pod's field ``metadata.annotations['batch.kubernetes.io/job-completion-index']``
  (the Indexed Job's index, also in the pod's JOB_COMPLETION_INDEX); PET_MASTER_ADDR =
  ``<trainjob>-node-0-0.<trainjob>`` (JobSet's pod 0 of Job 0 of the replicated job "node",
  through the headless service named after the TrainJob) and PET_MASTER_PORT = 29500. The
  master address and port are not set for torchtune's entrypoint (``tune run``).
- pkg/constants/constants.go: the five names (TorchEnvNumNodes ... TorchEnvMasterPort), Node =
  "node", ContainerTrainerPort = 29500 (unchanged since the plugin's first version, #2308),
  JobCompletionIndexFieldPath, and TorchRunReservedEnvNames: a TrainJob whose ``trainer.env``
  sets one of the five is refused by the torch plugin's validation.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from torch.distributed.argparse_util import check_env, env
from torch.distributed.run import get_args_parser

from resilient_comm.elastic.node import cli, torchrun_env
from resilient_comm.elastic.node.cli import parser
from resilient_comm.elastic.node.slurm import apply_defaults as slurm_defaults
from resilient_comm.elastic.node.torchrun_env import TorchrunEnvError, apply_defaults, finish

# Pod "llama-node-0-2" of TrainJob "llama": trainer.numNodes 3, resourcesPerNode nvidia.com/gpu 8,
# no numProcPerNode (so "auto"); Kubernetes adds JOB_COMPLETION_INDEX to an Indexed Job's pods.
TRAINJOB_POD = {
    "PET_NNODES": "3",
    "PET_NPROC_PER_NODE": "auto",
    "PET_NODE_RANK": "2",
    "PET_MASTER_ADDR": "llama-node-0-0.llama",
    "PET_MASTER_PORT": "29500",
    "JOB_COMPLETION_INDEX": "2",
}
# The same job with trainer.numProcPerNode 4; and a CPU job (resourcesPerNode cpu: 2, no GPU).
WITH_NUMPROCPERNODE = TRAINJOB_POD | {"PET_NPROC_PER_NODE": "4"}
CPU_ONLY = TRAINJOB_POD | {"PET_NPROC_PER_NODE": "2"}


class FakeLauncher:
    """Stands in for `Launcher`: keeps the arguments `cli.main` made it with."""

    made: ClassVar[list[dict[str, Any]]] = []
    metrics = None

    def __init__(self, cmd: list[str], nproc: int, **kwargs: Any) -> None:
        FakeLauncher.made.append({"cmd": cmd, "nproc": nproc, **kwargs})

    def forward(self, sig: int) -> None:
        raise AssertionError(f"signal {sig} forwarded")

    def run(self) -> int:
        return 0


@pytest.fixture
def launch(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """`launch(env, *flags)`: `cli.main` in `env` (and no other PET_* or Slurm variable) with
    `flags` and the script train.py; returns the Launcher's arguments."""
    monkeypatch.setattr(cli, "Launcher", FakeLauncher)
    monkeypatch.setattr(torchrun_env, "_cuda_devices", lambda: 8)  # the pod's 8 GPUs
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def run(environ: dict[str, str], *flags: str) -> dict[str, Any]:
        for k in [k for k in os.environ if k.startswith(("PET_", "SLURM_"))]:
            monkeypatch.delenv(k)
        for k, v in environ.items():
            monkeypatch.setenv(k, v)
        FakeLauncher.made = []
        assert cli.main([*flags, "train.py"]) == 0
        (made,) = FakeLauncher.made
        return made

    yield run
    for s, h in handlers.items():  # main gave them to the (fake) launcher
        signal.signal(s, h)


def _parse(environ: dict[str, str], *flags: str) -> argparse.Namespace:
    p = parser()
    taken = apply_defaults(p, environ)
    a = p.parse_args([*flags, "train.py"])
    finish(a, taken)
    return a


@pytest.mark.timeout(30)
def test_a_trainjob_pod_gives_the_layout_node_rank_store_and_its_gpus(
    launch: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "resilient_comm.launcher")
    made = launch(TRAINJOB_POD)
    assert (made["nproc"], made["nnodes"], made["max_nodes"], made["node_rank"]) == (8, 3, 3, 2)
    assert (made["endpoint"], made["rdzv_backend"]) == ("llama-node-0-0.llama:29500", "c10d")
    assert made["cmd"][-1] == "train.py"
    assert ("torchrun's environment (PET_*): --nproc-per-node 8 (auto) --nnodes 3 --master-addr "
            "llama-node-0-0.llama --master-port 29500 --node-rank 2") in caplog.text


@pytest.mark.timeout(30)
@pytest.mark.parametrize("environ,nproc", [(WITH_NUMPROCPERNODE, 4), (CPU_ONLY, 2)])
def test_numprocpernode_and_a_cpu_nodes_count_are_taken_as_they_are(launch: Any, environ: dict[str, str],
                                                                     nproc: int) -> None:
    assert launch(environ)["nproc"] == nproc


@pytest.mark.timeout(30)
def test_auto_without_a_gpu_is_torchruns_rule_and_gpu_without_one_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torchrun_env, "_cuda_devices", lambda: 0)
    monkeypatch.setattr(torchrun_env, "_npu_devices", lambda: 0)
    monkeypatch.setattr(torchrun_env.os, "cpu_count", lambda: 6)
    assert _parse(TRAINJOB_POD).nproc_per_node == 6  # torchrun: CUDA, else the accelerator, else the CPUs
    monkeypatch.setattr(torchrun_env, "_npu_devices", lambda: 4)
    assert _parse(TRAINJOB_POD).nproc_per_node == 4
    with pytest.raises(TorchrunEnvError, match=r"^PET_NPROC_PER_NODE='gpu': 'gpu': this node has no CUDA device "
                                               r"\(the default of --nproc-per-node\)$"):
        _parse(TRAINJOB_POD | {"PET_NPROC_PER_NODE": "gpu"})


@pytest.mark.timeout(30)
def test_explicit_flags_win_over_the_environment(launch: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "resilient_comm.launcher")
    made = launch(TRAINJOB_POD, "--nnodes", "2:4", "--node-rank", "0", "--nproc-per-node", "1",
                  "--rdzv-endpoint", "h0:1234")
    assert (made["nproc"], made["nnodes"], made["max_nodes"], made["node_rank"], made["endpoint"]) == (
        1, 2, 4, 0, "h0:1234")
    # What a flag overrode is not reported as taken.
    assert "torchrun's environment (PET_*): --master-addr llama-node-0-0.llama --master-port 29500\n" in caplog.text


@pytest.mark.timeout(30)
def test_with_etcd_the_rendezvous_places_the_node_not_pet_node_rank(
    launch: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A pod recreated under its index must not take ranks the job decided on: with etcd the
    rendezvous places every node (torchrun's dynamic backends ignore the node rank too)."""
    caplog.set_level(logging.INFO, "resilient_comm.launcher")
    made = launch(TRAINJOB_POD | {"PET_RDZV_BACKEND": "etcd", "PET_RDZV_ENDPOINT": "e0:2379,e1:2379"})
    assert (made["rdzv_backend"], made["endpoint"], made["node_rank"]) == ("etcd", "e0:2379,e1:2379", None)
    assert ("PET_NODE_RANK=2 not taken: with --rdzv-backend etcd the rendezvous places this node (a pod "
            "recreated under its index takes a free capacity place, not ranks the job decided on)") in caplog.text
    made = launch(TRAINJOB_POD, "--rdzv-backend", "etcd", "--rdzv-endpoint", "e0:2379", "--node-rank", "1")
    assert made["node_rank"] == 1  # the flag is an override with any backend


@pytest.mark.timeout(30)
def test_job_completion_index_alone_is_no_node_rank() -> None:
    """In a bare JobSet of several Jobs every pod can have index 0: the index is not read."""
    a = _parse({"JOB_COMPLETION_INDEX": "3"})
    assert a.node_rank is None


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name,text,why", [
    ("PET_NNODES", "abc", r"'abc' is not N or MIN:MAX \(whole numbers of nodes\) \(the default of --nnodes\)"),
    ("PET_NNODES", "3:2", r"'3:2': MIN 3 is more than MAX 2 \(the default of --nnodes\)"),
    ("PET_NPROC_PER_NODE", "lots", r"'lots' is not a whole number of workers, nor one of auto, gpu, cpu"),
    ("PET_NODE_RANK", "two", r"'two' is not a whole number \(the default of --node-rank\)"),
    ("PET_MASTER_PORT", "29500/tcp", r"'29500/tcp' is not a whole number \(the default of --master-port\)"),
    ("PET_RDZV_BACKEND", "etcd-v2", r"'etcd-v2' is not one of c10d, etcd, static \(the default of --rdzv-backend\)"),
    ("PET_STANDALONE", "yes", r"'yes' is not a whole number \(torchrun's rule for a switch: 0 off, any other "
                              r"number on\) \(the default of --standalone\)"),
    ("PET_HEALTH_CHECK_PERIOD", "1m", r"'1m' is not a number \(the default of --health-check-period\)"),
])  # fmt: skip
def test_a_malformed_value_is_a_usage_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str, text: str, why: str
) -> None:
    monkeypatch.setenv(name, text)
    assert cli.main(["train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"resilient-run: {name}={text!r}: ") and len(err.splitlines()) == 1, err
    assert re.search(why, err), err


@pytest.mark.timeout(30)
def test_an_empty_variable_says_nothing() -> None:
    a = _parse({"PET_NNODES": "", "PET_NODE_RANK": " ", "PET_MASTER_PORT": ""})
    assert (a.nnodes, a.node_rank, a.master_port) == (None, None, None)


# A value for every flag resilient-run shares with torchrun (torchrun reads PET_<DEST> for each),
# and what resilient-run makes of it.
SHARED = {
    "nnodes": ("2:4", (2, 4)),
    "nproc_per_node": ("3", 3),
    "rdzv_backend": ("etcd", "etcd"),
    "rdzv_endpoint": ("e0:2379", "e0:2379"),
    "rdzv_id": ("job7", "job7"),
    "rdzv_conf": ("join_timeout=60", "join_timeout=60"),
    "standalone": ("1", True),
    "max_restarts": ("2", 2),
    "monitor_interval": ("0.5", 0.5),
    "module": ("1", True),
    "no_python": ("1", True),
    "log_dir": ("/logs", "/logs"),
    "node_rank": ("1", 1),
    "master_addr": ("h0", "h0"),
    "master_port": ("29500", 29500),
}


@pytest.mark.timeout(30)
def test_every_flag_shared_with_torchrun_reads_the_variable_torchrun_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    ours = {a.dest for a in parser()._actions if a.option_strings}
    theirs = {a.dest: a for a in get_args_parser()._actions if isinstance(a, env | check_env)}
    assert set(SHARED) == ours & set(theirs), "a flag shared with torchrun needs a value in SHARED"
    environ = {f"PET_{dest.upper()}": text for dest, (text, _) in SHARED.items()}
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    torchrun = get_args_parser().parse_args(["train.py"])  # torchrun reads os.environ when made
    a = _parse(environ)
    for dest, (text, value) in SHARED.items():
        assert str(getattr(torchrun, dest)) in (text, "True"), (dest, getattr(torchrun, dest))
        if dest != "node_rank":  # (etcd: the rendezvous places the node; taken with c10d above)
            assert getattr(a, dest) == value, (dest, getattr(a, dest), value)


@pytest.mark.timeout(30)
def test_resilient_runs_own_flags_follow_the_same_rule() -> None:
    a = _parse({"PET_SPARES": "1", "PET_MAX_SPARE_STARTS": "4", "PET_IN_PROCESS": "1", "PET_METRICS_PORT": "0",
                "PET_HEALTH_CHECK": "builtin:accelerator", "PET_HEALTH_CHECK_PERIOD": "30",
                "PET_IGNORE_WORKER_ERRORS": "0"})
    assert (a.spares, a.max_spare_starts, a.in_process, a.metrics_port, a.health_check, a.health_check_period,
            a.ignore_worker_errors) == (1, 4, True, 0, "builtin:accelerator", 30.0, False)


@pytest.mark.timeout(30)
def test_pet_wins_over_slurms_step_flag_by_flag() -> None:
    """A task of an srun step in a pod with PET_*: the layout and store from PET_*, the run id
    (which PET_* does not give) from Slurm."""
    step = {"SLURM_JOB_ID": "4711", "SLURM_STEP_ID": "0", "SLURM_NNODES": "2", "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NUM_TASKS": "2", "SLURM_NODEID": "0", "SLURM_STEP_NODELIST": "gpu[01-02]"}
    environ = step | {k: v for k, v in TRAINJOB_POD.items() if k != "PET_NPROC_PER_NODE"}
    a = _parse(environ)
    slurm_defaults(a, environ)  # no scontrol asked: PET_MASTER_ADDR names the store's host
    assert (a.nnodes, a.node_rank, a.master_addr, a.rdzv_endpoint, a.rdzv_id) == (
        (3, 3), 2, "llama-node-0-0.llama", "", "4711")


# -- the example: examples/kubernetes/ ------------------------------------------------------------
#
# Not applied to a cluster: `kubectl apply --dry-run=client` still asks an API server for the kinds
# (and TrainJob's needs Kubeflow's CRDs installed). So the manifests are parsed and checked against
# the fields and rules of Kubeflow Trainer's API at the commit above (pkg/apis/trainer/v1alpha1/
# trainjob_types.go and trainingruntime_types.go; manifests/base/crds/), of JobSet's
# (kubernetes-sigs/jobset at 08dfbdfd682714a9ab929633eca8dc95315187e7: the pod labels
# jobset.sigs.k8s.io/jobset-name and restart-attempt, pkg/constants and
# pkg/controllers/jobset_controller.go) and of Kubernetes' Job, and the container's command goes
# through resilient-run's own parser in the environment Kubeflow Trainer would give it.

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "kubernetes")
TRAINJOB_SPEC = {"runtimeRef", "initializer", "trainer", "runtimePatches", "suspend", "activeDeadlineSeconds",
                 "managedBy"}
TRAINER = {"image", "command", "args", "env", "numNodes", "resourcesPerNode", "numProcPerNode"}
RUNTIME_SPEC = {"mlPolicy", "podGroupPolicy", "template"}
RESERVED = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}
RFC1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _manifests(name: str) -> dict[str, dict[str, Any]]:
    import yaml

    with open(os.path.join(EXAMPLE, name)) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    return {d["kind"]: d for d in docs}


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) in a command, an argument or an env value: from the container's env."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


@pytest.mark.timeout(30)
def test_the_example_trainjob_and_its_runtime_have_the_fields_kubeflow_trainer_takes() -> None:
    m = _manifests("trainjob.yaml")
    job, runtime = m["TrainJob"], m["TrainingRuntime"]
    for d in (job, runtime):
        assert d["apiVersion"] == "trainer.kubeflow.org/v1alpha1"
        assert RFC1035.match(d["metadata"]["name"]) and len(d["metadata"]["name"]) <= 63
    spec, trainer = job["spec"], job["spec"]["trainer"]
    assert set(spec) <= TRAINJOB_SPEC and set(trainer) <= TRAINER, (set(spec), set(trainer))
    assert spec["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime",
                                  "name": runtime["metadata"]["name"]}
    assert trainer["numNodes"] >= 0 and trainer["numProcPerNode"] >= 1
    assert not RESERVED & {e["name"] for e in trainer.get("env", [])}, "Kubeflow refuses a TrainJob that sets them"
    assert set(runtime["spec"]) <= RUNTIME_SPEC and "torch" in runtime["spec"]["mlPolicy"]
    js = runtime["spec"]["template"]["spec"]
    assert set(js["failurePolicy"]) <= {"maxRestarts", "restartStrategy", "rules"}
    (node,) = [r for r in js["replicatedJobs"] if r["name"] == "node"]  # PET_MASTER_ADDR names it
    assert node["template"]["metadata"]["labels"]["trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    pod = node["template"]["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["node"]  # the container the PET_* go to
    assert pod["restartPolicy"] == "Never", "a Job's podFailurePolicy needs restartPolicy Never"
    assert not RESERVED & {e["name"] for e in pod["containers"][0]["env"]}


@pytest.mark.timeout(30)
def test_the_example_command_parses_as_resilient_run_in_the_pods_environment(launch: Any) -> None:
    """The runtime's container env ($(VAR) expanded as Kubernetes does, the downward API's and
    the Secret's values stood in for) and the PET_* Kubeflow would add, then `cli.main` with the
    TrainJob's command: etcd's members from etcd.yaml, hot spares that fit the pod's GPUs, every
    pod a job node and places left for the pods the Job recreates."""
    m, etcd = _manifests("trainjob.yaml"), _manifests("etcd.yaml")
    job, runtime = m["TrainJob"], m["TrainingRuntime"]
    name, trainer = job["metadata"]["name"], job["spec"]["trainer"]
    node = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    downward = {"metadata.labels['jobset.sigs.k8s.io/jobset-name']": name,  # the JobSet is named after the TrainJob
                "metadata.labels['jobset.sigs.k8s.io/restart-attempt']": "0"}
    environ: dict[str, str] = {}
    for e in node["template"]["spec"]["containers"][0]["env"]:
        source = e.get("valueFrom", {})
        environ[e["name"]] = (downward[source["fieldRef"]["fieldPath"]] if "fieldRef" in source
                              else "secret" if "secretKeyRef" in source else _expand(e["value"], environ))
    environ |= {"PET_NNODES": str(trainer["numNodes"]), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
                "PET_NODE_RANK": "1", "PET_MASTER_ADDR": f"{name}-node-0-0.{name}", "PET_MASTER_PORT": "29500"}
    argv = [_expand(x, environ) for x in trainer["command"][1:] + trainer["args"]]
    assert trainer["command"][0] == "resilient-run" and argv[-1] == "train.py"
    made = launch(environ, *argv[:-1])
    assert (made["rdzv_backend"], made["run_id"], made["node_rank"]) == ("etcd", f"{name}-0", None)
    svc, sts = etcd["Service"], etcd["StatefulSet"]
    client = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "client")
    members = [f"{sts['metadata']['name']}-{i}.{svc['metadata']['name']}" for i in range(sts["spec"]["replicas"])]
    assert made["endpoint"] == ",".join(f"{h}:{client}" for h in members)
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"] and svc["spec"]["clusterIP"] == "None"
    cluster = next(a for a in sts["spec"]["template"]["spec"]["containers"][0]["command"] if "initial-cluster=" in a)
    assert cluster.split("=", 1)[1] == ",".join(f"{h.split('.')[0]}=http://{h}:2380" for h in members)
    assert made["nproc"] + made["spares"] <= int(trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"])
    assert made["nnodes"] == trainer["numNodes"] and made["max_nodes"] - made["nnodes"] >= node["backoffLimit"]
