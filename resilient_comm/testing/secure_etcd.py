"""A secured etcd for the tests and ``resilient-comm bench etcd-costs --tls``: certificates
made with the ``openssl`` binary, the flags that make a member speak TLS and ask every client
for a certificate, and etcd's auth enabled through the JSON gateway (root, and a user per job
whose role may read and write the job's prefixes only: docs/security.md's recipe, made with
the API calls etcdctl makes).

    certs = make_certs(tmp, clients=("job",))
    etcd = subprocess.Popen(etcd_command(0, members, tmp, "t", tls=certs))
    wait_etcd(endpoint, 30, certs.security("job"))
    enable_auth(endpoint, certs, "root-pw", {"job": ("job-pw", ["rc/job/"])})
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import shutil
import subprocess

from resilient_comm.elastic.membership.etcd.security import EtcdSecurity
from resilient_comm.elastic.membership.etcd.store import EtcdStore, b64, prefix_end

_DAYS = "2"  # certificates for one test run


def why_not() -> str | None:
    """None if a secured etcd can be started here, else why not."""
    if shutil.which("etcd") is None:
        return "no etcd binary (Debian: apt install etcd-server)"
    if shutil.which("openssl") is None:
        return "no openssl binary to make the certificates (Debian: apt install openssl)"
    return None


@dataclasses.dataclass(frozen=True)
class Certs:
    """A CA, the members' certificate (`member`, `member_key`) and client certificates, as
    PEM files in `directory`."""

    directory: str
    ca: str
    member: str
    member_key: str

    def client(self, name: str) -> tuple[str, str]:
        """Client `name`'s certificate and key."""
        return os.path.join(self.directory, f"{name}.pem"), os.path.join(self.directory, f"{name}.key")

    def security(
        self, client: str | None = "job", user: str | None = None, password_file: str | None = None
    ) -> EtcdSecurity:
        """TLS with this CA and client `client`'s certificate (None: no certificate), logging
        in as `user` where one is given."""
        cert, key = self.client(client) if client else (None, None)
        return EtcdSecurity("https", self.ca, cert, key, user, password_file)


def _openssl(*args: str, cwd: str) -> None:
    out = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {out.stderr.strip()[-500:]}")


def _leaf(directory: str, name: str, subject: str, extensions: list[str]) -> None:
    """A key and a certificate for `name`, signed by the CA in `directory`."""
    ext = os.path.join(directory, f"{name}.ext")
    with open(ext, "w") as f:
        f.write(
            "\n".join(
                [
                    "basicConstraints = CA:FALSE",
                    "keyUsage = critical, digitalSignature, keyEncipherment",
                    "subjectKeyIdentifier = hash",
                    "authorityKeyIdentifier = keyid",
                    *extensions,
                ]
            )
            + "\n"
        )
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req", "-new", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=directory
    )
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", f"{name}.pem", "-days", _DAYS, "-extfile", ext, cwd=directory,
    )  # fmt: skip


def make_certs(
    directory: str,
    hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
    clients: tuple[str, ...] = ("job",),
    named: tuple[str, ...] = (),
) -> Certs:
    """A new CA in `directory`; the members' certificate, naming `hosts` (IP addresses as
    IP:, names as DNS: in its subjectAltName: a client checks the host it dialled against
    them) and usable as a client certificate too (etcd's JSON gateway dials the member's own
    gRPC port with it); a client certificate per name in `clients`, with no CN (with auth
    enabled etcd refuses gateway requests from a certificate with one), and one per name in
    `named` whose CN is that name (to show that refusal)."""
    os.makedirs(directory, exist_ok=True)
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "ca.key", "-out", "ca.pem", "-days", _DAYS, "-subj", "/CN=resilient-comm test CA",
        "-addext", "basicConstraints = critical, CA:TRUE", "-addext", "keyUsage = critical, keyCertSign, cRLSign",
        cwd=directory,
    )  # fmt: skip
    names = [f"IP:{h}" if h.replace(".", "").isdigit() or ":" in h else f"DNS:{h}" for h in hosts]
    _leaf(
        directory,
        "member",
        "/CN=etcd member",
        [f"subjectAltName = {', '.join(names)}", "extendedKeyUsage = serverAuth, clientAuth"],
    )
    for name in clients:
        _leaf(directory, name, f"/O=resilient-comm test/OU={name}", ["extendedKeyUsage = clientAuth"])
    for name in named:
        _leaf(directory, name, f"/CN={name}", ["extendedKeyUsage = clientAuth"])
    return Certs(
        directory,
        os.path.join(directory, "ca.pem"),
        os.path.join(directory, "member.pem"),
        os.path.join(directory, "member.key"),
    )


def member_flags(certs: Certs) -> list[str]:
    """A member's flags for TLS on its client URLs, a client certificate signed by the CA
    required of every client."""
    return [
        "--cert-file", certs.member, "--key-file", certs.member_key,
        "--client-cert-auth", "--trusted-ca-file", certs.ca,
    ]  # fmt: skip


def password_file(directory: str, user: str, password: str) -> str:
    """`password` in a file only its owner reads; its path."""
    path = os.path.join(directory, f"{user}.password")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    return path


def enable_auth(
    endpoints: str,
    certs: Certs,
    root_password: str,
    users: dict[str, tuple[str, list[str]]],
    client: str = "job",
) -> None:
    """etcd's auth on: the root user (role root), and for each user (its password, its
    prefixes) a role of the same name with readwrite on each prefix and nothing else. Made
    through the gateway before auth is on, so no login is needed (client certificate `client`)."""
    admin = EtcdStore(endpoints, datetime.timedelta(seconds=30), certs.security(client))
    try:
        admin.api("/auth/user/add", {"name": "root", "password": root_password}, "add user root")
        admin.api("/auth/role/add", {"name": "root"}, "add role root")
        admin.api("/auth/user/grant", {"user": "root", "role": "root"}, "grant root to root")
        for user, (password, prefixes) in users.items():
            admin.api("/auth/user/add", {"name": user, "password": password}, f"add user {user}")
            admin.api("/auth/role/add", {"name": user}, f"add role {user}")
            for prefix in prefixes:
                perm = {"permType": "READWRITE", "key": b64(prefix), "range_end": b64(prefix_end(prefix))}
                admin.api("/auth/role/grant", {"name": user, "perm": perm}, f"grant {prefix} to role {user}")
            admin.api("/auth/user/grant", {"user": user, "role": user}, f"grant role {user} to {user}")
        admin.api("/auth/enable", {}, "enable auth")
    finally:
        admin.close()


__all__ = ["Certs", "enable_auth", "make_certs", "member_flags", "password_file", "why_not"]
