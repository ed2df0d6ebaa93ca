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

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlxcache.integrations._vlm_models import (
    MROPE_TYPES,
    RESUMABLE_KEYS,
    accepts_cached_features,
    embedding_unsupported_reason,
    encode_images,
    model_type,
    static_unsupported_reason,
)

log = logging.getLogger("mlxcache")

DEFAULT_PREFILL_STEP_SIZE = 2048  # mlx-vlm's default chunk

Sampler = Callable[[mx.array], mx.array]


@dataclass
class Prefill:
    """A prompt's state after prefill, ready to sample its first token from ``logits``."""

    prompt_cache: list[Any]
    extras: dict[str, mx.array]  # state stored with the KV cache, e.g. M-RoPE ``rope_deltas``
    num_cached_tokens: int  # prompt tokens restored from the cache (not recomputed)
    logits: mx.array  # (1, vocab) logits of the last prompt token
    num_tokens: int = 0  # prompt length
    num_stored_tokens: int = 0  # new tokens written to the cache
    vision_cached: bool = False  # image features came from the cache: the encoder did not run
    cached: bool = True  # False when the model or its cache classes ran uncached
    decode_kwargs: dict[str, Any] = field(default_factory=dict)  # per decode step


@dataclass
class GenerationResult:
    """Tokens (and text, given a tokenizer) of one request, with cache use and timings."""

    tokens: list[int] = field(default_factory=list)
    text: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    stored_tokens: int = 0
    vision_cached: bool = False
    cached: bool = True
    time_to_first_token: float = 0.0  # seconds from the call, cache lookup and restore included
    total_time: float = 0.0
    first_logits: mx.array | None = None

    @property
    def generation_tps(self) -> float:
        decode = self.total_time - self.time_to_first_token
        return (len(self.tokens) - 1) / decode if len(self.tokens) > 1 and decode > 0 else 0.0


@dataclass
class GenerationStep:
    """One streamed token; ``text`` is the new text it completes ("" without a tokenizer)."""

    token: int
    text: str
    result: GenerationResult  # running totals, final after the last step


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
    from mlxcache.hashing import images_digest

    parts: list[Any] = [b"pixel_values", b"" if pixel_values is None else pixel_values]
    for name, value in arrays:
        parts += [name.encode(), value]
    return [images_digest(parts)]


def _same_layout(restored: list[Any], fresh: list[Any]) -> bool:
    return len(restored) == len(fresh) and all(
        type(a) is type(b) for a, b in zip(restored, fresh, strict=True)
    )


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
    tokens = ids[0].tolist()

    hit, restored = None, None
    if cache is not None and reason is None and n > 1:
        hit = _cache_call("lookup", cache.lookup, tokens[:-1], images=keys)
        restored = getattr(hit, "vision_embeddings", None)
        if hit is not None and (hit.num_tokens <= 0 or hit.prompt_cache is None):
            hit = None  # only the images' embeddings were found
        if hit is not None and not _same_layout(hit.prompt_cache, fresh):
            log.warning("mlxcache: cached prefix has another cache layout; ignoring it")
            hit = None

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

    prompt_cache = hit.prompt_cache if hit is not None else fresh
    start = hit.num_tokens if hit is not None else 0
    for s in range(start, n - 1, prefill_step_size):
        e = min(s + prefill_step_size, n - 1)
        lm(ids[:, s:e], inputs_embeds=embeds[:, s:e], cache=prompt_cache, **lm_kwargs)
        mx.eval([c.state for c in prompt_cache])

    stored = 0
    if use_cache and n - 1 > start:
        kept = _cache_call(
            "store",
            cache.store,
            tokens[:-1],
            prompt_cache,
            images=keys,
            extras=extras or None,
            vision_embeddings=features,
        )
        stored = kept or 0

    out = lm(ids[:, n - 1 :], inputs_embeds=embeds[:, n - 1 :], cache=prompt_cache, **lm_kwargs)
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
    )


