"""Cached prefill and generation for mlx-vlm models on a PrefixCache.

``prefill`` restores the longest cached prefix of a prompt, runs the vision encoder only when
the images' embeddings are not cached, prefills the uncached rest and stores the new blocks.
``generate_tokens``/``stream_generate_tokens`` decode from it (token ids in, token ids out);
``cached_generate``/``stream_cached_generate`` take a processor and a text prompt like
``mlx_vlm.generate``. Greedy output equals mlx-vlm's uncached ``generate_step`` bit for bit.

The prompt is prefilled up to its last token, that state is stored, then the last token runs
alone (as ``generate_step`` does): a repeat of the same prompt restores everything but one
token, and a hit never needs a cache that can be cut (a sliding-window cache past its window
is reused at exactly the stored length).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any, cast

import mlx.core as mx

from mlxcache.hashing import images_digest
from mlxcache.integrations import resume
from mlxcache.integrations.generation import (
    Detokenizer,
    GenerationResult,
    GenerationStep,
    Prefill,
    Sampler,
    make_sampler,
    run_to_end,
    sample_tokens,
    stream_result,
    timed_from,
)
from mlxcache.integrations.mlx_vlm.models import (
    MROPE_TYPES,
    RESUMABLE_KEYS,
    accepts_cached_features,
    embedding_unsupported_reason,
    encode_images,
    model_type,
    static_unsupported_reason,
)
from mlxcache.integrations.resume import log

__all__ = [
    "DEFAULT_PREFILL_STEP_SIZE",
    "GenerationResult",
    "GenerationStep",
    "Prefill",
    "Sampler",
    "cached_generate",
    "decode",
    "generate_tokens",
    "image_keys",
    "make_sampler",
    "prefill",
    "stream_cached_generate",
    "stream_generate_tokens",
]

DEFAULT_PREFILL_STEP_SIZE = 2048  # mlx-vlm's default chunk


def _as_ids(input_ids: Any) -> mx.array:
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
    processor's extra model inputs (e.g. ``image_grid_thw``). Models or cache classes that
    cannot be resumed safely run uncached, with one log line.
    """
    from mlx_vlm.models.cache import make_prompt_cache

    ids = _as_ids(input_ids)
    n = ids.shape[1]
    lm = model.language_model
    fresh = make_prompt_cache(lm)

    reason = static_unsupported_reason(model, fresh) if cache is not None else None
    keys = image_keys(images, pixel_values, model_kwargs)
    tokens = cast("list[int]", ids[0].tolist())  # one row of token ids

    found = resume.lookup(cache if reason is None else None, tokens, fresh, images=keys)
    hit, restored = found.hit, found.vision_embeddings

    # Image features: restored with the prefix, else computed once here (the same computation
    # the model runs) so they can be stored; the model then never runs its own encoder.
    features, vision_cached = None, False
    if pixel_values is not None and accepts_cached_features(model):
        if restored is not None:
            features, vision_cached = restored, True
        else:
            features = encode_images(model, pixel_values, model_kwargs)
    emb_kwargs = dict(model_kwargs)
    if features is not None:
        emb_kwargs["cached_image_features"] = features
    emb = model.get_input_embeddings(
        ids, pixel_values, mask=mx.ones_like(ids) if mask is None else mask, **emb_kwargs
    )
    embeds = emb.inputs_embeds
    extra = {k: v for k, v in emb.to_dict().items() if k != "inputs_embeds" and v is not None}

    if cache is not None and reason is None:
        reason = embedding_unsupported_reason(extra)
    use_cache = cache is not None and reason is None
    if cache is not None and reason is not None:
        log.info("mlxcache: running uncached: %s", reason)
        hit = None

    rope = extra.get("rope_deltas")
    extras = {"rope_deltas": rope} if rope is not None else {}
    if hit is not None and rope is not None:
        stored_rope = (hit.extras or {}).get("rope_deltas")
        if stored_rope is not None and not _equal(stored_rope, rope):
            log.warning("mlxcache: cached rope_deltas differ from the prompt's; not reusing")
            hit = None
    if use_cache:
        lm_kwargs = {k: extra[k] for k in RESUMABLE_KEYS if k in extra}
    else:
        lm_kwargs = dict(extra)  # what mlx-vlm's generate_step passes

    prompt_cache = fresh
    if hit is not None:
        assert hit.prompt_cache is not None  # resume.lookup keeps only hits with a cache
        prompt_cache = hit.prompt_cache
    start = hit.num_tokens if hit is not None else 0

    def run(s: int, e: int) -> Any:
        return lm(ids[:, s:e], inputs_embeds=embeds[:, s:e], cache=prompt_cache, **lm_kwargs)

    out, stored = resume.finish_prompt(
        run,
        prompt_cache,
        tokens,
        start,
        cache=cache if use_cache else None,
        step_size=prefill_step_size,
        images=keys,
        extras=extras,
        vision_embeddings=features,
    )
    logits = out.logits[:, -1, :]
    mx.eval(logits)

    decode_kwargs: dict[str, Any] = {}
    if rope is not None and model_type(model) in MROPE_TYPES:
        decode_kwargs["rope_deltas"] = rope
    decode_kwargs.update(_carried_outputs(out))
    return Prefill(
        prompt_cache=prompt_cache,
        extras=extras,
        num_cached_tokens=start,
        logits=logits,
        num_tokens=n,
        num_stored_tokens=stored,
        vision_cached=vision_cached,
        cached=use_cache,
        decode_kwargs=decode_kwargs,
        token_ids=tokens,
    )


