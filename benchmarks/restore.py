"""Restores for another worker against the speed of the disk (issue 20).

The KV of Qwen2-VL-2B's shape (28 layers, 2 KV heads, head dim 128, bf16: 28,672 bytes a
token) in 256-token blocks, stored by one ``PrefixCache`` and looked up (+ ``mx.eval``) by a
second one on the same URI with ``hot_bytes=0``, against:

- ``file://``: ``mx.load`` + eval of ONE safetensors file holding the same arrays, with MLX's
  buffer cache emptied before each run (cold allocator: a new worker) and kept (warm: a server
  that restored or loaded the same size before);
- ``file://`` get + eval of one 256 MiB record against ``mx.load`` + eval of that file;
- ``redis://``: one ``GET`` of the same bytes on a plain socket, the value read straight into
  one buffer (``recv_into``), + ``mx.array`` of it, on the benchmark's own redis-server;
- ``SharedPromptCache.fetch_nearest_cache`` of another worker's 2k-token prompt (a
  TinyLlama-shaped cache, as in the peers section) against mlx-lm's ``load_prompt_cache`` +
  eval of that prompt's file.

Alternating, medians of ``repeat`` runs, MLX's buffer cache emptied before each unless a row
says "warm allocator". Targets: file:// and redis:// >= 0.8x, the
SharedPromptCache row >= 1.0x.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import mlx.core as mx
import numpy as np

from benchmarks.common import Row, Stats, evaluate, have, kv_cache, time_alternating

SECTION = "restore"
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 28, 2, 128, 256  # Qwen2-VL-2B's language model
TARGETS = {"file://": 0.8, "redis://": 0.8, "shared": 1.0}


def qwen2vl_cache(tokens: int, seed: int = 0) -> list[Any]:
    """28 evaluated mlx-lm KVCache layers of ``tokens`` random bf16 keys/values."""
    return kv_cache(tokens, LAYERS, KV_HEADS, HEAD_DIM, seed)


def _row(name: str, n: int, nbytes: int, st: Stats, base: str, base_st: Stats, goal: float,
         note: str) -> Row:  # fmt: skip
    ratio = base_st.median / st.median if st.median > 0 else None
    return Row(
        SECTION, name, n, nbytes, "s", st, baseline=base, ratio=ratio,
        ratio_kind="baseline / ours (>1 = ours faster)", target=f">= {goal}x",
        met=None if ratio is None else ratio >= goal, note=note,
    )  # fmt: skip


def _restorer(uri: str, tokens: list[int], cache: list[Any]) -> Any:
    """Store ``cache`` with one PrefixCache; the lookup + eval of a second one on ``uri``."""
    from mlxcache import PrefixCache

    salt = uuid.uuid4().hex
    with PrefixCache(uri, model="qwen2-vl-2b-shaped", salt=salt, hot_bytes=0) as w:
        w.store(tokens, cache)
    reader = PrefixCache(uri, model="qwen2-vl-2b-shaped", salt=salt, hot_bytes=0)

    def restore() -> None:
        hit = reader.lookup(tokens)
        if hit is None or hit.num_tokens != len(tokens):
            raise RuntimeError(f"restore of {len(tokens)} tokens from {uri} missed")
        mx.eval([c.state for c in hit.prompt_cache])

    return reader, restore


def _file_rows(n: int, ctx: Any) -> list[Row]:
    cache = qwen2vl_cache(n)
    tokens = list(range(1, n + 1))
    root = ctx.tmpdir / f"restore-{n}"
    path = str(ctx.tmpdir / f"restore-{n}.safetensors")
    mx.save_safetensors(
        path,
        {
            f"{j}.{s}": a
            for j, c in enumerate(cache)
            for s, a in zip("kv", c.state[:2], strict=True)
        },
    )
    nbytes = os.path.getsize(path)

    def load() -> None:
        mx.eval(list(mx.load(path).values()))

    reader, restore = _restorer(f"file://{root}?sync=never", tokens, cache)
    del cache
    try:
        cold = time_alternating({"load": load, "ours": restore}, ctx.repeat)
        # a server's case: MLX's buffer cache holds the buffers of the last restore/load
        warm = time_alternating({"load": load, "ours": restore}, ctx.repeat, clear=False)
        mx.clear_cache()
    finally:
        reader.backend.clear()
        reader.close()
        os.unlink(path)
    note = f"{n // BLOCK} block files read into the final arrays, every byte verified"
    return [
        _row(
            f"file:// PrefixCache lookup + eval, another worker ({kind} allocator)", n, nbytes,
            st["ours"], "mx.load + eval of one file", st["load"], TARGETS["file://"], note=note,
        )
        for kind, st in (("cold", cold), ("warm", warm))
    ]  # fmt: skip


def _record_rows(ctx: Any) -> list[Row]:
    """``file://`` get (+ eval) of ONE record of 256 MiB against ``mx.load`` + eval of that
    very file (a record file is a safetensors file)."""
    from mlxcache import Record, open_backend

    n = -(-(256 << 20) // (LAYERS * 2 * KV_HEADS * HEAD_DIM * 2)) if not ctx.smoke else 512
    cache = qwen2vl_cache(n)
    arrays = {
        f"{j}.{s}": a for j, c in enumerate(cache) for s, a in zip("kv", c.state[:2], strict=True)
    }
    backend = open_backend(f"file://{ctx.tmpdir / 'restore-record'}?sync=never")
    backend.put("one", Record(arrays, {"kind": "bench"}))
    del cache, arrays
    path = str(backend._data / backend._lookup(["one"])["one"])
    nbytes = os.path.getsize(path)

    def get() -> None:
        rec = backend.get("one")
        if rec is None:
            raise RuntimeError("the record did not read back")
        mx.eval(list(rec.arrays.values()))

    def load() -> None:
        mx.eval(list(mx.load(path).values()))

    try:
        st = time_alternating({"load": load, "get": get}, ctx.repeat)
    finally:
        backend.clear()
        backend.close()
    return [
        _row(
            "file:// get + eval of one record", n, nbytes, st["get"],
            "mx.load + eval of the same file", st["load"], TARGETS["file://"],
            note="one 256 MiB record, every byte verified",
        )
    ]  # fmt: skip


def _redis_rows(n: int, ctx: Any) -> list[Row]:
    import redis

    cache = qwen2vl_cache(n)
    tokens = list(range(1, n + 1))
    arrays = [a for c in cache for a in c.state[:2]]
    blob = b"".join(bytes(memoryview(a)) for a in arrays)
    client = redis.Redis.from_url(ctx.redis_url)
    client.set("restore-bench-blob", blob)
    nbytes, shape = len(blob), (len(arrays), *arrays[0].shape)
    del blob, arrays

    get, sock = _socket_get(ctx.redis_url, b"restore-bench-blob", nbytes, shape)

    reader, restore = _restorer(ctx.redis_url, tokens, cache)
    del cache
    try:
        st = time_alternating({"get": get, "ours": restore}, ctx.repeat)
    finally:
        reader.backend.clear()
        reader.close()
        client.delete("restore-bench-blob")
        client.close()
        sock.close()
    return [
        _row(
            "redis:// PrefixCache lookup + eval, another worker", n, nbytes, st["ours"],
            "one GET of the same bytes read off the socket into one buffer + mx.array",
            st["get"], TARGETS["redis://"],
            note="one walk_chain round trip; block records decoded, then concatenated",
        )
    ]  # fmt: skip


def _socket_get(url: str, key: bytes, nbytes: int, shape: tuple[int, ...]) -> Any:
    """The floor of a Redis read: ``GET`` on a plain socket, the value read straight into one
    unfilled buffer (``recv_into``), then ``mx.array`` of it (a copy into MLX's memory)."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(url)
    sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379))
    request = b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(key), key)
    head_len = len(b"$%d\r\n" % nbytes)

    def get() -> None:
        sock.sendall(request)
        buf = np.empty(head_len + nbytes + 2, np.uint8)
        view, got = memoryview(buf), 0
        while got < len(buf):
            n = sock.recv_into(view[got:])
            if not n:
                raise RuntimeError("redis closed the connection")
            got += n
        if bytes(view[:head_len]) != b"$%d\r\n" % nbytes:
            raise RuntimeError(f"unexpected reply {bytes(view[:32])!r}")
        raw = buf[head_len : head_len + nbytes].view(np.uint16).reshape(shape)
        mx.eval(mx.array(raw).view(mx.bfloat16))

    return get, sock


