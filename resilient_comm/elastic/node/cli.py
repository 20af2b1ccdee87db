"""``resilient-run``'s command line: the flags (torchrun's, plus ours), their defaults from
torchrun's ``PET_*`` variables (`torchrun_env`) and from a Slurm step (`slurm`), the health
check before the node joins (`health`), and the `Launcher` they make (`launcher`)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

from resilient_comm.elastic.membership.etcd import security as etcd_security
from resilient_comm.elastic.node import rendezvous, slurm, torchrun_env
from resilient_comm.elastic.node.connection import StoreError
from resilient_comm.elastic.node.health import (
    DEFAULT_PERIOD_S,
    DEFAULT_TIMEOUT_S,
    ENV_HEALTH_CHECK,
    EXIT_UNHEALTHY,
    HealthCheck,
    from_flags,
)
from resilient_comm.elastic.node.launcher import Launcher
from resilient_comm.elastic.node.metrics import MetricsError
from resilient_comm.elastic.node.rendezvous import JOIN_TIMEOUT_S

log = logging.getLogger("resilient_comm.launcher")
T = TypeVar("T")


def _rdzv_conf(text: str) -> dict[str, float]:
    """``--rdzv-conf``'s settings (torchrun's spelling): join_timeout=S, and etcd's TLS and login
    (`etcd.security.CONF`), which go into this process's environment as their knobs (its
    workers inherit them); others are refused."""
    out: dict[str, float] = {}
    etcd: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if key in (*etcd_security.CONF, "password") and sep:
            etcd[key] = value
            continue
        if key != "join_timeout" or not sep:
            raise ValueError(
                f"--rdzv-conf {text!r}: known settings: join_timeout=SECONDS, "
                f"{'=, '.join(etcd_security.CONF)}= (got {item!r})"
            )
        try:
            out[key] = float(value)
        except ValueError:
            raise ValueError(f"--rdzv-conf {item!r}: {key} takes seconds") from None
        if out[key] <= 0:
            raise ValueError(f"--rdzv-conf {item!r}: {key} must be positive")
    os.environ.update(etcd_security.conf_env(etcd))
    return out


def _healthy_to_join(check: HealthCheck) -> bool:
    """Run the node's health check before it joins; False, the reason logged, when it failed."""
    ok, why = check.run()
    if ok:
        log.info("health check `%s` passed%s", check.name, f": {why}" if why else "")
        return True
    log.error(
        "%s. This node does not join the job and started nothing (exit status %d). The job goes on "
        "without it where it can: with --nnodes MIN:MAX it starts once MIN healthy nodes are there; a "
        "job of fixed size waits for a healthy node to take this one's place (with --node-rank: this rank)",
        why,
        EXIT_UNHEALTHY,
    )
    return False


