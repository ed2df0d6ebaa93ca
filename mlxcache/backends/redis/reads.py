"""The read path of the Redis backend: pipelined gets, chunked values, headers, decoding.

``ReadMixin`` is the half of :class:`mlxcache.backends.redis.RedisBackend` that fetches and
decodes records (one pipeline per node, a value over ``FIRST_READ`` streamed into its arrays by
:mod:`mlxcache.backends.redis.stream`, a value that does not verify dropped); the backend module
keeps writes, the index scripts and the protocol.
"""

from __future__ import annotations

from typing import Any, cast

import redis
from redis.exceptions import NoScriptError, RedisError

from mlxcache.backends.base import log
from mlxcache.backends.redis.chunks import MAX_MANIFEST_BYTES, is_manifest, parse_manifest
from mlxcache.backends.redis.stream import FIRST_READ, Source, Vanished, decode
from mlxcache.errors import FormatError, UnsupportedVersionError, UntrustedRecordError
from mlxcache.records import format as st
from mlxcache.records.record import Record

HEADER_PROBE = 64 * 1024  # bytes read first for a header; a larger one costs one more read
_FAILURES = (RedisError, OSError)
RETRIES = 3  # reads of a value that keeps changing while it streams, before it is a miss

# What a read found for one key: nothing, a whole value, the chunks of a large one (decoded
# without joining them), where to stream a large one from, or why a chunked value is unreadable.
Value = bytes | list[bytes] | Source | FormatError | None


