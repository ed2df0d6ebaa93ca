"""What the vllm-mlx compatible MLLM manager hands out: its stats and its entries, with vllm-mlx's
fields, defaults and prefix-match semantics."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mlxcache.integrations.vllm_mlx import payloads

__all__ = ["MLLMCacheStats", "MLLMPrefixCacheEntry", "common_prefix", "as_tokens"]


@dataclass
class MLLMCacheStats:
    """Statistics for MLLM cache performance."""

    hits: int = 0
    misses: int = 0
    partial_hits: int = 0  # prefix matched but not in full, or vision embeddings only
    tokens_saved: int = 0
    image_cache_hits: int = 0
    vision_encoder_skips: int = 0
    total_queries: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        """Hits over queries (0.0 before the first query)."""
        return self.hits / self.total_queries if self.total_queries else 0.0

    def to_dict(self) -> dict:
        """The counters and the hit rate as a dict."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "partial_hits": self.partial_hits,
            "hit_rate": self.hit_rate,
            "tokens_saved": self.tokens_saved,
            "image_cache_hits": self.image_cache_hits,
            "vision_encoder_skips": self.vision_encoder_skips,
            "total_queries": self.total_queries,
            "evictions": self.evictions,
        }


@dataclass
class MLLMPrefixCacheEntry:
    """One cached prefix: vision embeddings, the language model's KV cache and its tokens."""

    image_hash: str
    prompt_hash: str
    vision_embeddings: Any = None
    kv_cache: list[Any] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_image_tokens: int = 0
    num_text_tokens: int = 0
    prompt_tokens: int = 0
    created_at: float = field(default_factory=time.time)
    hit_count: int = 0
    model_name: str = ""

    @property
    def total_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def memory_size(self) -> int:
        """Bytes really held by the vision embeddings and the KV cache (any cache class)."""
        return payloads.true_nbytes(self.vision_embeddings) + payloads.true_nbytes(self.kv_cache)

    def get_prefix_match_length(self, new_token_ids: np.ndarray | Sequence[int]) -> int:
        """How many leading tokens of ``new_token_ids`` equal this entry's tokens."""
        return common_prefix(as_tokens(self.token_ids), as_tokens(new_token_ids))


def as_tokens(token_ids: Any) -> np.ndarray:
    """Token ids (list, NumPy or MLX array) as a flat int64 array."""
    if token_ids is None:
        return np.zeros(0, dtype=np.int64)
    return np.asarray(token_ids, dtype=np.int64).reshape(-1)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n
