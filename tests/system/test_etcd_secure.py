"""The membership on a secured etcd, as production clusters run it: a real one-member etcd with
TLS on its client URL, a client certificate required of every client (``--client-cert-auth``
and ``--trusted-ca-file``), and auth enabled: root, and one user per job whose role may read
and write its prefix only (`testing.secure_etcd`, certificates made by the openssl binary).

The store's operations, its watches and a lease work over it with a login; a password rotated
in etcd and in its file is picked up by one new login; a client with no certificate, a wrong
password, a role for another prefix and a certificate with a CN (which etcd's JSON gateway
cannot log in by) are each refused at once with an error naming the cause; and a job under
``resilient-run --rdzv-conf cacert=,cert=,key=,user=,password_file=`` recovers from a SIGKILL.
Skipped, with the reason, where etcd or openssl is missing."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient_comm.elastic.membership.etcd.security import (
    ENV_PASSWORD,
    ENV_PASSWORD_FILE,
    EtcdAccessError,
    EtcdSecurity,
    conf_env,
)
from resilient_comm.elastic.membership.etcd.store import EtcdStore
from resilient_comm.elastic.membership.etcd.watch import DeleteWatch, PrefixWatch
from resilient_comm.elastic.membership.protocol import Membership
from resilient_comm.elastic.model.policy import Mesh
from resilient_comm.elastic.model.records import Decision
from resilient_comm.elastic.node.connection import JobConnection, StoreError
from resilient_comm.testing.cluster import etcd_command, wait_etcd
from resilient_comm.testing.harness import same_state
from resilient_comm.testing.secure_etcd import Certs, enable_auth, make_certs, password_file, why_not
from resilient_comm.testing.toy import read_events

WHY = why_not()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"a secured etcd needs etcd and openssl: {WHY}")
LAUNCHER = [sys.executable, "-m", "resilient_comm.elastic"]
PASSWORDS = {"root": "root-3f1c", "job": "job-9a7e", "other": "other-52d0", "rotate": "rotate-e1b4",
             "e2e": "e2e-c0d8", "cnjob": "cnjob-77aa"}
PREFIXES = {"job": ["rc/job/"], "other": ["rc/other/"], "rotate": ["rc/rotate/"], "e2e": ["rc/e2e/"],
            "cnjob": ["rc/job/"]}


@dataclasses.dataclass
class Secured:
    endpoint: str  # https://127.0.0.1:PORT
    certs: Certs
    files: dict[str, str]  # user -> its password file
    log: str  # the member's output

    def security(self, user: str | None = "job", client: str | None = "job") -> EtcdSecurity:
        return self.certs.security(client, user, self.files[user] if user else None)

    def store(self, user: str | None = "job", client: str | None = "job", timeout_s: float = 10) -> EtcdStore:
        return EtcdStore(self.endpoint, datetime.timedelta(seconds=timeout_s), self.security(user, client))

    def conf(self, user: str) -> str:
        """resilient-run's --rdzv-conf for `user` (torchrun's TLS names, our login)."""
        cert, key = self.certs.client("job")
        return f"protocol=https,cacert={self.certs.ca},cert={cert},key={key},user={user},password_file={self.files[user]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """One member with TLS, client certificates and auth on; a user and role per job."""
    tmp = str(tmp_path_factory.mktemp("secure-etcd"))
    certs = make_certs(os.path.join(tmp, "certs"), clients=("job",), named=("cnjob",))
    client, peer = _free_port(), _free_port()
    log = os.path.join(tmp, "etcd.log")
    with open(log, "wb") as out:
        proc = subprocess.Popen(etcd_command(0, {0: ("127.0.0.1", client, peer)}, tmp, "rc-secure", tls=certs),
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        endpoint = f"https://127.0.0.1:{client}"
        wait_etcd(endpoint, 30, certs.security("job"))
        enable_auth(endpoint, certs, PASSWORDS["root"], {u: (PASSWORDS[u], PREFIXES[u]) for u in PREFIXES})
        files = {u: password_file(tmp, u, p) for u, p in PASSWORDS.items()}
        yield Secured(endpoint, certs, files, log)
    finally:
        proc.kill()
        proc.wait()


def _decision(epoch: int, members: list[int]) -> Decision:
    return Decision(epoch, members, Mesh(dp=len(members)).as_dict(), "init" if epoch == 0 else "shrink", 0)


def _refused(call: Any, match: str, within_s: float = 3.0) -> EtcdAccessError:
    """`call()` raises an EtcdAccessError whose text matches `match`, within `within_s`: a
    refusal, not an unreachable cluster's 10 s of retries."""
    t0 = time.monotonic()
    with pytest.raises(EtcdAccessError, match=match) as e:
        call()
    took = time.monotonic() - t0
    assert took < within_s, f"refused after {took:.1f} s: {e.value}"
    return e.value


