"""Keys of the vllm-mlx compatible managers, and vllm-mlx's public image-hash helpers.

``compute_image_hash`` / ``compute_images_hash`` keep vllm-mlx's return format (16 hex
characters, ``"no_images"``); the keys the managers build use full-width digests, in order.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from typing import Any

from mlxcache.hashing import base64_bytes, image_digest, images_digest

logger = logging.getLogger("mlxcache.mllm_cache")


def content_bytes(image: Any) -> bytes | None:
    """The encoded bytes of an image given as bytes, a file path or base64; else None."""
    if isinstance(image, bytes | bytearray | memoryview):
        return bytes(image)
    if isinstance(image, os.PathLike) or (isinstance(image, str) and os.path.isfile(image)):
        with open(image, "rb") as f:
            return f.read()
    if isinstance(image, str):
        return base64_bytes(image)
    return None


def compute_image_hash(image_path: str) -> str:
    """First 16 hex chars of the SHA-256 of an image's content (file bytes, decoded base64).

    A string that is neither a file nor base64 (a URL, a video key) is hashed as text; PIL
    images and arrays by pixels, size/shape and mode/dtype.
    """
    try:
        data = content_bytes(image_path)
    except OSError as exc:
        logger.warning("Failed to hash image: %s", exc)
        data = None
    if data is not None:
        return hashlib.sha256(data).hexdigest()[:16]
    if isinstance(image_path, str):
        return hashlib.sha256(image_path.encode()).hexdigest()[:16]
    return image_digest(image_path).hex()[:16]


def compute_images_hash(images: list[str]) -> str:
    """Combined 16-hex-char hash of several images in order; ``"no_images"`` for none."""
    if not images:
        return "no_images"
    combined = "_".join(compute_image_hash(img) for img in images)
    return hashlib.sha256(combined.encode()).hexdigest()[:16]


def images_group(images: Sequence[Any] | None) -> str:
    """Full-width ordered digest of the images: the part of every key they decide."""
    return images_digest(list(images or ())).hex()


def prompt_digest(prompt: str) -> str:
    """Full-width SHA-256 of a prompt's text."""
    return hashlib.sha256(prompt.encode()).hexdigest()