def _carried_outputs(out: Any) -> dict[str, Any]:
    """Outputs a decode step feeds to the next (encoder-decoder models), as generate_step does."""
    for name in ("cross_attention_states", "encoder_outputs"):
        value = getattr(out, name, None)
        if value is not None:
            return {name: value}
    return {}


def decode(
    model: Any,
    state: Prefill,
    *,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    eos_token_ids: Sequence[int] = (),
) -> Iterator[int]:
    """Sample up to ``max_tokens`` tokens from a Prefill, stopping after an EOS token."""
    lm = model.language_model
    kwargs = dict(state.decode_kwargs)

    def step(y: mx.array) -> mx.array:
        nonlocal kwargs
        out = lm(y.reshape(1, 1), cache=state.prompt_cache, **kwargs)
        kwargs = {**state.decode_kwargs, **_carried_outputs(out)}
        return out.logits[:, -1, :]

    for token, _ in sample_tokens(
        state.logits,
        step,
        max_tokens=max_tokens,
        sampler=sampler or make_sampler(0.0),
        eos_token_ids=eos_token_ids,
    ):
        yield token


def stream_generate_tokens(
    model: Any,
    input_ids: Any,
    pixel_values: mx.array | None = None,
    *,
    cache: Any = None,
    images: Sequence[Any] = (),
    max_tokens: int = 256,
    temperature: float = 0.0,
    sampler: Sampler | None = None,
    eos_token_ids: Sequence[int] = (),
    tokenizer: Any = None,
    mask: mx.array | None = None,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    **model_kwargs: Any,
) -> Iterator[GenerationStep]:
    """Yield the tokens of a prompt given as ids (+ ``pixel_values`` and model inputs).

    ``tokenizer`` (anything with ``decode(list[int]) -> str``) is optional and only fills
    ``text``. Times count from the call, cache lookup and restore included.
    """
    t0 = time.perf_counter()
    state = prefill(
        model,
        input_ids,
        pixel_values,
        cache=cache,
        images=images,
        mask=mask,
        prefill_step_size=prefill_step_size,
        **model_kwargs,
    )
    sampler = sampler or make_sampler(temperature)
    tokens = decode(
        model, state, max_tokens=max_tokens, sampler=sampler, eos_token_ids=eos_token_ids
    )
    text = Detokenizer(tokenizer) if tokenizer is not None else None
    yield from stream_result(
        state, tokens, t0=t0, max_tokens=max_tokens, text=text, eos_token_ids=eos_token_ids
    )


def generate_tokens(
    model: Any, input_ids: Any, pixel_values: mx.array | None = None, **kwargs: Any
) -> GenerationResult:
    """``stream_generate_tokens`` run to the end: the GenerationResult."""
    return run_to_end(stream_generate_tokens(model, input_ids, pixel_values, **kwargs))


def _tokenizer_of(processor: Any) -> Any:
    tok = getattr(processor, "tokenizer", processor)
    return tok if hasattr(tok, "decode") else None


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids = getattr(tokenizer, "eos_token_ids", None)
    if ids is None:
        ids = getattr(tokenizer, "eos_token_id", None)
    if ids is None:
        ids = getattr(getattr(model, "config", None), "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in ids] if isinstance(ids, list | tuple | set) else [int(ids)]


def _prepare(model: Any, processor: Any, prompt: str | None, images: Any, kwargs: dict) -> tuple:
    """(input_ids, pixel_values, mask): the caller's tensors, else the processor's output."""
    if kwargs.get("input_ids") is not None:
        return kwargs.pop("input_ids"), kwargs.pop("pixel_values", None), kwargs.pop("mask", None)
    from mlx_vlm.utils import prepare_inputs, should_add_special_tokens

    if isinstance(images, str):
        images = [images]
    inputs = prepare_inputs(
        processor,
        images=images or None,
        prompts=prompt,
        image_token_index=getattr(model.config, "image_token_index", None),
        add_special_tokens=should_add_special_tokens(model.config.model_type, processor),
    )
    extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values")}
    mask = extra.pop("attention_mask", None)
    kwargs.update(extra)
    return inputs["input_ids"], inputs.get("pixel_values"), mask


def stream_cached_generate(
    model: Any,
    processor: Any,
    prompt: str | None = None,
    images: Any = None,
    *,
    cache: Any = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    sampler: Sampler | None = None,
    **kwargs: Any,
) -> Iterator[GenerationStep]:
    """Stream generation for a text prompt (already chat-formatted) and images, on a cache.

    Drop-in for ``mlx_vlm.stream_generate(model, processor, prompt, image)``; pass
    ``input_ids=``/``pixel_values=`` (+ model inputs) instead of a prompt to skip the processor.
    The images' processed ``pixel_values`` identify them in cache keys.
    """
    t0 = time.perf_counter()
    input_ids, pixel_values, mask = _prepare(model, processor, prompt, images, kwargs)
    tokenizer = _tokenizer_of(processor)
    kwargs.setdefault("eos_token_ids", _eos_ids(model, tokenizer))
    kwargs.update(cache=cache, max_tokens=max_tokens, tokenizer=tokenizer, mask=mask)
    kwargs.update(temperature=temperature, sampler=sampler)
    yield from timed_from(stream_generate_tokens(model, input_ids, pixel_values, **kwargs), t0)


def cached_generate(
    model: Any, processor: Any, prompt: str | None = None, images: Any = None, **kwargs: Any
) -> GenerationResult:
    """Generate for a prompt and images on a cache; ``.text`` holds the answer.

    ``kwargs`` are ``stream_cached_generate``'s (``cache``, ``max_tokens``, ...)."""
    return run_to_end(stream_cached_generate(model, processor, prompt, images, **kwargs))
