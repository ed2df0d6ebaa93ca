"""Beyond one tier and one server: background stores, tiered reads, Redis Cluster vs one Redis.

Rows (ratios are ``baseline time / our time``, > 1 = faster):

- ``PrefixCache.store`` wait, background vs synchronous: the time the caller is blocked for the
  same request (fresh keys each run), on Redis (or file:// without it).
- ``tiered://`` get on an L1 hit and on an L2 hit (memory over file), against ``file://`` alone.
- put/get on ``redis+cluster://`` (a local 3+3 cluster) against one ``redis://``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from benchmarks.common import Row, Stats, kv_arrays, payload_bytes, speed_ratio, time_runs
from mlxcache import PrefixCache, Record, open_backend
from mlxcache.backends.disk import DiskBackend
from mlxcache.backends.memory import MemoryBackend
from mlxcache.backends.tiered import TieredBackend

SECTION = "scale"
TESTS = Path(__file__).resolve().parent.parent / "tests"


def _row(name: str, tokens: int, nbytes: int, stats: Stats, base: str | None, ratio, note=""):
    return Row(
        SECTION, name, tokens, nbytes, "s", stats, baseline=base, ratio=ratio,
        ratio_kind="speed vs baseline (>1 = faster)" if base else "limit", note=note,
    )  # fmt: skip


def _caches(arrays: dict[str, Any], tokens: int) -> list[Any]:
    from mlx_lm.models.cache import KVCache

    out = []
    for layer in range(len(arrays) // 2):
        c = KVCache()
        c.state = (arrays[f"layers.{layer}.keys"], arrays[f"layers.{layer}.values"], tokens)
        out.append(c)
    return out


def _store_rows(tokens: int, arrays: dict[str, Any], ctx: Any, uri: str, where: str) -> list[Row]:
    nbytes = payload_bytes(arrays)
    caches = _caches(arrays, tokens)
    ids = list(range(1, tokens + 1))
    backend = open_backend(uri)
    runs = {"n": 0}

    def fresh() -> PrefixCache:
        runs["n"] += 1  # a new salt: every run writes all its blocks
        return PrefixCache(
            backend, model="bench", block_size=256, salt=f"run{runs['n']}", hot_bytes=0
        )

    state: dict[str, PrefixCache] = {}

    def setup() -> None:
        state["pc"] = fresh()

    def sync() -> None:
        if state["pc"].store(ids, caches) != tokens:
            raise RuntimeError("store did not keep the request")

    def background() -> None:
        state["pc"].store(ids, caches, background=True)

    def settle() -> None:
        pc = state["pc"]
        pc.flush()
        if pc.stats()["tokens_written"] != tokens:
            raise RuntimeError("background store did not keep the request")
        pc.close()

    s_sync = time_runs(sync, ctx.repeat, setup=setup, warmup=1)
    s_bg = time_runs(background, ctx.repeat, setup=setup, teardown=settle, warmup=1)
    backend.clear()
    backend.close()
    return [
        _row(f"PrefixCache.store, sync ({where})", tokens, nbytes, s_sync, None, None),
        _row(
            f"PrefixCache.store, background=True: caller's wait ({where})",
            tokens,
            nbytes,
            s_bg,
            f"PrefixCache.store, sync ({where})",
            speed_ratio(s_bg, s_sync),
        ),  # fmt: skip
    ]


def _tiered_rows(tokens: int, record: Record, ctx: Any) -> list[Row]:
    nbytes = record.nbytes
    disk_path = ctx.tmpdir / f"scale-file-{tokens}"
    alone = DiskBackend(disk_path)
    alone.put("k", record)
    tiered = TieredBackend(MemoryBackend(), f"file://{ctx.tmpdir}/scale-tier-{tokens}")
    tiered.put("k", record)

    held: dict[str, Any] = {}  # results are freed outside the timed part (freeing costs too)

    def get(b) -> None:
        held["r"] = b.get("k")
        if held["r"] is None:
            raise RuntimeError("tiered benchmark: miss")

    def drop() -> None:
        held.clear()

    def drop_l1() -> None:
        held.clear()
        tiered.l1.clear()

    s_file = time_runs(lambda: get(alone), ctx.repeat, setup=drop, warmup=1)
    s_l1 = time_runs(lambda: get(tiered), ctx.repeat, setup=drop, warmup=1)
    s_l2 = time_runs(lambda: get(tiered), ctx.repeat, setup=drop_l1, warmup=1)
    rows = [
        _row("file:// get alone", tokens, nbytes, s_file, None, None),
        _row(
            "tiered:// get, L1 hit (memory)",
            tokens,
            nbytes,
            s_l1,
            "file:// get alone",
            speed_ratio(s_l1, s_file),
        ),  # fmt: skip
        _row(
            "tiered:// get, L2 hit (file, fills L1)",
            tokens,
            nbytes,
            s_l2,
            "file:// get alone",
            speed_ratio(s_l2, s_file),
        ),  # fmt: skip
    ]
    tiered.close()
    alone.close()
    return rows


def _cluster_rows(tokens: int, record: Record, ctx: Any, cluster_url: str) -> list[Row]:
    nbytes = record.nbytes
    rows = []
    stats: dict[str, Stats] = {}
    for name, uri in (("redis://", ctx.redis_url), ("redis+cluster://", cluster_url)):
        b = open_backend(uri)
        stats[f"{name} put"] = time_runs(lambda b=b: b.put("k", record), ctx.repeat, warmup=1)

        held: dict[str, Any] = {}

        def get(b=b, name=name, held=held) -> None:
            held["r"] = b.get("k")  # freed outside the timed part
            if held["r"] is None:
                raise RuntimeError(f"{name}: miss")

        stats[f"{name} get"] = time_runs(get, ctx.repeat, setup=held.clear, warmup=1)
        b.clear()
        b.close()
    for op in ("put", "get"):
        single, cl = stats[f"redis:// {op}"], stats[f"redis+cluster:// {op}"]
        rows.append(_row(f"redis:// {op}", tokens, nbytes, single, None, None))
        rows.append(
            _row(
                f"redis+cluster:// {op} (3 primaries)",
                tokens,
                nbytes,
                cl,
                f"redis:// {op}",
                speed_ratio(cl, single),
            )  # fmt: skip
        )
    return rows


def run(sizes: list[int], ctx: Any) -> list[Row]:
    rows: list[Row] = []
    cluster = None
    if ctx.redis_url:
        try:
            if str(TESTS) not in sys.path:
                sys.path.insert(0, str(TESTS))
            from redis_cluster import LocalCluster

            cluster = LocalCluster(node_timeout_ms=15000)  # Redis' default: no failover
        except Exception as exc:  # a benchmark without a cluster still reports the rest
            ctx.note(f"no local Redis Cluster ({exc}): the cluster rows are left out.")
    try:
        for tokens in sizes:
            arrays = kv_arrays(tokens, seed=7)
            record = Record(arrays, {"tokens": tokens})
            uri = ctx.redis_url or f"file://{ctx.tmpdir}/scale-store-{tokens}"
            rows += _store_rows(tokens, arrays, ctx, uri, "redis" if ctx.redis_url else "file")
            rows += _tiered_rows(tokens, record, ctx)
            if cluster is not None:
                rows += _cluster_rows(tokens, record, ctx, cluster.url)
    finally:
        if cluster is not None:
            cluster.close()
    return rows
