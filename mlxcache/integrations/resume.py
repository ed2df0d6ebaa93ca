"""Engine-neutral resume of a prompt on a PrefixCache: restore, extend, store, last token.

An engine (mlx-vlm, mlx-lm) gives a fresh prompt cache and a step function that runs its model
on prompt positions ``[s, e)``. This module finds the longest cached prefix of all but the last
token, checks that it fits the fresh cache, runs the rest in chunks, stores the new blocks and
runs the last token alone (as the engines' own ``generate_step`` does): a repeat of a prompt
restores everything but one token, and a hit never needs a cache that can be cut. A cache with
state layers (ArraysCache) is split and checkpointed where ``prefix/checkpoints.py`` says: at a
stride (a multiple of the engine's prefill step, so a prefill with nothing restored and no branch
point splits only where the engine's own does) and at the block boundary where the request
branched off a stored prompt. A cache that
fails (a backend that raises, any error inside the cache) is logged and the prompt runs
uncached: the cache never breaks inference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxcache.prefix.cache import PrefixHit
from mlxcache.prefix.checkpoints import DEFAULT_SHARE, Checkpoints, stride
from mlxcache.serializers import adapters

log = logging.getLogger("mlxcache")

# Attributes that shape a cache layer beyond its class: a restored layer must agree with the
# fresh one on each it has (a 512-token window is not a 1024-token one).
_SHAPE_ATTRS = ("max_size", "keep", "bits", "group_size", "chunk_size")

Run = Callable[[int, int], Any]  # run the model on prompt positions [s, e); returns its output


def cache_call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A cache lookup or store whose failure must not break inference: logged, then None.

    Backends already turn their own failures (a dead Redis) into misses and no-ops; this also
    covers a backend that raises anyway (a third-party one with a bug) and any other error
    inside the cache.
    """
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        log.warning("mlxcache: cache %s failed, continuing without it: %r", what, e)
        return None


def unsupported_cache_reason(prompt_cache: Sequence[Any]) -> str | None:
    """Why this (fresh) prompt cache cannot be stored, or None: a class with no adapter."""
    for c in prompt_cache:
        if adapters.find(c) is None:
            why = adapters.unsafe(type(c))
            return why or f"cache class {type(c).__module__}.{type(c).__name__} is not supported"
    return None


def holds_window(prompt_cache: Sequence[Any]) -> bool:
    """Whether a cache has window layers (RotatingKVCache...), which drop their old tokens."""
    return any(
        (f := adapters.find(c)) is not None and f[1].window is not None for c in prompt_cache
    )


def holds_state(prompt_cache: Sequence[Any]) -> bool:
    """Whether a cache has layers stored whole per length (ArraysCache...: no blocks)."""
    found = [adapters.find(c) for c in prompt_cache]
    return any(f is not None and not f[1].per_block and f[1].window is None for f in found)


def stores_mid_prefill(prompt_cache: Sequence[Any]) -> bool:
    """Whether a cache has layers a store at the prompt's end cannot cover whole (window layers
    have dropped old blocks, state layers hold only the last length): stored after chunks."""
    return holds_window(prompt_cache) or holds_state(prompt_cache)


def chunk_store_due(
    prompt_cache: Sequence[Any], num_tokens: int, block_size: int, step: int,
    share: float = DEFAULT_SHARE,
) -> bool:  # fmt: skip
    """Whether a server's store after one of its engine's prefill chunks is due, the cache
    holding ``num_tokens``: always with window layers (the next chunk drops their oldest
    blocks), at multiples of the checkpoint stride with state layers (prefix/checkpoints.py),
    never for plain KV (the store at the prompt's end covers it)."""
    if holds_window(prompt_cache):
        return True
    if not holds_state(prompt_cache):
        return False
    every = stride(prompt_cache, block_size, share, step)
    return every is not None and num_tokens % every == 0


def same_layout(restored: Sequence[Any], fresh: Sequence[Any]) -> bool:
    """Whether a restored cache has the fresh cache's layers: same classes, same shapes."""
    if len(restored) != len(fresh):
        return False
    for a, b in zip(restored, fresh, strict=True):
        if type(a) is not type(b):
            return False
        for name in _SHAPE_ATTRS:
            if getattr(a, name, None) != getattr(b, name, None):
                return False
    return True


@dataclass
class Found:
    """What a lookup found: a usable prefix (or None), the images' embeddings (or None) and,
    for a cache with state layers, the branch point to checkpoint at (0: none)."""

    hit: PrefixHit | None = None
    vision_embeddings: Any = None
    branch: int = 0

    @property
    def num_tokens(self) -> int:
        return self.hit.num_tokens if self.hit is not None else 0


