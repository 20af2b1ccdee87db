"""``python -m resilient_comm.elastic.worker.inprocess_main [-m module | script.py] [args...]``: what
``resilient-run --in-process`` runs in each worker -- the script as ``__main__`` inside
`restartable`, so that an unmodified script restarts in-process (its top level runs again on
every restart; the modules it imports stay imported). A hot spare imports the modules the
script imports at its top level while it waits (`warm_imports`): placed, it runs the script
without the seconds a framework's import takes (Lightning: ~1.5 s here). Runs as each such
worker's ``__main__``."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import logging
import os
import runpy
import sys

from resilient_comm.elastic.model.env import ENV_SPARE
from resilient_comm.elastic.worker.inprocess import restartable

log = logging.getLogger("resilient_comm.elastic")


def top_level_imports(source: str) -> list[str]:
    """The absolute modules a script's top level imports (``import a.b``, ``from a.b import c``),
    in order, each once; those under ``if``/``try`` blocks too, not those inside functions."""
    found: list[str] = []
    body = list(ast.parse(source).body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            if isinstance(node, (ast.If, ast.Try)):
                body[:0] = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            continue
        found += [n for n in names if n not in found]
    return found


def warm_imports(target: str, module: bool) -> None:
    """Import what the script `target` (a module's name where `module`) imports at its top level,
    ahead of its run; a module that fails to import now is left for the script's own import
    to report (logged)."""
    try:
        path = importlib.util.find_spec(target).origin if module else target  # type: ignore[union-attr]
        with open(path or "", encoding="utf-8") as f:
            names = top_level_imports(f.read())
    except (OSError, SyntaxError, ValueError, ImportError, AttributeError) as e:
        log.info("spare: no imports to warm up from %s (%s)", target, e)
        return
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:  # the script's own import will raise it where it matters
            log.info("spare: importing %s ahead of the script failed (%s)", name, e)


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

    if os.environ.get(ENV_SPARE) == "1":
        warm_imports(target, module)

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
