"""A PrefixCache lookup on the default path: ``contains_many``, then ``get_many``.

For every backend without ``walk_chain`` (see prefix_walk): :func:`probe` asks which of the
request's keys are stored and where the longest match can end; :func:`fetch_keys` names the
records one ``get_many`` then reads, in the order ``prefix_restore.restore`` takes them.
"""

from __future__ import annotations

from collections.abc import Callable

from mlxcache.prefix.plan import Match, Plan
from mlxcache.protocol import CacheBackend

Key = Callable[[str, bytes], str]


def probe_keys(plan: Plan, key: Key, vkey: str | None) -> list[str]:
    """What one ``contains_many`` asks: every whole block, the tail at each whole block,
    the tail at each length inside the last partial block, the vision entry."""
    n_full, r = divmod(len(plan.tokens), plan.bs)
    full = plan.full(n_full)
    keys = [key("b", h) for h in full] + [key("t", h) for h in full]
    keys += [key("t", plan.partial(n_full, m)) for m in range(1, r + 1)]
    return keys + ([vkey] if vkey else [])


def probe(plan: Plan, key: Key, vkey: str | None, backend: CacheBackend) -> Match:
    """The longest candidates the backend holds (a second ``contains_many``, of at most
    ``block_size - 1`` keys, when the match ends inside the request's whole blocks)."""
    keys = probe_keys(plan, key, vkey)
    found = backend.contains_many(keys) if keys else []
    bs = plan.bs
    n_full, r = divmod(len(plan.tokens), bs)
    k = next((i for i, f in enumerate(found[:n_full]) if not f), n_full)
    # the longest stored length inside block k (the block after the leading whole blocks)
    if k == n_full:
        part = [m for m, f in zip(range(1, r + 1), found[2 * n_full :], strict=False) if f]
    else:
        cands = [plan.partial(k, m) for m in range(1, bs)]
        there = backend.contains_many([key("t", p) for p in cands])
        part = [m for m, f in zip(range(1, bs), there, strict=True) if f]
    aligned = max((i for i in range(1, k + 1) if found[n_full + i - 1]), default=0)
    vision = bool(plan.digests) and bool(found) and found[-1]
    return Match(k, part[-1] if part else 0, aligned, vision)


def fetch_keys(plan: Plan, key: Key, match: Match, vkey: str | None) -> list[str]:
    """What one ``get_many`` reads: the leading whole blocks, then the partial block and
    its tail (or the tail at the longest aligned length), then the vision entry."""
    fetch = [key("b", h) for h in plan.full(match.k)]
    if match.pm:
        p = plan.partial(match.k, match.pm)
        fetch += [key("b", p), key("t", p)]
    elif match.aligned:
        fetch.append(key("t", plan.full(match.aligned)[-1]))
    if match.vision and vkey:
        fetch.append(vkey)
    return fetch
