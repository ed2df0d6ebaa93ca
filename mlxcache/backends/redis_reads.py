"""The read path of the Redis backend: pipelined gets, chunked values, headers, decoding.

``ReadMixin`` is the half of :class:`mlxcache.backends.redis.RedisBackend` that fetches and
decodes records (one pipeline per node, chunks decoded without joining, a value that does not
verify dropped); the backend module keeps writes, the index scripts and the protocol.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.exceptions import NoScriptError, RedisError

from mlxcache import format as st
from mlxcache.backends.base import log
from mlxcache.backends.redis_chunks import complete_chunks, is_manifest, parse_manifest
from mlxcache.errors import FormatError, UnsupportedVersionError, UntrustedRecordError
from mlxcache.record import Record

HEADER_PROBE = 64 * 1024  # bytes read first for a header; a larger one costs one more read
_FAILURES = (RedisError, OSError)

# What a read found for one key: nothing, a whole value, the chunks of a large one (decoded
# without joining them), or the reason a chunked value is unreadable.
Value = bytes | list[bytes] | FormatError | None


class ReadMixin:
    """Fetching and decoding records (see the module doc)."""

    def _header(self, key: str) -> st.Header | None:
        """Read the first bytes of a value until its header fits (across chunks if need be)."""
        g = self.layout.group(key)
        client, vkey = self._client(g), self.layout.vkey(key, g)
        pipe = client.pipeline(transaction=False)
        pipe.getrange(vkey, 0, HEADER_PROBE - 1)
        pipe.strlen(vkey)
        prefix, size = pipe.execute()
        if not prefix:
            return None
        if not is_manifest(prefix):
            need = st.header_bytes_needed(prefix)
            if need > len(prefix):
                prefix = client.getrange(vkey, 0, need - 1)
            return st.parse_header(prefix, total_size=size)
        m = parse_manifest(prefix)
        if m is None:
            raise FormatError("malformed chunk manifest")
        head = b""
        for chunk in self._chunk_keys(g, m):
            head += client.getrange(chunk, 0, HEADER_PROBE - 1)
            if len(head) >= st.header_bytes_needed(head):
                break
        return st.parse_header(head, total_size=m["size"])

    def _get_many(self, keys: list[str]) -> list[Record | None]:
        """Fetch many records: one pipelined round trip per node (plus one for chunked values)."""
        blobs = self._fetch(keys)
        return [self._decode(k, b) for k, b in zip(keys, blobs, strict=True)]

    def _fetch(self, keys: list[str]) -> list[Value]:
        groups = [self.layout.group(k) for k in keys]
        values: list[Value] = [None] * len(keys)
        for client, pos in self._by_node(groups):
            found = self._fetch_node(client, [(keys[i], groups[i]) for i in pos])
            for i, v in zip(pos, found, strict=True):
                values[i] = v
        return values

    def _fetch_node(self, client: redis.Redis, items: list[tuple[str, int]]) -> list[Value]:
        """GET + LRU refresh of keys on one node in one round trip; chunks in one more."""
        pipe = client.pipeline(transaction=False)
        for k, g in items:  # the touch first: it drops a key whose lifetime is over
            vkey = self.layout.vkey(k, g)
            self._eval(pipe, "touch", g, [*self.layout.index[g], vkey], [k, 1])
            pipe.get(vkey)
        replies = pipe.execute(raise_on_error=False)
        values: list[Value] = replies[1::2]
        for r in values:
            if isinstance(r, Exception):
                raise r
        if any(isinstance(r, NoScriptError) for r in replies[0::2]):
            self._load_scripts(client)  # only the LRU refresh was lost; next time it works
        manifests = [i for i, v in enumerate(values) if v is not None and is_manifest(v)]
        if manifests:
            parsed = [parse_manifest(values[i]) for i in manifests]
            pipe = client.pipeline(transaction=False)
            for i, m in zip(manifests, parsed, strict=True):
                if m:
                    pipe.mget(self._chunk_keys(items[i][1], m))  # one slot: fine on a cluster
                else:
                    pipe.echo(b"")  # keeps replies aligned; _decode reports the bad manifest
            for i, m, chunks in zip(manifests, parsed, pipe.execute(), strict=True):
                if m:
                    seen, values[i] = values[i], complete_chunks(m, chunks)
                    if values[i] is None:  # replaced under us, or chunks lost: read it again
                        values[i] = self._read_again(client, *items[i], seen)
        return values

    def _chunk_keys(self, g: int, m: dict[str, Any]) -> list[str]:
        return [self.layout.ckey(g, m["gen"], i) for i in range(m["n"])]

    def _read_again(self, client: redis.Redis, key: str, g: int, seen: bytes) -> Value:
        """Read a chunked value once more; the same manifest with chunks still missing is lost."""
        value = client.get(self.layout.vkey(key, g))
        if value is None or not is_manifest(value):
            return value
        m = parse_manifest(value)
        if m is None:
            return value  # let _decode report it
        chunks = complete_chunks(m, client.mget(self._chunk_keys(g, m)))
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
                self._script("drop", self.layout.group(key), [key])
            except _FAILURES as err:
                self.error("delete", err)
            return None
