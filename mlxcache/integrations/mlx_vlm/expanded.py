"""Cache positions for models whose ``get_input_embeddings`` expands an image placeholder.

llava_next and phi4mm replace the one placeholder token of an image by the image's feature
rows, so the KV cache holds more positions than the prompt has ids. mlxcache keys and resumes
such a prompt in embedding positions: its ids with the placeholder repeated once per row.
"""

from __future__ import annotations

from typing import Any


def one_placeholder_expanded(model: Any, tokens: list[int], length: int) -> list[int] | None:
    """``tokens`` in ``length`` embedding positions, the image placeholder repeated per row.

    Only a prompt with exactly one placeholder is mapped (its row count is then exact: the
    embeddings' extra length); another prompt gives None and runs the engine's own path.
    """
    token = getattr(getattr(model, "config", None), "image_token_index", None)
    at = [i for i, t in enumerate(tokens) if t == token]
    rows = length - len(tokens) + 1
    if token is None or len(at) != 1 or rows < 1:
        return None
    p = at[0]
    return tokens[:p] + [int(token)] * rows + tokens[p + 1 :]
