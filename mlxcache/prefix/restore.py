"""Restoring a PrefixCache hit: verify the fetched records, in order, and rebuild the caches.

Which length is served (the partial block, an aligned tail, the whole blocks) follows from
what verified; checkpoint layers and ``require_extras`` need a tail at that length.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxcache.prefix import records as pr
from mlxcache.prefix.plan import Match, Plan
from mlxcache.records.gather import Joined
from mlxcache.serializers.kv_quant import KVQuant


@dataclass
class Restored:
    """The rebuilt prefix: its length, new cache objects and the extras stored with it."""

    num_tokens: int
    cache: list[Any]
    extras: dict[str, mx.array]


def fetch(backend: Any, plan: Plan, match: Match, keys: list[str]) -> list[Any]:
    """The records of ``keys`` (in ``prefix_probe.fetch_keys`` order) for :func:`restore`.

    One ``get_many``; on a backend that ``joins`` (``file://``) the blocks are read straight
    into their rows of the final arrays instead (``get_joined``: no per-block arrays, no
    concatenation) and the rest (tails, the vision entry) whole, in the same call.
    """
    if not keys:
        return []
    idx = list(range(match.k + (1 if match.pm else 0)))  # the blocks lead, the partial last
    if not idx or not getattr(backend, "joins", False):
        return backend.get_many(keys)
    rows = [plan.bs] * match.k + ([match.pm] if match.pm else [])
    return list(backend.get_joined([keys[i] for i in idx], Joined(rows), keys[len(idx) :]))


def restore(
    plan: Plan,
    match: Match,
    recs: list[Any],
    require_extras: bool,
    quant: KVQuant | None,
    reject: Callable[[Exception], None],
) -> Restored | None:
    """Verify what was fetched and rebuild the longest usable length (or None).

    ``recs`` are in the order of ``prefix_probe.fetch_keys``: the leading whole blocks, then
    the partial block and its tail (or the tail at the aligned length); blocks are Records, or
    ``Placed`` ones from :func:`fetch` (already in their joined arrays). Each record that fails
    its checks goes to ``reject`` (logged and counted by the caller) and ends the prefix there.
    """
    bs, k, pm, aligned = plan.bs, match.k, match.pm, match.aligned
    blocks: list[Any] = []
    lay: list[str] | None = None
    for i in range(k):  # whole blocks, in order, until one fails
        rec = recs[i]
        if rec is None:
            break
        try:
            lay = pr.check_block(
                rec, i * bs, plan.block_tokens(i), lay, blocks[-1] if blocks else None
            )
        except pr.RecordMismatch as e:
            reject(e)
            break
        blocks.append(rec)
    kv = len(blocks)
    part_block = part_tail = None
    if pm and kv == k and (got := recs[k]) is not None:
        try:
            like = blocks[-1] if blocks else None
            lay = pr.check_block(got, k * bs, plan.block_tokens(k, pm), lay, like)
            part_block = got
            if (got_tail := recs[k + 1]) is not None:
                pr.check_tail(got_tail, k * bs + pm, plan.block_tokens(k, pm), lay)
                part_tail = got_tail
        except pr.RecordMismatch as e:
            reject(e)
    al_tail = None
    if not pm and aligned and aligned <= kv and (got := recs[k]) is not None:
        try:
            pr.check_tail(got, aligned * bs, plan.block_tokens(aligned - 1), lay)
            al_tail = got
        except pr.RecordMismatch as e:
            reject(e)
    if lay is None:
        return None
    need_tail = require_extras or pr.has_checkpoint(lay)
    # candidates (length, blocks, tail), longest first
    if part_block is not None and (part_tail is not None or not need_tail):
        choice = (k * bs + pm, [*blocks, part_block], part_tail)
    elif al_tail is not None and (aligned == kv or need_tail):
        choice = (aligned * bs, blocks[:aligned], al_tail)
    elif not need_tail and kv:
        choice = (kv * bs, blocks, None)
    else:
        return None
    num, used, tail = choice
    if not pr.windows_held(used, lay, tail):
        # a window layer's positions at num are in a block stored without them (it had
        # dropped them) and no tail holds it whole: the longest block boundary that rebuilds
        last = min(kv, num // bs)
        m = next((i for i in range(last, 0, -1) if pr.windows_held(blocks[:i], lay, None)), 0)
        if need_tail or not m:
            return None
        num, used, tail = m * bs, blocks[:m], None
    try:  # a record that verified but does not rebuild (another format, forged) is a miss
        skip = pr.tail_windows(tail)
        layers = pr.join_blocks(used, lay, quant, skip) if used else {}
        ckpt, extras = pr.read_tail(tail, lay) if tail is not None else ({}, {})
        layers.update(ckpt)
        cache = [layers[j] for j in range(len(lay))]
        mx.eval([c.state for c in cache], list(extras.values()))
    except Exception as e:
        reject(e)
        return None
    return Restored(num, cache, extras)
