"""The `resilient-comm` command: demo, bench {checkpoint,collectives,compare,control-plane,etcd-costs,integrity,nccl,overhead,primitives,reconfigure,recovery}, chaos, sim, doctor."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="resilient-comm", description="fault-tolerant torch.distributed backend")
    p.add_argument("command", choices=["demo", "bench", "chaos", "sim", "doctor"], help="what to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the command (try --help after it)")
    a = p.parse_args(argv[:1])
    rest = argv[1:]
    if a.command == "demo":
        from resilient_comm.tools.demo import main as run
    elif a.command == "doctor":
        from resilient_comm.tools.doctor import main as run
    elif a.command == "chaos":
        from resilient_comm.tools.chaos import main as run
    elif a.command == "sim":
        from resilient_comm.sim import main as run
    else:
        return _bench(rest)
    return run(rest)


def _bench(argv: list[str]) -> int:
    suites = {
        "checkpoint": "resilient_comm.tools.bench.checkpoint",
        "collectives": "resilient_comm.tools.bench.collectives",
        "compare": "resilient_comm.tools.bench.compare",
        "control-plane": "resilient_comm.tools.bench.control_plane",
        "etcd-costs": "resilient_comm.tools.bench.etcd_costs",
        "integrity": "resilient_comm.tools.bench.integrity",
        "nccl": "resilient_comm.tools.bench.nccl_path",
        "overhead": "resilient_comm.tools.bench.overhead",
        "primitives": "resilient_comm.tools.bench.primitives",
        "reconfigure": "resilient_comm.tools.bench.reconfigure",
        "recovery": "resilient_comm.tools.bench.recovery",
    }
    if not argv or argv[0] not in suites:
        print(f"usage: resilient-comm bench {{{','.join(suites)}}} [options]", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(suites[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
