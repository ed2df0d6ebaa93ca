"""mlx-vlm's checkpoint-mode APC (sliding-window and hybrid models) on the shared PrefixCache.

The seam, read in mlx-vlm 0.7.10's wheel: a model whose cache cannot be cut into blocks
(``RotatingKVCache``, ``ArraysCache``, ...: ``model_apc_mode`` is ``"exact"``) runs APC in
checkpoint mode. Its generator stores the whole prompt cache at a few lengths with
``APCManager.store_exact_cache`` (``APCCoordinator.checkpoint_lengths``: the prompt less its
guard token, and ``checkpoint_interval_tokens`` strides; the full prompt when none was stored)
and asks ``lookup_exact_cache`` for a prompt, which an entry serves only at exactly its stored
length. ``SharedAPCManager`` keeps both and adds this module: every such state also goes to the
manager's ``PrefixCache`` (records under the model identity, salt and request tenant, as block
mode's), and so do the caches after each prefill chunk (``chunk_stores.py``: a window layer's
whole blocks, a recurrent state on its stride). A lookup asks the store for the longest prefix
it rebuilds, longer than the in-process answer: a stored length, a block boundary whose window
blocks are stored, a stride checkpoint. mlx-vlm takes any such length (``apc_lookup_plan``: a
prefix shorter than the prompt whose suffix is text only) and prefills the rest itself. A
corrupt record is a miss and a log line (the prefix cache's).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_vlm.apc_adapters import reserve_checkpoint_capacity

from mlxcache.integrations.resume import chunk_store_due
from mlxcache.integrations.serve_errors import ServeErrors
from mlxcache.prefix import PrefixCache

log = logging.getLogger("mlxcache")


def lookup(
    prefix: PrefixCache,
    token_ids: Sequence[int],
    images: list[bytes],
    *,
    max_prefix_tokens: int | None,
    above: int,
    errors: ServeErrors,
) -> tuple[list[Any], int] | None:
    """The longest prefix of ``token_ids`` the store rebuilds, longer than ``above``, or None.

    At most the prompt less one token (its logits come from a prefill) and ``max_prefix_tokens``.
    The restored caches get the capacity mlx-vlm's own restore reserves for the whole prompt
    (``reserve_checkpoint_capacity``), so the suffix prefill grows them as it does there.
    """
    limit = len(token_ids) - 1
    if max_prefix_tokens:
        limit = min(limit, int(max_prefix_tokens))
    if limit <= max(0, above):
        return None
    try:
        hit = prefix.lookup([int(t) for t in token_ids[:limit]], images=images)
    except Exception as exc:  # a dead backend: the in-process answer, or an uncached request
        log.warning("mlxcache APC: checkpoint lookup failed: %s", exc)
        errors.add("lookup")
        return None
    if hit is None or hit.prompt_cache is None or hit.num_tokens <= above:
        return None
    targets: list[mx.array] = []
    for entry in hit.prompt_cache:
        reserve_checkpoint_capacity(entry, min_capacity_tokens=len(token_ids), eval_targets=targets)
    if targets:
        mx.eval(targets)
    return hit.prompt_cache, hit.num_tokens


def prefill_store_due(
    prefix: PrefixCache, num_tokens: int, prompt_cache: Sequence[Any], step: int | None
) -> bool:
    """Whether a cache holding ``num_tokens`` is stored after a prefill chunk of ``step``.

    Window layers: always (the next chunk drops their oldest blocks). State layers only: at
    multiples of their checkpoint stride (``None`` step: one chunk, the block size stands in).
    """
    if not prompt_cache or num_tokens < prefix.block_size:
        return False
    bs = prefix.block_size
    return chunk_store_due(prompt_cache, num_tokens, bs, step or bs, prefix.checkpoint_share)


def store(
    prefix: PrefixCache,
    token_ids: Sequence[int],
    prompt_cache: Sequence[Any],
    images: list[bytes],
    *,
    min_tokens: int,
    errors: ServeErrors,
    mid_prefill: bool = False,
) -> int:
    """Store the state of exactly ``token_ids`` (with ``mid_prefill``, its whole blocks only);
    returns the new tokens the backend kept.

    Written before it returns (the generator's thread mutates the cache afterwards), so a
    server killed once it has answered has lost no checkpoint it made.
    """
    if len(token_ids) < min_tokens or not prompt_cache:
        return 0
    try:
        return prefix.store(
            [int(t) for t in token_ids], list(prompt_cache), images=images, mid_prefill=mid_prefill
        )
    except Exception as exc:  # a store failure never fails the request
        log.warning("mlxcache APC: checkpoint store failed: %s", exc)
        errors.add("store")
        return 0
