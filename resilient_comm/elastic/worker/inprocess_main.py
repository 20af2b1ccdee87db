"""``python -m resilient_comm.elastic.worker.inprocess_main [-m module | script.py] [args...]``: what
``resilient-run --in-process`` runs in each worker -- the script as ``__main__`` inside
`restartable`, so that an unmodified script restarts in-process (its top level runs again on
every restart; the modules it imports stay imported). Runs as each such worker's
``__main__``."""

from __future__ import annotations

import os
import runpy
import sys

from resilient_comm.elastic.worker.inprocess import restartable


def main(argv: list[str]) -> None:
    """``python -m resilient_comm.elastic.worker.inprocess_main script.py args`` (``resilient-run --in-process``):
    the script as ``__main__`` inside `restartable`; ``-m module`` for a module."""
    if not argv:
        raise SystemExit(
            "usage: python -m resilient_comm.elastic.worker.inprocess_main [-m module | script.py] [args...]"
        )
    module = argv[0] == "-m"
    if module:
        argv = argv[1:]
    target = argv[0]
    if not module:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as ``python script.py`` does

    @restartable
    def script() -> None:
        sys.argv = list(argv)
        try:
            if module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
        except SystemExit as e:
            if e.code not in (None, 0):
                raise

    script()


if __name__ == "__main__":
    main(sys.argv[1:])