def _parse_nnodes(text: str) -> tuple[int, int]:
    """``N`` or ``MIN:MAX`` -> (MIN, MAX)."""
    lo, sep, hi = text.partition(":")
    try:
        least, most = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or MIN:MAX (whole numbers of nodes)") from None
    if least < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a job needs at least 1 node (MIN >= 1)")
    if least > most:
        raise argparse.ArgumentTypeError(f"{text!r}: MIN {least} is more than MAX {most}")
    return least, most


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="resilient-run",
        allow_abbrev=False,
        description="A torchrun-compatible launcher: hosts the job's store, reports a "
        "worker's exit at once, never kills the survivors.",
    )
    # Every flag's default is PET_<DEST> where set (node/torchrun_env.py); under srun, a flag
    # left at None takes its value from the Slurm step (node/slurm.py).
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=torchrun_env.nproc_per_node,
        default=None,
        help="workers per node: N, or torchrun's gpu, cpu, auto (default 1; under srun: the GPUs Slurm "
        "bound to the task, if any)",
    )
    p.add_argument(
        "--nnodes",
        type=_parse_nnodes,
        default=None,
        metavar="N|MIN:MAX",
        help="nodes: N, or MIN:MAX (nodes MIN to MAX-1 join, at any time, as spare capacity; "
        "default 1; under srun: the step's nodes)",
    )
    p.add_argument(
        "--node-rank",
        "--node_rank",
        type=int,
        default=None,
        help="this node's rank (default: a place from the rendezvous, the same command on every node; "
        "node 0 on a single node)",
    )
    p.add_argument(
        "--rdzv-conf",
        "--rdzv_conf",
        default="",
        metavar="KEY=VALUE,...",
        help=f"rendezvous settings, as torchrun's: join_timeout=S (default {JOIN_TIMEOUT_S:g}): how long a "
        "node waits for the job's MIN nodes before it fails; etcd's protocol=https, cacert=, cert=, key=, "
        "user=, password_file= (docs/security.md)",
    )
    p.add_argument(
        "--rdzv-endpoint", "--rdzv_endpoint", default="", help="host:port of the store (node 0 hosts it)"
    )
    p.add_argument(
        "--rdzv-backend",
        "--rdzv_backend",
        default="c10d",
        choices=("c10d", "etcd", "static"),
        help="c10d (node 0 hosts a TCPStore; 'static' is the same) or etcd (the membership on an etcd "
        "cluster at --rdzv-endpoint h1:2379,h2:2379,...: no node's loss takes it down)",
    )
    p.add_argument(
        "--rdzv-id", "--rdzv_id", default=None, help="run id (default: random; under srun: the Slurm job id)"
    )
    p.add_argument("--master-addr", "--master_addr", default=None, help="store host when no --rdzv-endpoint")
    p.add_argument(
        "--master-port", "--master_port", type=int, default=None, help="store port when no --rdzv-endpoint"
    )
    p.add_argument("--standalone", action="store_true", help="single node on a free local port (the default)")
    p.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=0,
        help="whole-group restarts when no worker survives to recover (default 0)",
    )
    p.add_argument(
        "--monitor-interval",
        "--monitor_interval",
        type=float,
        default=None,
        help="accepted for torchrun compatibility; exits are seen at once (pidfd), not polled",
    )
    p.add_argument(
        "--spares",
        type=int,
        default=None,
        help="hot spares this node keeps waiting (default 0; on a capacity node --nproc-per-node)",
    )
    p.add_argument(
        "--max-spare-starts",
        "--max_spare_starts",
        type=int,
        default=None,
        metavar="N",
        help="spares started to refill the pool after failures, in all (default unlimited)",
    )
    p.add_argument(
        "--ignore-worker-errors",
        "--ignore_worker_errors",
        action="store_true",
        help="exit 0 when the job finished although a worker ended with an error of its own "
        "(by default that worker's status is the node's: a script's error stays visible)",
    )
    p.add_argument(
        "--log-dir", "--log_dir", default=None, help="write each worker's output to DIR/GEN/RANK.log"
    )
    (
        p.add_argument(
            "--metrics-port",
            type=int,
            default=None,
            metavar="N",
            help="serve this node's Prometheus metrics at http://0.0.0.0:N/metrics (0: any free port, "
            "logged; needs prometheus_client: resilient_comm[metrics])",
        ),
    )
    p.add_argument(
        "--health-check",
        default=None,
        metavar="CMD",
        help="a shell command that exits 0 on a healthy node, or builtin:accelerator (the GPUs/NPUs "
        "answer, NCCL/HCCL loads); run before the node joins (it does not join if it fails) and every "
        f"--health-check-period while it runs (it leaves as a lost node). Default: ${ENV_HEALTH_CHECK}",
    )
    p.add_argument(
        "--health-check-period",
        type=float,
        default=DEFAULT_PERIOD_S,
        metavar="S",
        help=f"seconds between health checks while the node runs (default {DEFAULT_PERIOD_S:g})",
    )
    p.add_argument(
        "--health-check-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"a health check that has not answered in S seconds is killed and fails (default {DEFAULT_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="restart the script in the same processes after a failure (elastic.restartable "
        "around its __main__)",
    )
    p.add_argument("-m", "--module", action="store_true", help="run the script as a module (python -m)")
    p.add_argument("--no-python", "--no_python", action="store_true", help="run the script as a program")
    p.add_argument("script", help="the training script (or module, or program)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return p


class _Signalled(BaseException):
    """SIGINT or SIGTERM before the launcher took them over, raised in the main thread by
    `_interrupt` (a BaseException: no ``except Exception`` on the way swallows it)."""

    def __init__(self, sig: int) -> None:
        super().__init__(sig)
        self.sig = sig


def _interrupt(sig: int, _frame: object) -> None:
    raise _Signalled(sig)


def _off_main_thread(fn: Callable[[], T]) -> T:
    """fn() on a thread of its own, the main thread waiting for it: Python runs a signal's
    handler only in the main thread, between bytecodes, and fn may block in C++ for long (a
    TCPStore client retries its connect for the whole store timeout). fn's exception is raised
    here; a `_Signalled` leaves fn's thread behind (the caller then leaves with os._exit)."""
    out: list[T] = []
    err: list[BaseException] = []

    def call() -> None:
        try:
            out.append(fn())
        except BaseException as e:  # raised again in the main thread
            err.append(e)

    t = threading.Thread(target=call, name="rc-launcher-setup", daemon=True)
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


def _endpoint(a: argparse.Namespace) -> str:
    if a.rdzv_endpoint:
        return str(a.rdzv_endpoint)
    if a.master_addr or a.master_port:
        return f"{a.master_addr or '127.0.0.1'}:{a.master_port or 0}"
    return "127.0.0.1:0"


def _worker_command(a: argparse.Namespace) -> list[str]:
    inproc = ["-m", "resilient_comm.elastic.worker.inprocess_main"] if a.in_process else []
    if a.no_python:
        return [a.script, *a.script_args]
    if a.module:
        return [sys.executable, "-u", *inproc, "-m", a.script, *a.script_args]
    return [sys.executable, "-u", *inproc, a.script, *a.script_args]


def main(argv: list[str] | None = None) -> int:
    # First thing: until the launcher takes them over, SIGINT and SIGTERM raise `_Signalled`, so
    # that this process ends with 128+N and says what it was doing, and a health check it runs
    # ends with it (the default action would leave the check running, orphaned).
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    doing, joining = "before it started", False
    launcher: Launcher | None = None
    try:
        p = parser()
        try:  # torchrun's rule: PET_<DEST> is each flag's default (Kubeflow Trainer sets five)
            pet = torchrun_env.apply_defaults(p, os.environ)
        except torchrun_env.TorchrunEnvError as e:
            print(f"resilient-run: {e}", file=sys.stderr)
            return 2
        a = p.parse_args(argv)
        logging.basicConfig(level=logging.INFO, format="[resilient-run] %(message)s", stream=sys.stderr)
        torchrun_env.finish(a, pet)
        try:  # a task of an srun step: the flags still not given come from Slurm's environment
            slurm.apply_defaults(a, os.environ)
        except slurm.SlurmError as e:
            print(f"resilient-run: {e}", file=sys.stderr)
            return 2
        a.nproc_per_node = 1 if a.nproc_per_node is None else a.nproc_per_node
        least, most = a.nnodes or (1, 1)
        endpoint = _endpoint(a)
        if most > 1 and endpoint.endswith(":0"):
            print(
                "resilient-run: more than one node (--nnodes N or MIN:MAX) needs --rdzv-endpoint host:port",
                file=sys.stderr,
            )
            return 2
        if a.rdzv_backend == "etcd" and not a.rdzv_endpoint:
            print(
                "resilient-run: --rdzv-backend etcd needs --rdzv-endpoint host:port[,host:port...]",
                file=sys.stderr,
            )
            return 2
        if a.in_process and a.no_python:
            print(
                "resilient-run: --in-process runs a Python script or module, not --no-python", file=sys.stderr
            )
            return 2
        try:
            health = from_flags(a.health_check, a.health_check_period, a.health_check_timeout)
            join_timeout_s = _rdzv_conf(a.rdzv_conf).get("join_timeout", JOIN_TIMEOUT_S)
        except ValueError as e:
            p.error(str(e))
        if health is not None:
            doing = f"during the health check `{health.name}` (its process group was killed)"
            if not _healthy_to_join(health):
                return EXIT_UNHEALTHY  # before the launcher: the node takes no place, starts nothing
        backend = "etcd" if a.rdzv_backend == "etcd" else "c10d"
        doing, joining = f"while joining the job (its store: {endpoint}, {backend})", True
        try:
            launcher = _off_main_thread(
                lambda: Launcher(
                    _worker_command(a),
                    a.nproc_per_node,
                    nnodes=least,
                    max_nodes=most,
                    node_rank=a.node_rank,
                    endpoint=endpoint,
                    max_restarts=a.max_restarts,
                    run_id=a.rdzv_id,
                    log_dir=a.log_dir,
                    spares=a.spares,
                    max_spare_starts=a.max_spare_starts,
                    rdzv_backend=backend,
                    metrics_port=a.metrics_port,
                    join_timeout_s=join_timeout_s,
                    health_check=health,
                    ignore_worker_errors=a.ignore_worker_errors,
                )
            )
        except ValueError as e:  # a bad layout (nodes, ranks, spares) or endpoint: a usage error
            p.error(str(e))
        except (rendezvous.RendezvousError, StoreError) as e:  # no place, or no store, for this node
            print(f"resilient-run: {e}", file=sys.stderr)
            return 1
        except MetricsError as e:  # --metrics-port: no prometheus_client, or the port is taken
            print(f"resilient-run: {e}", file=sys.stderr)
            return 2
        except (RuntimeError, OSError) as e:
            print(f"resilient-run: could not start this node's launcher: {e}", file=sys.stderr)
            return 1
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda s, _f: launcher.forward(s))
    except _Signalled as s:
        status = 128 + s.sig
        log.warning(
            "shut down by %s %s: this node started nothing (exit status %d)",
            signal.Signals(s.sig).name,
            doing,
            status,
        )
        if joining:  # the launcher's thread may be in a C++ call that nothing interrupts
            sys.stderr.flush()
            os._exit(status)
        return status
    finally:
        if launcher is None:  # ends before running anything: a caller in-process gets its handlers back
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    try:
        status = launcher.run()
    except rendezvous.RendezvousError as e:  # too few nodes arrived in time
        print(f"resilient-run: {e}", file=sys.stderr)
        status = 1
    if launcher.metrics is not None:
        launcher.metrics.close()
    log.info("all workers ended; exit status %d", status)
    return status


if __name__ == "__main__":
    sys.exit(main())
