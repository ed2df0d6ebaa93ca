"""Redis backend: one record per value, a shared LRU index, failures read as misses.

Key layout under ``prefix`` (default ``mlxcache:``)::

    {prefix}v:{key}           the record: a safetensors blob, or a chunk manifest
    {prefix}c:{gen}:{i}       chunk i of a large record; gen is random per write
    {prefix}i:lru             ZSET  key -> logical access clock (least recent first)
    {prefix}i:size            HASH  key -> stored bytes
    {prefix}i:exp             ZSET  key -> expiry time in server ms (only with ttl)
    {prefix}i:chunks          HASH  key -> "gen:n" for chunked records
    {prefix}i:total           bytes of all indexed records
    {prefix}i:clock           counter that orders accesses

User keys live only under ``v:``, so ``keys()`` scans that namespace alone. Every write and its
index update run in one MULTI/EXEC (small values) or one Lua script (chunked values), so every
client sees one true total and evicts by one LRU order. See docs/backends.md.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import SplitResult

import redis
from redis._parsers import Encoder
from redis.backoff import NoBackoff
from redis.connection import PythonRespSerializer
from redis.exceptions import NoScriptError, RedisError
from redis.retry import Retry

from mlxcache import format as st
from mlxcache import signing
from mlxcache.backends.base import BackendBase, log
from mlxcache.backends.redis_chunks import (
    MAX_CHUNKS,
    complete_chunks,
    is_manifest,
    make_manifest,
    parse_manifest,
)
from mlxcache.backends.redis_scripts import SCRIPTS, SHAS
from mlxcache.errors import FormatError, UnsupportedVersionError, UntrustedRecordError
from mlxcache.options import Options, redact_uri
from mlxcache.record import Record

REDIS_MAX_STRING = 512 * 1024 * 1024
DEFAULT_CHUNK_SIZE = 256 * 1024 * 1024
DEFAULT_TIMEOUT = 5.0
PENDING_CHUNK_MS = 600_000  # chunks of an unfinished write vanish on their own after this
HEADER_PROBE = 64 * 1024  # bytes read first for a header; a larger one costs one more read

# redis-py's pure-Python packer sends large values and memoryviews as they are; with hiredis
# installed the default packer would copy every value into one new command buffer (a full
# extra copy of each record). Replies are still parsed by hiredis when it is there.
_PACKER = PythonRespSerializer(6000, Encoder("utf-8", "strict", False).encode)

# Errors that mean "the server is not there": they start the reconnect backoff.
_UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, OSError)
_FAILURES = (RedisError, OSError)

# What a read found for one key: nothing, a whole value, the chunks of a large one (decoded
# without joining them), or the reason a chunked value is unreadable.
Value = bytes | list[bytes] | FormatError | None


def glob_escape(text: str) -> str:
    """Escape Redis MATCH wildcards so ``text`` matches only itself."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


