"""Position ids for language models that use an explicit ``position_ids`` as given.

GLM-4V, GLM-4V-MoE and PaddleOCR-VL neither slice an explicit ``position_ids`` at their cache
offset nor read their own ``_position_ids`` past the first prefill chunk: in mlx-vlm 0.7.10's
chunked prefill the first chunk (from cache offset 0) takes its positions from
``get_rope_index`` and every later token (later chunks, the last token, decoding) takes
``cache offset + rope_deltas``. A resumed suffix starts at another offset, so it is given the
engine's positions explicitly, sliced per chunk; a prompt whose stored part the engine would not
place at its ``get_rope_index`` positions (an image past the first chunk) is not resumed.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def engine_positions(run_kwargs: dict[str, Any], n: int, step: int) -> str | None:
    """Replace the primed ``position_ids`` (the prompt's ``get_rope_index``) in ``run_kwargs``
    with the ones mlx-vlm's uncached prefill of ``n`` tokens in chunks of ``step`` gives.

    Returns why the prompt may not be resumed or stored, or None: its first ``n - 1`` positions
    (the part a cache holds) must be ``get_rope_index``'s, which depend on the prefix alone.
    Either way the prompt then runs at the engine's positions.
    """
    positions, deltas = run_kwargs.get("position_ids"), run_kwargs.get("rope_deltas")
    if positions is None or deltas is None or positions.ndim != 3:
        return "its language model gave no M-RoPE position ids to resume with"
    first = min(step, n - 1)  # the engine's first chunk; every later token uses rope_deltas
    later = mx.arange(first, n, dtype=positions.dtype)[None, None] + deltas[None].astype(
        positions.dtype
    )
    later = mx.broadcast_to(later, (positions.shape[0], positions.shape[1], n - first))
    engine = mx.concatenate([positions[..., :first], later], axis=-1)
    run_kwargs["position_ids"] = engine
    if not bool(mx.array_equal(engine[..., : n - 1], positions[..., : n - 1]).item()):
        return "an image lies past mlx-vlm's first prefill chunk (its positions there differ)"
    return None


def for_chunk(run_kwargs: dict[str, Any], s: int, e: int) -> dict[str, Any]:
    """``run_kwargs`` for prompt positions ``[s, e)``: its ``position_ids`` sliced to them."""
    positions = run_kwargs.get("position_ids")
    if positions is None:
        return run_kwargs
    return {**run_kwargs, "position_ids": positions[..., s:e]}
