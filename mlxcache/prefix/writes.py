"""Which records storing one prompt writes: its blocks not yet stored, its tail, its vision entry.

``PrefixCache.store`` asks the backend once which of the prompt's keys exist, builds only the
missing records (everything that can fail is built before any put) and writes them in this
order: the blocks, then the tail and the vision entry, which name blocks that must exist first.
A prompt that ends inside a block also gets a sibling-index entry (``add_sibling``), so a
one-trip lookup finds that partial block.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mlxcache.prefix import records as pr
from mlxcache.prefix.plan import Plan
from mlxcache.records.record import Record
from mlxcache.serializers.prompt_cache import dump_prompt_cache


@dataclass
class Writes:
    """What one store writes: ``todo`` (key, record, new tokens) in order, every key of the
    prompt (``keys``, for pinning and the hot tier) and its sibling-index entry (or None)."""

    todo: list[tuple[str, Record, int]]
    keys: list[str]
    sibling: tuple[str, bytes, list[str]] | None


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

    ``key(kind, digest)`` names a record, ``exists(keys)`` is the backend's ``contains_many``;
    ``mid_prefill``: whole blocks only, plus a tail with the state of checkpoint layers at a
    block-aligned length (no extras, no vision entry)."""
    n, bs = len(plan.tokens), plan.bs
    lay = pr.layout(layers)
    n_full, r = divmod(n, bs)
    if mid_prefill:
        r, extras, vision_embeddings, vision_key = 0, None, None, None
    # (key, block index, tokens in it) for blocks; then the tail; then the vision entry
    blocks = [(key("b", h), i, bs) for i, h in enumerate(plan.full(n_full))]
    if r:
        blocks.append((key("b", plan.partial(n_full, r)), n_full, r))
    keys = [k for k, _, _ in blocks]
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
        members = [key("t", plan.partial(n_full, r)), blocks[-1][0]]
        sibling = (key("s", plan.parent(n_full)), plan.block_tokens(n_full, r), members)
    there = exists(keys)
    todo: list[tuple[str, Record, int]] = []
    views = pr.window_views(layers, lay) if n else {}  # what window layers still hold
    for (k, i, m), stored in zip(blocks, there, strict=False):
        if not stored:
            rec = pr.block_record(layers, lay, i * bs, plan.block_tokens(i, m), m, quant, views)
            todo.append((k, rec, m))
    if tail_key and not there[len(blocks)]:
        last = n_full if r else n_full - 1
        whole = pr.window_gaps([rec for _, rec, _ in todo], lay, n)  # windows it must hold
        tail = pr.tail_record(layers, lay, n, plan.block_tokens(last, r or None), extras, whole)
        todo.append((tail_key, tail, 0))  # after its blocks
    if vision_key and not there[-1]:
        todo.append((vision_key, dump_prompt_cache(vision_embeddings, meta={"kind": "vision"}), 0))
    return Writes(todo, keys, sibling)


__all__ = ["Writes", "plan_writes"]
