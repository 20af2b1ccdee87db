"""``resilient-run``'s defaults from torchrun's ``PET_*`` variables (Kubeflow Trainer sets them).

torchrun takes the default of each of its flags from ``PET_<DEST>``, DEST being the flag's
argparse name in capitals (``--nproc-per-node`` -> ``PET_NPROC_PER_NODE``): a valued flag takes
the text, a switch (``--standalone``) a whole number, 0 for off (torch's
``distributed/argparse_util.py``, ``env`` and ``check_env``). resilient-run follows the same rule
for every flag it has, torchrun's and its own (``PET_SPARES``, ``PET_IN_PROCESS``, ...), so a
command written for torchrun's environment runs unchanged:

- an explicit flag always wins; an empty variable says nothing;
- a value the flag would refuse is an error that names the variable (``PET_NNODES='abc': ...``);
- ``PET_NPROC_PER_NODE`` (and ``--nproc-per-node``) take torchrun's words too: ``gpu`` (the
  CUDA devices), ``cpu`` (the CPUs), ``auto`` (the CUDA devices, else the Ascend NPUs, else the
  CPUs). Kubeflow Trainer sends ``auto`` for a node with GPUs and no ``numProcPerNode``;
- ``PET_NODE_RANK`` is ``--node-rank``'s default with the c10d store (node 0 hosts it at
  ``PET_MASTER_ADDR:PET_MASTER_PORT``, as in torchrun's static rendezvous), not with
  ``--rdzv-backend etcd``: there the rendezvous places the node, as torchrun's own dynamic
  backends ignore the node rank, so that a pod Kubernetes recreates under its old index
  takes a free capacity place instead of ranks the job already decided on
  (docs/elastic.md, "Spare capacity": a node rank joins once);
- ``JOB_COMPLETION_INDEX`` (every pod of a Kubernetes Indexed Job has it) is not read: Kubeflow
  Trainer passes the same index as ``PET_NODE_RANK``, and elsewhere it is the pod's index in its
  own Job, which is no node rank when a JobSet runs several Jobs.

Flags > ``PET_*`` > Slurm's step (node/slurm.py), flag by flag: a ``PET_*`` variable was set for
torchrun's flags on purpose (by Kubeflow, or by the job's script), while Slurm's layout is only
where the task happens to run; torchrun under srun reads ``PET_*`` and ignores Slurm.

Kubeflow Trainer's torch plugin sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``,
``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` (docs/clusters.md, "Kubernetes"). torchrun flags that
resilient-run does not have (``PET_ROLE``, ``PET_START_METHOD``, ...) are not read.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

log = logging.getLogger("resilient_comm.launcher")

PREFIX = "PET_"
_NPROC_WORDS = ("auto", "gpu", "cpu")


class TorchrunEnvError(ValueError):
    """A ``PET_*`` variable holds a value its flag refuses (the message names both)."""


def env_name(action: argparse.Action) -> str:
    """The variable that holds a flag's default: torchrun's ``PET_<DEST>``."""
    return PREFIX + action.dest.upper()


def _cuda_devices() -> int:
    import torch

    return torch.cuda.device_count()


def _npu_devices() -> int:
    try:
        import torch
        import torch_npu  # noqa: F401 - registers torch.npu
    except ImportError:
        return 0
    return int(torch.npu.device_count())  # type: ignore[attr-defined]


def nproc_per_node(text: str) -> int:
    """``--nproc-per-node``'s value: a whole number, or torchrun's ``gpu``, ``cpu``, ``auto``."""
    word = text.strip().lower()
    if word not in _NPROC_WORDS:
        try:
            return int(word)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a whole number of workers, nor one of {', '.join(_NPROC_WORDS)}"
            ) from None
    if word != "cpu":
        devices = _cuda_devices() or (_npu_devices() if word == "auto" else 0)
        if devices:
            return devices
        if word == "gpu":
            raise argparse.ArgumentTypeError(f"{text!r}: this node has no CUDA device")
    return os.cpu_count() or 1


def _switch(text: str) -> bool:
    try:
        return bool(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number (torchrun's rule for a switch: 0 off, any other number on)"
        ) from None


def _value(action: argparse.Action, text: str) -> object:
    """`text` as the flag would take it on the command line."""
    if action.nargs == 0:  # a switch (store_true)
        return _switch(text)
    if action.type in (int, float):
        try:
            value: object = action.type(text)
        except ValueError:
            kind = "a whole number" if action.type is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind}") from None
    else:
        value = action.type(text) if callable(action.type) else text
    if action.choices is not None and value not in action.choices:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(map(str, action.choices))}")
    return value


@dataclass
class Taken:
    """The flags' defaults taken from ``PET_*``: dest -> (flag, the variable's text, value)."""

    flags: dict[str, tuple[str, str, object]] = field(default_factory=dict)
    skipped: str | None = None  # why PET_NODE_RANK was not taken

    def describe(self) -> str:
        """The defaults taken, as the flags that would give them (for the launcher's log)."""
        out = []
        for flag, text, value in self.flags.values():
            if isinstance(value, bool):
                out += [flag] if value else []
            elif isinstance(value, int) and text != str(value):  # torchrun's words: auto, gpu, cpu
                out.append(f"{flag} {value} ({text})")
            else:
                out.append(f"{flag} {text}")
        return " ".join(out)


def defaults(p: argparse.ArgumentParser, env: Mapping[str, str]) -> Taken:
    """Each optional flag of `p` whose ``PET_<DEST>`` is set, parsed as the flag would parse it.
    Raises TorchrunEnvError naming the variable and the flag where a value is refused."""
    taken = Taken()
    for action in p._actions:
        if not action.option_strings or action.dest == "help" or action.default == argparse.SUPPRESS:
            continue
        name = env_name(action)
        text = env.get(name, "").strip()
        if not text:
            continue
        flag = next((s for s in action.option_strings if s.startswith("--")), action.option_strings[0])
        try:
            value = _value(action, text)
        except (argparse.ArgumentTypeError, ValueError, TypeError) as e:
            raise TorchrunEnvError(f"{name}={text!r}: {e} (the default of {flag})") from None
        taken.flags[action.dest] = (flag, text, value)
    return taken


def apply_defaults(p: argparse.ArgumentParser, env: Mapping[str, str]) -> Taken:
    """Make ``PET_*`` the defaults of `p`'s flags (before parsing: a flag given wins), but for
    ``--node-rank``, which `finish` sets after parsing, once the backend is known."""
    taken = defaults(p, env)
    p.set_defaults(**{dest: value for dest, (_, _, value) in taken.flags.items() if dest != "node_rank"})
    return taken


def finish(a: argparse.Namespace, taken: Taken) -> None:
    """After parsing: ``--node-rank`` from ``PET_NODE_RANK`` where it was not given, with the
    c10d store only (module docstring); then log what was taken from ``PET_*`` (a flag given
    in place of a variable is not)."""
    pet = taken.flags.pop("node_rank", None)
    if pet is not None and a.node_rank is None:
        if a.rdzv_backend == "etcd":
            taken.skipped = (
                f"PET_NODE_RANK={pet[1]} not taken: with --rdzv-backend etcd the rendezvous places this "
                "node (a pod recreated under its index takes a free capacity place, not ranks the job "
                "decided on)"
            )
        else:
            a.node_rank = pet[2]
            taken.flags["node_rank"] = pet
    taken.flags = {dest: t for dest, t in taken.flags.items() if getattr(a, dest) == t[2]}
    if taken.flags:
        log.info("torchrun's environment (PET_*): %s", taken.describe())
    if taken.skipped:
        log.info("%s", taken.skipped)


__all__ = [
    "PREFIX",
    "Taken",
    "TorchrunEnvError",
    "apply_defaults",
    "defaults",
    "env_name",
    "finish",
    "nproc_per_node",
]
