"""The libhccl loader on a machine without CANN, through ``_C.probe_hccl``: a clear message when
libhccl is absent, and a bad RESILIENT_COMM_HCCL_LIB reported, never fatal (not at import, not
in the probe). Each case runs in a fresh interpreter: the loader keeps a success for the life of
the process, and the environment is read when it loads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from resilient_comm import _C

HINT = "(set RESILIENT_COMM_HCCL_LIB or install the CANN toolkit)"
REQUIRED = [
    "HcclGetRootInfo",
    "HcclCommInitRootInfoConfig",
    "HcclCommDestroy",
    "HcclGetCommAsyncError",
    "HcclAllReduce",
    "HcclBroadcast",
    "HcclAllGather",
    "HcclReduceScatter",
    "HcclSend",
    "HcclRecv",
    "HcclBarrier",
]


def _probe(env_lib: str | None) -> dict:
    code = "import json, resilient_comm\nfrom resilient_comm import _C\nprint(json.dumps(_C.probe_hccl()))\n"
    env = {"PATH": "/usr/bin:/bin"}
    if env_lib is not None:
        env["RESILIENT_COMM_HCCL_LIB"] = env_lib
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=50, env=env
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def no_cann() -> None:
    if _C.probe_hccl()["found"]:
        pytest.skip("libhccl is installed here: the absent-library messages cannot be seen")


@pytest.mark.timeout(60)
def test_absent_libhccl_gives_the_clear_message(no_cann: None) -> None:
    info = _probe(None)
    assert info["found"] is False
    assert info["error"].startswith("no libhccl found: libhccl.so: "), info["error"]
    assert info["error"].endswith(HINT), info["error"]


@pytest.mark.timeout(60)
def test_a_bogus_library_path_is_reported_not_fatal(tmp_path, no_cann: None) -> None:
    bogus = tmp_path / "libhccl.so"
    bogus.write_text("not a library")
    info = _probe(str(bogus))
    assert info["found"] is False
    error = info["error"]
    assert f"RESILIENT_COMM_HCCL_LIB={bogus}: " in error, error
    assert "; libhccl.so: " in error, "the default search path is still tried: " + error
    assert error.endswith(HINT), error


@pytest.mark.timeout(60)
def test_a_library_that_is_not_libhccl_is_named_with_what_it_lacks(no_cann: None) -> None:
    info = _probe("libm.so.6")
    assert info["found"] is False
    assert "libm.so.6: not a usable libhccl (missing HcclGetRootInfo, " in info["error"], info["error"]


@pytest.mark.timeout(120)
def test_a_library_with_the_hccl_symbols_loads_and_its_features_follow_them(tmp_path) -> None:
    """A stand-in libhccl built here: the loader's success path and the feature gates, on CPU."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a stand-in libhccl")
    exported = [*REQUIRED, "HcclCreateSubCommConfig", "HcclBatchSendRecv"]
    src = tmp_path / "stub.c"
    src.write_text("".join(f"int {name}(void) {{ return 0; }}\n" for name in exported))
    lib = tmp_path / "libhccl_stub.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, timeout=60)
    info = _probe(str(lib))
    assert info["found"], info.get("error")
    assert info["path"] == str(lib)
    assert {name for name, ok in info["symbols"].items() if ok} == set(exported)
    assert info["caps"] == {
        "sub_comm": True,
        "reduce": False,
        "all_to_all": False,
        "scatter": False,
        "batch_send_recv": True,
        "suspend": False,
        "resume": False,
    }
    missing_one = tmp_path / "missing.c"
    missing_one.write_text("".join(f"int {name}(void) {{ return 0; }}\n" for name in REQUIRED[1:]))
    lib2 = tmp_path / "libhccl_missing.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib2), str(missing_one)], check=True, timeout=60)
    info = _probe(str(lib2))
    assert not info["found"]
    assert f"{lib2}: not a usable libhccl (missing HcclGetRootInfo)" in info["error"], info["error"]