class ReadMixin:
    """Fetching and decoding records (see the module doc)."""

    last_error: str | None  # BackendBase's

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
        """Fetch many records: one pipelined round trip per node (plus one for chunked values),
        then a stream per value over ``FIRST_READ``; each value is let go once decoded."""
        values = self._fetch(keys)
        out: list[Record | None] = []
        for i, k in enumerate(keys):
            value, values[i] = values[i], None
            out.append(self._decode(k, value))
        return out

    def _fetch(self, keys: list[str]) -> list[Value]:
        groups = [self.layout.group(k) for k in keys]
        values: list[Value] = [None] * len(keys)
        for client, pos in self._by_node(groups):
            found = self._fetch_node(client, [(keys[i], groups[i]) for i in pos])
            for i, v in zip(pos, found, strict=True):
                values[i] = v
        return values

    def _fetch_node(self, client: redis.Redis, items: list[tuple[str, int]]) -> list[Value]:
        """LRU refresh, first bytes and size of keys on one node in one round trip (see _settle)."""
        pipe = client.pipeline(transaction=False)
        first = max(FIRST_READ, MAX_MANIFEST_BYTES)  # a manifest is always read whole
        for k, g in items:  # the touch first: it drops a key whose lifetime is over
            vkey = self.layout.vkey(k, g)
            self._eval(pipe, "touch", g, [*self.layout.index[g], vkey], [k, 1])
            pipe.getrange(vkey, 0, first - 1)
            pipe.strlen(vkey)
        replies = pipe.execute(raise_on_error=False)
        for r in replies[1::3] + replies[2::3]:
            if isinstance(r, Exception):
                raise r
        if any(isinstance(r, NoScriptError) for r in replies[0::3]):
            self._load_scripts(client)  # only the LRU refresh was lost; next time it works
        found = [r == 1 for r in replies[0::3]]
        return self._settle(client, items, replies[1::3], replies[2::3], found)

    def _settle(
        self,
        client: redis.Redis,
        items: list[tuple[str, int]],
        heads: list[bytes],
        sizes: list[int],
        found: list[bool] | None = None,
    ) -> list[Value]:
        """Values from the first ``FIRST_READ`` bytes and the size of each key on one node.

        A value that fits is returned whole; a larger one is a :class:`Source` streamed by
        :meth:`_decode`; chunk manifests cost one more round trip (their chunks' sizes and
        first bytes). ``found`` (the touch script's replies) tells an empty value from none.
        """
        values: list[Value] = []
        for n, ((k, g), head, size) in enumerate(zip(items, heads, sizes, strict=True)):
            if not size:
                values.append(b"" if found and found[n] else None)  # b"": unreadable, dropped
            elif size <= len(head):
                values.append(head)
            else:
                vkey = self.layout.vkey(k, g)
                values.append(Source(client, [vkey], [size], head, head, watch=True))
        manifests = [i for i, v in enumerate(values) if isinstance(v, bytes) and is_manifest(v)]
        if not manifests:
            return values
        parsed = [parse_manifest(cast(bytes, values[i])) for i in manifests]  # bytes, as tested
        pipe = client.pipeline(transaction=False)
        counts = [
            self._ask_chunks(pipe, items[i][1], m) if m else 0
            for i, m in zip(manifests, parsed, strict=True)
        ]
        replies = iter(pipe.execute())
        for i, m, n in zip(manifests, parsed, counts, strict=True):
            if m:  # else _decode reports the bad manifest
                got = [next(replies) for _ in range(n)]
                seen = values[i]
                values[i] = self._chunked(client, items[i][1], m, got, seen)  # type: ignore[arg-type]
                if values[i] is None:  # replaced under us, or chunks lost: read it again
                    values[i] = self._read_again(client, *items[i], seen)  # type: ignore[arg-type]
        return values

    def _chunk_keys(self, g: int, m: dict[str, Any]) -> list[str]:
        return [self.layout.ckey(g, m["gen"], i) for i in range(m["n"])]

    def _ask_chunks(self, pipe: Any, g: int, m: dict[str, Any]) -> int:
        """Queue what reading a manifest's chunks needs (one slot: fine on a cluster); returns
        the number of replies. Up to ``FIRST_READ`` bytes in all: the chunks themselves; more:
        the size of each and the first bytes, to stream the rest."""
        chunks = self._chunk_keys(g, m)
        if m["size"] <= FIRST_READ:
            pipe.mget(chunks)
            return 1
        for c in chunks:
            pipe.strlen(c)
        pipe.getrange(chunks[0], 0, FIRST_READ - 1)
        return len(chunks) + 1

    def _chunked(
        self, client: redis.Redis, g: int, m: dict[str, Any], got: list, manifest: bytes
    ) -> Value:
        """The chunks (small) or the Source (large) of a manifest from the replies to
        :meth:`_ask_chunks`; None if one is missing or they do not add up to its size."""
        if m["size"] <= FIRST_READ:
            chunks = got[0]
            if not all(isinstance(c, bytes) for c in chunks) or sum(map(len, chunks)) != m["size"]:
                return None
            return chunks
        sizes, head = got[:-1], got[-1]
        if not all(isinstance(n, int) and n > 0 for n in sizes) or sum(sizes) != m["size"]:
            return None
        return Source(client, self._chunk_keys(g, m), sizes, head, manifest)

    def _read_again(self, client: redis.Redis, key: str, g: int, seen: bytes) -> Value:
        """Read a chunked value once more; the same manifest with chunks still missing is lost."""
        vkey = self.layout.vkey(key, g)
        pipe = client.pipeline(transaction=False)
        pipe.getrange(vkey, 0, max(FIRST_READ, MAX_MANIFEST_BYTES) - 1)
        pipe.strlen(vkey)
        head, size = pipe.execute()
        if not size or size > len(head) or not is_manifest(head):
            return self._settle(client, [(key, g)], [head], [size])[0]
        m = parse_manifest(head)
        if m is None:
            return head  # let _decode report it
        pipe = client.pipeline(transaction=False)
        self._ask_chunks(pipe, g, m)
        value = self._chunked(client, g, m, pipe.execute(), head)
        if value is None and head == seen:  # evicted by Redis' maxmemory, deleted by hand...
            return FormatError("chunks of a large value are missing")
        return value

    def _stream(self, key: str, src: Source, again: int = RETRIES) -> Record | None:
        """Decode a streamed value. One that fails is looked at again: a value changed mid-read
        (replaced, deleted, chunks evicted) is read afresh, up to ``again`` times; the same
        bytes failing again are corrupt (dropped by ``_decode``)."""
        try:
            return decode(src, key=key, signer=self.signer)
        except (Vanished, FormatError) as exc:
            if isinstance(exc, UnsupportedVersionError):
                raise
            now = self._fetch([key])[0] if again > 0 else None
            same = isinstance(now, Source) and (now.seen, now.sizes) == (src.seen, src.sizes)
            if same and isinstance(exc, FormatError):
                raise  # read whole and unchanged (WATCH held), still wrong: corrupt or forged
            if now is None:
                log.debug("redis cache: %r changed while read: %s", key, exc)
                return None
            return self._decode(key, now, again - 1)

    def _decode(self, key: str, value: Value, again: int = RETRIES) -> Record | None:
        """The record of a fetched value (see ``Value``), or None (a miss) if unreadable; an
        unreadable or forged value is counted, logged and deleted."""
        if value is None:
            return None
        try:
            if isinstance(value, FormatError):
                raise value
            if isinstance(value, Source):  # too large to have been read whole
                return self._stream(key, value, again)
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