@pytest.mark.timeout(60)
def test_the_stores_operations_watches_and_a_lease_work_over_tls_with_a_login(
        secured: Secured, caplog: pytest.LogCaptureFixture) -> None:
    """Every call the membership makes, over TLS, with the job user's token: reads, writes,
    compare-and-set, transactions, a bounded wait, the agents' watch streams (events, a
    lease's expiry) and a lease kept alive; nothing of the password reaches etcd or the logs."""
    caplog.set_level(logging.DEBUG)
    s = secured.store("job")
    s.check_access("rc/job/")
    m = Membership(s, "rc/job/ops", token="job-token")
    assert m.start(_decision(0, [0, 1])).members == [0, 1]
    s.set("rc/job/ops/k", "v")
    assert s.get("rc/job/ops/k") == b"v"
    assert s.compare_set("rc/job/ops/k", "v", "w") == b"w" and s.compare_set("rc/job/ops/k", "v", "x") == b"w"
    assert s.add("rc/job/ops/n", 2) == 2 and s.add("rc/job/ops/n", 3) == 5
    assert s.multi_get(["rc/job/ops/k", "rc/job/ops/n"]) == [b"w", b"5"] and s.check(["rc/job/ops/k"])
    assert [k for k, _ in s.items("rc/job/ops/e/")] == ["rc/job/ops/e/0/decision"]

    later = threading.Timer(0.3, lambda: secured.store("job").set("rc/job/ops/later", "1"))
    later.start()
    t0 = time.monotonic()
    s.wait(["rc/job/ops/later"], datetime.timedelta(seconds=10))  # a watch, from the read's revision
    assert time.monotonic() - t0 < 5
    later.join()
    with pytest.raises(dist.DistStoreError, match=r"timed out after 0\.5 s waiting for key 'rc/job/ops/never'"):
        s.wait(["rc/job/ops/never"], datetime.timedelta(seconds=0.5))

    events = PrefixWatch(s, "rc/job/ops/events/")
    gone = threading.Event()
    lease = s.grant(2)
    s.put_with_lease("rc/job/ops/node/1", "alive", lease)
    deleted = DeleteWatch(s, "rc/job/ops/node/1", gone.set)
    try:
        assert deleted.created.wait(10), "the delete watch's stream never opened"
        assert m.post_event({"kind": "finished"}) == 0
        assert events.wait_for("rc/job/ops/events/0", 10)
        assert m.event(0, events.value("rc/job/ops/events/0")) == {"kind": "finished"}
        assert s.keepalive(lease) > 0, "a live lease is kept alive"
        assert gone.wait(10), "the lease's expiry (its key deleted) was never streamed"
        assert s.value("rc/job/ops/node/1")[0] is None
        assert events.opened == 1 and deleted.opened == 1, "a stream was reopened"
    finally:
        events.close()
        deleted.close()

    password = PASSWORDS["job"]
    assert password not in repr(secured.security("job")) and password not in caplog.text
    root = secured.store("root")
    assert all(password.encode() not in v for _, v in root.items("rc/")), "the password is in etcd"
    with open(secured.log) as f:
        assert password not in f.read(), "the password is in etcd's log"


