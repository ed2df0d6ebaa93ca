"""Which records storing one prompt writes: its blocks not yet stored, its tail, its vision entry.

``PrefixCache.store`` asks the backend once which of the prompt's keys exist, builds only the
missing records (everything that can fail is built before any put) and writes them in this
order: the blocks, then the tail and the vision entry, which name blocks that must exist first.
A prompt that ends inside a block also gets a sibling-index entry (``add_sibling``), so a
one-trip lookup finds that partial block.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlxcache.prefix import gaps
from mlxcache.prefix import records as pr
from mlxcache.prefix.plan import Plan
from mlxcache.records.record import Record
from mlxcache.serializers.prompt_cache import dump_prompt_cache


@dataclass
class Writes:
    """What one store writes: ``todo`` (key, record, new tokens) in order, every key of the
    prompt (``keys``, for pinning and the hot tier), its sibling-index entry (or None), and
    the gap marks to delete once the writes are in (``cleared``: blocks rewritten whole, and
    stale marks of blocks written whole; ``completed`` of them were rewrites)."""

    todo: list[tuple[str, Record, int]]
    keys: list[str]
    sibling: tuple[str, bytes, list[str]] | None
    cleared: list[str] = field(default_factory=list)
    completed: int = 0


def plan_writes(
    plan: Plan,
    layers: list[Any],
    key: Callable[[str, bytes], str],
    exists: Callable[[list[str]], list[bool]],
    *,
    quant: Any,
    vision_key: str | None,
    extras: Mapping[str, Any] | None,
    vision_embeddings: Any,
    mid_prefill: bool,
) -> Writes:
    """The records a store of ``layers`` (the cache of ``plan``'s tokens) writes.

    ``key(kind, digest)`` names a record, ``exists(keys)`` is the backend's ``contains_many``
    (asked once: the prompt's keys, and the gap marks of the blocks whose window slices this
    store holds or whose positions its tail's windows need; see prefix/gaps.py);
    ``mid_prefill``: whole blocks only, plus a tail with the state of checkpoint layers at a
    block-aligned length (no extras, no vision entry)."""
    n, bs = len(plan.tokens), plan.bs
    lay = pr.layout(layers)
    n_full, r = divmod(n, bs)
    if mid_prefill:
        r, extras, vision_embeddings, vision_key = 0, None, None, None
    # (digest, block index, tokens in it) of each block; then the tail; then the vision entry
    blocks = [(h, i, bs) for i, h in enumerate(plan.full(n_full))]
    if r:
        blocks.append((plan.partial(n_full, r), n_full, r))
    keys = [key("b", h) for h, _, _ in blocks]
    tail_key = (
        key("t", plan.partial(n_full, r) if r else plan.full(n_full)[-1])
        if n_full + r and not (mid_prefill and (n % bs or not pr.has_checkpoint(lay)))
        else None
    )
    if tail_key:
        keys.append(tail_key)
    if vision_key:
        keys.append(vision_key)
    if not keys:
        return Writes([], [], None)
    # the partial block, in its parent's sibling index: a one-trip lookup finds it there
    sibling = None
    if r:
        members = [key("t", plan.partial(n_full, r)), keys[len(blocks) - 1]]
        sibling = (key("s", plan.parent(n_full)), plan.block_tokens(n_full, r), members)
    views = pr.window_views(layers, lay) if n else {}  # what window layers still hold
    # blocks this store can give whole (fill) and those its tail's windows need (marks asked)
    fill = [gaps.holds(views, i * bs, i * bs + m) for _, i, m in blocks]
    need = [s for ranges in pr.window_needs(views, lay, n).values() for s in ranges]
    ask = [
        j
        for j, (_, i, m) in enumerate(blocks)
        if fill[j] or (tail_key and gaps.overlaps(need, i * bs, i * bs + m))
    ]
    found = exists(keys + [key(gaps.KIND, blocks[j][0]) for j in ask])
    there, marked = found[: len(keys)], dict(zip(ask, found[len(keys) :], strict=True))
    todo: list[tuple[str, Record, int]] = []
    written: list[Record] = []
    gapped: list[tuple[int, int]] = []  # stored blocks marked gapped that stay so
    out = Writes(todo, keys, sibling)
    for j, ((h, i, m), k, stored) in enumerate(zip(blocks, keys, there, strict=False)):
        if stored and not marked.get(j):
            continue
        if stored and not fill[j]:
            gapped.append((i * bs, i * bs + m))
            continue
        rec = pr.block_record(layers, lay, i * bs, plan.block_tokens(i, m), m, quant, views)
        if (gap := gaps.mark(rec)) is not None:
            todo.append((key(gaps.KIND, h), gap, 0))  # the mark first: never a gap unmarked
        elif marked.get(j):
            out.cleared.append(key(gaps.KIND, h))
            out.completed += stored
        todo.append((k, rec, 0 if stored else m))
        written.append(rec)
    if tail_key and not there[len(blocks)]:
        last = n_full if r else n_full - 1
        whole = pr.window_gaps(written, views, lay, n, gapped)  # windows it must hold
        tail = pr.tail_record(layers, lay, n, plan.block_tokens(last, r or None), extras, whole)
        todo.append((tail_key, tail, 0))  # after its blocks
    if vision_key and not there[-1]:
        todo.append((vision_key, dump_prompt_cache(vision_embeddings, meta={"kind": "vision"}), 0))
    return out


__all__ = ["Writes", "plan_writes"]
