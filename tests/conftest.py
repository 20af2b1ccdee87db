"""Tests import the installed (editable) package; see scripts/setup.sh."""

import pytest


@pytest.fixture
def data_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Parametrized indirectly ("shm" or "socket"): same-host payloads through the TCP
    transport's shared-memory rings (the default) or through the socket (RESILIENT_COMM_SHM=0).
    Workers inherit the variable."""
    monkeypatch.setenv("RESILIENT_COMM_SHM", "1" if request.param == "shm" else "0")
    return request.param
