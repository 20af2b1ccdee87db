"""How a process reaches a secured etcd: TLS (each member's certificate checked against a CA
and against the host name it is reached by; a client certificate where the cluster asks for
one) and etcd's own login (a user and its password, exchanged for a token that goes with every
request). `store.EtcdStore` applies it to its unary requests and its watches; every process
of a job that reaches etcd -- node agents and workers -- reads the same settings.

The settings are the ``RESILIENT_COMM_ETCD_*`` knobs (docs/configuration.md), or
``resilient-run --rdzv-conf`` with torchrun's names for TLS and ours for the login::

    --rdzv-conf protocol=https,cacert=ca.pem,cert=job.pem,key=job.key,user=job42,password_file=/run/secrets/etcd

``resilient-run`` turns ``--rdzv-conf``'s into the knobs (`conf_env`) and hands them to its
workers (`EtcdSecurity.worker_env`): the password file's path, never the password. A password
is never taken from a command line (``ps`` shows it to every user of the host), never logged,
never written to etcd.

[Note: no login by the certificate's CN] etcd can take a client certificate's Common Name as
the user (``--client-cert-auth`` with auth enabled), but not through its JSON gateway, which is
what this client speaks (its docs: "gRPC-gateway does not support authentication using TLS
Common Name"): with auth enabled, a member answers every gateway request made with a
certificate that has a CN with HTTP 400 ("CommonName of client sending a request against
gateway will be ignored and not used as expected"), whatever token it carries. So a job's
client certificate has no CN, and the job logs in with a user and its password. A cluster
whose clients must log in by CN alone is refused with an error that says so (`access_error`).

Refusals -- a TLS handshake the member or this client rejects, a failed login, a permission
the user's role lacks -- are `EtcdAccessError`s, raised at once: asking again, or asking
another member, gets the same answer, so they are not an unreachable cluster.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import ssl
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

ENV_PROTOCOL = "RESILIENT_COMM_ETCD_PROTOCOL"
ENV_CACERT = "RESILIENT_COMM_ETCD_CACERT"
ENV_CERT = "RESILIENT_COMM_ETCD_CERT"
ENV_KEY = "RESILIENT_COMM_ETCD_KEY"
ENV_USER = "RESILIENT_COMM_ETCD_USER"
ENV_PASSWORD_FILE = "RESILIENT_COMM_ETCD_PASSWORD_FILE"
ENV_PASSWORD = "RESILIENT_COMM_ETCD_PASSWORD"

# ``--rdzv-conf`` keys -> the knob each sets. torchrun's etcd rendezvous spells the TLS files
# cacert/cert/key, its etcd-v2 backend ca_cert/ssl_cert/ssl_cert_key: both are taken.
CONF = {
    "protocol": ENV_PROTOCOL,
    "cacert": ENV_CACERT,
    "cert": ENV_CERT,
    "key": ENV_KEY,
    "ca_cert": ENV_CACERT,
    "ssl_cert": ENV_CERT,
    "ssl_cert_key": ENV_KEY,
    "user": ENV_USER,
    "password_file": ENV_PASSWORD_FILE,
}
_PATHS = (ENV_CACERT, ENV_CERT, ENV_KEY, ENV_PASSWORD_FILE)

# etcd's words for a token it no longer takes (expired, or issued before the auth store
# changed): the client logs in again, once.
_STALE_TOKEN = ("invalid auth token", "revision of auth store is old")


class EtcdAccessError(dist.DistStoreError):
    """etcd refused this client -- its TLS handshake, its login or a permission -- and would
    refuse it again: raised at once, the message naming the cause and the setting to fix."""


def conf_env(conf: Mapping[str, str]) -> dict[str, str]:
    """``--rdzv-conf``'s etcd settings (`CONF`'s keys) as the knobs they set; paths made
    absolute (the workers are handed them). A password is refused: use a file or the
    environment (``RESILIENT_COMM_ETCD_PASSWORD``)."""
    out: dict[str, str] = {}
    for key, value in conf.items():
        if key == "password":
            raise ValueError(
                "--rdzv-conf password=...: a command line is visible to every user of the host (ps); "
                f"give password_file=PATH, or set {ENV_PASSWORD} in resilient-run's environment"
            )
        env = CONF.get(key)
        if env is None:
            raise ValueError(f"--rdzv-conf {key}=: not an etcd setting (known: {', '.join(CONF)})")
        if not value:
            raise ValueError(f"--rdzv-conf {key}=: empty")
        out[env] = os.path.abspath(value) if env in _PATHS else value
    return out


def split_scheme(endpoints: str) -> tuple[str | None, str]:
    """'https://h1:2379,https://h2:2379' -> ('https', 'h1:2379,h2:2379'); no scheme: None.
    Every endpoint names the same scheme, or none does."""
    parts = [p.strip() for p in endpoints.split(",")]
    schemes = {p.split("://", 1)[0].lower() if "://" in p else None for p in parts}
    if len(schemes) > 1:
        raise ValueError(f"etcd endpoints {endpoints!r}: every endpoint takes the same scheme, or none does")
    scheme = schemes.pop()
    if scheme not in (None, "http", "https"):
        raise ValueError(f"etcd endpoints {endpoints!r}: the scheme is http:// or https://, not {scheme}://")
    return scheme, ",".join(p.split("://", 1)[-1] for p in parts)


@dataclasses.dataclass(frozen=True)
class EtcdSecurity:
    """How to reach the cluster: `protocol` (http or https), the CA bundle that members'
    certificates must chain to (`cacert`; None: the system's), this client's certificate and
    key, and the etcd `user` with its password's source (`password_file`, read at each login,
    so a rotated file is picked up; else `password`, from the environment: never shown)."""

    protocol: str = "http"
    cacert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password_file: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.protocol not in ("http", "https"):
            raise ValueError(f"{ENV_PROTOCOL}/--rdzv-conf protocol={self.protocol!r}: http or https")
        if (self.cert is None) != (self.key is None):
            raise ValueError(
                "an etcd client certificate needs both cert= and key= "
                f"({ENV_CERT} and {ENV_KEY}); got only {'cert' if self.cert else 'key'}"
            )
        if self.protocol == "http" and (self.cacert or self.cert):
            raise ValueError(
                "etcd TLS files (cacert=, cert=, key=) were given with protocol=http: "
                "use protocol=https (or https:// endpoints), or drop the files"
            )
        if self.user and not (self.password_file or self.password):
            raise ValueError(
                f"etcd user {self.user!r} needs a password: password_file=PATH in --rdzv-conf, or "
                f"{ENV_PASSWORD_FILE}, or {ENV_PASSWORD} in the environment"
            )
        if not self.user and (self.password_file or self.password):
            raise ValueError(
                f"an etcd password was given without a user: user= in --rdzv-conf, or {ENV_USER}"
            )

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, scheme: str | None = None) -> EtcdSecurity:
        """The knobs' settings (default: this process's environment); `scheme` is the
        endpoints' own (`split_scheme`): https:// there, or a TLS file, means https."""
        env = os.environ if environ is None else environ
        cacert, cert, key = (env.get(n) or None for n in (ENV_CACERT, ENV_CERT, ENV_KEY))
        protocol = (env.get(ENV_PROTOCOL) or "").strip().lower()
        if scheme and protocol and scheme != protocol:
            raise ValueError(
                f"etcd endpoints say {scheme}://, but {ENV_PROTOCOL} (or protocol=) says {protocol}"
            )
        protocol = protocol or scheme or ("https" if cacert or cert else "http")
        return cls(
            protocol,
            cacert,
            cert,
            key,
            env.get(ENV_USER) or None,
            env.get(ENV_PASSWORD_FILE) or None,
            env.get(ENV_PASSWORD) or None,
        )

    @property
    def tls(self) -> bool:
        return self.protocol == "https"

    @functools.cached_property
    def ssl_context(self) -> ssl.SSLContext:
        """Verifies the member's certificate and its name (a member reached as 10.0.0.1 must
        list IP:10.0.0.1 in its subjectAltName; as etcd1.cluster, DNS:etcd1.cluster), and
        presents this client's certificate if there is one."""
        try:
            ctx = ssl.create_default_context(cafile=self.cacert)
            if self.cert and self.key:
                ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as e:  # a missing file, or not PEM
            raise ValueError(
                f"etcd TLS files (cacert {self.cacert}, cert {self.cert}, key {self.key}) cannot be used: {e}"
            ) from e
        return ctx

    def requests_verify(self) -> str | bool:
        """The `requests` session's ``verify`` for the watches: the same CA as the unary
        requests (`ssl_context`), the system's bundle where no CA is given."""
        return self.cacert or ssl.get_default_verify_paths().openssl_cafile or True

    def login_body(self) -> bytes:
        """The authenticate request (the password read now, from its file or the environment)."""
        if self.password_file:
            try:
                with open(self.password_file) as f:
                    password = f.read().rstrip("\r\n")
            except OSError as e:
                raise EtcdAccessError(f"cannot read etcd user {self.user!r}'s password file: {e}") from e
        else:
            password = self.password or ""
        return json.dumps({"name": self.user, "password": password}).encode()

    def worker_env(self) -> dict[str, str]:
        """The knobs a worker needs to reach the cluster as this process does. Not the password:
        its file's path; a password from the environment reaches the workers as the rest of
        the environment does. A plain cluster's: none."""
        if not (self.tls or self.user):
            return {}
        out = {ENV_PROTOCOL: self.protocol}
        for name, value in (
            (ENV_CACERT, self.cacert),
            (ENV_CERT, self.cert),
            (ENV_KEY, self.key),
            (ENV_USER, self.user),
            (ENV_PASSWORD_FILE, self.password_file),
        ):
            if value:
                out[name] = os.path.abspath(value) if name in _PATHS else value
        return out

    def describe(self) -> str:
        """For logs: the protocol, the files and the user (never the password)."""
        parts = [self.protocol]
        if self.cacert:
            parts.append(f"CA {self.cacert}")
        if self.cert:
            parts.append(f"client certificate {self.cert}")
        if self.user:
            parts.append(f"user {self.user}")
        return ", ".join(parts)


