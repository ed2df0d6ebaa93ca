"""Any sampling settings on a restored prefix: mlx-vlm's own sampler on mlxcache's logits.

The KV of a prompt does not depend on how the next token is sampled, so the simple-mode VLM
path restores the prefix for every request and then samples as mlx-vlm 0.7's
``generate_step`` does: its ``make_sampler`` (temperature, top-p, top-k, min-p, ...; its
position-keyed sampler when a ``seed`` is given) and ``make_logits_processors`` (logit bias,
repetition, presence and frequency penalties) plus the request's own logits processors, on the
bit-exact logits of mlxcache's ``prefill``. ``unsupported(kwargs)`` names the settings that
cannot be reproduced this way (a draft model, KV quantization, audio); those requests keep
vllm-mlx's own path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from mlxcache.integrations.generation import (
    Detokenizer,
    GenerationResult,
    GenerationStep,
    run_to_end,
    stream_result,
    timed_from,
)

# generate_step's sampling keywords, all reproduced from the restored state
SAMPLING = {
    "top_p", "top_k", "min_p", "top_n_sigma", "p_less", "typical_p", "seed", "logit_bias",
    "repetition_penalty", "repetition_context_size", "presence_penalty",
    "presence_context_size", "frequency_penalty", "frequency_context_size", "logits_processors",
}  # fmt: skip
# what vllm-mlx passes that changes nothing in the tokens (or is handled by vllm-mlx itself)
IGNORED = {"verbose", "prompt_cache", "skip_prompt_processing", "stop", "chat_template_kwargs"}
EMPTY: tuple[Any, ...] = (None, [], (), {}, False)  # e.g. ``audio=None``, ``tools=[]``


def unsupported(temperature: Any, kwargs: dict[str, Any]) -> list[str]:
    """The settings of a request that a restored prefix cannot serve exactly (empty: none)."""
    bad = [] if isinstance(temperature, int | float) and temperature >= 0 else ["temperature"]
    for key, value in kwargs.items():
        if key in SAMPLING or key in IGNORED:
            continue
        if not any(value is e or (type(value) is type(e) and value == e) for e in EMPTY):
            bad.append(key)
    return bad


def engine_sampling(model: Any, temperature: float, kwargs: dict[str, Any]) -> tuple[Any, list]:
    """mlx-vlm's sampler and logits processors for these settings, built as generate_step does."""
    from mlx_vlm.generate import ar
    from mlx_vlm.generate.common import (
        DEFAULT_MIN_P,
        DEFAULT_REPETITION_CONTEXT_SIZE,
        resolve_sampling_defaults,
    )
    from mlx_vlm.sample_utils import clamp_temperature, make_logits_processors, make_sampler

    def get(name: str, default: Any) -> Any:
        value = kwargs.get(name)
        return default if value is None else value

    temp, top_p, top_k = resolve_sampling_defaults(
        getattr(model, "config", None),
        temperature=temperature,
        top_p=kwargs.get("top_p"),
        top_k=kwargs.get("top_k"),
    )
    temp = clamp_temperature(temp)
    min_p, seed = get("min_p", DEFAULT_MIN_P), kwargs.get("seed")
    top_n_sigma = get("top_n_sigma", ar.DEFAULT_TOP_N_SIGMA)
    p_less, typical_p = bool(get("p_less", False)), get("typical_p", 1.0)
    if (
        seed is not None
        and temp > 0
        and min_p == DEFAULT_MIN_P
        and top_n_sigma == ar.DEFAULT_TOP_N_SIGMA
        and not p_less
        and typical_p == 1.0
    ):
        sampler: Any = ar._PositionedTargetSampler(
            temperature=temp, top_p=top_p, top_k=top_k, seed=seed
        )
    else:
        sampler = make_sampler(
            temp=temp, top_p=top_p, min_p=min_p, top_k=top_k, top_n_sigma=top_n_sigma,
            p_less=p_less, typical_p=typical_p,
        )  # fmt: skip
    context = DEFAULT_REPETITION_CONTEXT_SIZE
    processors = make_logits_processors(
        kwargs.get("logit_bias"),
        kwargs.get("repetition_penalty"),
        get("repetition_context_size", context),
        kwargs.get("presence_penalty"),
        get("presence_context_size", context),
        kwargs.get("frequency_penalty"),
        get("frequency_context_size", context),
    )
    processors.extend(kwargs.get("logits_processors") or [])
    position = [0]

    def sample(logprobs: mx.array) -> mx.array:  # generate_step's _sample_with_positions
        y = ar._sample_with_positions(sampler, logprobs, row_ids=[0], positions=[position[0]])
        position[0] += 1
        return y

    return sample, processors


def stream_generate(
    model: Any,
    processor: Any,
    prompt: str,
    images: Any,
    *,
    cache: Any,
    max_tokens: int,
    temperature: float,
    settings: dict[str, Any],
    **inputs: Any,
) -> Iterator[GenerationStep]:
    """GenerationSteps of one request: the prefix restored from ``cache``, then mlx-vlm's
    sampling (``settings``: generate_step's keywords) on the logits. ``inputs``
    (``input_ids``, ``pixel_values``, model inputs) replace the processor's output."""
    from mlxcache.integrations.mlx_vlm import generate as vlm

    t0 = time.perf_counter()
    extra: dict[str, Any] = dict(inputs)
    input_ids, pixel_values, mask = vlm._prepare(model, processor, prompt, images, extra)
    tokenizer = vlm._tokenizer_of(processor)
    eos = vlm._eos_ids(model, tokenizer)
    sampler, processors = engine_sampling(model, temperature, settings)
    state = vlm.prefill(model, input_ids, pixel_values, cache=cache, mask=mask, **extra)
    pairs = vlm.decode_steps(
        model, state, max_tokens=max_tokens, sampler=sampler, eos_token_ids=eos,
        logits_processors=processors,
    )  # fmt: skip
    steps = stream_result(
        state, pairs, t0=t0, max_tokens=max_tokens, text=Detokenizer(tokenizer),
        eos_token_ids=eos,
    )  # fmt: skip
    yield from timed_from(steps, t0)


def generate(model: Any, processor: Any, prompt: str, images: Any, **kwargs: Any) -> Any:
    """``stream_generate`` run to the end: the GenerationResult."""
    t0 = time.perf_counter()
    result: GenerationResult = run_to_end(
        stream_generate(model, processor, prompt, images, **kwargs), t0
    )
    return result
