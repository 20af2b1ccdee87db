#!/usr/bin/env python3
"""Checks that code uses other code only along the architecture's arrows (docs/architecture.md).

The arrows are written once, below: for each part, the parts it may use. A C++ file's part is
the folder under csrc/ that holds it; a Python module's is the package prefix that names it
(the longest one that matches). The check reads `#include "..."` lines and Python `import`
statements (with ast, so nothing is imported), and fails on

- a use against the arrows (it names both files and the rule),
- an import cycle among Python modules (module-level imports only: an import inside a function
  runs late and cannot deadlock an import, but it is still checked against the arrows),
- a Python module importing another module's private (underscore) name.

    python scripts/check_layers.py            # both languages
    python scripts/check_layers.py --cpp      # C++ only (the CMake build runs this)
    python scripts/check_layers.py --root DIR # another checkout (tests plant a wrong-way import)

Exit status 0 when clean, 1 with one line per finding otherwise.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

# --- the arrows --------------------------------------------------------------------------------

# C++: a folder under csrc/ -> the folders its files may include (besides its own).
_BELOW_TRANSPORTS = {"common", "comm", "device", "watchdog"}
_TRANSPORTS = {"transport/tcp", "transport/nccl", "transport/hccl"}
CPP_ARROWS: dict[str, set[str]] = {
    "common": set(),
    "device": {"common"},
    "comm": {"common", "device"},
    "watchdog": {"common"},
    "transport/tcp": {"common", "comm"},
    "transport/nccl": _BELOW_TRANSPORTS,
    "transport/hccl": _BELOW_TRANSPORTS,
    # Test doubles of vendor libraries and devices; the NCCL emulator moves bytes over TCP.
    "emulation": _BELOW_TRANSPORTS | _TRANSPORTS,
    # The backend names no vendor library: it finds device transports in comm's registry; the
    # host transport (TCP) is its own.
    "backend": _BELOW_TRANSPORTS | {"transport/tcp"},
    "python": _BELOW_TRANSPORTS | _TRANSPORTS | {"emulation", "backend"},
}

# Python: a package prefix -> the prefixes its modules may import (besides their own part).
# "lib" is the library's top level: registration, api, groups, errors, config, the extension.
_LIB = {
    "resilient_comm",
    "resilient_comm._C",
    "resilient_comm.api",
    "resilient_comm.groups",
    "resilient_comm.errors",
    "resilient_comm.nccl_lib",
}
PY_ARROWS: dict[str, set[str]] = {
    "lib": {"resilient_comm.config", "resilient_comm.checkpoint"},
    "resilient_comm.config": {"lib"},  # the knobs, read from the extension's one table
    "resilient_comm.checkpoint": {"lib"},
    "resilient_comm.elastic.model": {"resilient_comm.config"},  # pure, but for reading the knobs
    "resilient_comm.elastic.membership": {"resilient_comm.elastic.model", "lib"},
    "resilient_comm.elastic.state": {"resilient_comm.elastic.model", "lib", "resilient_comm.checkpoint"},
    "resilient_comm.elastic.node": {
        "resilient_comm.elastic.model",
        "resilient_comm.elastic.membership",
        "lib",
    },
    "resilient_comm.elastic.worker": {
        "resilient_comm.elastic.model",
        "resilient_comm.elastic.membership",
        "resilient_comm.elastic.state",
        "lib",
        "resilient_comm.config",
        "resilient_comm.checkpoint",
    },
    # The package's surface re-exports the public API of every part.
    "resilient_comm.elastic": {
        "resilient_comm.elastic.model",
        "resilient_comm.elastic.membership",
        "resilient_comm.elastic.state",
        "resilient_comm.elastic.node",
        "resilient_comm.elastic.worker",
        "lib",
        "resilient_comm.checkpoint",
    },
    "resilient_comm.sim": {"resilient_comm.checkpoint"},
    # Tools, test programs and examples sit on top and may use anything.
    "resilient_comm.tools": {"*"},
    "resilient_comm.integrations": {"*"},  # on top: framework integrations use anything
    "resilient_comm.testing": {"*"},
    "resilient_comm.examples": {"*"},
}

# --- C++ ---------------------------------------------------------------------------------------

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def cpp_part(rel: str) -> str | None:
    """The part of a path relative to csrc/ (a file or an included header)."""
    best = None
    for part in CPP_ARROWS:
        if (rel == part or rel.startswith(part + "/")) and (best is None or len(part) > len(best)):
            best = part
    return best


def check_cpp(root: Path) -> list[str]:
    csrc = root / "csrc"
    findings = []
    for path in sorted(csrc.rglob("*")):
        if path.suffix not in {".h", ".hpp", ".cpp", ".cc"}:
            continue
        rel = path.relative_to(csrc).as_posix()
        part = cpp_part(rel)
        if part is None:
            findings.append(f"csrc/{rel}: in no part of scripts/check_layers.py's CPP_ARROWS")
            continue
        for inc in _INCLUDE.findall(path.read_text(errors="replace")):
            target = cpp_part(inc)
            if target is None:
                if (path.parent / inc).exists():  # a header beside it, by a relative name
                    continue
                findings.append(f'csrc/{rel} includes "{inc}", which is in no part')
            elif target != part and target not in CPP_ARROWS[part]:
                findings.append(
                    f"csrc/{rel} includes csrc/{inc}: {part} may not use {target} "
                    f"(it may use: {', '.join(sorted(CPP_ARROWS[part])) or 'nothing'})"
                )
    return findings


# --- Python ------------------------------------------------------------------------------------


def module_name(root: Path, path: Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def py_part(module: str) -> str | None:
    if module in _LIB:
        return "lib"
    best = None
    for part in PY_ARROWS:
        if part == "lib":
            continue
        if (module == part or module.startswith(part + ".")) and (best is None or len(part) > len(best)):
            best = part
    if best == "resilient_comm.elastic" and module != "resilient_comm.elastic":
        # A module directly in elastic/ (not in a subpackage) belongs to no part but the surface.
        return "resilient_comm.elastic" if module.endswith("__main__") else None
    return best


def _resolve(module: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(root: Path, path: Path, modules: set[str]) -> list[tuple[str, int, bool, list[str]]]:
    """(imported module, line, at module level, names taken from it) for each import of ours."""
    module = module_name(root, path)
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(n) for n in tree.body}
    for n in tree.body:  # `if TYPE_CHECKING:` / try-blocks at the top level still run at import
        if isinstance(n, (ast.If, ast.Try)):
            for sub in ast.walk(n):
                top.add(id(sub))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "resilient_comm":
                    out.append((alias.name, node.lineno, id(node) in top, []))
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, path.name == "__init__.py", node)
            if target.split(".")[0] != "resilient_comm":
                continue
            names = [a.name for a in node.names]
            # `from pkg import mod` imports a module: record it as such.
            # The extension (`from resilient_comm import _C`) is a module with no .py file.
            submodules = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
            plain = [n for n in names if f"{target}.{n}" not in modules and f"{target}.{n}" not in _LIB]
            extension = [
                f"{target}.{n}" for n in names if f"{target}.{n}" in _LIB and f"{target}.{n}" not in modules
            ]
            out += [(ext, node.lineno, False, []) for ext in extension]
            for sub in submodules:
                out.append((sub, node.lineno, id(node) in top, []))
            if plain or not (submodules or extension):
                out.append((target, node.lineno, id(node) in top, plain))
    return out


def check_python(root: Path) -> list[str]:
    pkg = root / "resilient_comm"
    files = sorted(p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts)
    modules = {module_name(root, p): p for p in files}
    findings = []
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        part = py_part(module)
        rel = path.relative_to(root).as_posix()
        if part is None:
            findings.append(f"{rel}: module {module} is in no part of scripts/check_layers.py's PY_ARROWS")
            continue
        for target, line, at_top, names in _imports(root, path, set(modules)):
            tpart = py_part(target)
            tpath = modules.get(target)
            trel = tpath.relative_to(root).as_posix() if tpath else target
            allowed = PY_ARROWS[part]
            if "lib" in allowed:  # what may use the library may read the knobs too
                allowed = allowed | {"resilient_comm.config"}
            if tpart is not None and tpart != part and "*" not in allowed and tpart not in allowed:
                findings.append(
                    f"{rel}:{line} imports {trel}: {part} may not use {tpart} "
                    f"(it may use: {', '.join(sorted(allowed)) or 'nothing'})"
                )
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private:
                findings.append(f"{rel}:{line} imports the private name(s) {', '.join(private)} of {trel}")
            if at_top and target in modules and target != module:
                graph[module].add(target)
    findings += [f"import cycle: {' -> '.join(c)}" for c in _cycles(graph)]
    return findings


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for comp in comps:  # a readable cycle through the component's first module
        members = set(comp)
        path = [comp[0]]
        seen = {comp[0]}
        while True:
            nxt = sorted(graph[path[-1]] & members)
            back = [n for n in nxt if n == comp[0]]
            if back and len(path) > 1:
                out.append([*path, comp[0]])
                break
            fresh = [n for n in nxt if n not in seen]
            if not fresh:
                out.append([*comp, comp[0]])
                break
            path.append(fresh[0])
            seen.add(fresh[0])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--cpp", action="store_true", help="check the C++ includes only")
    ap.add_argument("--python", action="store_true", help="check the Python imports only")
    args = ap.parse_args(argv)
    both = not (args.cpp or args.python)
    findings = []
    if args.cpp or both:
        findings += check_cpp(args.root)
    if args.python or both:
        findings += check_python(args.root)
    for f in findings:
        print(f, file=sys.stderr)
    if findings:
        print(
            f"check_layers: {len(findings)} finding(s); the arrows are in scripts/check_layers.py",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
