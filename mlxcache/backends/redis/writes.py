"""The write path of the Redis backend: a record's bytes, whole or in chunks, and its commit.

``WriteMixin`` is the half of :class:`mlxcache.backends.redis.RedisBackend` that writes: a value
up to ``chunk_size`` is set and indexed in one MULTI/EXEC, a larger one is sent in chunks under
a fresh generation and committed by one Lua script (a reader never sees half of it); a record
larger than a key group's share of the budget is refused. The backend module keeps the index
scripts, the protocol and the connection.
"""

from __future__ import annotations

import uuid
from typing import Any

from redis.exceptions import NoScriptError, RedisError

from mlxcache.backends.base import log
from mlxcache.backends.redis.chunks import MAX_CHUNKS, make_manifest
from mlxcache.records import format as st
from mlxcache.records.record import Record

PENDING_CHUNK_MS = 600_000  # chunks of an unfinished write vanish on their own after this


class WriteMixin:
    """Writing records (see the module doc)."""

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
        budget = self.group_budget
        if self.groups > 1 and budget is not None and size > budget:
            log.warning(
                "%s cache: refusing %r (%d bytes) larger than a key group's share of the "
                "budget (max_bytes=%d / groups=%d)",
                self.scheme, key, size, self.max_bytes, self.groups,
            )  # fmt: skip
            return 0
        if size <= self.chunk_size:
            return self._put_whole(key, blob)
        return self._put_chunked(key, blob)

    def _commit_args(self, key: str, size: int, info: str, manifest: bytes) -> list[Any]:
        budget = self.group_budget
        return [key, size, -1 if budget is None else budget, info, manifest]

    @property
    def _px(self) -> int | None:
        """Real-time expiry of a value just written: the sooner of ttl and idle_ttl."""
        px = min(x for x in (self._ttl_ms, self._idle_ms, 1 << 62) if x)
        return None if px == 1 << 62 else px

    def _put_whole(self, key: str, blob: bytes) -> int:
        g = self.layout.group(key)
        client = self._client(g)
        keys = [*self.layout.index[g], self.layout.vkey(key, g)]
        args = self._commit_args(key, len(blob), "", b"")
        pipe = client.pipeline(transaction=True)
        pipe.set(keys[-1], blob, px=self._px)
        self._eval(pipe, "commit", g, keys, args)
        _, result = pipe.execute(raise_on_error=False)
        if isinstance(result, NoScriptError):  # the value is set; index it now
            self._load_scripts(client)
            result = self._eval(client, "commit", g, keys, args)
        if isinstance(result, Exception):
            raise result
        return int(result[1])

    def _put_chunked(self, key: str, blob: bytes) -> int:
        g = self.layout.group(key)
        client = self._client(g)
        view = memoryview(blob)
        size, step = len(blob), self.chunk_size
        gen, n = uuid.uuid4().hex, -(-len(blob) // step)
        chunk_keys = [self.layout.ckey(g, gen, i) for i in range(n)]
        pipe = client.pipeline(transaction=False)
        for i, ck in enumerate(chunk_keys):
            pipe.set(ck, view[i * step : (i + 1) * step], px=PENDING_CHUNK_MS)
        pipe.execute()
        manifest = make_manifest(gen, n, size)
        keys = [*self.layout.index[g], self.layout.vkey(key, g), *chunk_keys]
        args = self._commit_args(key, size, f"{gen}:{n}", manifest)
        status, evicted = self._script("commit", g, args, keys)
        if status != 1:
            client.unlink(*chunk_keys)  # one slot: fine on a cluster
            raise RedisError(f"chunks of {key!r} vanished before commit (written too slowly?)")
        return int(evicted)


__all__ = ["PENDING_CHUNK_MS", "WriteMixin"]
