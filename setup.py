"""Builds resilient_comm._C with CMake against the torch installed in this environment.

Build with ``pip install --no-build-isolation -e .`` (or ``pip wheel --no-build-isolation .``):
torch is deliberately not a build requirement, so pip never fetches a multi-GB torch into an
isolated build environment.
"""

from __future__ import annotations

import os
import shutil
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
            import torch
        except ImportError:
            sys.exit(
                "resilient_comm builds against an installed torch: run `pip install torch==2.14.1` first, "
                "then `pip install --no-build-isolation -e .`"
            )
        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        # One build tree per Python and torch: a venv with another torch never reuses objects
        # compiled against the wrong headers.
        torch_version = torch.__version__.split("+")[0]
        build_dir = ROOT / "build" / f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch_version}"
        build_dir.mkdir(parents=True, exist_ok=True)
        cfg = ["-DCMAKE_BUILD_TYPE=Release", f"-DPython3_EXECUTABLE={sys.executable}",
               f"-DRESILIENT_COMM_PY_OUTPUT_DIR={out_dir}"]
        cmake = _tool("cmake")
        if cmake is None:
            sys.exit("resilient_comm needs CMake >= 3.18: `pip install cmake` or your system's package")
        ninja = _tool("ninja")
        gen = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
        if (build_dir / "CMakeCache.txt").exists():
            gen = []  # the generator is fixed at the first configure
        subprocess.check_call([cmake, str(ROOT), *gen, *cfg], cwd=build_dir)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))
        subprocess.check_call([cmake, "--build", ".", "--parallel", jobs], cwd=build_dir)


def _tool(name: str) -> str | None:
    """`name` from this interpreter's environment first (pip-installed cmake/ninja), then PATH."""
    here = os.path.dirname(sys.executable)
    return shutil.which(name, path=os.pathsep.join([here, os.environ.get("PATH", "")]))


def _requirements() -> list[str]:
    """numpy, and the torch this build is for: `torch==X.Y.*` of the torch installed now (the
    extension is built against its C++ ABI and fails to load in another minor version; a
    patch release keeps it). Without a torch (an sdist being made) torch is left unpinned:
    the wheel built from it pins it."""
    try:
        import torch
    except ImportError:
        return ["numpy", "torch"]
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return ["numpy", f"torch=={major}.{minor}.*"]


setup(
    install_requires=_requirements(),
    ext_modules=[CMakeExtension("resilient_comm._C")],
    cmdclass={"build_ext": CMakeBuild},
)
