"""Cached generation for mlx-vlm models on a PrefixCache.

``prefill`` (``prefill.py``) restores the longest cached prefix of a prompt, runs the vision
encoder only when the images' embeddings are not cached, prefills the uncached rest and stores
the new blocks. ``generate_tokens``/``stream_generate_tokens`` decode from it (token ids in,
token ids out); ``cached_generate``/``stream_cached_generate`` take a processor and a text
prompt like ``mlx_vlm.generate``. Greedy output equals mlx-vlm's uncached ``generate_step``
bit for bit.

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
    tokens_only,
)
from mlxcache.integrations.mlx_vlm import engine
from mlxcache.integrations.mlx_vlm.prefill import (
    DEFAULT_PREFILL_STEP_SIZE,
    as_ids,
    carried_outputs,
    image_keys,
    prefill,
    refusal,
)

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


def decode(model: Any, state: Prefill, **kwargs: Any) -> Iterator[int]:
    """Sample up to ``max_tokens`` tokens from a Prefill, stopping after an EOS token.

    ``kwargs`` are ``decode_steps``'s."""
    return tokens_only(decode_steps(model, state, **kwargs))


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
        kwargs = carried_outputs(out)
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
    if cache is None or refusal(model) is not None:
        ids = as_ids(input_ids)
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
