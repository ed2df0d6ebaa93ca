"""Cached prefill of an mlx-vlm prompt on a PrefixCache: restore, embed, run the rest, store.

``prefill`` restores the longest cached prefix of a prompt, runs the vision encoder only when
the images' embeddings are not cached, prefills the uncached rest with the calls of mlx-vlm's
own chunked prefill and stores the new blocks. What a family needs comes from the family table
(``models.py``); ``generate.py`` decodes from the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx

from mlxcache.hashing import images_digest
from mlxcache.integrations import resume
from mlxcache.integrations.generation import Prefill
from mlxcache.integrations.mlx_vlm import positions, whole
from mlxcache.integrations.mlx_vlm.engine import chunks_prefill
from mlxcache.integrations.mlx_vlm.models import (
    accepts_cached_features,
    encode_images,
    family,
    key_inputs,
    prime_positions,
    static_unsupported_reason,
    tell_once,
    unpack_features,
)
from mlxcache.integrations.resume import log

DEFAULT_PREFILL_STEP_SIZE = 2048  # mlx-vlm's default chunk
ONE_PASS = "mlx-vlm prefills this prompt in one pass (no split may be resumed)"


def as_ids(input_ids: Any) -> mx.array:
    ids = input_ids if isinstance(input_ids, mx.array) else mx.array(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise ValueError(f"input_ids must hold one non-empty prompt, got shape {ids.shape}")
    return ids


def image_keys(images: Sequence[Any], pixel_values: Any, model_kwargs: dict[str, Any]) -> list:
    """What identifies the prompt's images in cache keys.

    The caller's ``images`` when given; otherwise one digest of the processed ``pixel_values``
    and every array model input, by name (``image_grid_thw``: the same pixels on another grid
    are another image; ``pixel_values_videos``: a video's pixels), so two different images or
    videos never share a prefix. Text only (no array inputs): no image keys.
    """
    if images:
        return list(images)
    arrays = [(k, v) for k, v in sorted(model_kwargs.items()) if isinstance(v, mx.array)]
    if pixel_values is None and not arrays:
        return []

    parts: list[Any] = [b"pixel_values", b"" if pixel_values is None else pixel_values]
    for name, value in arrays:
        parts += [name.encode(), value]
    return [images_digest(parts)]


def _equal(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and bool(mx.array_equal(a, b).item())


def _embed(
    model: Any, ids: mx.array, pixel_values: Any, mask: Any, kwargs: dict, features: Any
) -> tuple[mx.array, dict[str, Any]]:
    """``get_input_embeddings``: (inputs_embeds, its other non-None outputs by name)."""
    emb_kwargs = dict(kwargs)
    carried: dict[str, Any] = {}  # outputs the model leaves out given cached features
    if features is not None:
        emb_kwargs["cached_image_features"], carried = unpack_features(model, features)
    emb = model.get_input_embeddings(ids, pixel_values, mask=mask, **emb_kwargs)
    extra = {k: v for k, v in emb.to_dict().items() if k != "inputs_embeds" and v is not None}
    return emb.inputs_embeds, {**extra, **carried}


def prefill(
    model: Any,
    input_ids: Any,
    pixel_values: mx.array | None = None,
    *,
    cache: Any,
    images: Sequence[Any] = (),
    mask: mx.array | None = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    **model_kwargs: Any,
) -> Prefill:
    """Prefill a prompt, reusing its longest cached prefix and storing what is new.

    ``cache`` is a ``PrefixCache`` (or None: plain uncached prefill). ``model_kwargs`` are the
    processor's extra model inputs (e.g. ``image_grid_thw``). The model runs with the calls of
    mlx-vlm's own ``generate_step`` prefill (chunks with every embedding output, the last token
    alone, or the whole prompt in one pass where mlx-vlm does that); a model or prompt that
    cannot be resumed safely runs uncached (``models.FAMILIES``), logged once per model.
    """
    from mlx_vlm.models.cache import make_prompt_cache

    ids = as_ids(input_ids)
    mask = mx.ones_like(ids) if mask is None else mask  # what mlx-vlm's processors give
    lm = model.language_model
    fresh = make_prompt_cache(lm)
    reason = static_unsupported_reason(model, fresh) if cache is not None else None
    keys = image_keys(images, pixel_values, key_inputs(model, model_kwargs))
    tokens = cast("list[int]", ids[0].tolist())  # one row of token ids

    # A family whose embeddings may outnumber the ids embeds first: it is keyed and resumed in
    # embedding positions (models.Family.embedding_tokens).
    expands = family(model).embedding_tokens
    embedded = None
    if expands is not None and pixel_values is not None:
        embedded = _embed(model, ids, pixel_values, mask, model_kwargs, None)
        if embedded[0].shape[1] != len(tokens):
            tokens = expands(model, tokens, embedded[0].shape[1]) or tokens
    found = resume.lookup(cache if reason is None else None, tokens, fresh, images=keys)
    hit, restored = found.hit, found.vision_embeddings

    # Image features: restored with the prefix, else computed once here (the same computation
    # the model runs) so they can be stored; the model then never runs its own encoder.
    features, vision_cached = None, False
    if embedded is None and pixel_values is not None and accepts_cached_features(model):
        if restored is not None:
            features, vision_cached = restored, True
        else:
            features = encode_images(model, pixel_values, model_kwargs)
    if embedded is None:
        embedded = _embed(model, ids, pixel_values, mask, model_kwargs, features)
    embeds, extra = embedded
    run_kwargs = {**model_kwargs, **extra}
    if "position_ids" not in extra:
        run_kwargs.update(prime_positions(model, ids, mask, model_kwargs))
    sliced = family(model).slice_positions
    if sliced:
        why = positions.engine_positions(run_kwargs, ids.shape[1], prefill_step_size)
        reason = reason or why
    if reason is None and embeds.shape[1] != len(tokens):
        reason = "get_input_embeddings returned another length than the prompt's ids"
    one_pass = not chunks_prefill(model, ids, embeds, run_kwargs)
    # a prompt prefilled in one pass: only an exact repeat of all of it is reused (whole.py)
    repeat_keys = None
    if cache is not None and reason is None and one_pass:
        repeat_keys = whole.keys(ids, mask, keys, model_kwargs)
        tell_once(model, ONE_PASS, path=whole.PATH)
        hit = None
    use_cache = cache is not None and reason is None
    if cache is not None and reason is not None:
        tell_once(model, reason)
        hit = None

    rope = run_kwargs.get("rope_deltas")
    extras = {"rope_deltas": rope} if rope is not None else {}
    if hit is not None and rope is not None:
        stored_rope = (hit.extras or {}).get("rope_deltas")
        if stored_rope is not None and not _equal(stored_rope, rope):
            log.warning("mlxcache: cached rope_deltas differ from the prompt's; not reusing")
            hit = None

    prompt_cache = fresh
    if hit is not None:
        assert hit.prompt_cache is not None  # resume.lookup keeps only hits with a cache
        prompt_cache = hit.prompt_cache
    start = hit.num_tokens if hit is not None else 0
    n = embeds.shape[1]

    def run(s: int, e: int) -> Any:
        # mlx-vlm's calls: a chunk gets n_to_process, the last token does not; both keep one row.
        # Positions are embedding positions; the ids are sliced alike (clipped), as mlx-vlm does
        chunk = {"n_to_process": e - s} if e < n else {}
        return lm(
            ids[:, s:e],
            inputs_embeds=embeds[:, s:e],
            cache=prompt_cache,
            logits_to_keep=1,
            **chunk,
            **(positions.for_chunk(run_kwargs, s, e) if sliced else run_kwargs),
        )

    stored = 0
    repeat = whole.lookup(cache, tokens, fresh, repeat_keys) if repeat_keys else None
    if repeat is not None:  # the cache and last logits of the engine's pass over this prompt
        prompt_cache, last = repeat
        state = Prefill(prompt_cache, extras={}, num_cached_tokens=n, logits=last, num_tokens=n)
        state.token_ids = tokens
        return state
    if one_pass:
        out = run(0, n)
        if repeat_keys and not carried_outputs(out):
            stored = whole.store(cache, tokens, prompt_cache, out.logits[:, -1, :], repeat_keys)
    else:
        # every embedding position runs (a prompt whose ids do not map onto its embeddings is
        # uncached, and its runs are then exactly mlx-vlm's chunked prefill from position 0)
        keyed = tokens if len(tokens) == n else list(range(n))
        out, stored = resume.finish_prompt(
            run,
            prompt_cache,
            keyed,
            start,
            cache=cache if use_cache else None,
            step_size=prefill_step_size,
            images=keys,
            extras=extras,
            vision_embeddings=features,
            branch=found.branch,
        )
    logits = out.logits[:, -1, :]
    mx.eval(logits)
    return Prefill(
        prompt_cache=prompt_cache,
        extras=extras,
        num_cached_tokens=start,
        logits=logits,
        num_tokens=n,
        num_stored_tokens=stored,
        vision_cached=vision_cached,
        cached=use_cache,
        decode_kwargs=carried_outputs(out),
        token_ids=cast("list[int]", ids[0].tolist()),
    )


def refusal(model: Any) -> str | None:
    """Why ``model`` is never resumed (logged once per model), or None."""
    from mlx_vlm.models.cache import make_prompt_cache

    reason = static_unsupported_reason(model, make_prompt_cache(model.language_model))
    if reason is not None:
        tell_once(model, reason)
    return reason


def carried_outputs(out: Any) -> dict[str, Any]:
    """Outputs a decode step feeds to the next (encoder-decoder models), as generate_step does."""
    for name in ("cross_attention_states", "encoder_outputs"):
        value = getattr(out, name, None)
        if value is not None:
            return {name: value}
    return {}
