"""Redis over TLS with client certificates and an ACL user, against a real redis-server; and
no password or token from a URI ever shown in repr, stats, logs, exceptions or CLI output."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import redis
from helpers import ROOT, assert_same, full_kv, sample_record
from redis_server import free_port
from tls_redis import PASSWORD, USER, TLSRedis

import mlxcache
from mlxcache import PrefixCache
from mlxcache.cli import main as cli_main

DOWN_PW = "hunter2-down-server-pw"


@pytest.fixture(scope="module")
def tls():
    server = TLSRedis()
    yield server
    server.close()


def _no_secret(*texts: str) -> None:
    for text in texts:
        assert PASSWORD not in text and DOWN_PW not in text and "wrong-pw-" not in text, text


def test_tls_client_certificate_and_acl_user(tls, monkeypatch):
    monkeypatch.setenv("MLXCACHE_SECRET", "tls-and-signed-secret-0123")
    with tls.client() as c:
        assert c.acl_whoami() == USER
        with pytest.raises(redis.exceptions.NoPermissionError):
            c.set("outside-the-prefix", 1)  # the ACL user is confined to mlxcache:*
        for k in c.scan_iter("mlxcache:*"):
            c.delete(k)
    b = mlxcache.open_backend(tls.uri())
    assert type(b.pool.connection_class).__name__ != "Connection"
    b.put("k", sample_record())
    assert_same(sample_record(), b.get("k"))
    assert b.stats()["entries"] == 1 and b.stats()["available"] is True
    pc = PrefixCache(tls.uri(), model="m", block_size=4)  # signed records, over TLS
    pc.store(list(range(8)), full_kv(8))
    assert pc.lookup(list(range(8))).num_tokens == 8
    assert f"{USER}:***@" in repr(b) and f"{USER}:***@" in b.stats()["url"]
    _no_secret(repr(b), str(b), str(b.stats()), repr(pc))


@pytest.mark.parametrize(
    "how", ["wrong password", "untrusted server CA", "no client certificate", "plain redis://"]
)
def test_tls_failures_are_misses_that_never_show_the_password(tls, how, caplog):
    uri = {
        "wrong password": tls.uri(password="wrong-pw-123"),
        "untrusted server CA": tls.uri(ca="other-ca.crt"),
        "no client certificate": tls.uri(client=False),
        "plain redis://": tls.uri().replace("rediss://", "redis://", 1).split("?")[0]
        + "?timeout=1",
    }[how]
    with caplog.at_level(logging.INFO, logger="mlxcache"):
        b = mlxcache.open_backend(uri)
        b.put("x", sample_record())
        assert b.get("x") is None and "x" not in b
        stats = b.stats()
    assert stats["errors"] >= 1 and stats["available"] is False
    _no_secret(caplog.text, repr(b), str(stats), b.last_error or "")


# ---------------------------------------------------------------- the CLI and exceptions

DOWN = f"redis://{USER}:{DOWN_PW}@127.0.0.1:{free_port()}/0?timeout=0.2"


@pytest.mark.parametrize(
    "argv",
    [
        ["stats", DOWN],
        ["stats", DOWN, "--json"],
        ["ls", DOWN],
        ["inspect", DOWN, "k", "--json"],
        ["copy", DOWN, "memory://"],
        ["copy", "memory://", DOWN],
        ["gc", DOWN, "--max-bytes", "1MiB"],
        ["verify", DOWN, "--json"],
        ["rm", DOWN, "k"],
        ["clear", DOWN, "--yes"],
        ["stats", f"redis://u:{DOWN_PW}@127.0.0.1:notaport/0"],
        ["stats", f"redis://u:{DOWN_PW}@127.0.0.1:6379/x"],
        ["stats", f"redis://127.0.0.1:1/0?password={DOWN_PW}&timeout=nope"],
        ["stats", f"redis://127.0.0.1:1/0?password={DOWN_PW}&bogus=1"],
        ["stats", f"s3://u:{DOWN_PW}@bucket/x"],
        ["stats", f"file://u:{DOWN_PW}@host/x"],
        ["stats", f"memory://u:{DOWN_PW}@host"],
    ],
)
def test_cli_error_lines_never_show_the_password(argv, capsys, caplog):
    with caplog.at_level(logging.DEBUG, logger="mlxcache"):
        code = cli_main(argv)
    out, err = capsys.readouterr()
    assert code == 1 and err.startswith("mlxcache: error:"), (out, err)
    _no_secret(out, err, caplog.text)


def test_cli_verbose_log_lines_never_show_the_password(tls):
    for uri in (DOWN, tls.uri(password="wrong-pw-456")):
        for argv in (["-v", "stats", uri], ["-v", "ls", uri], ["-v", "verify", uri]):
            proc = subprocess.run(
                [sys.executable, "-m", "mlxcache", *argv],
                capture_output=True,
                text=True,
                cwd=ROOT,
                timeout=60,
            )
            assert proc.returncode == 1 and "***@" in proc.stderr, proc.stderr
            _no_secret(proc.stdout, proc.stderr)


@pytest.mark.parametrize(
    "uri",
    [
        f"redis://:{DOWN_PW}@127.0.0.1:port/0",
        f"rediss://u:{DOWN_PW}@127.0.0.1:6379/db",
        f"unix://u:{DOWN_PW}@host/sock",
        f"redis://127.0.0.1:6379/0?password={DOWN_PW}&max_bytes=lots",
        f"redis://127.0.0.1:6379/0?token={DOWN_PW}",
        f"ftp://u:{DOWN_PW}@host/",
        f"file://u:{DOWN_PW}@elsewhere/x",
    ],
)
def test_invalid_uri_errors_never_repeat_the_password(uri):
    with pytest.raises(ValueError) as err:
        mlxcache.open_backend(uri)
    _no_secret(str(err.value))


def test_managers_never_show_the_password(tmp_path):
    from mlxcache.mllm_cache import MLLMPrefixCacheManager

    uri = f"redis://{USER}:{DOWN_PW}@127.0.0.1:{free_port()}/0?timeout=0.2"
    m = MLLMPrefixCacheManager(backend=uri)
    with pytest.raises(TypeError) as err:  # a Python object cannot go to a persistent store
        m.store(["i"], "p", object(), [], [1, 2])
    pc = PrefixCache(uri, model="m")
    _no_secret(str(err.value), repr(m), repr(pc), str(pc.stats()))
