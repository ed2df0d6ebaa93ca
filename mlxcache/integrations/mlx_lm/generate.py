"""Cached prefill and generation for mlx-lm text models on a PrefixCache.

``prefill`` restores the longest cached prefix of a prompt, prefills the uncached rest in
chunks and stores the new blocks; ``generate_tokens``/``stream_generate_tokens`` decode from it
(token ids in, token ids out); ``cached_generate``/``stream_cached_generate`` take a tokenizer
and a text prompt like ``mlx_lm.generate``/``mlx_lm.stream_generate``. Any architecture mlx-lm
loads works (KV, rotating, quantized and hybrid/SSM caches, through the serializers' adapters).

The model calls follow mlx-lm 0.32's ``generate_step`` (chunked prefill up to the last token,
the last token alone, the same sampler input, logits processors and KV quantization), so greedy
output equals ``mlx_lm.generate`` uncached, token for token. A cache that fails is logged and
the prompt runs uncached.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import mlx.core as mx

from mlxcache.integrations import resume
from mlxcache.integrations.generation import (
    GenerationResult,
    GenerationStep,
    Prefill,
    Sampler,
    make_sampler,
    run_to_end,
    sample_tokens,
    stream_result,
    timed_from,
    tokens_only,
)
from mlxcache.integrations.resume import log

__all__ = [
    "DEFAULT_PREFILL_STEP_SIZE",
    "GenerationResult",
    "GenerationStep",
    "Prefill",
    "cached_generate",
    "decode",
    "decode_steps",
    "encode_prompt",
    "generate_tokens",
    "prefill",
    "stream_cached_generate",
    "stream_generate_tokens",
]

DEFAULT_PREFILL_STEP_SIZE = 2048  # mlx-lm's default chunk
DEFAULT_QUANTIZED_KV_START = 5000  # mlx-lm's default

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


# the options of ``prefill`` that ``decode_steps`` takes too
_DECODE_OPTIONS = ("logits_processors", "kv_bits", "kv_group_size", "quantized_kv_start")


def _prompt(input_ids: Any) -> mx.array:
    """The prompt as a 1-D mx.array (mlx-lm's own dtype for a list: int32)."""
    ids = input_ids if isinstance(input_ids, mx.array) else mx.array(input_ids)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1 or ids.shape[0] == 0:
        raise ValueError(f"input_ids must hold one non-empty prompt, got shape {ids.shape}")
    return ids


class _Model:
    """The model calls of mlx-lm's ``generate_step`` for one request, on one prompt cache."""

    def __init__(
        self,
        model: Any,
        prompt_cache: list[Any],
        *,
        logits_processors: Sequence[LogitsProcessor] | None,
        kv_bits: int | None,
        kv_group_size: int,
        quantized_kv_start: int,
    ) -> None:
        from mlx_lm.generate import generation_stream

        self.model, self.prompt_cache, self.stream = model, prompt_cache, generation_stream
        self.processors = list(logits_processors or [])
        self.kv = (quantized_kv_start, kv_group_size, kv_bits)
        self.tokens: mx.array | None = None  # what the processors see: every token fed so far

    def quantize(self) -> None:
        from mlx_lm.generate import maybe_quantize_kv_cache

        maybe_quantize_kv_cache(self.prompt_cache, *self.kv)

    def seen(self, ids: mx.array) -> None:
        if self.processors and len(ids) > 0:
            self.tokens = ids if self.tokens is None else mx.concat([self.tokens, ids])

    def chunk(self, ids: mx.array) -> None:
        """A prefill chunk: run the model, quantize the KV if due (no logits kept)."""
        with mx.stream(self.stream):
            self.model(ids[None], cache=self.prompt_cache)
            self.quantize()
        self.seen(ids)

    def step(self, ids: mx.array) -> mx.array:
        """The last prompt token or a sampled token: the (1, vocab) logits after processors."""
        with mx.stream(self.stream):
            logits = self.model(ids[None], cache=self.prompt_cache)[:, -1, :]
            self.seen(ids)
            for processor in self.processors:
                assert self.tokens is not None  # seen() has just taken ids (never empty here)
                logits = processor(self.tokens, logits)
            self.quantize()
        return logits


def _lm_logprobs(logits: mx.array) -> mx.array:
    """What mlx-lm's generate_step feeds its sampler: ``logits - logsumexp`` (all axes)."""
    return logits - mx.logsumexp(logits, keepdims=True)


def _fits(restored: Sequence[Any], fresh: Sequence[Any], kv_bits: int | None, group: int) -> bool:
    """The restored layout matches the fresh cache, allowing layers mlx-lm quantized."""
    if kv_bits is not None and len(restored) == len(fresh):
        from mlx_lm.models.cache import QuantizedKVCache

        ref = []
        for r, f in zip(restored, fresh, strict=True):
            if isinstance(r, QuantizedKVCache) and not isinstance(f, QuantizedKVCache):
                try:
                    f = f.to_quantized(group_size=group, bits=kv_bits)
                except (AttributeError, NotImplementedError):
                    pass
            ref.append(f)
        fresh = ref
    return resume.same_layout(restored, fresh)


def prefill(
    model: Any,
    input_ids: Any,
    *,
    cache: Any,
    prefill_step_size: int = DEFAULT_PREFILL_STEP_SIZE,
    max_kv_size: int | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
    logits_processors: Sequence[LogitsProcessor] | None = None,
    prompt_progress_callback: Callable[[int, int], None] | None = None,
) -> Prefill:
    """Prefill a prompt, reusing its longest cached prefix and storing what is new.

    ``cache`` is a ``PrefixCache`` (or None: plain uncached prefill). The other options are
    ``mlx_lm.generate_step``'s. Cache classes the serializers do not know run uncached, with
    one log line.
    """
    from mlx_lm.models.cache import make_prompt_cache

    prompt = _prompt(input_ids)
    tokens = cast("list[int]", prompt.tolist())  # a 1-D array of token ids
    n = len(tokens)
    fresh = make_prompt_cache(model, max_kv_size=max_kv_size)
    reason = resume.unsupported_cache_reason(fresh) if cache is not None else None
    if reason is not None:
        log.info("mlxcache: running uncached: %s", reason)
    use_cache = cache is not None and reason is None

    found = resume.lookup(
        cache if use_cache else None,
        tokens,
        fresh,
        fits=lambda restored, new: _fits(restored, new, kv_bits, kv_group_size),
    )
    prompt_cache = fresh
    if found.hit is not None:
        assert found.hit.prompt_cache is not None  # resume.lookup keeps only hits with a cache
        prompt_cache = found.hit.prompt_cache
    start = found.num_tokens

    runner = _Model(
        model,
        prompt_cache,
        logits_processors=logits_processors,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
    )
    if start:
        runner.quantize()  # a restored KVCache past quantized_kv_start, as mlx-lm would have it
        runner.seen(prompt[:start])
    progress = prompt_progress_callback or (lambda *_: None)
    progress(start, n)

    def run(s: int, e: int) -> Any:
        if e == n:
            return runner.step(prompt[s:e])
        return runner.chunk(prompt[s:e])

    def after_chunk(e: int) -> None:
        progress(e, n)
        mx.clear_cache()

    logits, stored = resume.finish_prompt(
        run,
        runner.prompt_cache,
        tokens,
        start,
        cache=cache if use_cache else None,
        step_size=prefill_step_size,
        after_chunk=after_chunk,
        branch=found.branch,
    )
    mx.eval(logits)
    progress(n, n)
    return Prefill(
        prompt_cache=runner.prompt_cache,
        extras={},
        num_cached_tokens=start,
        logits=logits,
        num_tokens=n,
        num_stored_tokens=stored,
        cached=use_cache,
        token_ids=tokens,
    )


def decode(model: Any, state: Prefill, **kwargs: Any) -> Iterator[int]:
    """Sample up to ``max_tokens`` tokens (-1: no limit) from a Prefill, stopping after EOS.

    ``kwargs`` are ``decode_steps``'s: pass the ``logits_processors`` and KV quantization
    options given to ``prefill``.
    """
    return tokens_only(decode_steps(model, state, **kwargs))


def decode_steps(
    model: Any,
    state: Prefill,
    *,
    max_tokens: int = 256,
    sampler: Sampler | None = None,
    eos_token_ids: Sequence[int] = (),
    logits_processors: Sequence[LogitsProcessor] | None = None,
    kv_bits: int | None = None,
    kv_group_size: int = 64,
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
) -> Iterator[tuple[int, mx.array]]:
    """``decode`` with each token's log-probabilities: (token, (vocab,) logprobs) pairs."""
    runner = _Model(
        model,
        state.prompt_cache,
        logits_processors=logits_processors,
        kv_bits=kv_bits,
        kv_group_size=kv_group_size,
        quantized_kv_start=quantized_kv_start,
    )
    runner.seen(mx.array(state.token_ids))
    if state.logits is None:
        raise ValueError("this Prefill holds no logits to decode from (the engine's path ran)")
    yield from sample_tokens(
        state.logits,
        runner.step,
        max_tokens=None if max_tokens == -1 else max_tokens,
        sampler=sampler or make_sampler(0.0),
        eos_token_ids=eos_token_ids,
        logprobs_of=_lm_logprobs,
    )


class _Text:
    """mlx-lm's streaming detokenizer as a TextStream; EOS tokens add no text.

    Read exactly as ``mlx_lm.stream_generate`` reads it, so the text is the same.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
        self.detokenizer = tokenizer.detokenizer
        self.eos = set(eos_token_ids)
        self.text = ""

    def _segment(self) -> str:
        segment = self.detokenizer.last_segment
        self.text += segment
        return segment

    def add(self, token: int, last: bool = False) -> str:
        if token not in self.eos:
            self.detokenizer.add_token(token)
        if last:
            return self.finish()
        return "" if token in self.eos else self._segment()

    def finish(self) -> str:
        self.detokenizer.finalize()
        return self._segment()


def _wrap(tokenizer: Any) -> Any:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)


def stream_generate_tokens(
    model: Any,
    input_ids: Any,
    *,
    cache: Any = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    sampler: Sampler | None = None,
    eos_token_ids: Sequence[int] = (),
    tokenizer: Any = None,
    **prefill_options: Any,
) -> Iterator[GenerationStep]:
    """Yield the tokens of a prompt given as ids, on a ``PrefixCache`` (or None: uncached).

    Without ``eos_token_ids`` it runs ``max_tokens`` tokens, as ``generate_step`` does. A
    ``tokenizer`` (mlx-lm's, or a Hugging Face one) only fills ``text`` (EOS tokens add none).
    ``prefill_options`` are ``prefill``'s; its logits processors and KV quantization apply to
    the decoded tokens too. Times count from the call, cache lookup and restore included.
    """
    t0 = time.perf_counter()
    state = prefill(model, input_ids, cache=cache, **prefill_options)
    shared = {k: v for k, v in prefill_options.items() if k in _DECODE_OPTIONS}
    tokens = decode_steps(
        model,
        state,
        max_tokens=max_tokens,
        sampler=sampler or make_sampler(temperature),
        eos_token_ids=eos_token_ids,
        **shared,
    )
    text = _Text(_wrap(tokenizer), eos_token_ids) if tokenizer is not None else None
    yield from stream_result(
        state,
        tokens,
        t0=t0,
        max_tokens=None if max_tokens == -1 else max_tokens,
        text=text,
        eos_token_ids=eos_token_ids,
    )


def generate_tokens(model: Any, input_ids: Any, **kwargs: Any) -> GenerationResult:
    """``stream_generate_tokens`` run to the end: the GenerationResult."""
    return run_to_end(stream_generate_tokens(model, input_ids, **kwargs))


def encode_prompt(tokenizer: Any, prompt: str | list[int] | tuple[int, ...] | mx.array) -> mx.array:
    """The prompt's ids as ``mlx_lm.stream_generate`` makes them (BOS added unless present)."""
    if isinstance(prompt, mx.array):
        return prompt
    if isinstance(prompt, str):
        tokenizer = _wrap(tokenizer)
        bos = tokenizer.bos_token
        ids = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
        return mx.array(ids)
    return mx.array(prompt)


def stream_cached_generate(
    model: Any,
    tokenizer: Any,
    prompt: str | list[int] | tuple[int, ...] | mx.array,
    *,
    cache: Any = None,
    max_tokens: int = 256,
    **kwargs: Any,
) -> Iterator[GenerationStep]:
    """Stream generation for a text prompt (already chat-formatted) or its ids, on a cache.

    Drop-in for ``mlx_lm.stream_generate(model, tokenizer, prompt)``: the same ids, stops at
    the tokenizer's EOS tokens, and the steps' ``text`` joins to ``mlx_lm.generate``'s text.
    ``kwargs`` are ``stream_generate_tokens``'s (``sampler``, ``logits_processors``,
    ``max_kv_size``, ``kv_bits``, ``prefill_step_size``, ...).
    """
    if max_tokens == 0:
        raise ValueError("max_tokens must be non-zero (use -1 for no limit)")
    t0 = time.perf_counter()
    tokenizer = _wrap(tokenizer)
    ids = encode_prompt(tokenizer, prompt)
    eos = sorted(tokenizer.eos_token_ids)
    kwargs.update(cache=cache, max_tokens=max_tokens, tokenizer=tokenizer)
    yield from timed_from(stream_generate_tokens(model, ids, eos_token_ids=eos, **kwargs), t0)


def cached_generate(
    model: Any, tokenizer: Any, prompt: str | list[int] | tuple[int, ...] | mx.array, **kwargs: Any
) -> GenerationResult:
    """Generate for a prompt on a cache; ``.text`` equals ``mlx_lm.generate``'s answer.

    ``kwargs`` are ``stream_cached_generate``'s (``cache``, ``max_tokens``, ...)."""
    return run_to_end(stream_cached_generate(model, tokenizer, prompt, **kwargs))
