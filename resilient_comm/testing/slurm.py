"""A real Slurm on the nodes of a `NetnsCluster`: one ``slurmd`` per network namespace.

    with NetnsCluster(3, [0, 1, 2], tmp) as c, SlurmCluster(c, tmp) as s:
        srun = s.client(["srun", "-N", "3", "hostname"], stdout=subprocess.PIPE)
        c.kill_node(2)        # node 2's slurmd, its slurmstepd and the job's tasks there

Slurm node i is named after its namespace (``rc<tag>n<i>``) with ``NodeAddr`` its address.
``slurmctld`` runs in the root namespace on the bridge's address, so killing a node's
processes never takes the controller down, and the clients (``srun``, ``scontrol``,
``sinfo``) run there too, with ``SLURM_CONF`` naming this cluster's configuration. Every slurmd
shares the machine's file system, so each gets its own spool directory and pid file (``%n``);
each runs in a UTS namespace of its own whose host name is its node's name (Debian's build has
no ``--enable-multiple-slurmd``: a slurmd finds its node by its host name), and the job steps
it starts inherit that name, as on a real cluster. Authentication is munge, with a key and a
``munged`` of this cluster's own (no system daemon is touched). Processes are tracked by
``proctrack/linuxproc`` (no cgroups needed); there is no accounting database, so a job's end
is read from ``scontrol show job`` while slurmctld still holds it (``MinJobAge``).

Needs root, Debian's ``slurm-wlm`` and ``munge`` packages, and what `NetnsCluster` needs;
`available()` says why not.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from typing import IO, Any, Self

from resilient_comm.testing.cluster import NET, NetnsCluster
from resilient_comm.testing.cluster import available as netns_available

_PROGRAMS = (
    "munged",
    "mungekey",
    "slurmctld",
    "slurmd",
    "slurmstepd",
    "srun",
    "scontrol",
    "sinfo",
    "nsenter",
    "unshare",
)


def available() -> str | None:
    """None if a Slurm cluster can be started here, else why not."""
    if os.geteuid() != 0:
        return "needs root (slurmd runs as root in each node's namespace)"
    missing = [p for p in _PROGRAMS if shutil.which(p) is None]
    if missing:
        return f"no {', '.join(missing)} (Debian: apt install slurm-wlm munge)"
    return netns_available()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class SlurmCluster:
    """munged, slurmctld and one slurmd per node of `cluster` (started, its nodes all idle, by
    `start()`; everything killed and its state removed by `close()`). Owned by one thread."""

    def __init__(self, cluster: NetnsCluster, workdir: str, slurmd_timeout_s: int = 5) -> None:
        """`slurmd_timeout_s`: how long slurmctld waits on a silent slurmd before it sets its
        node DOWN (Slurm's SlurmdTimeout; a job step on a DOWN node ends as failed there)."""
        self.c = cluster
        self.dir = os.path.join(workdir, "slurm")
        self.conf = os.path.join(self.dir, "slurm.conf")
        self.munge_socket = os.path.join(self.dir, "munge", "munge.socket")
        self.slurmd_timeout_s = slurmd_timeout_s
        self.munged: subprocess.Popen | None = None
        self.slurmctld: subprocess.Popen | None = None
        self.slurmd: dict[int, subprocess.Popen] = {}
        self._logs: list[IO[bytes]] = []

    def node(self, i: int) -> str:
        """Slurm's name of node i (its namespace's)."""
        return self.c.ns(i)

    @property
    def controller(self) -> str:
        """The bridge's address (slurmctld's): every node reaches it, and no node's loss takes it."""
        return f"10.{NET}.{self.c.tag}.254"

    def env(self) -> dict[str, str]:
        """The environment of a Slurm client of this cluster (this process's, plus SLURM_CONF)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = self.conf
        return env

    def client(self, cmd: list[str], **popen: Any) -> subprocess.Popen:
        """Start a Slurm client command (srun, scontrol, ...) in the root namespace."""
        popen.setdefault("env", self.env())
        return subprocess.Popen(cmd, **popen)

    def query(self, *cmd: str, timeout_s: float = 30.0) -> str:
        """A client command's output (it must succeed)."""
        out = subprocess.run(list(cmd), env=self.env(), capture_output=True, text=True, timeout=timeout_s)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
        return out.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, NodeList, ...)."""
        fields: dict[str, str] = {}
        for word in self.query("scontrol", "show", "job", "--oneliner", job_id).split():
            key, sep, value = word.partition("=")
            if sep:
                fields[key] = value
        return fields

    # -- set-up and tear-down -------------------------------------------------------------

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _log(self, name: str) -> IO[bytes]:
        f = open(os.path.join(self.dir, name), "wb")  # noqa: SIM115
        self._logs.append(f)
        return f

    def start(self, timeout_s: float = 60.0) -> None:
        for sub in ("munge", "state", "spool"):
            os.makedirs(os.path.join(self.dir, sub), mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)
        key = os.path.join(self.dir, "munge", "munge.key")
        subprocess.run(["mungekey", "--create", "--keyfile", key], check=True, capture_output=True)
        self.munged = subprocess.Popen(
            [
                "munged",
                "--foreground",
                "--force",  # its socket is in a private temp dir, not one every user can search
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={os.path.join(self.dir, 'munge', 'munged.pid')}",
                f"--seed-file={os.path.join(self.dir, 'munge', 'munged.seed')}",
                f"--log-file={os.path.join(self.dir, 'munge', 'munged.log')}",
            ],
            stdout=self._log("munged.out"),
            stderr=subprocess.STDOUT,
        )
        self._write_conf()
        self.slurmctld = subprocess.Popen(
            ["slurmctld", "-D", "-i", "-f", self.conf],
            stdout=self._log("slurmctld.out"),
            stderr=subprocess.STDOUT,
            env=self.env(),
        )
        for i in range(self.c.nodes):
            self.start_slurmd(i)
        self.wait_idle(timeout_s)

    def start_slurmd(self, i: int) -> None:
        """Node i's slurmd, in the node's namespace with the node's host name."""
        name = self.node(i)
        os.makedirs(os.path.join(self.dir, "spool", name), mode=0o700, exist_ok=True)
        self.slurmd[i] = subprocess.Popen(
            [
                "nsenter",
                f"--net=/run/netns/{self.c.ns(i)}",
                "unshare",
                "--uts",
                "sh",
                "-c",
                f'hostname {name} && exec slurmd -D -f "$0"',
                self.conf,
            ],
            stdout=self._log(f"slurmd-{name}.out"),
            stderr=subprocess.STDOUT,
            env=self.env(),
        )

    def _write_conf(self) -> None:
        port = _free_port(self.controller)
        nodes = [self.node(i) for i in range(self.c.nodes)]
        lines = [
            f"ClusterName=rc{self.c.tag}",
            f"SlurmctldHost={socket.gethostname()}({self.controller})",
            f"SlurmctldPort={port}",
            "SlurmdPort=6818",  # one per namespace: every slurmd may use the same port
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            f"StateSaveLocation={os.path.join(self.dir, 'state')}",
            f"SlurmdSpoolDir={os.path.join(self.dir, 'spool', '%n')}",
            f"SlurmctldPidFile={os.path.join(self.dir, 'slurmctld.pid')}",
            f"SlurmdPidFile={os.path.join(self.dir, 'slurmd-%n.pid')}",
            f"SlurmctldLogFile={os.path.join(self.dir, 'slurmctld.log')}",
            f"SlurmdLogFile={os.path.join(self.dir, 'slurmd-%n.log')}",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SelectType=select/linear",  # whole nodes: one task per node, as resilient-run is
            "SchedulerType=sched/builtin",
            "SlurmdParameters=config_overrides",  # the nodes' CPUs are as written, not as probed
            "ReturnToService=2",
            f"SlurmdTimeout={self.slurmd_timeout_s}",
            "SlurmctldTimeout=30",
            "MessageTimeout=5",
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=300",  # a finished job stays in `scontrol show job` (there is no database)
            *(
                f"NodeName={n} NodeHostname={n} NodeAddr={self.c.addr(i)} CPUs=2 State=UNKNOWN"
                for i, n in enumerate(nodes)
            ),
            f"PartitionName=rc Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP",
        ]
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def wait_idle(self, timeout_s: float) -> None:
        """Until sinfo shows every node idle (each slurmd registered)."""
        deadline = time.monotonic() + timeout_s
        want = {self.node(i) for i in range(self.c.nodes)}
        states: dict[str, str] = {}
        while True:
            for name, p in [
                ("slurmctld", self.slurmctld),
                ("munged", self.munged),
                *((f"slurmd on {self.node(i)}", q) for i, q in self.slurmd.items()),
            ]:
                if p is not None and p.poll() is not None:
                    raise RuntimeError(f"{name} exited ({p.returncode}) while starting: {self.logs()}")
            try:
                out = self.query("sinfo", "--noheader", "--Node", "--format=%N %t", timeout_s=10)
                states = dict(line.split() for line in out.splitlines() if line.strip())
            except (RuntimeError, subprocess.TimeoutExpired):
                states = {}
            if want <= {n for n, s in states.items() if s == "idle"}:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the Slurm nodes were not idle within {timeout_s:g} s: {states}; {self.logs()}"
                )
            time.sleep(0.2)  # polling the controller while the slurmds register

    def logs(self, tail: int = 1500) -> str:
        """The ends of the daemons' logs (for a failure's message)."""
        out = []
        for name in sorted(os.listdir(self.dir)) if os.path.isdir(self.dir) else []:
            if name.endswith((".log", ".out")):
                with open(os.path.join(self.dir, name), errors="replace") as f:
                    text = f.read()[-tail:]
                if text.strip():
                    out.append(f"--- {name}:\n{text}")
        return "\n".join(out)

    def close(self) -> None:
        for p in [*self.slurmd.values(), self.slurmctld, self.munged]:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGKILL)
            if p is not None:
                p.wait()
        self.slurmd.clear()
        for f in self._logs:
            f.close()
        self._logs.clear()
        for sub in ("munge", "state", "spool"):  # the logs stay, for a failed test's reader
            shutil.rmtree(os.path.join(self.dir, sub), ignore_errors=True)


__all__ = ["SlurmCluster", "available"]