class RedisBackend(BackendBase):
    """Records in Redis under a key prefix, with a byte budget and LRU shared by all clients.

    ``url`` is any redis-py URL (``redis://``, ``rediss://``, ``unix://``). ``ttl`` (seconds)
    applies to every value written; ``max_bytes`` bounds the stored bytes of all clients using
    the same prefix (None: unbounded, leave it to Redis' ``maxmemory``). Values larger than
    ``chunk_size`` are split and still committed atomically. When Redis is unreachable every
    call degrades (miss, no-op, empty) and the server is skipped for a backoff that grows from
    ``backoff`` to ``max_backoff`` seconds, then tried again. With a ``signer`` (default: from
    ``$MLXCACHE_SECRET``, or the variable ``secret_env`` names) every record is signed for its
    key and a value without a valid MAC is rejected (``stats()["rejected"]``) and deleted.
    """

    scheme = "redis"
    _unreachable = _UNREACHABLE

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "mlxcache:",
        ttl: float | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        max_bytes: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        backoff: float = 0.1,
        max_backoff: float = 5.0,
        signer: signing.Signer | None = None,
        secret_env: str | None = None,
        **redis_kwargs: Any,
    ) -> None:
        if not isinstance(url, str):
            raise TypeError(f"url must be a str, got {type(url).__name__}")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError("prefix must be a non-empty str (clear() deletes what it covers)")
        if ttl is not None and not ttl > 0:
            raise ValueError(f"ttl must be > 0 seconds or None, got {ttl!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if not 0 < chunk_size <= REDIS_MAX_STRING:
            raise ValueError(f"chunk_size must be in 1..{REDIS_MAX_STRING} bytes, got {chunk_size}")
        super().__init__(max_bytes=max_bytes, backoff=backoff, max_backoff=max_backoff)
        self.signer = signer if signer is not None else signing.resolve(secret_env)
        self.prefix = prefix
        self.ttl = ttl
        self.timeout = timeout
        self.chunk_size = chunk_size
        self._ttl_ms = 0 if ttl is None else max(1, round(ttl * 1000))
        self.pool = redis.ConnectionPool.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1),  # one quick retry for a stale pooled connection
            command_packer=_PACKER,
            **redis_kwargs,
        )
        self.client = redis.Redis(connection_pool=self.pool)
        self.url = _public_url(url)
        self._index = [
            prefix + "i:" + n for n in ("lru", "size", "exp", "chunks", "total", "clock")
        ]
        if max_bytes is not None:
            self.trim(max_bytes)  # opening with a budget enforces it (``mlxcache gc``)

    def where(self) -> str:
        return self.url

    def _trim(self, max_bytes: int) -> int:
        return int(self._script("evict", self._index, [max_bytes]))

    # ------------------------------------------------------------ keys and state

    def _vkey(self, key: str) -> str:
        return self.prefix + "v:" + key

    def _ckey(self, gen: str, i: int) -> str:
        return f"{self.prefix}c:{gen}:{i}"

    def _eval(self, target: Any, name: str, keys: list[str], args: list[Any]) -> Any:
        return target.evalsha(SHAS[name], len(keys), *keys, self.prefix, *args)

    def _load_scripts(self) -> None:
        for body in SCRIPTS.values():
            self.client.script_load(body)

    def _script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run a script by SHA, loading it once if the server forgot it (restart, flush)."""
        try:
            return self._eval(self.client, name, keys, args)
        except NoScriptError:
            self._load_scripts()
            return self._eval(self.client, name, keys, args)

    def _header(self, key: str) -> st.Header | None:
        """A record's header without its tensor data (``mlxcache inspect``); None if absent."""
        return self._read_header(self._vkey(key))

    def _read_header(self, vkey: str) -> st.Header | None:
        """Read the first bytes of a value until its header fits (across chunks if need be)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.getrange(vkey, 0, HEADER_PROBE - 1)
        pipe.strlen(vkey)
        prefix, size = pipe.execute()
        if not prefix:
            return None
        if not is_manifest(prefix):
            need = st.header_bytes_needed(prefix)
            if need > len(prefix):
                prefix = self.client.getrange(vkey, 0, need - 1)
            return st.parse_header(prefix, total_size=size)
        m = parse_manifest(prefix)
        if m is None:
            raise FormatError("malformed chunk manifest")
        head = b""
        for chunk in self._chunk_keys(m):
            head += self.client.getrange(chunk, 0, HEADER_PROBE - 1)
            if len(head) >= st.header_bytes_needed(head):
                break
        return st.parse_header(head, total_size=m["size"])

    # ------------------------------------------------------------ writing

    def _prepare(self, key: str, record: Record) -> tuple[bytes, int]:
        # raises on a bad dtype before anything is sent
        blob = st.to_bytes(record, key=key, signer=self.signer)
        if -(-len(blob) // self.chunk_size) > MAX_CHUNKS:
            raise ValueError(
                f"a record of {len(blob)} bytes needs more than {MAX_CHUNKS} chunks of "
                f"chunk_size={self.chunk_size}: use a larger chunk_size"
            )
        return blob, len(blob)

    def _put(self, key: str, blob: bytes, size: int) -> int:
        if size <= self.chunk_size:
            return self._put_whole(key, blob)
        return self._put_chunked(key, blob)

    def _commit_args(self, key: str, size: int, info: str, manifest: bytes) -> list[Any]:
        max_bytes = -1 if self.max_bytes is None else self.max_bytes
        return [key, size, self._ttl_ms, max_bytes, info, manifest]

    def _put_whole(self, key: str, blob: bytes) -> int:
        keys = [*self._index, self._vkey(key)]
        args = self._commit_args(key, len(blob), "", b"")
        pipe = self.client.pipeline(transaction=True)
        pipe.set(keys[-1], blob, px=self._ttl_ms or None)
        self._eval(pipe, "commit", keys, args)
        _, result = pipe.execute(raise_on_error=False)
        if isinstance(result, NoScriptError):  # the value is set; index it now
            self._load_scripts()
            result = self._eval(self.client, "commit", keys, args)
        if isinstance(result, Exception):
            raise result
        return int(result[1])

    def _put_chunked(self, key: str, blob: bytes) -> int:
        view = memoryview(blob)
        size, step = len(blob), self.chunk_size
        gen, n = uuid.uuid4().hex, -(-len(blob) // step)
        chunk_keys = [self._ckey(gen, i) for i in range(n)]
        pipe = self.client.pipeline(transaction=False)
        for i, ck in enumerate(chunk_keys):
            pipe.set(ck, view[i * step : (i + 1) * step], px=PENDING_CHUNK_MS)
        pipe.execute()
        manifest = make_manifest(gen, n, size)
        keys = [*self._index, self._vkey(key), *chunk_keys]
        status, evicted = self._script(
            "commit", keys, self._commit_args(key, size, f"{gen}:{n}", manifest)
        )
        if status != 1:
            self.client.unlink(*chunk_keys)
            raise RedisError(f"chunks of {key!r} vanished before commit (written too slowly?)")
        return int(evicted)

    # ------------------------------------------------------------ reading

    def _get_many(self, keys: list[str]) -> list[Record | None]:
        """Fetch many records in one pipelined round trip (plus one for chunked values)."""
        blobs = self._fetch(keys)
        return [self._decode(k, b) for k, b in zip(keys, blobs, strict=True)]

    def _fetch(self, keys: list[str]) -> list[Value]:
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            vkey = self._vkey(k)
            pipe.get(vkey)
            self._eval(pipe, "touch", [*self._index, vkey], [k])
        replies = pipe.execute(raise_on_error=False)
        values: list[Value] = replies[0::2]
        for r in values:
            if isinstance(r, Exception):
                raise r
        if any(isinstance(r, NoScriptError) for r in replies[1::2]):
            self._load_scripts()  # only the LRU refresh was lost; next time it works
        manifests = [i for i, v in enumerate(values) if v is not None and is_manifest(v)]
        if manifests:
            parsed = [parse_manifest(values[i]) for i in manifests]
            pipe = self.client.pipeline(transaction=False)
            for m in parsed:
                if m:
                    pipe.mget(self._chunk_keys(m))
                else:
                    pipe.echo(b"")  # keeps replies aligned; _decode reports the bad manifest
            for i, m, chunks in zip(manifests, parsed, pipe.execute(), strict=True):
                if m:
                    seen, values[i] = values[i], complete_chunks(m, chunks)
                    if values[i] is None:  # replaced under us, or chunks lost: read it again
                        values[i] = self._read_again(keys[i], seen)
        return values

    def _chunk_keys(self, m: dict[str, Any]) -> list[str]:
        return [self._ckey(m["gen"], i) for i in range(m["n"])]

    def _read_again(self, key: str, seen: bytes) -> Value:
        """Read a chunked value once more; the same manifest with chunks still missing is lost."""
        value = self.client.get(self._vkey(key))
        if value is None or not is_manifest(value):
            return value
        m = parse_manifest(value)
        if m is None:
            return value  # let _decode report it
        chunks = complete_chunks(m, self.client.mget(self._chunk_keys(m)))
        if chunks is None and value == seen:  # evicted by Redis' maxmemory, deleted by hand...
            return FormatError("chunks of a large value are missing")
        return chunks

    def _decode(self, key: str, value: Value) -> Record | None:
        if value is None:
            return None
        try:
            if isinstance(value, FormatError):
                raise value
            if isinstance(value, list):  # chunks: freed one by one as they are decoded
                return st.from_buffers(value, consume=True, key=key, signer=self.signer)
            return st.from_bytes(value, key=key, signer=self.signer)
        except UnsupportedVersionError as exc:  # a newer mlxcache shares this server: keep it
            self._rlog.warning("version", "redis cache: skipping %r: %s", key, exc)
            return None
        except MemoryError:
            self.error("get", f"out of memory decoding {key!r}")
            return None
        except FormatError as exc:
            if isinstance(exc, UntrustedRecordError):
                self._counters.add("rejected")
                self.last_error = f"{self.scheme} cache: rejected {key!r}: {exc}"
            else:
                self.error("get", f"unreadable value {key!r}: {exc}", logged=True)
            log.warning("redis cache: deleting unreadable value %r: %s", key, exc)
            try:
                self._script("drop", self._index, [key])
            except _FAILURES as err:
                self.error("delete", err)
            return None

    # ------------------------------------------------------------ the rest of the protocol

    def _delete(self, key: str) -> bool:
        return bool(self._script("drop", self._index, [key]))

    def _contains_many(self, keys: list[str]) -> list[bool]:
        """EXISTS for many keys in one pipelined round trip."""
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.exists(self._vkey(k))
        return [bool(x) for x in pipe.execute()]

    def _keys(self, prefix: str) -> Iterator[str]:
        """User keys starting with ``prefix`` (SCAN, never KEYS; internal keys never listed)."""
        start = len(self.prefix.encode()) + 2
        pattern = glob_escape(self._vkey(prefix)) + "*"
        seen: set[bytes] = set()
        for raw in self.client.scan_iter(match=pattern, count=1000):
            if raw not in seen:
                seen.add(raw)
                yield raw[start:].decode("utf-8", "replace")

    def _count(self) -> int:
        return int(self._script("stats", self._index, [])[0])

    def _clear(self) -> None:
        """Remove every key under our prefix (SCAN + UNLINK); other keys are untouched."""
        pattern = glob_escape(self.prefix) + "[vci]:*"
        batch: list[bytes] = []
        for raw in self.client.scan_iter(match=pattern, count=1000):
            batch.append(raw)
            if len(batch) >= 1000:
                self.client.unlink(*batch)
                batch.clear()
        if batch:
            self.client.unlink(*batch)

    def _stats(self) -> dict[str, Any]:
        """Entries and bytes from the shared index (hits/misses/...: this process's)."""
        entries, nbytes = self._script("stats", self._index, [])
        return {"entries": int(entries), "bytes": int(nbytes)}

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "prefix": self.prefix,
            "ttl": self.ttl,
            "chunk_size": self.chunk_size,
        }

    def _close(self) -> None:
        """Close pooled connections (a later call would open new ones)."""
        self.pool.disconnect()

    def __repr__(self) -> str:
        return f"RedisBackend({self.url!r}, prefix={self.prefix!r})"