class Login:
    """One user's etcd token, shared by every store of this process with the same settings
    (`login_for`): a login costs the cluster a bcrypt hash, so a process logs in once, not
    once per thread. `token` logs in if there is no token yet; `renew` logs in again unless
    another thread already replaced the stale token. Thread-safe; the lock is held across the
    login's request, so concurrent callers wait for one login rather than each making one."""

    def __init__(self, security: EtcdSecurity) -> None:
        self.security = security
        self._lock = threading.Lock()
        self._token: str | None = None

    def token(self, send: Callable[[bytes], dict[str, Any]]) -> str:
        with self._lock:
            if self._token is None:
                self._token = self._login(send)
            return self._token

    def renew(self, stale: str, send: Callable[[bytes], dict[str, Any]]) -> str:
        with self._lock:
            if self._token in (None, stale):
                self._token = self._login(send)
            return self._token

    def _login(self, send: Callable[[bytes], dict[str, Any]]) -> str:
        """`send(body)`: the authenticate request to one member; its connection failures pass
        through (the caller tries the next member), a refusal is an `EtcdAccessError`."""
        from etcd3gw import exceptions

        user = self.security.user
        try:
            r = send(self.security.login_body())
        except (
            exceptions.ConnectionFailedError,
            exceptions.ConnectionTimeoutError,
            exceptions.InternalServerError,
        ):
            raise
        except exceptions.Etcd3Exception as e:
            detail = etcd_message(e)
            if "authentication failed" in detail:
                why = f"wrong password, or no such user; the password came from {self._source()}"
            elif "authentication is not enabled" in detail:
                why = "the cluster has auth disabled: drop user= and the password, or enable auth"
            else:
                why = access_hint(detail, self.security) or "see etcd's answer"
            raise EtcdAccessError(f"etcd refused the login of user {user!r}: {detail} ({why})") from e
        token = r.get("token")
        if not token:
            raise EtcdAccessError(f"etcd answered the login of user {user!r} with no token: {r}")
        return str(token)

    def _source(self) -> str:
        s = self.security
        return f"the file {s.password_file}" if s.password_file else ENV_PASSWORD


