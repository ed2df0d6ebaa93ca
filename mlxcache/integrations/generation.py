"""Engine-neutral generation pieces: prefill state, results, sampling and the decode loop.

Shared by the mlx-vlm and mlx-lm integrations so both report cache use, timings and text the
same way; each engine supplies only how one decode step runs its model and how text is made.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import mlx.core as mx

Sampler = Callable[[mx.array], mx.array]
Step = Callable[[mx.array], mx.array]  # sampled token (shape (1,)) -> (1, vocab) logits


@dataclass
class Prefill:
    """A prompt's state after prefill, ready to sample its first token from ``logits``."""

    prompt_cache: list[Any]
    extras: dict[str, mx.array]  # state stored with the KV cache, e.g. M-RoPE ``rope_deltas``
    num_cached_tokens: int  # prompt tokens restored from the cache (not recomputed)
    logits: mx.array | None  # (1, vocab) logits of the last prompt token (None: engine's path)
    num_tokens: int = 0  # prompt length in KV cache positions (an expanded image counts its rows)
    num_stored_tokens: int = 0  # new tokens written to the cache
    vision_cached: bool = False  # image features came from the cache: the encoder did not run
    cached: bool = True  # False when the model or its cache classes ran uncached
    decode_kwargs: dict[str, Any] = field(default_factory=dict)  # per decode step
    token_ids: list[int] = field(default_factory=list)  # the prompt (for logits processors)


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
    first_logits: mx.array | None = None  # None when the engine's own path ran
    finish_reason: str | None = None  # "stop" (an EOS token) or "length", once finished

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
    logprobs: mx.array | None = None  # the (vocab,) log-probabilities the token was sampled from


class TextStream(Protocol):
    """Turns tokens into text deltas: ``add`` per token, ``finish`` once; ``text`` is all.

    ``add(token, last=True)`` adds the last token and flushes what was held back (it replaces
    ``finish``).
    """

    text: str

    def add(self, token: int, last: bool = False) -> str: ...

    def finish(self) -> str: ...


def make_sampler(temperature: float = 0.0) -> Sampler:
    """Greedy (argmax) at temperature 0, else categorical sampling of ``logprobs / T``."""
    if temperature == 0:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    return lambda logprobs: mx.random.categorical(logprobs * (1 / temperature))


def log_softmax(logits: mx.array) -> mx.array:
    """``logits - logsumexp`` over the vocabulary axis (what mlx-vlm's generate_step does)."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def sample_tokens(
    logits: mx.array,
    step: Step,
    *,
    max_tokens: int | None,
    sampler: Sampler,
    eos_token_ids: Iterable[int] = (),
    logprobs_of: Callable[[mx.array], mx.array] = log_softmax,
) -> Iterator[tuple[int, mx.array]]:
    """(token, logprobs) pairs from the prompt's last logits, stopping after an EOS token
    (``logprobs``: the (vocab,) row the token was sampled from).

    ``step`` feeds the sampled token to the model and returns the next logits. ``max_tokens``
    None means no limit.
    """
    eos = set(eos_token_ids)
    i = 0
    while max_tokens is None or i < max_tokens:
        logprobs = logprobs_of(logits)
        y = sampler(logprobs)
        token = cast(int, y.item())  # a sampled token id
        yield token, logprobs.reshape(-1)
        i += 1
        if token in eos or (max_tokens is not None and i == max_tokens):
            return
        logits = step(y)


class Detokenizer:
    """Text deltas from a tokenizer's ``decode`` (held back while a character is incomplete)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""

    def add(self, token: int, last: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd") or not text.startswith(self.text):
            return self.finish() if last else ""
        delta, self.text = text[len(self.text) :], text
        return delta + (self.finish() if last else "")

    def finish(self) -> str:
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.tokens)
        delta = text[len(self.text) :] if text.startswith(self.text) else ""
        self.text = text
        return delta


def stream_result(
    state: Prefill,
    tokens: Iterable[tuple[int, mx.array | None]],
    *,
    t0: float,
    max_tokens: int | None = None,
    text: TextStream | None = None,
    eos_token_ids: Iterable[int] = (),
) -> Iterator[GenerationStep]:
    """GenerationSteps over ``(token, logprobs)`` pairs decoded from ``state``; the result is
    final at the end.

    Times count from ``t0`` (the caller's start, cache lookup and restore included). With
    ``text``, the last step (an EOS token or the ``max_tokens``-th) also carries the text held
    back until the end, and the result's ``text`` is set.
    """
    result = GenerationResult(
        prompt_tokens=state.num_tokens,
        cached_tokens=state.num_cached_tokens,
        stored_tokens=state.num_stored_tokens,
        vision_cached=state.vision_cached,
        cached=state.cached,
        first_logits=state.logits,
    )
    eos = set(eos_token_ids)
    finished = False
    for token, logprobs in tokens:
        now = time.perf_counter() - t0
        if not result.tokens:
            result.time_to_first_token = now
        result.tokens.append(token)
        result.total_time = now
        last = token in eos or len(result.tokens) == max_tokens
        delta = text.add(token, last) if text is not None else ""
        if last:
            result.finish_reason = "stop" if token in eos else "length"
            if text is not None:
                result.text = text.text
            finished = True
        yield GenerationStep(token, delta, result, logprobs)
    if not finished:
        result.finish_reason = "length" if result.tokens else None
        if text is not None:
            text.finish()
            result.text = text.text
    result.total_time = time.perf_counter() - t0


def tokens_only(steps: Iterable[tuple[int, Any]]) -> Iterator[int]:
    """The tokens of ``(token, logprobs)`` pairs."""
    return (token for token, _ in steps)


def timed_from(steps: Iterable[GenerationStep], t0: float) -> Iterator[GenerationStep]:
    """``steps`` timed on one clock started at ``t0``: a wrapper that encodes the prompt first
    counts that work in the time to first token and in the total time, as the engines do."""
    result = None
    for step in steps:
        result = step.result
        now = time.perf_counter() - t0
        if len(result.tokens) == 1:
            result.time_to_first_token = now
        result.total_time = now
        yield step
    if result is not None:  # the steps' own clock set it last, from their later start
        result.total_time = time.perf_counter() - t0


def run_to_end(steps: Iterable[GenerationStep], t0: float | None = None) -> GenerationResult:
    """The final GenerationResult of ``steps``; with ``t0``, its total time counts from it."""
    result = GenerationResult()
    for step in steps:
        result = step.result
    if t0 is not None:
        result.total_time = time.perf_counter() - t0
    return result
