"""``resilient-run`` under ``srun``: the launcher's defaults from the Slurm step it is a task of.

    srun --nodes 3 --ntasks-per-node 1 --no-kill --kill-on-bad-exit=0 \\
        resilient-run --nproc-per-node 8 --rdzv-backend etcd --rdzv-endpoint $ETCD train.py

One launcher per node: srun starts each task with the step's layout in its environment
(srun(1), "OUTPUT ENVIRONMENT VARIABLES"), and a flag not given takes its value from there:

- ``--nnodes``: the step's node count (``SLURM_STEP_NUM_NODES``, else ``SLURM_NNODES``);
- ``--node-rank``: this node's place in the step (``SLURM_NODEID``), so that ranks follow
  Slurm's node order and a job's ranks are where ``squeue`` says;
- ``--rdzv-id``: the job id (``SLURM_JOB_ID``): every node agrees on it without being told,
  and a requeued job keeps it (a second training step in the same allocation should pass its
  own ``--rdzv-id``: the run's keys in the store are named by it);
- ``--rdzv-endpoint`` with the c10d backend: the step's first host (``scontrol show
  hostnames`` of ``SLURM_STEP_NODELIST``, Slurm's own expansion of its compressed lists) on
  torchrun's port, 29400; that host is node 0, which hosts the store. The etcd backend has no
  default: its endpoint lists etcd's members, which Slurm does not know;
- ``--nproc-per-node``: the GPUs Slurm bound to this task (``SLURM_STEP_GPUS``, else
  ``SLURM_JOB_GPUS``), else 1. Slurm also sets ``CUDA_VISIBLE_DEVICES`` to them; the workers
  inherit it, and LOCAL_RANK i (a spare's too) picks the i-th visible device.

Ranks follow ``SLURM_NODEID``, so the step must run one task per node: a step with more
tasks than nodes is refused when a default would come from it. Nothing here changes what an
explicit flag says. Pure functions of an environment mapping, but for `apply_defaults`
(which fills the parsed flags and logs what it took); only `expand_hostnames` runs a program
(scontrol), and only when the c10d endpoint is needed and the node list has a range.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

C10D_PORT = 29400  # torchrun's default rendezvous port

log = logging.getLogger("resilient_comm.launcher")


class SlurmError(RuntimeError):
    """Slurm's environment cannot give a default the launcher needs (says which and why)."""


@dataclass(frozen=True)
class SlurmStep:
    """What one task of an srun step learns from its environment."""

    job_id: str
    step_id: str
    nnodes: int
    node_id: int
    ntasks: int
    nodelist: str  # Slurm's compressed form, e.g. "gpu[01-04,07]"
    gpus: tuple[str, ...]  # the devices Slurm bound to this task on this node (none: empty)

    def one_task_per_node(self) -> None:
        """Raise unless each node of the step runs one task (one launcher per node)."""
        if self.ntasks != self.nnodes:
            raise SlurmError(
                f"Slurm step {self.job_id}.{self.step_id} runs {self.ntasks} tasks on {self.nnodes} "
                "node(s): resilient-run is one task per node (srun --ntasks-per-node=1), or give "
                "--nnodes and --node-rank yourself"
            )


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        text = env.get(name, "").strip()
        if text:
            try:
                return int(text)
            except ValueError:
                raise SlurmError(f"{name}={text!r} is not a whole number") from None
    return None


def step_from_env(env: Mapping[str, str]) -> SlurmStep | None:
    """The srun step this process is a task of, or None when it is not one (no Slurm, or a
    batch script's own shell, which has a job but no step layout to take a node's place from)."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    step_id = env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID")
    if not job_id or not step_id or "SLURM_NODEID" not in env:
        return None
    nnodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_NNODES")
    node_id = _int(env, "SLURM_NODEID")
    ntasks = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if nnodes is None or node_id is None:
        raise SlurmError(f"Slurm step {job_id}.{step_id} without SLURM_STEP_NUM_NODES/SLURM_NNODES")
    gpus = env.get("SLURM_STEP_GPUS") or env.get("SLURM_JOB_GPUS") or ""
    return SlurmStep(
        job_id=job_id,
        step_id=step_id,
        nnodes=nnodes,
        node_id=node_id,
        ntasks=nnodes if ntasks is None else ntasks,
        nodelist=env.get("SLURM_STEP_NODELIST")
        or env.get("SLURM_JOB_NODELIST")
        or env.get("SLURM_NODELIST", ""),
        gpus=tuple(g for g in gpus.split(",") if g.strip()),
    )


def expand_hostnames(nodelist: str, scontrol: str = "scontrol") -> list[str]:
    """Slurm's compressed node list as host names, by Slurm itself (``scontrol show
    hostnames``): its syntax has ranges, padding and nested brackets."""
    path = shutil.which(scontrol)
    if path is None:
        raise SlurmError(
            f"no {scontrol!r} on PATH to expand the node list {nodelist!r} into the rendezvous host: "
            "give --rdzv-endpoint host:port (or --master-addr) yourself"
        )
    out = subprocess.run([path, "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    hosts = out.stdout.split()
    if out.returncode != 0 or not hosts:
        raise SlurmError(
            f"'scontrol show hostnames {nodelist}' failed ({out.returncode}): "
            f"{out.stderr.strip() or 'no host names'}; give --rdzv-endpoint host:port yourself"
        )
    return hosts


def first_host(step: SlurmStep, hostnames: Callable[[str], list[str]] = expand_hostnames) -> str:
    """The step's node 0 (SLURM_NODEID 0 is the first host of the step's node list). A list
    without brackets is plain names ("node07", "a,b"): its first is read without scontrol,
    which needs the cluster's slurm.conf (a single-node step has no range to expand)."""
    if not step.nodelist:
        raise SlurmError(
            f"Slurm step {step.job_id}.{step.step_id} has no SLURM_STEP_NODELIST or SLURM_JOB_NODELIST: "
            "give --rdzv-endpoint host:port yourself"
        )
    if "[" not in step.nodelist:
        return step.nodelist.split(",")[0].strip()
    return hostnames(step.nodelist)[0]


