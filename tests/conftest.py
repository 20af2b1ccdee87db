"""Tests import the installed (editable) package; see scripts/setup.sh. They are arranged by
part: unit (no worker processes), transport (the data path), backend (c10d integration,
faults, reconfigure, torch's own suite), elastic (the controller and resilient-run) and system
(namespaces, etcd, the wheel, the CLI; marked `system`)."""

import socket
import subprocess
from typing import Any

import pytest


@pytest.fixture
def data_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Parametrized indirectly ("shm" or "socket"): same-host payloads through the TCP
    transport's shared-memory rings (the default) or through the socket (RESILIENT_COMM_SHM=0).
    Workers inherit the variable."""
    monkeypatch.setenv("RESILIENT_COMM_SHM", "1" if request.param == "shm" else "0")
    return request.param


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def etcd_proc(tmp_path: Any) -> Any:
    """A one-member etcd on loopback (Debian's etcd-server): (endpoint, process)."""
    import shutil

    from resilient_comm.testing.cluster import etcd_command, wait_etcd

    if shutil.which("etcd") is None:
        pytest.skip("needs the etcd binary (Debian: apt install etcd-server)")
    client, peer = _free_port(), _free_port()
    proc = subprocess.Popen(etcd_command(0, {0: ("127.0.0.1", client, peer)}, str(tmp_path / "etcd"), "rc-agent-test"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_etcd(f"127.0.0.1:{client}", 30)
        yield f"127.0.0.1:{client}", proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def etcd(etcd_proc: tuple[str, Any]) -> str:
    """A one-member etcd on loopback; its endpoint."""
    return etcd_proc[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests under tests/system/ (nodes in network namespaces, a real etcd, the built wheel, the
    command line end to end) carry the `system` marker: `pytest -m "not system"` leaves them out."""
    for item in items:
        if "system" in item.path.relative_to(config.rootpath).parts[:2]:
            item.add_marker(pytest.mark.system)