def _shared_rows(ctx: Any) -> list[Row]:
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from benchmarks.peers_lm import MODEL_KEY, tinyllama_cache
    from mlxcache import open_backend
    from mlxcache.integrations.mlx_lm.prompt_cache import SharedPromptCache

    tokens = 256 if ctx.smoke else 2048
    cache = tinyllama_cache(tokens)
    ids = np.random.default_rng(3).integers(1, 32000, size=tokens + 16).tolist()
    prompt, request = ids[:tokens], ids
    path = str(ctx.tmpdir / "restore-shared.safetensors")
    save_prompt_cache(path, cache)
    nbytes = os.path.getsize(path)
    backend = open_backend(f"file://{ctx.tmpdir / 'restore-shared'}?sync=never")
    salt = uuid.uuid4().hex
    first = SharedPromptCache(max_size=10, backend=backend, salt=salt)
    first.insert_cache(MODEL_KEY, prompt, cache)
    first.flush()
    first.close()

    def other() -> None:
        worker = SharedPromptCache(max_size=10, backend=backend, salt=salt)
        got, rest = worker.fetch_nearest_cache(MODEL_KEY, request)
        if got is None or len(rest) != len(request) - tokens:
            raise RuntimeError("another worker did not find the shared prefix")
        evaluate([[c.keys, c.values] for c in got])

    try:
        st = time_alternating(
            {"load": lambda: evaluate(load_prompt_cache(path)), "other": other}, ctx.repeat
        )
    finally:
        backend.clear()
        backend.close()
        os.unlink(path)
    return [
        _row(
            "SharedPromptCache (file://) fetch_nearest_cache, another worker", tokens, nbytes,
            st["other"], "mlx-lm load_prompt_cache + eval of the prompt's file", st["load"],
            TARGETS["shared"], note="TinyLlama-shaped 2k-token prompt, empty hot tier",
        )
    ]  # fmt: skip


def run(lengths: list[int], ctx: Any) -> list[Row]:
    if not have("mlx_lm"):
        ctx.note("mlx-lm is missing: restore rows left out.")
        return []
    rows: list[Row] = []
    for n in lengths:
        rows += _file_rows(n, ctx)
    if getattr(ctx, "redis_url", None):
        rows += _redis_rows(lengths[min(1, len(lengths) - 1)], ctx)
    rows += _record_rows(ctx)
    rows += _shared_rows(ctx)
    for r in rows:
        print(f"restore: {r.name} ({r.tokens} tokens): {r.ratio:.2f}x, target {r.target}",
              flush=True)  # fmt: skip
    return rows
