"""Prefix lookup latency of ``mlxcache.prefix.PrefixCache`` over a large number of stored blocks.

The store is filled with tiny block records (one layer, one head, dim 8) under the prefix
cache's own key space, by ``put_many`` batches (``file://`` with its default ``sync=batch``:
one sync per batch), so what is timed is the index, not tensor bytes. One real prompt is then
stored with ``PrefixCache.store`` and looked up: a full hit (every block found and fetched) and
a miss (an unseen prompt: the ``contains_many`` query alone). On Redis the round trips of each
lookup are counted at the redis-py connection.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from benchmarks.common import Row, have, time_runs

SECTION = "lookup"
BLOCK = 16  # tokens per block: small, so a short prompt spans many blocks
PROMPT = 512  # tokens in the looked-up prompt: 32 blocks
TARGET_S = 1e-3
FILL_BATCH = 1000  # block records per put_many while filling the store


def _tiny_cache(tokens: int, seed: int = 0) -> list[Any]:
    from mlx_lm.models.cache import KVCache

    mx.random.seed(seed)
    c = KVCache()
    k = mx.random.normal((1, 1, tokens, 8), dtype=mx.bfloat16)
    v = mx.random.normal((1, 1, tokens, 8), dtype=mx.bfloat16)
    mx.eval(k, v)
    c.state = (k, v, tokens)
    return [c]


def _fill(backend: Any, prefix: str, count: int) -> float:
    """Put ``count`` tiny block records under the prefix cache's key space, ``FILL_BATCH`` per
    ``put_many`` (on file:// one sync and one transaction each, as ``PrefixCache.store``);
    returns seconds."""
    from mlxcache import Record

    rec = Record(arrays={"k": mx.zeros((1, 1, BLOCK, 8), mx.bfloat16)}, meta={"tokens": BLOCK})
    put_many = getattr(backend, "put_many", None)
    t0 = time.perf_counter()
    for start in range(0, count, FILL_BATCH):
        items = [
            (f"{prefix}b/{os.urandom(32).hex()}", rec)
            for _ in range(min(FILL_BATCH, count - start))
        ]
        if put_many is not None:
            put_many(items)
        else:
            for key, r in items:
                backend.put(key, r)
    return time.perf_counter() - t0


@contextlib.contextmanager
def _count_round_trips() -> Iterator[list[int]]:
    """Count redis-py ``send_packed_command`` calls (one per command or pipeline sent)."""
    import redis.connection as rc

    counter = [0]
    cls = rc.AbstractConnection if hasattr(rc, "AbstractConnection") else rc.Connection
    original = cls.send_packed_command

    def counting(self: Any, *args: Any, **kwargs: Any) -> Any:
        counter[0] += 1
        return original(self, *args, **kwargs)

    cls.send_packed_command = counting
    try:
        yield counter
    finally:
        cls.send_packed_command = original


def _measure(label: str, uri: str, blocks: int, ctx: Any) -> list[Row]:
    from mlxcache import open_backend
    from mlxcache.prefix import PrefixCache

    backend = open_backend(uri)
    rows: list[Row] = []
    try:
        pc = PrefixCache(backend, model="bench-lookup", block_size=BLOCK)
        fill_s = _fill(backend, pc.key_prefix, blocks)
        tokens = list(range(1000, 1000 + PROMPT))
        pc.store(tokens, _tiny_cache(PROMPT))
        unseen = list(range(5000, 5000 + PROMPT))
        hit = pc.lookup(tokens)
        if hit is None or hit.num_tokens != PROMPT:
            raise RuntimeError(f"{label}: the stored prompt was not found in full ({hit})")
        if pc.lookup(unseen) is not None:
            raise RuntimeError(f"{label}: an unseen prompt was reported as a hit")
        total = len(backend)
        runs = max(ctx.repeat, 20)
        for kind, prompt in (("hit", tokens), ("miss", unseen)):
            trips: list[int] = []
            if label == "redis://":
                with _count_round_trips() as counter:
                    pc.lookup(prompt)
                trips.append(counter[0])
            stats = time_runs(lambda p=prompt: pc.lookup(p), runs, warmup=2, collect=False)
            note = f"{PROMPT} tokens, {PROMPT // BLOCK} blocks of {BLOCK}"
            if kind == "miss":
                note = "unseen prompt: contains_many only"
            extra: dict[str, Any] = {"blocks": total, "fill_seconds": round(fill_s, 1)}
            if trips:
                extra["round_trips"] = trips[0]
                note += f"; {trips[0]} round trip{'s' if trips[0] != 1 else ''}"
            target, met = None, None
            if label == "memory://":
                target, met = "< 1 ms", stats.median < TARGET_S
            elif trips:
                target, met = "1 round trip", trips[0] == 1
            rows.append(
                Row(
                    SECTION,
                    f"{label} lookup ({kind})",
                    PROMPT,
                    None,
                    "s",
                    stats,
                    target=target,
                    met=met,
                    note=note,
                    extra=extra,
                )
            )
    finally:
        backend.clear()
        backend.close()
    return rows


def run(blocks: int, disk_blocks: int, ctx: Any) -> list[Row]:
    if not have("mlxcache.prefix"):
        ctx.note("mlxcache.prefix had not landed: the prefix lookup rows are left out.")
        return []
    if not have("mlx_lm"):
        ctx.note("mlx-lm is not installed: the prefix lookup rows are left out.")
        return []
    rows = _measure("memory://", "memory://", blocks, ctx)
    if have("mlxcache.backends.disk"):
        rows += _measure("file://", f"file://{ctx.tmpdir / 'lookup-store'}", disk_blocks, ctx)
    if ctx.redis_url and have("mlxcache.backends.redis"):
        rows += _measure("redis://", ctx.redis_url, blocks, ctx)
    return rows
