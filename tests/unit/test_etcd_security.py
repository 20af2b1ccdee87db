"""etcd's TLS and login settings (`membership.etcd.security`) as resilient-run and the knobs
give them, checked before any connection: torchrun's --rdzv-conf names, a password never
taken from a command line nor handed to workers, contradictory settings refused with the
setting named. Against a real secured etcd: tests/system/test_etcd_secure.py."""

from __future__ import annotations

import datetime
import os
import pathlib

import pytest

from resilient_comm.elastic.membership.etcd.security import (
    CONF,
    ENV_CACERT,
    ENV_CERT,
    ENV_KEY,
    ENV_PASSWORD,
    ENV_PASSWORD_FILE,
    ENV_PROTOCOL,
    ENV_USER,
    EtcdSecurity,
    split_scheme,
)
from resilient_comm.elastic.membership.etcd.store import EtcdStore, parse_endpoints
from resilient_comm.elastic.node.cli import _rdzv_conf


@pytest.mark.timeout(10)
def test_rdzv_conf_takes_torchruns_tls_names_and_ours_for_the_login_as_the_knobs(
        monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    for name in set(CONF.values()):
        monkeypatch.setenv(name, "")  # (undone after the test: _rdzv_conf sets them)
    monkeypatch.chdir(tmp_path)
    conf = "join_timeout=5,protocol=https,cacert=ca.pem,ssl_cert=c.pem,key=c.key,user=job42,password_file=pw"
    assert _rdzv_conf(conf) == {"join_timeout": 5.0}
    assert {n: os.environ[n] for n in (ENV_PROTOCOL, ENV_CACERT, ENV_CERT, ENV_KEY, ENV_USER, ENV_PASSWORD_FILE)} == {
        ENV_PROTOCOL: "https", ENV_CACERT: str(tmp_path / "ca.pem"), ENV_CERT: str(tmp_path / "c.pem"),
        ENV_KEY: str(tmp_path / "c.key"), ENV_USER: "job42", ENV_PASSWORD_FILE: str(tmp_path / "pw")}
    with pytest.raises(ValueError, match=r"password=\.\.\.: a command line is visible to every user of the host"):
        _rdzv_conf("user=job42,password=hunter2")
    with pytest.raises(ValueError, match="known settings: join_timeout=SECONDS, protocol=, cacert=, cert=, key="):
        _rdzv_conf("cafile=ca.pem")
    with pytest.raises(ValueError, match="cacert=: empty"):
        _rdzv_conf("cacert=")


@pytest.mark.timeout(10)
def test_contradictory_or_incomplete_settings_are_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="needs both cert= and key="):
        EtcdSecurity.from_env({ENV_CERT: "c.pem"})
    with pytest.raises(ValueError, match="were given with protocol=http"):
        EtcdSecurity.from_env({ENV_PROTOCOL: "http", ENV_CACERT: "ca.pem"})
    with pytest.raises(ValueError, match="user 'job42' needs a password"):
        EtcdSecurity.from_env({ENV_USER: "job42"})
    with pytest.raises(ValueError, match="etcd password was given without a user"):
        EtcdSecurity.from_env({ENV_PASSWORD: "x"})
    with pytest.raises(ValueError, match="endpoints say https://, but RESILIENT_COMM_ETCD_PROTOCOL"):
        EtcdSecurity.from_env({ENV_PROTOCOL: "http"}, scheme="https")
    with pytest.raises(ValueError, match="every endpoint takes the same scheme"):
        split_scheme("https://h1:2379,http://h2:2379")
    with pytest.raises(ValueError, match="say https://, the settings http"):
        EtcdStore("https://h1:2379", datetime.timedelta(seconds=1), EtcdSecurity())
    with pytest.raises(ValueError, match="cannot be used"):
        _ = EtcdSecurity("https", "/nonexistent/ca.pem").ssl_context


@pytest.mark.timeout(10)
def test_tls_is_implied_by_the_scheme_or_a_file_and_workers_get_a_path_never_the_password() -> None:
    assert split_scheme("https://h1:2379, https://h2:2379") == ("https", "h1:2379,h2:2379")
    assert parse_endpoints("https://h1:2379,https://h2:2380") == [("h1", 2379), ("h2", 2380)]
    assert EtcdSecurity.from_env({}, scheme="https").tls and EtcdSecurity.from_env({ENV_CACERT: "ca.pem"}).tls
    assert not EtcdSecurity.from_env({}).tls
    from_env = EtcdSecurity.from_env({ENV_CACERT: "ca.pem", ENV_USER: "job42", ENV_PASSWORD: "s3cret"})
    assert "s3cret" not in repr(from_env) and "s3cret" not in str(from_env.worker_env())
    assert from_env.worker_env() == {ENV_PROTOCOL: "https", ENV_CACERT: os.path.abspath("ca.pem"), ENV_USER: "job42"}
    from_file = EtcdSecurity.from_env({ENV_PROTOCOL: "https", ENV_USER: "job42", ENV_PASSWORD_FILE: "pw"})
    assert from_file.worker_env()[ENV_PASSWORD_FILE] == os.path.abspath("pw")