_logins: dict[EtcdSecurity, Login] = {}
_logins_lock = threading.Lock()


def login_for(security: EtcdSecurity) -> Login | None:
    """This process's `Login` for these settings (None: no user, no login)."""
    if not security.user:
        return None
    with _logins_lock:
        return _logins.setdefault(security, Login(security))


def token_refused(refusal: Exception | str) -> bool:
    """Whether etcd refused a request (its exception, or a watch's cancel reason) for its token
    alone (expired, or stale after a change of users or roles): a new login may be accepted."""
    detail = refusal if isinstance(refusal, str) else etcd_message(refusal)
    return any(s in detail for s in _STALE_TOKEN)


def etcd_message(e: Exception) -> str:
    """etcd's words for a refusal: the gateway's JSON ``message`` ("etcdserver: permission
    denied"), else its text (a member's plain-text refusal), else the exception's."""
    text = getattr(e, "detail_text", None)
    if isinstance(text, str) and text:
        try:
            return str(json.loads(text)["message"])
        except (ValueError, KeyError, TypeError):
            return text.strip()[:300]
    return str(e)


def access_hint(detail: str, security: EtcdSecurity) -> str | None:
    """What to change, for an etcd refusal that is about this client's access (None: another
    refusal, such as an expired lease)."""
    user = security.user
    if "permission denied" in detail:
        return (
            f"user {user!r}'s role does not grant readwrite on this key: a job's role needs readwrite on "
            "its prefix rc/<rdzv-id>/ (docs/security.md, 'etcd')"
            if user
            else "permission denied with no login: set user= and password_file="
        )
    if "user name is empty" in detail:
        return (
            "the cluster has auth enabled and this client has no user: set user= and password_file= in "
            f"--rdzv-conf, or {ENV_USER} and {ENV_PASSWORD_FILE} (a login by the certificate's CN does not "
            "work through etcd's JSON gateway: docs/security.md)"
        )
    if "CommonName of client" in detail:
        return (
            f"the client certificate {security.cert} has a Common Name: with auth enabled, etcd refuses "
            "every JSON-gateway request made with such a certificate; use one with no CN, and log in "
            "with user= and password_file= (docs/security.md)"
        )
    if any(s in detail for s in _STALE_TOKEN):
        return f"etcd refused user {user!r}'s new token too"
    if "Client sent an HTTP request to an HTTPS server" in detail:
        return "the member speaks TLS: use protocol=https (or https:// endpoints) and cacert="
    return None


