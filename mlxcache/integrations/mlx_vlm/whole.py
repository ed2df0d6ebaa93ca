"""Exact repeats of prompts mlx-vlm prefills in one pass (prefix-LMs, bidirectional vision).

Such a prompt's KV depends on every token of it, so no prefix of it may be resumed. What may be
reused is the whole prompt: the cache after the engine's one pass and that pass's last logits,
stored under a key of every token, the mask, the pixels and every model input, so two prompts
never share a block. A repeat restores both and decodes as the engine would after its pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx

from mlxcache.hashing import images_digest
from mlxcache.integrations import resume

LOGITS = "one_pass_logits"
PATH = "reused only as an exact repeat of a whole prompt"  # how tell_once says it


def keys(ids: mx.array, mask: mx.array, image_keys: Sequence[Any], kwargs: dict) -> list:
    """The image keys of a whole prompt: its own digest first (no block is shared), then the
    prompt's image keys."""
    arrays = [(k, v) for k, v in sorted(kwargs.items()) if isinstance(v, mx.array)]
    parts: list[Any] = [b"one-pass prompt", ids, b"mask", mask]
    for name, value in arrays:
        parts += [name.encode(), value]
    return [images_digest(parts), *image_keys]


def lookup(cache: Any, tokens: list[int], fresh: Sequence[Any], images: list) -> Any:
    """(prompt_cache, logits) of a stored one-pass run of exactly ``tokens``, else None."""
    hit = resume.cache_call("lookup", cache.lookup, tokens, images=images, require_extras=True)
    if hit is None or hit.num_tokens != len(tokens) or hit.prompt_cache is None:
        return None
    logits = (hit.extras or {}).get(LOGITS)
    if logits is None or not resume.same_layout(hit.prompt_cache, fresh):
        return None
    return hit.prompt_cache, logits


def store(
    cache: Any, tokens: list[int], prompt_cache: Sequence[Any], logits: mx.array, images: list
) -> int:
    """Store the one-pass cache of ``tokens`` with its last logits; the tokens kept."""
    return resume.store(cache, tokens, prompt_cache, images=images, extras={LOGITS: logits})
