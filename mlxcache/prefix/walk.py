"""A PrefixCache lookup as one ``walk_chain`` (one round trip on Redis; docs/prefix.md).

:func:`chain_walk` phrases a request's keys as a :class:`~mlxcache.backends.base.ChainWalk`;
:func:`read_walk` checks the backend's answer against the keys the request computes and puts
its records in the order of the default path's ``get_many``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlxcache import hashing
from mlxcache.backends.base import log
from mlxcache.backends.chains import ChainFound, ChainWalk

TOKEN_BYTES = len(hashing.tokens_bytes([0]))  # one token in a sibling label (int64)

Key = Callable[[str, bytes], str]


def chain_walk(plan: Any, key: Key, vkey: str | None) -> ChainWalk:
    """Whole blocks ``b/`` (marks: their ``t/``), the sibling index ``s/`` of each block's
    parent with the request's tokens as labels, the trailing candidates ``r..1`` as ends."""
    bs = plan.bs
    n_full, r = divmod(len(plan.tokens), bs)
    full = plan.full(n_full)
    parts = [plan.partial(n_full, m) for m in range(r, 0, -1)]
    return ChainWalk(
        chain=[key("b", h) for h in full],
        marks=[key("t", h) for h in full],
        siblings=[key("s", plan.parent(i)) for i in range(n_full)],
        labels=hashing.tokens_bytes(plan.tokens[: n_full * bs]),
        label_size=bs * TOKEN_BYTES,
        unit=TOKEN_BYTES,
        ends=[[key("t", p), key("b", p)] for p in parts],
        extras=[vkey] if vkey else [],
    )


def read_walk(plan: Any, key: Key, found: ChainFound) -> tuple[int, int, int, bool, list] | None:
    """``(k, pm, aligned, vision, records)`` of a walk, or None when its candidate names other
    keys than this request's length ``pm`` has (a forged or colliding sibling entry)."""
    bs = plan.bs
    n_full, r = divmod(len(plan.tokens), bs)
    k, pm, recs = found.k, 0, list(found.records)
    if found.rank:
        pm = r + 1 - found.rank if k == n_full else found.rank
        p = plan.partial(k, pm) if 0 < pm < bs and k <= n_full else None
        if p is None or found.members != [key("t", p), key("b", p)]:
            log.warning("prefix cache: a sibling index entry names other keys; not using it")
            return None
        recs[k : k + 2] = recs[k + 1 : k + 2] + recs[k : k + 1]  # the block, then its tail
    vision = bool(plan.digests) and bool(found.extras) and found.extras[0]
    return k, pm, found.aligned, vision, recs