def access_error(what: str, e: Exception, security: EtcdSecurity) -> EtcdAccessError | None:
    """An `EtcdAccessError` for a refusal of `what` about this client's access, else None."""
    detail = etcd_message(e)
    hint = access_hint(detail, security)
    return None if hint is None else EtcdAccessError(f"etcd refused {what}: {detail} ({hint})")


def tls_error(e: ssl.SSLError, where: str, security: EtcdSecurity) -> EtcdAccessError | None:
    """An `EtcdAccessError` for a TLS handshake that failed for good (a certificate refused by
    either side, a member that does not speak TLS), else None: a connection that ended (an
    EOF, a reset) is a connection failure, tried again on the next member."""
    if isinstance(e, (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLWantReadError, ssl.SSLWantWriteError)):
        return None
    reason = str(getattr(e, "reason", "") or "")
    if isinstance(e, ssl.SSLCertVerificationError):
        why = (
            f"its certificate did not verify ({e.verify_message}): it must chain to the CA given "
            f"(cacert=, {ENV_CACERT}: {security.cacert or 'none: the system store'}) and name the host "
            "as the endpoint writes it (subjectAltName IP: or DNS:)"
        )
    elif "ALERT" in reason and not security.cert:  # (Go's member answers a missing one with bad_certificate)
        why = (
            "it requires a client certificate (--client-cert-auth) and this client has none: "
            f"set cert= and key= (--rdzv-conf), or {ENV_CERT} and {ENV_KEY}"
        )
    elif any(s in reason for s in ("UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE", "HANDSHAKE_FAILURE")):
        why = (
            f"it refused the client certificate {security.cert}: not signed by its --trusted-ca-file's CA, "
            "expired, or without the clientAuth usage"
        )
    elif "WRONG_VERSION_NUMBER" in reason or "RECORD_LAYER_FAILURE" in reason:
        why = "it does not speak TLS there: an http:// member? (protocol=http, or http:// endpoints)"
    else:
        why = "the TLS handshake failed"
    if isinstance(e, ssl.SSLCertVerificationError):
        return EtcdAccessError(f"etcd at {where} is not trusted: {why} [{e}]")
    return EtcdAccessError(f"etcd at {where} refused the connection: {why} [{e}]")


__all__ = [
    "CONF",
    "ENV_CACERT",
    "ENV_CERT",
    "ENV_KEY",
    "ENV_PASSWORD",
    "ENV_PASSWORD_FILE",
    "ENV_PROTOCOL",
    "ENV_USER",
    "EtcdAccessError",
    "EtcdSecurity",
    "Login",
    "access_error",
    "conf_env",
    "etcd_message",
    "login_for",
    "split_scheme",
    "tls_error",
    "token_refused",
]
