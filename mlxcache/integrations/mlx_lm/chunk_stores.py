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

One exception, for state layers only: a prompt that branches off a stored one (its blocks
match up to ``m``, the checkpoint it resumed from lies before the last block boundary ``b <=
m``: ``SharedPromptCache.branch``) also ends a prefill chunk at ``b`` and is checkpointed
there, so the next request that branches there resumes at ``b``. Its answer is then mlx-lm's
resumed at ``b`` (what that next request runs), not its uncached one where the split changes
the numerics; a prompt with no branch point, and any model without state layers, runs as before.

- ``batch_generator_class``: mlx-lm's ``BatchGenerator`` (requests served in a batch), storing
  each prompt's cache (mlx-lm's own ``extract_cache``) after every chunk inside a segment; a
  branch point is one more segment end, hidden from the server.
- ``stream_generate_with_stores``: mlx-lm's ``stream_generate`` as its server calls it for a
  request served alone (a seed, ``--kv-bits``, a model that cannot batch), storing a snapshot
  of the cache at each progress callback of the prefill; up to a branch point it makes
  ``generate_step``'s chunk calls itself, then hands mlx-lm the rest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from mlxcache.integrations.resume import holds_state, stores_mid_prefill

log = logging.getLogger("mlxcache")


@dataclass
class _Branch:
    """A prompt in the batch whose prefill ends a chunk at its branch point ``at``."""

    key: Any  # the model key of its lookup (its salt on it)
    start: int  # tokens restored before its first segment
    at: int  # where mlxcache cut a segment (an end the server must not see)


def split_at(segments: list[list[int]], start: int, at: int) -> list[list[int]] | None:
    """``segments`` (a prompt's, after ``start`` restored tokens) with the one that holds
    position ``at`` strictly inside cut there (None when ``at`` is a segment end or outside)."""
    s = start
    for i, seg in enumerate(segments):
        if s < at < s + len(seg):
            return [*segments[:i], seg[: at - s], seg[at - s :], *segments[i + 1 :]]
        s += len(seg)
    return None


