"""mlx-vlm's own generation path, unchanged, for prompts mlxcache does not resume.

A model (or a request) that mlxcache cannot resume safely runs ``mlx_vlm.generate.ar.
generate_step`` itself with the caller's inputs, so its answer is the engine's answer bit for
bit; mlxcache only reports it in its own result types. The checks here are the engine's own
rules, read in mlx-vlm 0.7.10's ``generate/ar.py`` and ``generate/common.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from mlxcache.integrations.generation import Sampler


def chunks_prefill(model: Any, ids: mx.array, embeds: mx.array, kwargs: dict[str, Any]) -> bool:
    """Whether mlx-vlm splits this prompt's prefill into chunks (its ``_chunked_prefill_enabled``).

    A model that is prefilled in one pass (a prefix-LM, bidirectional vision attention) gives
    another answer when the prompt is split, so mlxcache may not resume it at any boundary.
    """
    candidates = [model]
    lm = getattr(model, "language_model", None)
    if lm is not None and lm is not model:
        candidates.append(lm)
    for candidate in candidates:
        policy = getattr(candidate, "chunked_prefill_policy", None)
        if callable(policy):
            enabled = policy(
                input_ids=ids,
                inputs_embeds=embeds,
                prompt_cache=None,
                draft_model=None,
                draft_kind=None,
                prefill_kwargs=kwargs,
            )
            return bool(getattr(enabled, "enabled", enabled))
    return not any(getattr(c, "no_chunked_prefill", False) for c in candidates)


def generate_steps(
    model: Any,
    input_ids: mx.array,
    pixel_values: mx.array | None,
    *,
    mask: mx.array | None,
    max_tokens: int,
    sampler: Sampler,
    eos_token_ids: Any = (),
    prefill_step_size: int,
    **model_kwargs: Any,
) -> Iterator[tuple[int, mx.array]]:
    """(token, (vocab,) logprobs) pairs of mlx-vlm's ``generate_step``, stopping after EOS."""
    from mlx_vlm.generate.ar import generate_step

    eos = set(eos_token_ids)
    steps = generate_step(
        input_ids,
        model,
        pixel_values,
        mask,
        max_tokens=max_tokens,
        temperature=0.0,
        sampler=sampler,
        prefill_step_size=prefill_step_size,
        **model_kwargs,
    )
    for token, logprobs in steps:
        token = int(token)
        yield token, logprobs.reshape(-1)
        if token in eos:
            return
