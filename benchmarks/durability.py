"""``file://`` put cost under each ``?sync=`` setting (always, batch, never), in one run.

Four workloads, each timed under the three settings in alternating order (ratio = time under
``sync=always`` / time under the setting, > 1 = faster): a ``put_many`` of many tiny block
records (what the lookup benchmark fills), a ``put_many`` of 16 blocks of 1 MiB (a prompt's
blocks in one ``PrefixCache.store``), the same 16 blocks as 16 single ``put`` calls, and one
``put`` of the benchmark's 512-token KV record (58.7 MB). Before each timed run every store is
cleared, so no setting pays for another's unwritten pages.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from benchmarks.common import Row, have, kv_arrays, payload_bytes, time_alternating

SECTION = "durability"
MODES = ("always", "batch", "never")


def _blob(nbytes: int, seed: int) -> Any:
    from mlxcache import Record

    a = mx.random.randint(0, 256, (nbytes,), dtype=mx.uint8, key=mx.random.key(seed))
    mx.eval(a)
    return Record({"x": a}, {"seed": seed})


def _workloads(ctx: Any) -> list[tuple[str, int, int, Callable[[Any, str], None]]]:
    """(name, tokens or None, tensor bytes, fn(backend, fresh key prefix))."""
    from mlxcache import Record

    tiny_n = 32 if ctx.smoke else 1000
    tiny = Record({"k": mx.zeros((1, 1, 16, 8), mx.bfloat16)}, {"tokens": 16})
    mid_size = 2**14 if ctx.smoke else 2**20
    mids = [_blob(mid_size, i) for i in range(4 if ctx.smoke else 16)]
    big_tokens = 8 if ctx.smoke else 512
    arrays = kv_arrays(big_tokens)
    big = Record(arrays=arrays, meta={"tokens": big_tokens, "model": "bench"})
    mid_label = f"{len(mids)} blocks of {mid_size // 1024} KiB"

    def tiny_many(b: Any, g: str) -> None:
        b.put_many([(f"{g}/{i}", tiny) for i in range(tiny_n)])

    def mid_many(b: Any, g: str) -> None:
        b.put_many([(f"{g}/{i}", r) for i, r in enumerate(mids)])

    def mid_each(b: Any, g: str) -> None:
        for i, r in enumerate(mids):
            b.put(f"{g}/{i}", r)

    def big_one(b: Any, g: str) -> None:
        b.put(f"{g}/big", big)

    return [
        (f"put_many, {tiny_n} tiny blocks", 0, tiny_n * tiny.nbytes, tiny_many),
        (f"put_many, {mid_label}", 0, len(mids) * mid_size, mid_many),
        (f"{len(mids)} single puts, {mid_label}", 0, len(mids) * mid_size, mid_each),
        ("put, one KV record", big_tokens, payload_bytes(arrays), big_one),
    ]


def _time_modes(
    stores: dict[str, Any], fn: Callable[[Any, str], None], fresh: Any, repeat: int
) -> dict[str, Any]:
    """Time ``fn`` on each store in alternating order, every store cleared before each run."""
    group = {m: f"g{next(fresh)}" for m in stores}

    def clear_all(m: str) -> None:
        for b in stores.values():
            b.clear()  # unlinked files drop their unwritten pages: nothing carries over
        group[m] = f"g{next(fresh)}"

    return time_alternating(
        {m: (lambda m=m: fn(stores[m], group[m])) for m in stores},
        repeat,
        setup={m: (lambda m=m: clear_all(m)) for m in stores},
        warmup=1,
        clear=False,
    )


def run(ctx: Any) -> list[Row]:
    if not have("mlxcache.backends.disk"):
        ctx.note("mlxcache.backends.disk is missing: the durability rows are left out.")
        return []
    from mlxcache import open_backend

    stores = {m: open_backend(f"file://{ctx.tmpdir / f'sync-{m}'}?sync={m}") for m in MODES}
    if any(b.stats().get("sync") != m for m, b in stores.items()):
        ctx.note("file:// has no sync option here: the durability rows are left out.")
        return []
    fresh = itertools.count()
    rows: list[Row] = []
    try:
        for name, tokens, nbytes, fn in _workloads(ctx):
            stats = _time_modes(stores, fn, fresh, ctx.repeat)
            for m in MODES:
                base = stats["always"].median
                rows.append(
                    Row(
                        SECTION,
                        f"file:// {name}, sync={m}",
                        tokens or None,
                        nbytes,
                        "s",
                        stats[m],
                        baseline=None if m == "always" else "sync=always",
                        ratio=None if m == "always" else base / max(stats[m].median, 1e-12),
                        ratio_kind="" if m == "always" else "sync=always / this (>1 = faster)",
                    )
                )
    finally:
        for b in stores.values():
            b.clear()
            b.close()
    return rows
