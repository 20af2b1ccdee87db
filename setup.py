"""Builds resilient_comm._C with CMake against the torch installed in this environment.

Build with ``pip install --no-build-isolation -e .`` (or ``pip wheel --no-build-isolation .``):
torch is deliberately not a build requirement, so pip never fetches a multi-GB torch into an
isolated build environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        try:
            import torch  # noqa: F401
        except ImportError:
            sys.exit(
                "resilient_comm builds against an installed torch: run `pip install torch==2.13.0` first, "
                "then `pip install --no-build-isolation -e .`"
            )
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = ROOT / "build" / f"py{sys.version_info.major}{sys.version_info.minor}"
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = ["-DCMAKE_BUILD_TYPE=Release", f"-DPython3_EXECUTABLE={sys.executable}",
               f"-DRESILIENT_COMM_PY_OUTPUT_DIR={out_dir}"]
        gen = ["-G", "Ninja"] if _have("ninja") else []
        if not (build_dir / "CMakeCache.txt").exists():
            subprocess.check_call(["cmake", str(ROOT), *gen, *cfg], cwd=build_dir)
        else:
            subprocess.check_call(["cmake", str(ROOT), *cfg], cwd=build_dir)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.check_call(["cmake", "--build", ".", "--parallel", jobs], cwd=build_dir)


def _have(tool: str) -> bool:
    from shutil import which

    return which(tool) is not None


setup(
    ext_modules=[CMakeExtension("resilient_comm._C")],
    cmdclass={"build_ext": CMakeBuild},
)
