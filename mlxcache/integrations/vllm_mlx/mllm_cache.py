"""vllm-mlx compatible MLLM prefix cache (``vllm_mlx.mllm_cache``) on any mlxcache backend.

Same names, signatures, defaults, stats fields and aliases as vllm-mlx, plus a ``backend=``
keyword: ``"memory://"`` (the default, one process) or ``file://``/``redis://`` (entries survive
a restart and are shared by processes). Deliberate differences are listed in docs/compat.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from mlxcache.backends.base import CacheBackend
from mlxcache.integrations.vllm_mlx import images_index, payloads, sketch
from mlxcache.integrations.vllm_mlx.entries import LRU, EntryStore, Slot
from mlxcache.integrations.vllm_mlx.images_index import ENTRY_PREFIX, INDEX_PREFIX, VERSION
from mlxcache.integrations.vllm_mlx.keys import (
    compute_image_hash,
    compute_images_hash,
    images_group,
    prompt_digest,
)
from mlxcache.integrations.vllm_mlx.prefix_entry import (
    MLLMCacheStats,
    MLLMPrefixCacheEntry,
    as_tokens,
)
from mlxcache.records.record import Record

logger = logging.getLogger("mlxcache.mllm_cache")

__all__ = [
    "MLLMCacheManager",
    "MLLMCacheStats",
    "MLLMPrefixCacheEntry",
    "MLLMPrefixCacheManager",
    "VLMCacheEntry",
    "VLMCacheManager",
    "VLMCacheStats",
    "VLMPrefixCacheEntry",
    "VLMPrefixCacheManager",
    "compute_image_hash",
    "compute_images_hash",
]


_Best = tuple[MLLMPrefixCacheEntry, int, str]  # entry, matched tokens, its key


class MLLMPrefixCacheManager:
    """LRU cache of MLLM prefix states (vision embeddings + KV cache) on any backend.

    ``fetch`` returns ``(entry, prefix_match_length)``; with ``token_ids`` it picks the entry
    with the longest verified common prefix among those stored with the same images, in order.
    """

    def __init__(
        self,
        max_entries: int = 50,
        max_memory_mb: int = 2048,
        *,
        backend: CacheBackend | str = "memory://",
    ):
        """``max_entries``/``max_memory_mb`` bound this manager; ``backend`` is a URI or backend."""
        self.max_size = max_entries
        self.max_memory = max_memory_mb * 1024 * 1024
        self.stats = MLLMCacheStats()
        self._entries = EntryStore(backend, "MLLM cache", logger)
        self._backend = self._entries.backend
        self._lru = LRU()
        self._lock = threading.RLock()
        self._warm_start()

    # ---- keys and the per-images index -------------------------------------------------

    def _keys(self, images: Sequence[Any] | None, prompt: str) -> tuple[str, str]:
        group = images_group(images)
        return group, f"{ENTRY_PREFIX}{group}.{prompt_digest(prompt)}"

    def _read_index(self, group: str) -> list[dict[str, Any]]:
        return images_index.read_index(self._backend, group)

    def _index_add(self, group: str, item: dict[str, Any]) -> None:
        images_index.index_add(self._backend, group, item)

    def _index_remove(self, group: str, *keys: str) -> None:
        images_index.index_remove(self._backend, group, *keys)

    def _forget_gone(self) -> None:
        """Drop from the LRU and the index the entries the backend no longer has."""
        gone: dict[str, list[str]] = {}
        for key in self._entries.gone(self._lru.items):
            slot = self._lru.pop(key)
            gone.setdefault(slot.group if slot else "", []).append(key)
        for group, lost in gone.items():
            self._index_remove(group, *lost)

    def _warm_start(self) -> None:
        """Learn the entries already in a shared backend from the index records (no tensors)."""
        found = []
        for ikey in list(self._backend.keys(INDEX_PREFIX)):
            group = ikey[len(INDEX_PREFIX) :]
            for item in self._read_index(group):
                found.append((item.get("time", 0.0), item["key"], item.get("bytes", 0), group))
        for _, key, nbytes, group in sorted(found):
            self._lru.put(key, Slot(nbytes=nbytes, seq=self._entries.next_seq(), group=group))

    # ---- load / store ------------------------------------------------------------------

    def _load(self, key: str) -> MLLMPrefixCacheEntry | None:
        """The entry under ``key`` as fresh objects, or None (and forget it) if it is gone."""
        found = self._entries.read(key, lambda rec: rec.meta.get("v") == VERSION, self._entry)
        if found is None:
            self._lru.pop(key)
            self._entries.forget(key)
            return None
        entry, rec = found
        slot = self._lru.get(key)
        if slot is None:  # stored by another process: adopt it into our LRU
            group = key[len(ENTRY_PREFIX) :].split(".")[0]
            slot = Slot(nbytes=self._entries.nbytes(key, rec), group=group)
            self._lru.put(key, slot)
        self._lru.touch(key, self._entries.next_seq())
        entry.hit_count = slot.hit_count
        return entry

    @staticmethod
    def _entry(rec: Record, live: dict[str, Any] | None) -> MLLMPrefixCacheEntry:
        m = rec.meta
        types = {"image_hash": str, "prompt_hash": str, "model_name": str, "created_at": float}
        types |= dict.fromkeys(("num_image_tokens", "num_text_tokens", "prompt_tokens"), int)
        for name, want in types.items():  # stored data: a wrong type is a damaged record
            ok = isinstance(m[name], int | float) if want is float else type(m[name]) is want
            if not ok or isinstance(m[name], bool):
                raise ValueError(f"{name} has the wrong type")
        return MLLMPrefixCacheEntry(
            image_hash=m["image_hash"],
            prompt_hash=m["prompt_hash"],
            vision_embeddings=payloads.unpack("vis", m["vis"], rec, live),
            kv_cache=payloads.unpack("kv", m["kv"], rec, live),
            token_ids=np.frombuffer(m["tokens"], dtype=np.int64).tolist(),
            num_image_tokens=m["num_image_tokens"],
            num_text_tokens=m["num_text_tokens"],
            prompt_tokens=m["prompt_tokens"],
            created_at=m["created_at"],
            model_name=m["model_name"],
        )

    def _over(self) -> bool:
        return len(self._lru) > self.max_size or self._lru.nbytes > self.max_memory

    def _evict(self) -> None:
        if self._over():
            self._forget_gone()
        while self._over():
            oldest = self._lru.oldest()
            if oldest is None:
                break
            key, slot = oldest
            self._lru.pop(key)
            self._entries.drop(key)
            self._index_remove(slot.group, key)
            self.stats.evictions += 1
            logger.debug("MLLM cache evicted: %s", key[:40])

    # ---- public API --------------------------------------------------------------------

    def fetch(
        self,
        images: list[str],
        prompt: str,
        token_ids: list[int] | None = None,
    ) -> tuple[MLLMPrefixCacheEntry | None, int]:
        """Look up a prefix state: ``(entry, prefix_match_length)``, ``(None, 0)`` on a miss.

        Without ``token_ids`` only the exact images+prompt entry hits (match = its length).
        With them, the entry of the same images sharing the longest prefix wins. An entry with
        the same images but no KV match still gives its vision embeddings, with match 0.
        """
        return self._fetch(images, prompt, token_ids, vision_only=True)

    def _fetch(
        self, images: Any, prompt: str, token_ids: Any, *, vision_only: bool
    ) -> tuple[MLLMPrefixCacheEntry | None, int]:
        group, key = self._keys(images, prompt)
        tokens = as_tokens(token_ids) if token_ids is not None else None
        if tokens is not None and len(tokens) == 0:
            tokens = None  # vllm-mlx treats empty token ids as none
        with self._lock:
            self.stats.total_queries += 1
            best: _Best | None = None
            exact = self._load(key)
            index = None
            if exact is not None:
                n = exact.total_tokens if tokens is None else exact.get_prefix_match_length(tokens)
                best = (exact, n, key)
            if tokens is not None:
                index = self._read_index(group)
                best = self._best_prefix(group, index, key, tokens, best)
            if best is not None:
                entry, n, hit_key = best
                self.stats.hits += 1
                if images:
                    self.stats.image_cache_hits += 1
                if entry.vision_embeddings is not None:
                    self.stats.vision_encoder_skips += 1
                if tokens is not None and n < entry.total_tokens:
                    self.stats.partial_hits += 1
                self.stats.tokens_saved += n
                self._count_hit(hit_key, entry)
                return entry, n
            if images and vision_only:
                vision_entry = self._vision_only(group, index)
                if vision_entry is not None:
                    self.stats.partial_hits += 1
                    self.stats.vision_encoder_skips += 1
                    return vision_entry, 0
            self.stats.misses += 1
            return None, 0

    def _count_hit(self, key: str, entry: MLLMPrefixCacheEntry) -> None:
        slot = self._lru.get(key)
        if slot is not None:
            slot.hit_count += 1
            entry.hit_count = slot.hit_count

    def _best_prefix(
        self,
        group: str,
        index: list[dict[str, Any]],
        exact_key: str,
        tokens: np.ndarray,
        best: _Best | None,
    ) -> _Best | None:
        """Longest verified prefix among the indexed entries of one image group."""
        candidates = []
        request = sketch.sketch(tokens)
        for item in index:
            if item["key"] == exact_key or item.get("dummy"):
                continue
            stored = images_index.item_sketch(item)
            assert stored is not None  # read_index keeps only lines with a sketch
            n = sketch.match_bound(stored, request)  # an upper bound: verified below
            if n > 0:
                candidates.append((n, item["key"]))
        candidates.sort(reverse=True)
        gone = []
        for n, key in candidates:
            if best is not None and n <= best[1]:
                break
            entry = self._load(key)
            if entry is None:
                gone.append(key)
                continue
            real = entry.get_prefix_match_length(tokens)  # the index may be stale: verify
            if real > 0 and (best is None or real > best[1]):
                best = (entry, real, key)
        if gone:
            self._index_remove(group, *gone)
        return best

    def _vision_only(
        self, group: str, index: list[dict[str, Any]] | None
    ) -> MLLMPrefixCacheEntry | None:
        """The newest entry of these images that has vision embeddings (index, not a scan)."""
        if index is None:
            index = self._read_index(group)
        gone = []
        found = None
        for item in reversed(index):
            if item.get("vision"):
                entry = self._load(item["key"])
                if entry is None:
                    gone.append(item["key"])
                elif entry.vision_embeddings is not None:
                    found = entry
                    break
        if gone:
            self._index_remove(group, *gone)
        return found

    def fetch_cache(
        self,
        images: list[str],
        prompt: str,
    ) -> tuple[list[Any] | None, bool]:
        """Legacy API: ``(kv_cache, True)`` for the exact images+prompt entry, else a miss."""
        entry, _ = self._fetch(images, prompt, None, vision_only=False)
        if entry is not None and entry.kv_cache is not None:
            return entry.kv_cache, True
        return None, False

    def store(
        self,
        images: list[str],
        prompt: str,
        vision_embeddings: Any,
        kv_cache: list[Any],
        token_ids: list[int],
        num_image_tokens: int = 0,
        model_name: str = "",
    ) -> None:
        """Store a prefix state; a copy is kept, so later changes to ``kv_cache`` do not leak in."""
        self._store(
            images, prompt, vision_embeddings, kv_cache, token_ids,
            num_image_tokens, model_name, dummy=False,
        )  # fmt: skip

    def _store(
        self,
        images: Any,
        prompt: str,
        vision_embeddings: Any,
        kv_cache: Any,
        token_ids: Any,
        num_image_tokens: int,
        model_name: str,
        *,
        dummy: bool,
    ) -> None:
        if self.max_size <= 0 or self.max_memory <= 0:
            logger.debug("MLLM cache disabled by a limit of 0: nothing stored")
            return
        group, key = self._keys(images, prompt)
        tokens = as_tokens(token_ids)
        packer = self._entries.packer()
        meta = {
            "v": VERSION,
            "kv": packer.pack("kv", kv_cache, what="kv_cache"),
            "vis": packer.pack("vis", vision_embeddings, what="vision_embeddings"),
            "image_hash": compute_images_hash(images),
            "prompt_hash": prompt_digest(prompt)[:16],
            "tokens": tokens.tobytes(),
            "num_image_tokens": int(num_image_tokens),
            "num_text_tokens": len(tokens) - int(num_image_tokens),
            "prompt_tokens": len(tokens),
            "created_at": time.time(),
            "model_name": str(model_name),
        }
        record = packer.record(meta)
        nbytes = record.nbytes + packer.live_nbytes()
        if nbytes > self.max_memory:
            logger.warning(
                "MLLM cache: refusing an entry of %.1f MB, larger than max_memory_mb=%.1f",
                nbytes / 2**20, self.max_memory / 2**20,
            )  # fmt: skip
            return
        item = {
            "key": key,
            **sketch.sketch(tokens).as_fields(),
            "bytes": nbytes,
            "vision": vision_embeddings is not None,
            "dummy": dummy,
            "time": meta["created_at"],
        }
        with self._lock:
            if not self._entries.write(key, record, packer.live):
                self._lru.pop(key)
                self._index_remove(group, key)
                return
            self._lru.put(key, Slot(nbytes=nbytes, seq=self._entries.next_seq(), group=group))
            self._index_add(group, item)
            self._evict()
        logger.debug("MLLM cache stored %s: %d tokens, %d bytes", key[:40], len(tokens), nbytes)

    def store_cache(
        self,
        images: list[str],
        prompt: str,
        cache: list[Any] | None,
        num_tokens: int = 0,
    ) -> None:
        """Legacy API: store a KV cache for images+prompt (an empty or None cache is ignored)."""
        if cache is None or (isinstance(cache, list) and len(cache) == 0):
            return
        self._store(images, prompt, None, cache, [0] * num_tokens, 0, "", dummy=True)

    def get_stats(self) -> dict[str, Any]:
        """Counters plus entries, max_entries, memory_used_mb and max_memory_mb."""
        with self._lock:
            stats = self.stats.to_dict()
            stats["entries"] = len(self._lru)
            stats["max_entries"] = self.max_size
            stats["memory_used_mb"] = self._lru.nbytes / 1024 / 1024
            stats["max_memory_mb"] = self.max_memory / 1024 / 1024
            return stats

    def reset_stats(self) -> None:
        """Reset the counters (entries stay)."""
        with self._lock:
            self.stats = MLLMCacheStats()

    def clear(self) -> None:
        """Remove every MLLM entry from the backend (all processes' entries) and reset stats."""
        with self._lock:
            self._entries.clear((ENTRY_PREFIX, INDEX_PREFIX))
            self._lru.clear()
            self.reset_stats()

    def close(self) -> None:
        """Close the backend if this manager opened it from a URI."""
        self._entries.close()

    def __len__(self) -> int:
        """Number of entries this manager knows of."""
        return len(self._lru)

    def __repr__(self) -> str:
        mem_mb = self._lru.nbytes / 1024 / 1024
        return f"<MLLMPrefixCacheManager entries={len(self)} memory={mem_mb:.1f}MB>"


MLLMCacheManager = MLLMPrefixCacheManager

VLMCacheStats = MLLMCacheStats
VLMPrefixCacheEntry = MLLMPrefixCacheEntry
VLMCacheEntry = MLLMPrefixCacheEntry
VLMPrefixCacheManager = MLLMPrefixCacheManager
VLMCacheManager = MLLMPrefixCacheManager