def batch_generator_class(base: type, prompt_cache: Any, model_key: Callable[[], Any]) -> type:
    """``base`` (mlx-lm's ``BatchGenerator``) storing each prompt's cache after its chunks.

    ``model_key()`` is the model key of the model being loaded (mlx-lm makes a generator right
    after it loads one); ``prompt_cache`` is the server's ``SharedPromptCache``.
    """

    class StoringBatchGenerator(base):
        """mlx-lm's ``BatchGenerator``; after each prefill chunk its caches go to the store.

        With state layers a prompt that branches off a stored one inside a segment gets one
        more segment end at its branch point (its checkpoint stored there); the server never
        sees that end (``end_of_segment`` is reset), so it inserts only at its own segments.
        """

        def __init__(self, model: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(model, *args, **kwargs)
            self._mlxcache_key = model_key()
            fresh = make_prompt_cache(model)
            self._mlxcache_stores = stores_mid_prefill(fresh)
            self._mlxcache_states = holds_state(fresh) and hasattr(prompt_cache, "branch")
            self._mlxcache_branches: dict[int, _Branch] = {}

        def insert_segments(
            self,
            segments: list[list[list[int]]],
            max_tokens: Any = None,
            caches: Any = None,
            all_tokens: Any = None,
            *args: Any,
            **kwargs: Any,
        ) -> list[int]:
            """mlx-lm's, with a prompt's segment cut at its branch point (state layers)."""
            marks: list[_Branch | None] = [None] * len(segments)
            if self._mlxcache_states:
                segments = [list(seq) for seq in segments]
                for i, seq in enumerate(segments):
                    mark = self._branch(seq, all_tokens[i] if all_tokens else [])
                    # at a segment end already (the system messages'), the server inserts there
                    cut = split_at(seq, mark.start, mark.at) if mark is not None else None
                    if cut is not None:
                        segments[i], marks[i] = cut, mark
            uids = super().insert_segments(
                segments, max_tokens, caches, all_tokens, *args, **kwargs
            )
            for uid, mark in zip(uids, marks, strict=True):
                if mark is not None:
                    self._mlxcache_branches[uid] = mark
            return uids

        def _branch(self, seq: list[list[int]], restored: list[int]) -> _Branch | None:
            """Where this prompt branches off a stored one (None: nowhere to checkpoint)."""
            tokens = [*restored, *(t for seg in seq for t in seg)]
            key, at = prompt_cache.branch(tokens, len(restored))
            return _Branch(key, len(restored), at) if at else None

        def remove(self, uids: Any, *args: Any, **kwargs: Any) -> Any:
            for uid in uids:
                self._mlxcache_branches.pop(uid, None)
            return super().remove(uids, *args, **kwargs)

        def next(self):  # noqa: A003 - mlx-lm's name
            prompt_responses, generation_responses = super().next()
            if self._mlxcache_stores:
                branched = self._branched(prompt_responses) if self._mlxcache_branches else {}
                for uid, (cache, tokens) in self.extract_cache(list(branched)).items():
                    prompt_cache.store_branch(branched[uid], list(tokens), cache)
                # a chunk inside a segment: a segment's end is inserted by the server itself
                uids = [r.uid for r in prompt_responses
                        if not r.end_of_segment and r.uid not in branched]  # fmt: skip
                for cache, tokens in self.extract_cache(uids).values() if uids else ():
                    prompt_cache.store_prefill(self._mlxcache_key, list(tokens), cache)
            return prompt_responses, generation_responses

        def _branched(self, prompt_responses: list[Any]) -> dict[int, Any]:
            """The prompts whose chunk just ended at their branch point (uid -> model key);
            the segment end mlxcache added there is reset, so the server does not see it."""
            out = {}
            for r in prompt_responses:
                mark = self._mlxcache_branches.get(r.uid)
                if mark is None:
                    continue
                if mark.start + r.progress[0] == mark.at:
                    r.end_of_segment = False
                    out[r.uid] = mark.key
                if mark.start + r.progress[0] >= mark.at or r.end_of_prompt:
                    del self._mlxcache_branches[r.uid]
            return out

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
    run as they are; a caller's progress callback is still called. With state layers and a
    prompt cache that gives branch points (``SharedPromptCache.branch``), a prompt that
    branches off a stored one is prefilled up to its branch point in mlx-lm's chunks
    (``generate_step``'s calls), checkpointed there, and handed on to ``stream_generate``
    from there: mlx-lm resumed at the branch point, as the next request that hits there is.
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

        at = _branch(prompt_cache, tokens, start, cache, kwargs)
        if not at:
            return original(*args, **{**kwargs, "prompt_progress_callback": progress})
        bkey, k = at[0], at[1] - start
        step = kwargs.get("prefill_step_size", 2048)
        with mx.stream(kwargs.get("stream") or generation_stream):
            if callback is not None:
                callback(0, len(rest))
            for s in range(0, k, step):  # generate_step's chunk calls, the last one ending at k
                e = min(s + step, k)
                kwargs["model"](mx.array(rest[s:e])[None], cache=cache)
                mx.eval([c.state for c in cache])
                if e < k:
                    progress(e, len(rest))
                elif callback is not None:
                    callback(e, len(rest))
                mx.clear_cache()
        layers = _snapshot(list(cache))
        if layers is not None:
            prompt_cache.store_branch(bkey, tokens[: at[1]], layers)
        given = kwargs["prompt"]
        after = rest[k:] if isinstance(given, list) else mx.array(rest[k:], dtype=given.dtype)

        def shifted(done: int, total: int) -> None:  # the rest's progress, in the prompt's
            if done:
                progress(done + k, total + k)

        return original(*args, **{**kwargs, "prompt": after, "prompt_progress_callback": shifted})

    return stream_generate


def _branch(
    prompt_cache: Any, tokens: list[int], start: int, cache: list[Any], kwargs: dict[str, Any]
) -> tuple[Any, int] | None:
    """(model key, branch point) of a lone request to split at, or None: a cache with state
    layers whose prompt cache gives branch points; not with ``kv_bits`` (mlx-lm quantizes the
    live cache between its chunks) nor a ``model`` not passed by name."""
    branch = getattr(prompt_cache, "branch", None)
    if branch is None or kwargs.get("kv_bits") is not None or kwargs.get("model") is None:
        return None
    if not holds_state(cache):
        return None
    key, at = branch(tokens, start)
    return (key, at) if at else None