@dataclass(frozen=True)
class Defaults:
    """The launcher's flags as the step gives them (None: the step has nothing to say)."""

    nnodes: tuple[int, int] | None
    node_rank: int | None
    run_id: str | None
    endpoint: str | None
    nproc_per_node: int | None

    def describe(self) -> str:
        """The defaults taken, as the flags that would give them (for the launcher's log)."""
        flags = []
        if self.nnodes is not None:
            flags.append(f"--nnodes {self.nnodes[0]}")
        if self.node_rank is not None:
            flags.append(f"--node-rank {self.node_rank}")
        if self.run_id is not None:
            flags.append(f"--rdzv-id {self.run_id}")
        if self.endpoint is not None:
            flags.append(f"--rdzv-endpoint {self.endpoint}")
        if self.nproc_per_node is not None:
            flags.append(f"--nproc-per-node {self.nproc_per_node}")
        return " ".join(flags)


def defaults(
    step: SlurmStep,
    *,
    nnodes: tuple[int, int] | None,
    node_rank: int | None,
    run_id: str | None,
    endpoint_needed: bool,
    nproc_per_node: int | None,
    port: int | None = None,
    hostnames: Callable[[str], list[str]] = expand_hostnames,
) -> Defaults:
    """The values the step gives to the flags that were not given (each argument: the flag's
    value, None where not given; `endpoint_needed`: c10d and no endpoint or master address;
    `port`: --master-port, the endpoint's port in place of torchrun's)."""
    if nnodes is None or node_rank is None:
        step.one_task_per_node()
    return Defaults(
        nnodes=(step.nnodes, step.nnodes) if nnodes is None else None,
        node_rank=step.node_id if node_rank is None else None,
        run_id=step.job_id if run_id is None else None,
        endpoint=f"{first_host(step, hostnames)}:{port or C10D_PORT}" if endpoint_needed else None,
        nproc_per_node=len(step.gpus) if nproc_per_node is None and step.gpus else None,
    )


def apply_defaults(a: argparse.Namespace, env: Mapping[str, str]) -> SlurmStep | None:
    """Fill ``resilient-run``'s flags that were not given (None) from the srun step this
    process is a task of, log what was taken, and return the step (None: not under srun, or
    ``--standalone``: nothing taken). Raises SlurmError when a needed default cannot be had."""
    step = None if a.standalone else step_from_env(env)
    if step is None:
        return None
    taken = defaults(
        step,
        nnodes=a.nnodes,
        node_rank=a.node_rank,
        run_id=a.rdzv_id,
        endpoint_needed=a.rdzv_backend != "etcd" and not a.rdzv_endpoint and not a.master_addr,
        nproc_per_node=a.nproc_per_node,
        port=a.master_port,
    )
    a.nnodes = a.nnodes or taken.nnodes
    a.node_rank = taken.node_rank if a.node_rank is None else a.node_rank
    a.rdzv_id = a.rdzv_id or taken.run_id
    a.rdzv_endpoint = a.rdzv_endpoint or taken.endpoint or ""
    a.nproc_per_node = taken.nproc_per_node if a.nproc_per_node is None else a.nproc_per_node
    log.info("Slurm step %s.%s: %s", step.job_id, step.step_id, taken.describe() or "every flag given")
    note = device_note(step, a.nproc_per_node or 1, a.spares or 0, env.get("CUDA_VISIBLE_DEVICES"))
    if note:
        log.warning("%s", note)
    return step


def device_note(step: SlurmStep, nproc: int, spares: int, visible: str | None) -> str | None:
    """A warning when this node's processes need more devices than Slurm bound to the task:
    LOCAL_RANK i picks the i-th visible device, so a process past the last has none."""
    if not step.gpus or nproc + spares <= len(step.gpus):
        return None
    return (
        f"Slurm bound {len(step.gpus)} GPU(s) to this task ({','.join(step.gpus)}; "
        f"CUDA_VISIBLE_DEVICES={visible}) but it starts {nproc} worker(s) and {spares} spare(s): "
        f"LOCAL_RANK {len(step.gpus)} and up have no device of their own"
    )


__all__ = [
    "C10D_PORT",
    "Defaults",
    "SlurmError",
    "SlurmStep",
    "apply_defaults",
    "defaults",
    "device_note",
    "expand_hostnames",
    "first_host",
    "step_from_env",
]
