"""vllm-mlx compatible vision cache (``vllm_mlx.vision_embedding_cache``) on any backend.

Three caches share one byte budget: pixel values per images+prompt, pixel values per images
only, and the vision encoding output per images+prompt. Same names, signatures, defaults and
stats fields as vllm-mlx plus ``max_memory_mb=`` and ``backend=``; see docs/compat.md.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional  # noqa: UP035 - signatures as vllm-mlx spells them

import mlx.core as mx

from mlxcache.backends.base import CacheBackend
from mlxcache.integrations.vllm_mlx import payloads
from mlxcache.integrations.vllm_mlx.entries import LRU, EntryStore, Slot
from mlxcache.integrations.vllm_mlx.keys import (
    compute_image_hash,
    compute_images_hash,
    images_group,
    prompt_digest,
)
from mlxcache.records.record import Record

logger = logging.getLogger("mlxcache.vision_embedding_cache")

__all__ = [
    "EncodingCacheEntry",
    "PixelCacheEntry",
    "PixelOnlyCacheEntry",
    "VisionCacheStats",
    "VisionEmbeddingCache",
    "compute_image_hash",
    "compute_images_hash",
]

KEY_PREFIX = "vis."
_PIXEL, _PIXEL_ONLY, _ENCODING = "p", "o", "e"
_VERSION = 1


@dataclass
class VisionCacheStats:
    """Statistics for vision cache performance (pixel-only lookups counted apart)."""

    pixel_cache_hits: int = 0
    pixel_cache_misses: int = 0
    encoding_cache_hits: int = 0
    encoding_cache_misses: int = 0
    total_time_saved: float = 0.0
    total_images_processed: int = 0
    pixel_only_cache_hits: int = 0
    pixel_only_cache_misses: int = 0

    @property
    def pixel_hit_rate(self) -> float:
        total = self.pixel_cache_hits + self.pixel_cache_misses
        return self.pixel_cache_hits / total if total > 0 else 0.0

    @property
    def pixel_only_hit_rate(self) -> float:
        total = self.pixel_only_cache_hits + self.pixel_only_cache_misses
        return self.pixel_only_cache_hits / total if total > 0 else 0.0

    @property
    def encoding_hit_rate(self) -> float:
        total = self.encoding_cache_hits + self.encoding_cache_misses
        return self.encoding_cache_hits / total if total > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "pixel_cache_hits": self.pixel_cache_hits,
            "pixel_cache_misses": self.pixel_cache_misses,
            "pixel_hit_rate": self.pixel_hit_rate,
            "encoding_cache_hits": self.encoding_cache_hits,
            "encoding_cache_misses": self.encoding_cache_misses,
            "encoding_hit_rate": self.encoding_hit_rate,
            "total_time_saved": self.total_time_saved,
            "total_images_processed": self.total_images_processed,
            "pixel_only_cache_hits": self.pixel_only_cache_hits,
            "pixel_only_cache_misses": self.pixel_only_cache_misses,
            "pixel_only_hit_rate": self.pixel_only_hit_rate,
        }


@dataclass
class PixelCacheEntry:
    """Cached pixel values from prepare_inputs."""

    pixel_values: mx.array
    input_ids: mx.array
    attention_mask: Optional[mx.array]  # noqa: UP045
    image_grid_thw: Optional[mx.array]  # noqa: UP045
    extra_kwargs: Dict[str, Any]  # noqa: UP006
    processing_time: float = 0.0


@dataclass
class PixelOnlyCacheEntry:
    """Cached pixel values only (prompt-independent), for the same images with new prompts."""

    pixel_values: mx.array
    image_grid_thw: Optional[mx.array]  # noqa: UP045
    processing_time: float = 0.0


@dataclass
class EncodingCacheEntry:
    """Cached vision encoding output."""

    logits: mx.array
    first_token: int
    logprobs: mx.array
    encoding_time: float = 0.0


_FIELDS = {
    _PIXEL: ("pixel_values", "input_ids", "attention_mask", "image_grid_thw"),
    _PIXEL_ONLY: ("pixel_values", "image_grid_thw"),
    _ENCODING: ("logits", "logprobs"),
}
_SCALARS = {_PIXEL: ("processing_time",), _PIXEL_ONLY: ("processing_time",),
            _ENCODING: ("first_token", "encoding_time")}  # fmt: skip
_CLASSES = {
    _PIXEL: PixelCacheEntry,
    _PIXEL_ONLY: PixelOnlyCacheEntry,
    _ENCODING: EncodingCacheEntry,
}
_NAMES = {_PIXEL: "pixel", _PIXEL_ONLY: "pixel-only", _ENCODING: "encoding"}


class VisionEmbeddingCache:
    """Two-level cache for vision processing in MLLM (pixel values, vision encoding).

    LRU per level by entry count, plus one byte budget (``max_memory_mb``) over all levels.
    Stored and returned entries never share array objects or kwargs dicts with the caller.
    """

    def __init__(
        self,
        max_pixel_entries: int = 100,
        max_encoding_entries: int = 50,
        enabled: bool = True,
        *,
        max_memory_mb: int = 2048,
        backend: CacheBackend | str = "memory://",
    ):
        """Limits of 0 store nothing; ``backend`` is a URI (file://, redis://) or a backend."""
        self.max_pixel_entries = max_pixel_entries
        self.max_encoding_entries = max_encoding_entries
        self.enabled = enabled
        self.max_memory = max_memory_mb * 1024 * 1024
        self.stats = VisionCacheStats()
        self._entries = EntryStore(backend, "vision cache", logger)
        self._backend = self._entries.backend
        self._lru = {kind: LRU() for kind in _FIELDS}
        self._lock = threading.RLock()

    # ---- keys, limits, storage ---------------------------------------------------------

    @staticmethod
    def _key(kind: str, images: List[str], prompt: str | None = None) -> str:  # noqa: UP006
        key = f"{KEY_PREFIX}{kind}.{images_group(images)}"
        if prompt is not None:
            key += "." + prompt_digest(prompt)
        return key

    def _limit(self, kind: str) -> int:
        return self.max_encoding_entries if kind == _ENCODING else self.max_pixel_entries

    def _get(self, kind: str, key: str) -> Any:
        """The entry under ``key`` as fresh objects, or None (forgotten if it is gone)."""

        def accept(rec: Record) -> bool:
            return rec.meta.get("v") == _VERSION and rec.meta.get("kind") == kind

        found = self._entries.read(key, accept, lambda rec, live: self._entry(kind, rec, live))
        lru = self._lru[kind]
        if found is None:
            lru.pop(key)
            self._entries.forget(key)
            return None
        entry, rec = found
        if key not in lru:  # written by another process: adopt it
            lru.put(key, Slot(nbytes=self._entries.nbytes(key, rec)))
        lru.touch(key, self._entries.next_seq())
        return entry

    @staticmethod
    def _entry(kind: str, rec: Record, live: dict[str, Any] | None) -> Any:
        m = rec.meta
        values = {
            f: payloads.unpack(f, m["fields"][f], rec, live, copy_live=True) for f in _FIELDS[kind]
        }
        values.update({s: m[s] for s in _SCALARS[kind]})
        for name in _SCALARS[kind]:  # stored data: a wrong type is a damaged record, a miss
            want = int if name == "first_token" else int | float
            if isinstance(values[name], bool) or not isinstance(values[name], want):
                raise ValueError(f"{name} is not a number")
        if kind == _PIXEL:
            values["extra_kwargs"] = {
                k: payloads.unpack(f"x/{k}", d, rec, live, copy_live=True)
                for k, d in m["extra"].items()
            }
        return _CLASSES[kind](**values)

    def _set(self, kind: str, key: str, fields: dict[str, Any], scalars: dict[str, Any],
             extra: dict[str, Any] | None = None) -> bool:  # fmt: skip
        """Store one entry; False if a limit of 0 or the byte budget refuses it."""
        if self._limit(kind) <= 0 or self.max_memory <= 0:
            return False
        packer = self._entries.packer()
        meta: dict[str, Any] = {"v": _VERSION, "kind": kind, **scalars}
        meta["fields"] = {f: packer.pack(f, v, what=f, plain=True) for f, v in fields.items()}
        if extra is not None:
            if not all(isinstance(k, str) for k in extra):
                raise TypeError("extra_kwargs keys must be str")
            meta["extra"] = {
                k: packer.pack(f"x/{k}", v, what=f"extra_kwargs[{k!r}]", plain=True)
                for k, v in extra.items()
            }
        record = packer.record(meta)
        nbytes = record.nbytes + packer.live_nbytes()
        if nbytes > self.max_memory:
            logger.warning(
                "vision cache: refusing a %s entry of %.1f MB, larger than max_memory_mb=%.1f",
                _NAMES[kind], nbytes / 2**20, self.max_memory / 2**20,
            )  # fmt: skip
            return False
        with self._lock:
            if not self._entries.write(key, record, packer.live):
                self._lru[kind].pop(key)
                return False
            self._lru[kind].put(key, Slot(nbytes=nbytes, seq=self._entries.next_seq()))
            self._evict(kind)
        return True

    def _evict(self, kind: str) -> None:
        lru = self._lru[kind]
        if len(lru) > self._limit(kind) or self._nbytes() > self.max_memory:
            self._forget_gone()
        while len(lru) > self._limit(kind):
            oldest = lru.oldest()
            assert oldest is not None  # the LRU holds more than its limit
            self._drop(kind, oldest[0])
        while self._nbytes() > self.max_memory:
            firsts = [(k, lru.oldest()) for k, lru in self._lru.items()]  # None: an empty LRU
            heads = [(o[1].seq, k, o[0]) for k, o in firsts if o is not None]
            if not heads:
                break
            _, k, key = min(heads)
            self._drop(k, key)

    def _forget_gone(self) -> None:
        """Forget entries the backend no longer has, so their bytes do not evict live ones."""
        for lru in self._lru.values():
            for key in self._entries.gone(lru.items):
                lru.pop(key)

    def _drop(self, kind: str, key: str) -> None:
        self._lru[kind].pop(key)
        self._entries.drop(key)
        logger.debug("vision cache evicted (%s): %s", _NAMES[kind], key[:40])

    def _nbytes(self) -> int:
        return sum(lru.nbytes for lru in self._lru.values())

    # ========== Pixel Cache ==========

    def get_pixel_cache(
        self,
        images: List[str],  # noqa: UP006
        prompt: str,
    ) -> Optional[PixelCacheEntry]:  # noqa: UP045
        """Cached pixel values for images+prompt, or None."""
        if not self.enabled or not images:
            return None
        with self._lock:
            entry = self._get(_PIXEL, self._key(_PIXEL, images, prompt))
            if entry is None:
                self.stats.pixel_cache_misses += 1
                return None
            self.stats.pixel_cache_hits += 1
            self.stats.total_time_saved += entry.processing_time
            return entry

    def set_pixel_cache(
        self,
        images: List[str],  # noqa: UP006
        prompt: str,
        pixel_values: mx.array,
        input_ids: mx.array,
        attention_mask: Optional[mx.array] = None,  # noqa: UP045
        image_grid_thw: Optional[mx.array] = None,  # noqa: UP045
        extra_kwargs: Optional[Dict[str, Any]] = None,  # noqa: UP006, UP045
        processing_time: float = 0.0,
    ) -> None:
        """Store pixel values for images+prompt (``extra_kwargs`` is copied, not referenced)."""
        if not self.enabled or not images:
            return
        fields = {
            "pixel_values": pixel_values,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "image_grid_thw": image_grid_thw,
        }
        key = self._key(_PIXEL, images, prompt)
        scalars = {"processing_time": float(processing_time)}
        with self._lock:
            if self._set(_PIXEL, key, fields, scalars, dict(extra_kwargs or {})):
                self.stats.total_images_processed += len(images)

    # ========== Pixel-Only Cache (prompt-independent) ==========

    def get_pixel_values(
        self,
        images: List[str],  # noqa: UP006
    ) -> Optional[PixelOnlyCacheEntry]:  # noqa: UP045
        """Cached prompt-independent pixel values for these images (in order), or None."""
        if not self.enabled or not images:
            return None
        with self._lock:
            entry = self._get(_PIXEL_ONLY, self._key(_PIXEL_ONLY, images))
            if entry is None:
                self.stats.pixel_only_cache_misses += 1
                return None
            self.stats.pixel_only_cache_hits += 1
            self.stats.total_time_saved += entry.processing_time
            return entry

    def set_pixel_values(
        self,
        images: List[str],  # noqa: UP006
        pixel_values: mx.array,
        image_grid_thw: Optional[mx.array] = None,  # noqa: UP045
        processing_time: float = 0.0,
    ) -> None:
        """Store pixel values for these images, whatever the prompt."""
        if not self.enabled or not images:
            return
        fields = {"pixel_values": pixel_values, "image_grid_thw": image_grid_thw}
        scalars = {"processing_time": float(processing_time)}
        self._set(_PIXEL_ONLY, self._key(_PIXEL_ONLY, images), fields, scalars)

    # ========== Encoding Cache ==========

    def get_encoding_cache(
        self,
        images: List[str],  # noqa: UP006
        prompt: str,
    ) -> Optional[EncodingCacheEntry]:  # noqa: UP045
        """Cached vision encoding output for images+prompt, or None."""
        if not self.enabled or not images:
            return None
        with self._lock:
            entry = self._get(_ENCODING, self._key(_ENCODING, images, prompt))
            if entry is None:
                self.stats.encoding_cache_misses += 1
                return None
            self.stats.encoding_cache_hits += 1
            self.stats.total_time_saved += entry.encoding_time
            return entry

    def set_encoding_cache(
        self,
        images: List[str],  # noqa: UP006
        prompt: str,
        logits: mx.array,
        first_token: int,
        logprobs: mx.array,
        encoding_time: float = 0.0,
    ) -> None:
        """Store the vision encoding output for images+prompt."""
        if not self.enabled or not images:
            return
        fields = {"logits": logits, "logprobs": logprobs}
        scalars = {"first_token": int(first_token), "encoding_time": float(encoding_time)}
        self._set(_ENCODING, self._key(_ENCODING, images, prompt), fields, scalars)

    # ========== Utilities ==========

    def get_stats(self) -> dict:
        """Counters, the three cache sizes, memory_used_mb and max_memory_mb."""
        with self._lock:
            stats = self.stats.to_dict()
            stats["pixel_cache_size"] = len(self._lru[_PIXEL])
            stats["pixel_only_cache_size"] = len(self._lru[_PIXEL_ONLY])
            stats["encoding_cache_size"] = len(self._lru[_ENCODING])
            stats["memory_used_mb"] = self._nbytes() / 1024 / 1024
            stats["max_memory_mb"] = self.max_memory / 1024 / 1024
            return stats

    def clear(self) -> None:
        """Remove every vision entry from the backend (all processes') and reset stats."""
        with self._lock:
            self._entries.clear([KEY_PREFIX])
            for lru in self._lru.values():
                lru.clear()
            self.stats = VisionCacheStats()

    def close(self) -> None:
        """Close the backend if this cache opened it from a URI."""
        self._entries.close()

    def __repr__(self) -> str:
        return (
            f"<VisionEmbeddingCache "
            f"pixel={len(self._lru[_PIXEL])}/{self.max_pixel_entries} "
            f"pixel_only={len(self._lru[_PIXEL_ONLY])}/{self.max_pixel_entries} "
            f"encoding={len(self._lru[_ENCODING])}/{self.max_encoding_entries}>"
        )
