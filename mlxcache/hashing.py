"""Stable content hashes: images by content and in order, chained token-block hashes.

Everything here is SHA-256 over explicitly framed bytes, so keys are equal across processes,
machines and PYTHONHASHSEED values (Python's ``hash()`` is never used).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import struct
from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

import mlx.core as mx
import numpy as np

from mlxcache.buffers import array_memoryview

HASH_VERSION = 1  # bump when any framing below changes: old keys then simply miss

Tokens: TypeAlias = "np.ndarray | Sequence[int]"  # token ids: a list or a NumPy array


def _h(*parts: bytes | memoryview) -> bytes:
    """SHA-256 of length-prefixed parts (no two part lists share a digest)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(struct.pack("<Q", len(p)))
        h.update(p)
    return h.digest()


def _array_digest(kind: bytes, dtype: str, shape: Sequence[int], data: memoryview) -> bytes:
    return _h(kind, dtype.encode(), np.asarray(shape, dtype=np.int64).tobytes(), data)


def base64_bytes(text: str) -> bytes | None:
    """Decoded bytes of a ``data:...;base64,`` URI or of a bare base64 string, else None."""
    if text.startswith("data:"):
        head, sep, payload = text.partition(",")
        if not sep or not head.endswith(";base64"):
            return None
    elif len(text) >= 16 and "://" not in text and len(text) % 4 == 0:
        payload = text
    else:
        return None
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return None


def image_digest(image: Any) -> bytes:
    """32-byte digest of one image's content.

    - ``bytes``/``bytearray``/``memoryview``: the encoded bytes;
    - ``str`` or ``os.PathLike`` naming an existing file: the file's bytes;
    - a ``data:`` URI with base64 payload, or a bare base64 string: the decoded bytes (same
      digest as the raw bytes);
    - any other ``str`` (an ``http(s)://`` URL, which is not fetched): the string itself;
    - a PIL image: pixels plus size and mode (and palette and transparency, which give a
      palette image its colours);
    - a NumPy or MLX array (e.g. ``pixel_values``): bytes plus shape and dtype.
    """
    if isinstance(image, bytes | bytearray | memoryview):
        return _h(b"bytes", bytes(image))
    if isinstance(image, os.PathLike) or (isinstance(image, str) and os.path.isfile(image)):
        with open(image, "rb") as f:
            return _h(b"bytes", f.read())
    if isinstance(image, str):
        decoded = base64_bytes(image)
        if decoded is not None:
            return _h(b"bytes", decoded)
        return _h(b"str", image.encode("utf-8"))
    if isinstance(image, mx.array):
        a = mx.contiguous(image)
        mx.eval(a)
        data = array_memoryview(a).cast("B") if a.nbytes else memoryview(b"")
        return _array_digest(b"array", str(a.dtype), a.shape, data)
    if isinstance(image, np.ndarray):
        n = np.ascontiguousarray(image)
        return _array_digest(b"array", n.dtype.str, n.shape, n.data.cast("B"))
    if hasattr(image, "tobytes") and hasattr(image, "mode") and hasattr(image, "size"):
        size = np.asarray(image.size, dtype=np.int64).tobytes()
        # a "P"/"PA" image's pixels are palette indices: the colours are in the palette, and
        # info["transparency"] changes what convert("RGBA") gives
        get_palette = getattr(image, "getpalette", None)
        palette = get_palette() if callable(get_palette) else None
        palette_bytes = b"" if palette is None else np.asarray(palette, np.int64).tobytes()
        transparency = repr(getattr(image, "info", {}).get("transparency")).encode()
        return _h(b"pil", image.mode.encode(), size, image.tobytes(), palette_bytes, transparency)
    raise TypeError(
        f"cannot hash an image of type {type(image).__name__}: pass bytes, a file path, "
        "a data URI, a URL string, a PIL image or an array"
    )


def images_digest(images: Iterable[Any]) -> bytes:
    """Digest of several images in order: swapping two images changes it."""
    return _h(b"images", *(image_digest(img) for img in images))


def namespace_seed(
    model: str, salt: str = "", *, format_version: int = HASH_VERSION, kv: str = ""
) -> bytes:
    """The root of every block-hash chain: format version, model identity and tenant salt.

    ``kv`` names a lossy KV storage setting (e.g. ``"affine-q8-g64"``); exact storage ("")
    keeps the seed it always had, so stored exact entries stay found.
    """
    if not isinstance(model, str) or not model:
        raise ValueError("model identity must be a non-empty str")
    if not isinstance(salt, str) or not isinstance(kv, str):
        raise TypeError("salt and kv must be str")
    parts = [b"mlxcache-ns", str(format_version).encode(), model.encode(), salt.encode()]
    return _h(*parts, *([kv.encode()] if kv else []))


def tokens_bytes(tokens: Tokens) -> bytes:
    """Token ids as little-endian int64 bytes (the form hashed and stored)."""
    return np.asarray(tokens, dtype=np.int64).tobytes()


def chain(parent: bytes, tokens: Tokens, extra: bytes = b"") -> bytes:
    """``h[i] = H(h[i-1], tokens of block i, extra keys of block i)``."""
    return _h(b"block", parent, tokens_bytes(tokens), extra)


def block_hashes(
    seed: bytes,
    tokens: Tokens,
    block_size: int,
    extras: Sequence[bytes] | None = None,
) -> list[bytes]:
    """Chained hashes of each whole block of ``tokens`` (a trailing partial block is left out).

    ``extras[i]`` (optional) is mixed into block ``i``: e.g. the digests and offsets of the
    images whose tokens fall in that block.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    out: list[bytes] = []
    parent = seed
    for i in range(len(tokens) // block_size):
        extra = extras[i] if extras is not None and i < len(extras) else b""
        parent = chain(parent, tokens[i * block_size : (i + 1) * block_size], extra)
        out.append(parent)
    return out


# ---------------------------------------------------------------- prefix-cache helpers


def image_runs(tokens: Tokens, image_token_id: int) -> list[int]:
    """Start positions of each run of ``image_token_id`` in ``tokens`` (one run per image)."""
    t = np.asarray(tokens, dtype=np.int64)
    is_img = t == image_token_id
    if not is_img.any():
        return []
    starts = is_img & ~np.concatenate(([False], is_img[:-1]))
    return [int(i) for i in np.flatnonzero(starts)]


def all_images_extra(digests: Sequence[bytes]) -> bytes:
    """Extra key of block 0 when image positions are unknown: every image, in order."""
    return _h(b"images-all", *digests) if digests else b""


def placed_images_extra(
    digests: Sequence[bytes], positions: Sequence[int], start: int, end: int
) -> bytes:
    """Extra key of the tokens ``[start, end)``: each image starting there, with its offset."""
    parts = [
        struct.pack("<Q", p - start) + d
        for d, p in zip(digests, positions, strict=True)
        if start <= p < end
    ]
    return _h(b"images-at", *parts) if parts else b""


def vision_digest(seed: bytes, digests: Sequence[bytes]) -> bytes:
    """Key digest of the vision embeddings of these images (in order) under one namespace."""
    return _h(b"vision", seed, *digests)
