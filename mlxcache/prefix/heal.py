"""Healing: write a hot entry's records back when the backend has lost them.

When Redis restarts without persistence (or a cache folder is wiped), the prompts hot in one
worker's hot tier are still served there, but every other worker misses them until one of
them recomputes the prompt. A hot hit already asks the backend about its entry's records
now and then (with the LRU touch, at most once per ``TOUCH_EVERY`` seconds per entry); the
records it finds missing are rebuilt from the entry (its layers, extras and vision
embeddings are exactly what ``store`` was given, or what a verified hit assembled) and
written back on the cache's writer thread, so the other workers hit them again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxcache.backends.base import CacheBackend, put_all
from mlxcache.backends.chains import add_sibling
from mlxcache.prefix import gaps
from mlxcache.prefix import records as pr
from mlxcache.prefix.hot import HotEntry
from mlxcache.prefix.plan import Plan
from mlxcache.records.record import Record
from mlxcache.serializers.prompt_cache import dump_prompt_cache

Key = Callable[[str, bytes], str]
Sibling = tuple[str, bytes, list[str]]


def lost(backend: CacheBackend, keys: list[str]) -> list[str]:
    """The keys the backend does not hold; none when it did not answer (a failed
    ``contains_many`` reads all False: that is no reason to write anything)."""
    counters = getattr(backend, "counters", None)
    before = counters().get("errors", 0) if counters else 0
    there = backend.contains_many(keys)
    if counters and counters().get("errors", 0) != before:
        return []
    return [k for k, ok in zip(keys, there, strict=True) if not ok]


def rebuild(
    plan: Plan, entry: HotEntry, key: Key, wanted: set[str], vision_key: str | None
) -> tuple[list[tuple[str, Record]], Sibling | None]:
    """The records of ``entry`` (a prefix of ``plan``'s tokens) whose keys are in ``wanted``,
    in store's order (blocks, the tail, the vision entry), and the sibling index entry of a
    partial last block. A tail is rebuilt only for an entry at a stored length (``stored``:
    its extras are the stored ones), so no length gains a tail it never had."""
    bs = plan.bs
    n = entry.num_tokens
    a, p = divmod(n, bs)
    layers, lay = entry.layers, pr.layout(entry.layers)
    blocks = [(h, i, bs) for i, h in enumerate(plan.full(a))]
    if p:
        blocks.append((plan.partial(a, p), a, p))
    out: list[tuple[str, Record]] = []
    written: list[Record] = []
    views = pr.window_views(layers, lay)
    for h, i, m in blocks:
        if key("b", h) in wanted:
            rec = pr.block_record(layers, lay, i * bs, plan.block_tokens(i, m), m, None, views)
            if (gap := gaps.mark(rec)) is not None:  # a block without a window slice: marked
                out.append((key(gaps.KIND, h), gap))
            out.append((key("b", h), rec))
            written.append(rec)
    sibling = None
    tail_key = key("t", plan.partial(a, p) if p else plan.full(a)[-1])
    if entry.stored and tail_key in wanted:
        last = a if p else a - 1
        tokens = plan.block_tokens(last, p or None)
        whole = pr.window_gaps(written, views, lay, n)
        out.append((tail_key, pr.tail_record(layers, lay, n, tokens, entry.extras, whole)))
        if p:
            sibling = (
                key("s", plan.parent(a)),
                plan.block_tokens(a, p),
                [tail_key, key("b", blocks[-1][0])],
            )
    if entry.vision is not None and vision_key is not None and vision_key in wanted:
        out.append((vision_key, dump_prompt_cache(entry.vision, meta={"kind": "vision"})))
    return out, sibling


def write_back(backend: CacheBackend, todo: list[tuple[str, Record]], sibling: Any) -> int:
    """Store rebuilt records (then the sibling entry); returns how many the backend kept."""
    put_all(backend, todo)
    kept = backend.contains_many([k for k, _ in todo]) if todo else []
    if sibling is not None and all(kept):
        add_sibling(backend, *sibling)
    return sum(kept)