def _cache_call(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
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


def _carried_outputs(out: Any) -> dict[str, Any]:
    """Outputs a decode step feeds to the next (encoder-decoder models), as generate_step does."""
    for name in ("cross_attention_states", "encoder_outputs"):
        value = getattr(out, name, None)
        if value is not None:
            return {name: value}
    return {}


def make_sampler(temperature: float = 0.0) -> Sampler:
    """Greedy (argmax) at temperature 0, else categorical sampling of ``logprobs / T``."""
    if temperature == 0:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    return lambda logprobs: mx.random.categorical(logprobs * (1 / temperature))


def decode(
    model: Any,
    state: Prefill,
    *,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    eos_token_ids: Sequence[int] = (),
) -> Iterator[int]:
    """Sample up to ``max_tokens`` tokens from a Prefill, stopping after an EOS token."""
    sampler = sampler or make_sampler(0.0)
    lm = model.language_model
    logits, kwargs = state.logits, dict(state.decode_kwargs)
    eos = set(eos_token_ids)
    for i in range(max_tokens):
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        y = sampler(logprobs)
        token = y.item()
        yield token
        if token in eos or i == max_tokens - 1:
            return
        out = lm(y.reshape(1, 1), cache=state.prompt_cache, **kwargs)
        logits = out.logits[:, -1, :]
        kwargs = {**state.decode_kwargs, **_carried_outputs(out)}


class _Detokenizer:
    """Text deltas from a tokenizer's ``decode`` (held back while a character is incomplete)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""

    def add(self, token: int) -> str:
        if self.tokenizer is None:
            return ""
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd") or not text.startswith(self.text):
            return ""
        delta, self.text = text[len(self.text) :], text
        return delta

    def finish(self) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.tokens)
        delta = text[len(self.text) :] if text.startswith(self.text) else ""
        self.text = text
        return delta


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
    result = GenerationResult(
        prompt_tokens=state.num_tokens,
        cached_tokens=state.num_cached_tokens,
        stored_tokens=state.num_stored_tokens,
        vision_cached=state.vision_cached,
        cached=state.cached,
        first_logits=state.logits,
    )
    detok = _Detokenizer(tokenizer)
    sampler = sampler or make_sampler(temperature)
    for token in decode(
        model, state, max_tokens=max_tokens, sampler=sampler, eos_token_ids=eos_token_ids
    ):
        now = time.perf_counter() - t0
        if not result.tokens:
            result.time_to_first_token = now
        result.tokens.append(token)
        result.total_time = now
        yield GenerationStep(token, detok.add(token), result)
    if tokenizer is not None:
        detok.finish()
        result.text = detok.text
    result.total_time = time.perf_counter() - t0


def generate_tokens(
    model: Any, input_ids: Any, pixel_values: mx.array | None = None, **kwargs: Any
) -> GenerationResult:
    """``stream_generate_tokens`` run to the end: the GenerationResult."""
    result = GenerationResult()
    for step in stream_generate_tokens(model, input_ids, pixel_values, **kwargs):
        result = step.result
    return result


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
    for step in stream_generate_tokens(
        model,
        input_ids,
        pixel_values,
        cache=cache,
        max_tokens=max_tokens,
        temperature=temperature,
        sampler=sampler,
        tokenizer=tokenizer,
        mask=mask,
        **kwargs,
    ):
        if len(step.result.tokens) == 1:
            step.result.time_to_first_token = time.perf_counter() - t0
        yield step


def cached_generate(
    model: Any,
    processor: Any,
    prompt: str | None = None,
    images: Any = None,
    *,
    cache: Any = None,
    max_tokens: int = 256,
    **kwargs: Any,
) -> GenerationResult:
    """Generate for a prompt and images on a cache; ``.text`` holds the answer."""
    t0 = time.perf_counter()
    result = GenerationResult()
    for step in stream_cached_generate(
        model, processor, prompt, images, cache=cache, max_tokens=max_tokens, **kwargs
    ):
        result = step.result
    result.total_time = time.perf_counter() - t0
    return result