@pytest.mark.timeout(60)
def test_a_rotated_password_is_picked_up_by_one_new_login_and_a_wrong_one_is_refused_clearly(
        secured: Secured) -> None:
    """etcd invalidates a user's tokens when its password changes. With the new password in
    the file, the next request is refused for its token, logs in again once and goes on;
    with a password that no longer matches the file, that one login is refused, with the
    reason (not a retry loop)."""
    s = secured.store("rotate")
    s.set("rc/rotate/k", "1")
    first = s.token(0)
    root = secured.store("root")
    root.api("/auth/user/changepw", {"name": "rotate", "password": "rotated-1"}, "change rotate's password")
    password_file(os.path.dirname(secured.files["rotate"]), "rotate", "rotated-1")
    assert s.get("rc/rotate/k") == b"1"
    assert s.token(0) != first, "no new login"

    root.api("/auth/user/changepw", {"name": "rotate", "password": "rotated-2"}, "change it again")
    e = _refused(lambda: s.set("rc/rotate/k", "2"),
                 r"etcd refused the login of user 'rotate': etcdserver: authentication failed, invalid user ID or "
                 r"password \(wrong password, or no such user; the password came from the file .*rotate.password\)")
    assert "rotated" not in str(e)


@pytest.mark.timeout(60)
def test_a_client_without_a_certificate_or_trusting_another_ca_is_refused_at_once(secured: Secured, tmp_path: Any) -> None:
    _refused(lambda: secured.store("job", client=None).set("rc/job/k", "1"),
             r"etcd at 127.0.0.1:\d+ refused the connection: it requires a client certificate \(--client-cert-auth\) "
             r"and this client has none: set cert= and key=")
    elsewhere = make_certs(str(tmp_path / "other-ca"), clients=())
    sec = dataclasses.replace(secured.security("job"), cacert=elsewhere.ca)
    _refused(lambda: EtcdStore(secured.endpoint, datetime.timedelta(seconds=10), sec).get("rc/job/k"),
             r"is not trusted: its certificate did not verify \(unable to get local issuer certificate\): "
             r"it must chain to the CA given")


@pytest.mark.timeout(60)
def test_a_wrong_password_is_refused_at_once_and_never_shown(secured: Secured, tmp_path: Any) -> None:
    wrong = password_file(str(tmp_path), "job", "not-the-password")
    sec = dataclasses.replace(secured.security("job"), password_file=wrong)
    e = _refused(lambda: EtcdStore(secured.endpoint, datetime.timedelta(seconds=10), sec).get("rc/job/k"),
                 r"etcd refused the login of user 'job': etcdserver: authentication failed, invalid user ID or "
                 r"password \(wrong password, or no such user; the password came from the file .*job.password\)")
    assert "not-the-password" not in str(e)
    from_env = EtcdSecurity.from_env({"RESILIENT_COMM_ETCD_CACERT": secured.certs.ca,
                                      "RESILIENT_COMM_ETCD_CERT": secured.certs.client("job")[0],
                                      "RESILIENT_COMM_ETCD_KEY": secured.certs.client("job")[1],
                                      "RESILIENT_COMM_ETCD_USER": "job", ENV_PASSWORD: "also-wrong"}, scheme="https")
    e = _refused(lambda: EtcdStore(secured.endpoint, datetime.timedelta(seconds=10), from_env).get("rc/job/k"),
                 f"the password came from {ENV_PASSWORD}")
    assert "also-wrong" not in str(e) and "also-wrong" not in repr(from_env)


