"""Prefix lookup latency of ``mlxcache.prefix.PrefixCache`` over a large number of stored blocks.

The store is filled with tiny block records (one layer, one head, dim 8) under the prefix
cache's own key space, by ``put_many`` batches (``file://`` with its default ``sync=batch``:
one sync per batch), so what is timed is the index, not tensor bytes. One real prompt is then
stored with ``PrefixCache.store`` and looked up: a full hit (every block found and fetched), a
partial hit (a chat turn 2 whose turn 1 ended inside a block) and a miss (an unseen prompt). On
Redis the round trips of each lookup are counted at the redis-py connection, and the one-trip
``walk_chain`` path is timed against the default ``contains_many`` + ``get_many`` path on the
same store, alternating, in the same run.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from benchmarks.common import Row, Stats, have, time_runs

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


def _default_path(uri: str) -> Any:
    """The same Redis store with the one-trip ``walk_chain`` off: the default lookup path
    (``contains_many`` + ``get_many``), the baseline measured in the same run."""
    from mlxcache.backends.redis import RedisBackend

    class DefaultPath(RedisBackend):
        def walk_chain(self, walk: Any) -> None:
            return None

    return DefaultPath(uri)


def _trips(pc: Any, prompt: list[int]) -> int:
    """Round trips of one lookup (the fleet counters, flushed at most once a second by any
    call, are flushed first: that pipeline is no part of a lookup)."""
    pc.backend.flush_counters()
    with _count_round_trips() as counter:
        pc.lookup(prompt)
    return counter[0]


def _interleaved(pc: Any, base: Any, prompt: list[int], runs: int) -> tuple[Stats, Stats]:
    """Time the walk and the default path call by call, alternating which goes first, so a
    loaded machine slows both alike (the garbage collector paused, as in ``time_runs``)."""
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(2):
        pc.lookup(prompt), base.lookup(prompt)
    gc.collect()
    gc.disable()
    try:
        for i in range(runs):
            for who in (0, 1) if i % 2 else (1, 0):
                c = pc if who == 0 else base
                t0 = time.perf_counter()
                c.lookup(prompt)
                times[who].append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return Stats.of(times[0]), Stats.of(times[1])


def _measure(label: str, uri: str, blocks: int, ctx: Any) -> list[Row]:
    from mlxcache import open_backend
    from mlxcache.prefix import PrefixCache

    backend = open_backend(uri)
    redis = label == "redis://"
    baseline = _default_path(uri) if redis else None
    rows: list[Row] = []
    try:
        pc = PrefixCache(backend, model="bench-lookup", block_size=BLOCK, hot_bytes=0)
        base = (
            PrefixCache(baseline, model="bench-lookup", block_size=BLOCK, hot_bytes=0)
            if redis
            else None
        )
        fill_s = _fill(backend, pc.key_prefix, blocks)
        tokens = list(range(1000, 1000 + PROMPT))
        pc.store(tokens, _tiny_cache(PROMPT))
        # a chat turn 1 that ended inside a block, and its turn 2 (the match ends in that block)
        turn1 = list(range(20000, 20000 + PROMPT - BLOCK // 2))
        pc.store(turn1, _tiny_cache(len(turn1), seed=1))
        turn2 = list(range(20000, 20000 + PROMPT + 2 * BLOCK))
        unseen = list(range(5000, 5000 + PROMPT))
        for cache in (pc, base) if base else (pc,):
            hit = cache.lookup(tokens)
            if hit is None or hit.num_tokens != PROMPT:
                raise RuntimeError(f"{label}: the stored prompt was not found in full ({hit})")
            hit = cache.lookup(turn2)
            if hit is None or hit.num_tokens != len(turn1):
                raise RuntimeError(f"{label}: turn 2 did not reuse turn 1 ({hit})")
            if cache.lookup(unseen) is not None:
                raise RuntimeError(f"{label}: an unseen prompt was reported as a hit")
        total = len(backend)
        runs = max(ctx.repeat, 20)
        kinds = (("hit", tokens), ("partial", turn2), ("miss", unseen))
        for kind, prompt in kinds:
            note = {
                "hit": f"{PROMPT} tokens, {PROMPT // BLOCK} blocks of {BLOCK}",
                "partial": f"turn 2 ({len(turn2)} tokens) reuses turn 1 ({len(turn1)}, "
                "ending inside a block)",
                "miss": "unseen prompt",
            }[kind]
            extra: dict[str, Any] = {"blocks": total, "fill_seconds": round(fill_s, 1)}
            target, met, ratio = None, None, None
            if redis:
                trips, base_trips = _trips(pc, prompt), _trips(base, prompt)
                stats, default = _interleaved(pc, base, prompt, 3 * runs)
                ratio = default.median / stats.median
                extra |= {"round_trips": trips, "round_trips_default": base_trips,
                          "default_median_s": default.median}  # fmt: skip
                note += (
                    f"; {trips} round trip{'s' if trips != 1 else ''} "
                    f"(default path: {base_trips}, {default.median * 1e3:.2f} ms)"
                )
                target, met = "1 round trip", trips == 1
            else:
                stats = time_runs(lambda p=prompt: pc.lookup(p), runs, warmup=2, collect=False)
                if label == "memory://":
                    target, met = "< 1 ms", stats.median < TARGET_S
            rows.append(
                Row(
                    SECTION,
                    f"{label} lookup ({kind})",
                    PROMPT,
                    None,
                    "s",
                    stats,
                    baseline="default path (contains_many + get_many)" if redis else None,
                    ratio=ratio,
                    ratio_kind="default path / walk_chain (>1 = faster)" if redis else "",
                    target=target,
                    met=met,
                    note=note,
                    extra=extra,
                )
            )
    finally:
        backend.clear()
        backend.close()
        if baseline is not None:
            baseline.close()
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