def _public_url(url: str) -> str:
    """The URL fit to print: ``user:***@host:port/db``, never the password."""
    return redact_uri(url)


_REDIS_OPTIONS = ("db", "username", "password", "max_connections", "ssl_cert_reqs",
                  "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")  # fmt: skip


def from_uri(url: SplitResult, opts: Options) -> RedisBackend:
    """``redis://[user:password@]host:port/db``, ``rediss://...``, ``unix:///path.sock?db=0``.

    Options: prefix, ttl (s), timeout (s), max_bytes, chunk_size, backoff (s), max_backoff (s),
    and for redis-py: db, username, password, max_connections, ssl_cert_reqs, ssl_ca_certs,
    ssl_certfile, ssl_keyfile.
    """
    scheme = url.scheme.lower()
    try:
        url.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ValueError(f"{scheme}:// URI has a bad port: {exc}") from None
    if scheme == "unix":
        if url.hostname or not url.path.startswith("/"):
            raise ValueError("unix:// needs an absolute socket path, like unix:///run/redis.sock")
    elif url.path not in ("", "/") and not re.fullmatch(r"/\d+", url.path):
        raise ValueError(f"{scheme}:// path must be a database number like /0, got {url.path!r}")
    prefix = opts.str("prefix", "mlxcache:")
    ttl = opts.float("ttl", None, minimum=0.001)
    timeout = opts.float("timeout", DEFAULT_TIMEOUT, minimum=0.001)
    max_bytes = opts.size("max_bytes", None)
    chunk_size = opts.size("chunk_size", DEFAULT_CHUNK_SIZE)
    backoff = opts.float("backoff", 0.1, minimum=0.001)
    max_backoff = opts.float("max_backoff", 5.0, minimum=0.001)
    secret_env = opts.str("secret_env", None)
    extra: dict[str, Any] = {}
    for name in _REDIS_OPTIONS:
        value = opts.int(name, None) if name in ("db", "max_connections") else opts.str(name, None)
        if value is not None:
            extra[name] = value
    opts.done()
    base = f"{scheme}://{url.netloc}{url.path}"  # urlunsplit drops "//" of unix:///x
    return RedisBackend(
        base,
        prefix=prefix,
        ttl=ttl,
        timeout=timeout,
        max_bytes=max_bytes,
        chunk_size=chunk_size,
        backoff=backoff,
        max_backoff=max_backoff,
        secret_env=secret_env,
        **extra,
    )