@pytest.mark.timeout(60)
def test_credentials_for_another_prefix_are_refused_with_the_prefix_named(secured: Secured) -> None:
    """User `other` may only use rc/other/: the access check and every call on the job's keys
    are refused at once, naming the role and the prefix a job needs."""
    s = secured.store("other")
    s.check_access("rc/other/")
    why = r"etcdserver: permission denied \(user 'other''s role does not grant readwrite on this key: a job's role needs readwrite on its prefix rc/<rdzv-id>/"
    _refused(lambda: s.check_access("rc/job/"), r"etcd refused read and write under 'rc/job/' .*" + why)
    _refused(lambda: s.set("rc/job/x", "1"), r"etcd refused set 'rc/job/x': " + why)
    _refused(lambda: s.wait(["rc/job/x"], datetime.timedelta(seconds=30)), r"etcd refused get 'rc/job/x': " + why)


@pytest.mark.timeout(60)
def test_a_certificate_with_a_cn_or_no_login_is_refused_with_the_reason(secured: Secured) -> None:
    """etcd user `cnjob` exists with the job's role, and the certificate's CN is `cnjob`: with
    --client-cert-auth that would be its login over gRPC, but etcd refuses every JSON-gateway
    request made with a certificate that has a CN (docs/security.md), so it must be refused,
    saying why -- with or without a password. A certificate with no CN and no user is told to
    log in."""
    cn = r"CommonName of client sending a request against gateway will be ignored .* has a Common Name"
    _refused(lambda: secured.store(None, client="cnjob").set("rc/job/k", "1"), r"etcd refused set 'rc/job/k': " + cn)
    _refused(lambda: secured.store("cnjob", client="cnjob").get("rc/job/k"), cn)
    _refused(lambda: secured.store(None).set("rc/job/k", "1"),
             r"etcdserver: user name is empty \(the cluster has auth enabled and this client has no user: set user= and "
             r"password_file=")


