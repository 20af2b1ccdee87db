"""The architecture's arrows hold (scripts/check_layers.py): C++ includes and Python imports go
only the allowed way, no Python import cycle, no import of another module's private name; and a
planted wrong-way use fails the check with a message naming both files."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "check_layers.py"


def _check(root: pathlib.Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECK), "--root", str(root), *flags],
                          capture_output=True, text=True, timeout=120, check=False)


def _copy(tmp_path: pathlib.Path) -> pathlib.Path:
    root = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(ROOT / "csrc", root / "csrc", ignore=ignore)
    shutil.copytree(ROOT / "resilient_comm", root / "resilient_comm", ignore=ignore)
    return root


def test_the_tree_keeps_the_arrows() -> None:
    out = _check(ROOT)
    assert out.returncode == 0, out.stderr


def test_a_wrong_way_include_is_named_with_both_files(tmp_path: pathlib.Path) -> None:
    root = _copy(tmp_path)
    (root / "csrc" / "transport" / "tcp" / "planted.cpp").write_text('#include "backend/resilient_backend.h"\n')
    out = _check(root, "--cpp")
    assert out.returncode == 1
    assert "csrc/transport/tcp/planted.cpp includes csrc/backend/resilient_backend.h: transport/tcp may not use " \
           "backend" in out.stderr, out.stderr


def test_the_backend_may_not_name_a_vendor_transport_or_the_emulator(tmp_path: pathlib.Path) -> None:
    """The backend finds device transports in comm's registry: including one is a wrong way."""
    root = _copy(tmp_path)
    (root / "csrc" / "backend" / "planted.cpp").write_text(
        '#include "transport/nccl/nccl_communicator.h"\n#include "emulation/nccl/nccl_emulator.h"\n')
    out = _check(root, "--cpp")
    assert out.returncode == 1
    assert "csrc/backend/planted.cpp includes csrc/transport/nccl/nccl_communicator.h: backend may not use " \
           "transport/nccl" in out.stderr, out.stderr
    assert "backend may not use emulation" in out.stderr, out.stderr


def test_a_wrong_way_import_a_cycle_and_a_private_name_are_each_named(tmp_path: pathlib.Path) -> None:
    root = _copy(tmp_path)
    elastic = root / "resilient_comm" / "elastic"
    worker = sorted(p.stem for p in (elastic / "worker").glob("*.py") if p.stem != "__init__")[0]
    (elastic / "node" / "planted.py").write_text(f"from resilient_comm.elastic.worker import {worker}\n")
    (elastic / "model" / "planted_a.py").write_text("from resilient_comm.elastic.model import planted_b\n")
    (elastic / "model" / "planted_b.py").write_text("from resilient_comm.elastic.model import planted_a\n")
    (elastic / "model" / "planted_c.py").write_text("from resilient_comm.elastic.model.planted_a import _hidden\n")
    out = _check(root, "--python")
    assert out.returncode == 1
    err = out.stderr
    assert (f"resilient_comm/elastic/node/planted.py:1 imports resilient_comm/elastic/worker/{worker}.py: "
            "resilient_comm.elastic.node may not use resilient_comm.elastic.worker") in err, err
    assert ("import cycle: resilient_comm.elastic.model.planted_a -> resilient_comm.elastic.model.planted_b -> "
            "resilient_comm.elastic.model.planted_a") in err, err
    assert "resilient_comm/elastic/model/planted_c.py:1 imports the private name(s) _hidden" in err, err


def test_test_modules_have_unique_basenames() -> None:
    """pytest imports test modules by basename (rootdir-relative, no packages): two files of
    one name in different folders stop the whole run at collection."""
    seen: dict[str, pathlib.Path] = {}
    for p in sorted((ROOT / "tests").rglob("test_*.py")):
        assert p.name not in seen, f"{p.relative_to(ROOT)} and {seen[p.name].relative_to(ROOT)} share a basename"
        seen[p.name] = p
