"""A redis-server that speaks only TLS (client certificates required) and an ACL user confined
to the ``mlxcache:*`` keys, without the dangerous commands (FLUSHALL, CONFIG, ...).

Certificates are made here with the ``cryptography`` package: a CA, a server certificate for
127.0.0.1 and a client certificate, plus a second CA that the server does not trust.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import tempfile
import time

import redis
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from redis_server import REDIS_SERVER, free_port

USER, PASSWORD = "alice", "tls-acl-password-7f3a"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject, key, issuer, issuer_key, *, ca: bool, ip: bool = False) -> x509.Certificate:
    import ipaddress

    now = datetime.datetime.now(datetime.timezone.utc)
    b = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ip:
        b = b.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
    return b.sign(issuer_key, hashes.SHA256())


def _write(path: str, key, cert: x509.Certificate) -> None:
    with open(path + ".key", "wb") as f:
        f.write(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    with open(path + ".crt", "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))


def make_certs(folder: str) -> None:
    """ca, server (127.0.0.1), client (signed by ca) and other-ca (trusted by no one)."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert(_name("mlxcache test CA"), ca_key, _name("mlxcache test CA"), ca_key, ca=True)
    _write(os.path.join(folder, "ca"), ca_key, ca)
    for name in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(_name(name), key, ca.subject, ca_key, ca=False, ip=name == "server")
        _write(os.path.join(folder, name), key, cert)
    other_key = ec.generate_private_key(ec.SECP256R1())
    other = _cert(_name("other CA"), other_key, _name("other CA"), other_key, ca=True)
    _write(os.path.join(folder, "other-ca"), other_key, other)


class TLSRedis:
    """redis-server on a loopback TLS port only, client certificates required, ACL user."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="mlxcache-tls-")
        make_certs(self.dir)
        self.port = free_port()
        conf = os.path.join(self.dir, "redis.conf")
        with open(conf, "w") as f:
            f.write(
                f"port 0\ntls-port {self.port}\nbind 127.0.0.1\n"
                f"tls-cert-file {self.path('server.crt')}\n"
                f"tls-key-file {self.path('server.key')}\n"
                f"tls-ca-cert-file {self.path('ca.crt')}\n"
                "tls-auth-clients yes\n"
                f'dir {self.dir}\nsave ""\nappendonly no\n'
                f"logfile {self.path('redis.log')}\n"
                "user default off\n"
                f"user {USER} on >{PASSWORD} ~mlxcache:* resetchannels +@all -@dangerous\n"
            )
        self.proc = subprocess.Popen([REDIS_SERVER, conf], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with self.client() as c:
                    if c.ping():
                        return
            except (redis.RedisError, OSError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"TLS redis-server did not start:\n{self.log()}")
            time.sleep(0.05)

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def client(self) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            username=USER,
            password=PASSWORD,
            ssl=True,
            ssl_ca_certs=self.path("ca.crt"),
            ssl_certfile=self.path("client.crt"),
            ssl_keyfile=self.path("client.key"),
            socket_timeout=2,
        )

    def uri(
        self,
        *,
        password: str = PASSWORD,
        ca: str = "ca.crt",
        client: bool = True,
        timeout: float = 2,
    ) -> str:
        query = f"ssl_ca_certs={self.path(ca)}&timeout={timeout}"
        if client:
            query += (
                f"&ssl_certfile={self.path('client.crt')}&ssl_keyfile={self.path('client.key')}"
            )
        return f"rediss://{USER}:{password}@127.0.0.1:{self.port}/0?{query}"

    def log(self) -> str:
        try:
            with open(self.path("redis.log")) as f:
                return f.read()[-3000:]
        except OSError:
            return ""

    def close(self) -> None:
        import shutil

        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)