@pytest.mark.timeout(90)
def test_resilient_run_refuses_a_node_whose_role_does_not_cover_the_job_and_never_takes_a_password_flag(
        secured: Secured, monkeypatch: pytest.MonkeyPatch) -> None:
    """At start-up, before it takes a place: exit status 1 and the cause; a password on the
    command line is a usage error. A node that is let in hands its workers the settings with
    the password file's path, never the password."""
    t0 = time.monotonic()
    out = subprocess.run([*LAUNCHER, "--nnodes", "2", "--rdzv-backend", "etcd", "--rdzv-endpoint", secured.endpoint,
                          "--rdzv-id", "job", "--rdzv-conf", secured.conf("other"), "train.py"],
                         capture_output=True, text=True, timeout=60, check=False)
    took = time.monotonic() - t0
    assert out.returncode == 1, out.stderr
    assert (f"resilient-run: the job's store at etcd://{secured.endpoint} refused this node (https, CA "
            f"{secured.certs.ca}, client certificate {secured.certs.client('job')[0]}, user other): etcd refused read "
            "and write under 'rc/job/'") in out.stderr, out.stderr
    assert "permission denied (user 'other''s role does not grant readwrite" in out.stderr, out.stderr
    assert took < 30, f"{took:.1f} s"

    out = subprocess.run([*LAUNCHER, "--rdzv-backend", "etcd", "--rdzv-endpoint", secured.endpoint,
                          "--rdzv-conf", "user=job,password=hunter2", "train.py"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "a command line is visible to every user of the host (ps)" in out.stderr, out.stderr

    for name, value in conf_env(dict(item.split("=", 1) for item in secured.conf("job").split(","))).items():
        monkeypatch.setenv(name, value)
    conn = JobConnection("etcd", secured.endpoint, 0, datetime.timedelta(seconds=10), 2, "job")
    env = conn.worker_env()
    assert env[ENV_PASSWORD_FILE] == secured.files["job"] and ENV_PASSWORD not in env
    assert PASSWORDS["job"] not in str(env)
    monkeypatch.setenv("RESILIENT_COMM_ETCD_USER", "other")
    monkeypatch.setenv(ENV_PASSWORD_FILE, secured.files["other"])
    with pytest.raises(StoreError, match=r"refused this node .* permission denied"):
        JobConnection("etcd", secured.endpoint, 0, datetime.timedelta(seconds=10), 2, "job")


@pytest.mark.timeout(240)
def test_a_job_on_the_secured_etcd_recovers_from_a_sigkill(secured: Secured, tmp_path: Any) -> None:
    """resilient-run with the TLS files and the login in --rdzv-conf (torchrun's names), the
    toy on 3 workers, rank 2 SIGKILLed at step 5: the node agent and the workers (which reach
    etcd with the settings they were handed) recover once, and the survivors finish with
    identical replicas."""
    steps, dump, events = 12, str(tmp_path / "dump"), str(tmp_path / "events")
    out = subprocess.run([*LAUNCHER, "--nproc-per-node", "3", "--rdzv-backend", "etcd",
                          "--rdzv-endpoint", secured.endpoint, "--rdzv-id", "e2e", "--rdzv-conf", secured.conf("e2e"),
                          "-m", "resilient_comm.testing.toy", "--steps", str(steps), "--kill", "2:5:start",
                          "--events", events, "--dump", dump],
                         capture_output=True, text=True, timeout=200, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "access to rc/e2e/ checked" in out.stderr, out.stderr[-4000:]
    finals = {r: torch.load(os.path.join(dump, f"final-{r}.pt"), weights_only=False) for r in (0, 1)}
    for r, d in finals.items():
        assert d["members"] == [0, 1] and d["committed"] == steps - 1, (r, d["members"], d["committed"])
        assert len(d["recoveries"]) == 1, d["recoveries"]
    assert same_state(finals[0]["state"], finals[1]["state"])
    assert [e["rank"] for e in read_events(events) if e["event"] == "kill"] == [2]
    kept = secured.store("e2e").items("rc/e2e/g0/e/")
    assert any(k.endswith("/decision") for k, _ in kept), "the job's decisions are not on the secured etcd"


@pytest.mark.timeout(60)
def test_an_agent_on_the_secured_etcd_is_fenced_when_its_lease_is_dropped(secured: Secured) -> None:
    """Fencing over TLS with a login: a node agent on the job's prefix holds its lease through
    the secured member; when the store drops the lease (revoked here, as an expiry after a long
    stall would), the agent is fenced within a keepalive period and its record goes."""
    from resilient_comm.elastic import DetectorConfig
    from resilient_comm.elastic.node.agent import NodeAgent

    cfg = DetectorConfig(heartbeat_s=0.02, silence_floor_s=0.3, straggler_floor_s=0.3, slow_factor=10.0)
    m = Membership(secured.store(), "rc/job/fence")
    a = NodeAgent(m, 0, 1, nproc=1, config=cfg, lease_s=3.0)
    a.add(0, 0)
    a.hello(0, cfg)
    store: Any = m.store

    def drive(until: Any, timeout_s: float) -> float:
        t0, seq = time.monotonic(), 0
        while not until():
            assert time.monotonic() - t0 < timeout_s, "the condition was not reached in time"
            seq += 1
            for p in list(a.procs.values()):
                a.on_beat(p, f"{seq} 4 compute 1.0 10.0 0.1", time.monotonic())  # a healthy worker's beat
            a.tick()
            time.sleep(a.next_tick_in())  # pacing the fake worker's beats
        return time.monotonic() - t0

    try:
        a.start()
        drive(lambda: m.node_record(0) is not None, 10)
        lease = store.kv_range(m.key("node", 0))["kvs"][0]["lease"]
        store._post("/lease/revoke", {"ID": lease}, "revoke the node's lease")
        took = drive(lambda: a.fenced is not None, 10)
        assert took < 1.5, f"fenced {took:.1f} s after the lease was dropped"
        assert "lease expired" in (a.fenced or ""), a.fenced
        assert m.node_record(0) is None
    finally:
        a.stop()
