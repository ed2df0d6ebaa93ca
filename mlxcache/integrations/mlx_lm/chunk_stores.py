"""Stores after each prefill chunk of mlx-lm's server, for window and state (recurrent) layers.

mlx-lm's server hands its prompt cache a request's cache only at segment ends (the end of the
system messages, the prompt minus its last token) and at the response's end. By then a window
layer (``RotatingKVCache``) has dropped all but its last window, and a state layer
(``ArraysCache``) holds its state at that one length: a later prompt that shares only a passage
inside the user turn found nothing to restore on these models. mlx-lm runs a prefill in chunks
of ``--prefill-step-size``; after each chunk these seams give a copy of the request's cache to
``SharedPromptCache.store_prefill``, which stores its whole blocks (and, at a chunk end on the
checkpoint stride, a checkpoint of the state layers) while the window still holds them. They
read the cache and never touch it: mlx-lm computes exactly what it computes without them.

- ``batch_generator_class``: mlx-lm's ``BatchGenerator`` (requests served in a batch), storing
  each prompt's cache (mlx-lm's own ``extract_cache``) after every chunk inside a segment.
- ``stream_generate_with_stores``: mlx-lm's ``stream_generate`` as its server calls it for a
  request served alone (a seed, ``--kv-bits``, a model that cannot batch), storing a snapshot
  of the cache at each progress callback of the prefill.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import make_prompt_cache

from mlxcache.integrations.resume import stores_mid_prefill

log = logging.getLogger("mlxcache")


def batch_generator_class(base: type, prompt_cache: Any, model_key: Callable[[], Any]) -> type:
    """``base`` (mlx-lm's ``BatchGenerator``) storing each prompt's cache after its chunks.

    ``model_key()`` is the model key of the model being loaded (mlx-lm makes a generator right
    after it loads one); ``prompt_cache`` is the server's ``SharedPromptCache``.
    """

    class StoringBatchGenerator(base):
        """mlx-lm's ``BatchGenerator``; after each prefill chunk its caches go to the store."""

        def __init__(self, model: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(model, *args, **kwargs)
            self._mlxcache_key = model_key()
            self._mlxcache_stores = stores_mid_prefill(make_prompt_cache(model))

        def next(self):  # noqa: A003 - mlx-lm's name
            prompt_responses, generation_responses = super().next()
            if self._mlxcache_stores:
                # a chunk inside a segment: a segment's end is inserted by the server itself
                uids = [r.uid for r in prompt_responses if not r.end_of_segment]
                for cache, tokens in self.extract_cache(uids).values() if uids else ():
                    prompt_cache.store_prefill(self._mlxcache_key, list(tokens), cache)
            return prompt_responses, generation_responses

    return StoringBatchGenerator


def _snapshot(layers: list[Any]) -> list[Any] | None:
    """New cache objects holding the current state of ``layers`` (None if a class cannot).

    Their arrays are new array objects (evaluated here): the next chunk updates the live
    cache's arrays in place, never these.
    """

    def fresh(a: Any) -> Any:
        return mx.contiguous(a) if isinstance(a, mx.array) else a

    def rebuilt(c: Any) -> Any:
        state = tree_map(fresh, c.state)
        if hasattr(c, "meta_state"):
            try:  # mlx-lm 0.31 (vllm-mlx 0.6's): from_state(state, meta_state)
                return type(c).from_state(state, c.meta_state)
            except TypeError:
                pass
        return type(c).from_state(state)  # mlx-lm 0.32

    try:
        out = [rebuilt(c) for c in layers]
    except Exception as e:  # a class without a state round trip: no store mid-prefill
        log.debug("mlx-lm prompt cache: no snapshot of this cache: %r", e)
        return None
    mx.eval([c.state for c in out])
    return out


def stream_generate_with_stores(
    original: Callable[..., Any], prompt_cache: Any, model_key: Callable[[], Any]
) -> Callable[..., Any]:
    """mlx-lm's ``stream_generate`` storing the prompt cache after each prefill chunk.

    The prompt's tokens are the ones the server has just looked up (``last_lookup()`` of the
    prompt cache); ``prompt`` (a list, or a 1-D ``mx.array`` as vllm-mlx passes it) is their
    uncached rest. Speculative decoding and prompts with images (looked up by another key)
    run as they are; a caller's progress callback is still called.
    """

    def stream_generate(*args: Any, **kwargs: Any):
        cache, rest = kwargs.get("prompt_cache"), kwargs.get("prompt")
        callback = kwargs.get("prompt_progress_callback")
        tokens: list[int] = prompt_cache.last_lookup() or []
        if isinstance(rest, mx.array) and rest.ndim == 1 and tokens:
            rest = rest.tolist()
        start = len(tokens) - len(rest) if isinstance(rest, list) else -1
        plain = kwargs.get("input_embeddings") is None and kwargs.get("draft_model") is None
        if (
            cache is None
            or not plain
            or start < 0
            or tokens[start:] != rest
            or not stores_mid_prefill(cache)
        ):
            return original(*args, **kwargs)
        key = model_key()

        def progress(done: int, total: int) -> None:
            if callback is not None:
                callback(done, total)
            n = start + done
            # a chunk's end (at ``total`` the first token has run)
            if 0 < done < total and prompt_cache.prefill_store_due(n, cache):
                layers = _snapshot(list(cache))
                if layers is not None:
                    prompt_cache.store_prefill(key, tokens[:n], layers)

        return original(*args, **{**kwargs, "prompt_progress_callback": progress})

    return stream_generate
