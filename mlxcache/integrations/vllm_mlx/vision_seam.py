"""The vision cache of vllm-mlx's batched MLLM path (``--mllm --continuous-batching``).

vllm-mlx 0.6's ``MLLMBatchGenerator`` builds a ``VisionEmbeddingCache`` in memory whose keys
sort the images' hashes, so the same question with images [B, A] after [A, B] is answered from
the [A, B] entry. ``install()`` replaces that name with ``shared_vision_cache_class(config)``:
mlxcache's compatible ``VisionEmbeddingCache`` (images by content and in order in every key)
on the installed backend, so processed images persist and are shared, with the vllm-mlx
version, this tier's format and the model's name in every key, and the salt of the request
being served (``mllm_salts.py``) joined to the server's: a salted request's images and prompt
are its salt's own entries (no salt keeps the server's keys).
"""

from __future__ import annotations

import hashlib
from typing import Any

from mlxcache.integrations.request_salt import join_salt
from mlxcache.integrations.vllm_mlx import salts
from mlxcache.integrations.vllm_mlx.shared_tier import TIER_FORMAT, TierConfig
from mlxcache.integrations.vllm_mlx.vision_embedding_cache import (
    KEY_PREFIX,
    VisionEmbeddingCache,
)


def namespace(config: TierConfig, request_salt: str = "") -> str:
    """The part of every vision key that says which engine version and model wrote it, under
    which salt (the server's, joined with a request's own)."""
    name = f"vllm-mlx-{config.engine_version}/{TIER_FORMAT}/{config.model_name or ''}"
    salt = join_salt(config.salt, request_salt)
    return hashlib.sha256(f"{name}\0{salt}".encode()).hexdigest()[:16]


def shared_vision_cache_class(config: TierConfig) -> type:
    """vllm-mlx's ``VisionEmbeddingCache`` signature over mlxcache's on ``config.backend``."""
    space = namespace(config)

    class SharedVisionEmbeddingCache(VisionEmbeddingCache):
        """mlxcache's ordered ``VisionEmbeddingCache`` on the backend ``install()`` was given."""

        def __init__(
            self,
            max_pixel_entries: int = 100,
            max_encoding_entries: int = 50,
            enabled: bool = True,
            **kwargs: Any,
        ) -> None:
            kwargs.setdefault("backend", config.backend)  # given, so never closed here
            super().__init__(max_pixel_entries, max_encoding_entries, enabled, **kwargs)

        @staticmethod
        def _key(kind: str, images: Any, prompt: str | None = None) -> str:
            key = VisionEmbeddingCache._key(kind, images, prompt)
            salt = salts.current()  # the request being preprocessed
            at = namespace(config, salt) if salt else space
            return f"{KEY_PREFIX}{at}/{key[len(KEY_PREFIX) :]}"

    return SharedVisionEmbeddingCache
