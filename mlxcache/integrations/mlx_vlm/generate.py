"""Cached prefill and generation for mlx-vlm models on a PrefixCache.

``prefill`` restores the longest cached prefix of a prompt, runs the vision encoder only when
the images' embeddings are not cached, prefills the uncached rest and stores the new blocks.
``generate_tokens``/``stream_generate_tokens`` decode from it (token ids in, token ids out);
``cached_generate``/``stream_cached_generate`` take a processor and a text prompt like
``mlx_vlm.generate``. Greedy output equals mlx-vlm's uncached ``generate_step`` bit for bit.

The prompt is prefilled up to its last token, that state is stored, then the last token runs
alone (as ``generate_step`` does): a repeat of the same prompt restores everything but one
token, and a hit never needs a cache that can be cut (a sliding-window cache past its window
is reused at exactly the stored length). A prompt mlx-vlm prefills in one pass (a prefix-LM,
bidirectional image tokens) runs in one pass too; only an exact repeat of it is reused (whole.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
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
    log_softmax,
    make_sampler,
    run_to_end,
    sample_tokens,
    stream_result,
    timed_from,
)
from mlxcache.integrations.mlx_vlm import engine, positions, whole
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

ONE_PASS = "mlx-vlm prefills this prompt in one pass (no split may be resumed)"

__all__ = [
    "DEFAULT_PREFILL_STEP_SIZE",
    "GenerationResult",
    "GenerationStep",
    "Prefill",
    "Sampler",
    "cached_generate",
    "decode",
    "decode_steps",
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

    ids = _as_ids(input_ids)
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
        prompt_cache, logits = repeat
        return Prefill(
            prompt_cache=prompt_cache,
            extras={},
            num_cached_tokens=n,
            logits=logits,
            num_tokens=n,
            cached=True,
            token_ids=tokens,
        )
    if one_pass:
        out = run(0, n)
        if repeat_keys and not _carried_outputs(out):
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
        decode_kwargs=_carried_outputs(out),
        token_ids=cast("list[int]", ids[0].tolist()),
    )


def _refused(model: Any) -> str | None:
    """Why ``model`` is never resumed (logged once per model), or None."""
    from mlx_vlm.models.cache import make_prompt_cache

    reason = static_unsupported_reason(model, make_prompt_cache(model.language_model))
    if reason is not None:
        tell_once(model, reason)
    return reason


def _carried_outputs(out: Any) -> dict[str, Any]:
    """Outputs a decode step feeds to the next (encoder-decoder models), as generate_step does."""
    for name in ("cross_attention_states", "encoder_outputs"):
        value = getattr(out, name, None)
        if value is not None:
            return {name: value}
    return {}


def decode(model: Any, state: Prefill, **kwargs: Any) -> Iterator[int]:
    """Sample up to ``max_tokens`` tokens from a Prefill, stopping after an EOS token.

    ``kwargs`` are ``decode_steps``'s."""
    for token, _ in decode_steps(model, state, **kwargs):
        yield token


def decode_steps(
    model: Any,
    state: Prefill,
    *,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    eos_token_ids: Sequence[int] = (),
    logits_processors: Sequence[Callable[[mx.array, mx.array], mx.array]] = (),
) -> Iterator[tuple[int, mx.array]]:
    """``decode`` with each token's log-probabilities: (token, (vocab,) logprobs) pairs.

    ``logits_processors`` run on the logits before the log-softmax, as in mlx-vlm's
    ``generate_step``: they see the prompt's last token, then every sampled one."""
    lm = model.language_model
    kwargs = dict(state.decode_kwargs)
    history = [int(state.token_ids[-1])] if state.token_ids else []

    def logprobs_of(logits: mx.array) -> mx.array:
        if logits_processors:
            seen = mx.array(history)
            for processor in logits_processors:
                logits = processor(seen, logits)
        return log_softmax(logits)

    def step(y: mx.array) -> mx.array:
        nonlocal kwargs
        history.append(cast(int, y.item()))
        out = lm(y.reshape(1, 1), cache=state.prompt_cache, logits_to_keep=1, **kwargs)
        kwargs = _carried_outputs(out)
        return out.logits[:, -1, :]

    if state.logits is None:
        raise ValueError("this Prefill holds no logits to decode from (the engine's path ran)")
    yield from sample_tokens(
        state.logits,
        step,
        max_tokens=max_tokens,
        sampler=sampler or make_sampler(0.0),
        eos_token_ids=eos_token_ids,
        logprobs_of=logprobs_of,
    )


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

    Without a ``cache``, or for a model mlxcache does not resume, mlx-vlm's own
    ``generate_step`` runs unchanged (its answer is the engine's; ``first_logits`` is None).
    ``tokenizer`` (anything with ``decode(list[int]) -> str``) is optional and only fills
    ``text``. Times count from the call, cache lookup and restore included.
    """
    t0 = time.perf_counter()
    sampler = sampler or make_sampler(temperature)
    steps: Iterator[tuple[int, mx.array]]
    if cache is None or _refused(model) is not None:
        ids = _as_ids(input_ids)
        mask = mx.ones_like(ids) if mask is None else mask
        state = Prefill(prompt_cache=[], extras={}, num_cached_tokens=0, logits=None)
        state.num_tokens, state.cached = ids.shape[1], False
        steps = engine.generate_steps(
            model,
            ids,
            pixel_values,
            mask=mask,
            max_tokens=max_tokens,
            sampler=sampler,
            eos_token_ids=eos_token_ids,
            prefill_step_size=prefill_step_size,
            **model_kwargs,
        )
    else:
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
        steps = decode_steps(
            model, state, max_tokens=max_tokens, sampler=sampler, eos_token_ids=eos_token_ids
        )
    text = Detokenizer(tokenizer) if tokenizer is not None else None
    yield from stream_result(
        state, steps, t0=t0, max_tokens=max_tokens, text=text, eos_token_ids=eos_token_ids
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