def lookup(
    cache: Any,
    tokens: Sequence[int],
    fresh: Sequence[Any],
    *,
    images: Sequence[Any] = (),
    fits: Callable[[Sequence[Any], Sequence[Any]], bool] = same_layout,
) -> Found:
    """The longest cached prefix of ``tokens[:-1]`` whose layout ``fits`` the ``fresh`` cache.

    ``cache`` is a ``PrefixCache`` or None (nothing found). The last token is never looked up:
    it runs after the restore so its logits come from the model. A prefix with another layout
    (another window size, another cache class) is ignored with a log line.
    """
    if cache is None or len(tokens) < 2:
        return Found()
    hit = cache_call("lookup", cache.lookup, list(tokens[:-1]), images=images)
    vision = getattr(hit, "vision_embeddings", None)
    if hit is not None and (hit.num_tokens <= 0 or hit.prompt_cache is None):
        hit = None  # only the images' embeddings were found
    if hit is not None and not fits(hit.prompt_cache, fresh):
        log.warning("mlxcache: cached prefix has another cache layout; ignoring it")
        hit = None
    have = hit.num_tokens if hit is not None else 0
    branch = branch_point(cache, tokens[:-1], images, have) if holds_state(fresh) else 0
    return Found(hit, vision, branch)


def branch_point(cache: Any, tokens: Sequence[int], images: Sequence[Any], have: int) -> int:
    """The last block boundary at or before where ``tokens`` stop matching stored blocks, when
    it lies past the ``have`` restored tokens and before the end (else 0): a checkpoint there
    lets the next request that branches at the same place resume there.

    One ``longest`` (a ``contains_many``, none when ``have`` is in the last block).
    """
    if have >= len(tokens):
        return 0
    matched = cache_call("probe", cache.longest, list(tokens), images=images, have=have) or 0
    b = matched // cache.block_size * cache.block_size
    return b if have < b < len(tokens) else 0


def extend(
    run: Run,
    prompt_cache: Sequence[Any],
    start: int,
    end: int,
    *,
    step_size: int,
    after_chunk: Callable[[int], None] | None = None,
    checkpoints: Checkpoints | None = None,
) -> None:
    """Run prompt positions ``[start, end)`` in chunks of ``step_size``, evaluating the cache.

    With ``checkpoints`` the chunks end where it says (``Checkpoints.next_end``: the same
    chunks from a cold start; also at the branch point, and at stride multiples when resumed
    off the step's grid). ``after_chunk(e)`` runs after each chunk is evaluated (progress,
    freeing buffers, storing).
    """
    if step_size <= 0:
        raise ValueError(f"prefill_step_size must be positive, got {step_size}")
    s = start
    while s < end:
        e = min(s + step_size, end)
        if checkpoints is not None:
            checkpoints.learn(prompt_cache)
            e = checkpoints.next_end(s, end)
        run(s, e)
        mx.eval([c.state for c in prompt_cache])
        if checkpoints is not None:
            checkpoints.learn(prompt_cache, ran=True)
        if after_chunk is not None:
            after_chunk(e)
        s = e


def store(
    cache: Any,
    tokens: Sequence[int],
    prompt_cache: Sequence[Any],
    *,
    images: Sequence[Any] = (),
    extras: dict[str, mx.array] | None = None,
    vision_embeddings: Any = None,
) -> int:
    """Store the cache of exactly ``tokens``; how many new tokens the cache kept (0 on failure)."""
    kept = cache_call(
        "store",
        cache.store,
        list(tokens),
        prompt_cache,
        images=images,
        extras=extras or None,
        vision_embeddings=vision_embeddings,
    )
    return kept or 0


def finish_prompt(
    run: Run,
    prompt_cache: Sequence[Any],
    tokens: Sequence[int],
    start: int,
    *,
    cache: Any = None,
    step_size: int,
    images: Sequence[Any] = (),
    extras: dict[str, mx.array] | None = None,
    vision_embeddings: Any = None,
    after_chunk: Callable[[int], None] | None = None,
    branch: int = 0,
) -> tuple[Any, int]:
    """Extend a cache holding ``tokens[:start]`` to all but the last token, store, run the last.

    With ``cache`` (a PrefixCache) the state before the last token is stored when something was
    new; with window layers, each chunk's whole blocks too, right after the chunk. With state
    layers the chunks end on checkpoints too (prefix/checkpoints.py: a stride of whole prefill
    steps, and ``branch``, the block boundary ``lookup`` found a request to branch at), each
    stored with its blocks. Returns
    the last token's ``run`` output and how many tokens the stores kept.
    """
    n = len(tokens)
    stored = 0
    each = after_chunk
    windows, states = cache is not None and holds_window(prompt_cache), holds_state(prompt_cache)
    marks = None
    if cache is not None and states:
        share = getattr(cache, "checkpoint_share", DEFAULT_SHARE)
        marks = Checkpoints(cache.block_size, share, step_size, branch)
    if cache is not None and (windows or states):
        # a window layer drops old tokens in the next chunk: store each chunk's whole blocks
        # while it holds them; a state layer (ArraysCache) is checkpointed at its marks (the
        # answer is the engine's resumed at the same splits)
        def each(e: int) -> None:
            nonlocal stored
            if e < n - 1 and (windows or (marks is not None and marks.keeps(e))):
                kept = cache_call(
                    "store",
                    cache.store,
                    list(tokens[:e]),
                    prompt_cache,
                    images=images,
                    mid_prefill=True,
                )
                stored += kept or 0
            if after_chunk is not None:
                after_chunk(e)

    extend(
        run, prompt_cache, start, n - 1, step_size=step_size, after_chunk=each, checkpoints=marks
    )
    if cache is not None and n - 1 > start:
        stored += store(
            cache,
            tokens[:-1],
            prompt_cache,
            images=images,
            extras=extras,
            vision_embeddings=vision_embeddings,
        )
    return run(n - 1, n), stored
