"""A persistent, shared tier under vllm-mlx's ``MemoryAwarePrefixCache``.

vllm-mlx's scheduler (text models with ``--continuous-batching``) and its batched MLLM path
read the prefix cache's private ``_entries``, ``_last_match_type``, ``_last_matched_key`` and
``_current_memory``, so the cache is not replaced: ``shared_prefix_cache_class(base)`` makes a
subclass whose in-process LRU is vllm-mlx's own and which adds a ``PrefixCache`` on any
mlxcache URI underneath:

- every entry vllm-mlx publishes (``commit_prepared``, which ``store`` calls) is also stored
  there, before the call returns: vllm-mlx stores a finished request's cache before it hands
  the response out, so a server killed right after answering has lost nothing it answered;
- a fetch the in-process LRU answers with fewer than ``len(tokens) - 1`` tokens (a miss, a
  shorter prefix, or an exact/supersequence match, which vllm-mlx's scheduler throws away and
  prefills in full) asks the shared tier, which restores at most ``len(tokens) - 1`` tokens
  as a ``"prefix"`` match, so the scheduler runs only the rest; but when the batched MLLM
  path has just read that exact entry's ``last_logits`` (``fetch_exact_auxiliary``, on the
  same thread), it samples from them and prefills nothing, so that fetch is the entry itself;
- hits and ``tokens_saved`` from the shared tier count in vllm-mlx's own stats
  (``GET /v1/cache/stats``), and ``get_stats()`` adds the tier's counters as ``"mlxcache"``.

Keys: the model identity (config, weights layout, quantization, vllm-mlx's revision of the
model), the vllm-mlx version and this tier's format version seed every block hash, so two
models or two vllm-mlx versions never read each other's entries. A failing store (a dead
Redis, a full disk) is a miss and a log line, never an error in the server.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mlxcache.backends.base import CacheBackend
from mlxcache.integrations.request_salt import join_salt
from mlxcache.integrations.serve_errors import ServeErrors
from mlxcache.integrations.vllm_mlx import salts
from mlxcache.prefix import PrefixCache
from mlxcache.prefix.model_id import model_identity

log = logging.getLogger("mlxcache")

TIER_FORMAT = "vllm-mlx-tier/v1"  # bump when what a stored entry means changes
RECENT_PROMPTS = 64  # prompts remembered (as fingerprints) to store their length minus one
LIVE: weakref.WeakSet = weakref.WeakSet()  # the tiers of live caches (for /metrics)
ERRORS = ServeErrors("vllm-mlx")  # every tier's failed lookups and stores (for /metrics)


@dataclass
class TierConfig:
    """What ``install()`` gives every shared prefix cache it makes."""

    backend: CacheBackend
    block_size: int = 256
    salt: str = ""
    model_name: str | None = None  # the model's name in the keys (default: its folder)
    engine_version: str = ""


def held_tokens(layers: Sequence[Any]) -> int | None:
    """How many tokens a list of cache layers holds (None if no layer counts them)."""
    for c in layers:
        n = getattr(c, "offset", None)
        if isinstance(n, int) and not isinstance(n, bool):
            return n
        inner = getattr(c, "caches", None)  # CacheList
        if inner:
            n = held_tokens(inner)
            if n is not None:
                return n
    return None


def _digest(tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(repr(list(tokens)).encode(), digest_size=16).digest()


def _trimmed(layers: list[Any], n: int) -> list[Any] | None:
    """Copies of ``layers`` without their last ``n`` tokens (vllm-mlx's own trim), or None
    when a layer cannot be rewound (recurrent state)."""
    from vllm_mlx import memory_cache

    if not all(memory_cache._is_cache_layer_trimmable(c) for c in layers):
        return None
    return memory_cache._trim_cache_offset(layers, n)


def identity(model: Any, config: TierConfig, revision: Any = None) -> str:
    """The shared keys' model identity: engine version, tier format, model, revision."""
    name = config.model_name
    if name is None:
        path = getattr(model, "mlxcache_model_path", None) or os.environ.get(
            "MLXCACHE_VLLM_MODEL", ""
        )
        name = os.path.realpath(path) if path and os.path.isdir(path) else (path or None)
    try:
        model_id = model_identity(model, name=name)
    except TypeError:  # a model without .config/.args: its name alone
        model_id = f"model:{name}"
    rev = f"@{revision}" if revision else ""
    return f"vllm-mlx-{config.engine_version}/{TIER_FORMAT}/{model_id}{rev}"


class SharedTier:
    """One model's ``PrefixCache`` on the installed backend, with counters.

    ``lookup`` and ``store`` never raise: a failing backend is a miss (counted in
    ``lookup_errors``/``store_errors``) and a log line.
    """

    def __init__(self, config: TierConfig, model_id: str) -> None:
        self.config, self.model_id = config, model_id
        self.prefix = PrefixCache(
            config.backend,
            model=model_id,
            block_size=config.block_size,
            salt=config.salt,
            hot_bytes=0,  # vllm-mlx's own LRU is the hot tier
        )
        self._lock = threading.Lock()
        LIVE.add(self)
        self._recent: deque[tuple[int, int, bytes]] = deque(maxlen=RECENT_PROMPTS)
        self._counts = dict.fromkeys(
            ("lookups", "hits", "tokens_reused", "stores", "tokens_stored", "lookup_errors",
             "store_errors"), 0)  # fmt: skip

    def _count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self._counts[k] += v

    def seen(self, tokens: Sequence[int]) -> None:
        """Remember a prompt (a few bytes) so its cache is also stored at its length - 1."""
        if tokens:
            self._recent.append((len(tokens), tokens[-1], _digest(tokens)))

    def lookup(self, tokens: Sequence[int], have: int) -> tuple[int, list[Any]] | None:
        """The longest stored prefix of ``tokens[:-1]`` longer than ``have``, or None."""
        if len(tokens) < 2:
            return None
        self._count(lookups=1)
        head = list(tokens[:-1])
        try:
            if self.prefix.longest(head, have=have) <= have:
                return None
            hit = self.prefix.lookup(head)
        except Exception as e:  # a failing store is a miss, never an error in the server
            log.warning("vllm-mlx shared tier: lookup failed, running uncached: %s", e)
            self._count(lookup_errors=1)
            ERRORS.add("lookup")
            return None
        if hit is None or hit.prompt_cache is None or hit.num_tokens <= have:
            return None
        self._count(hits=1, tokens_reused=hit.num_tokens)
        return hit.num_tokens, hit.prompt_cache

    def store(self, tokens: Sequence[int], layers: Sequence[Any]) -> None:
        """Store the cache of the tokens it holds (its offset; vllm-mlx keys some entries
        one token longer than their KV) and, when they extend a prompt looked up recently,
        a copy at that prompt's length minus one: the same prompt in another process then
        restores all but its last token, not only its whole blocks."""

        def write() -> int | None:
            n = held_tokens(layers)
            n = len(tokens) if n is None else n
            if n <= 0 or n > len(tokens):
                return None
            head = list(tokens[:n])
            written = self.prefix.store(head, list(layers))
            p = self._prompt_of(head)
            if p is not None and 1 < p < n:
                part = _trimmed(list(layers), n - (p - 1))
                if part is not None:
                    written += self.prefix.store(head[: p - 1], part)
            return written

        self._guarded(write)

    def store_prefill(self, tokens: Sequence[int], layers: Sequence[Any]) -> None:
        """Store a prompt's cache after one of its prefill chunks (``PrefixCache``'s
        ``mid_prefill``): its whole blocks, and the state layers' checkpoint at a block-aligned
        length; the store at the prompt's end writes the rest."""
        self._guarded(lambda: self.prefix.store(list(tokens), list(layers), mid_prefill=True))

    def _guarded(self, write: Callable[[], int | None]) -> None:
        """Run a store, counted (None: nothing to store); a failure is a log line, never an
        error in the server."""
        try:
            written = write()
            if written is not None:
                self._count(stores=1, tokens_stored=written)
        except Exception as e:  # never into the server: the in-process LRU still has it
            log.warning("vllm-mlx shared tier: store failed, kept in memory only: %s", e)
            self._count(store_errors=1)
            ERRORS.add("store")

    def _prompt_of(self, tokens: list[int]) -> int | None:
        """The length of the longest recently looked-up prompt that ``tokens`` extends."""
        best = None
        for n, last, digest in list(self._recent):
            if n > len(tokens) or (best is not None and n <= best) or tokens[n - 1] != last:
                continue
            if _digest(tokens[:n]) == digest:
                best = n
        return best

    def stats(self) -> dict[str, Any]:
        """This tier's counters and the backend's stats."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
        try:
            out["backend"] = self.config.backend.stats()
        except Exception as e:
            out["backend"] = {"error": str(e)}
        return out


def _plain_layers(layers: list[Any]) -> list[Any]:
    """Entries vllm-mlx keeps quantized (``--kv-cache-quantization``) go to the shared tier as
    plain caches: the tier's records are the model's own cache classes."""
    from vllm_mlx import memory_cache

    wrapper = getattr(memory_cache, "_QuantizedCacheWrapper", None)
    if wrapper is not None and any(isinstance(c, wrapper) for c in layers):
        return memory_cache._dequantize_cache(layers)
    return layers


def shared_prefix_cache_class(base: type, config: TierConfig) -> type:
    """A subclass of vllm-mlx's ``MemoryAwarePrefixCache`` over the shared tier of ``config``."""

    class SharedMemoryAwarePrefixCache(base):
        """vllm-mlx's ``MemoryAwarePrefixCache`` with mlxcache's shared tier underneath."""

        mlxcache_config = config

        def __init__(self, model: Any, config: Any = None) -> None:
            super().__init__(model, config)
            tier_config = type(self).mlxcache_config
            revision = getattr(self, "_model_revision", None)
            self.mlxcache_tier = SharedTier(tier_config, identity(model, tier_config, revision))
            self.mlxcache_salted: dict[str, SharedTier] = {}  # a request salt's own tier
            self.mlxcache_logits = threading.local()  # key: an exact entry's logits were read
            log.info("vllm-mlx shared tier: %s on %r", self.mlxcache_tier.model_id,
                     tier_config.backend)  # fmt: skip

        def _tier(self, salt: str) -> SharedTier:
            if not salt:
                return self.mlxcache_tier
            tier = self.mlxcache_salted.get(salt)
            if tier is None:
                base = self.mlxcache_tier
                joined = replace(base.config, salt=join_salt(base.config.salt, salt))
                tier = self.mlxcache_salted[salt] = SharedTier(joined, base.model_id)
            return tier

        def fetch(self, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
            salt = salts.admitting()  # the request being admitted (salts.py); "" for none
            salts.remember(tokens)
            key = salts.salted(tokens, salt)
            read = getattr(self.mlxcache_logits, "key", None)
            self.mlxcache_logits.key = None
            with_logits = read is not None and read == tuple(key)
            cache, remaining = super().fetch(key)
            remaining = salts.unsalted(remaining)
            if salt and cache is not None:  # super() counted the sentinel's words as tokens
                self._stats.tokens_saved -= salts.SENTINEL
            if with_logits:  # sampled from the entry's logits: its own KV, never a prefix
                self._tier(salt).seen(tokens)
                return cache, remaining
            return self._shared_fetch(tokens, cache, remaining, self._tier(salt))

        def fetch_exact_auxiliary(self, tokens: list[int]) -> Any:
            """The batched MLLM path asks it before its lookup (the same request's salt); with
            ``last_logits`` it samples the first token from them with the cache of the next
            ``fetch`` of these tokens and prefills nothing, so that fetch is the exact entry."""
            key = salts.salted(tokens, salts.admitting())
            aux = super().fetch_exact_auxiliary(key)
            with_logits = aux is not None and "last_logits" in aux  # as vllm-mlx tests it
            self.mlxcache_logits.key = tuple(key) if with_logits else None
            return aux

        def prepare_store(self, tokens: list[int], cache: list[Any], *args: Any, **kw: Any):
            found = salts.salts_of(tokens)
            if len(found) > 1:  # prompts of several salts share these tokens: not stored
                return None
            return super().prepare_store(salts.salted(tokens, found.pop()), cache, *args, **kw)

        def remove(self, tokens: list[int], *args: Any, **kwargs: Any) -> bool:
            removed = False
            for salt in salts.salts_of(tokens):
                removed = super().remove(salts.salted(tokens, salt), *args, **kwargs) or removed
            return removed

        def _shared_fetch(
            self, tokens: list[int], cache: Any, remaining: list[int], tier: SharedTier
        ) -> tuple[list[Any] | None, list[int]]:
            tier.seen(tokens)
            kind: str | None = getattr(self, "_last_match_type", None)
            if len(tokens) < max(2, self._config.min_prefix_tokens):
                return cache, remaining
            have = len(tokens) - len(remaining) if cache is not None else 0
            if kind in ("exact", "supersequence"):  # the scheduler prefills these in full
                have = 0
            elif have >= len(tokens) - 1:
                return cache, remaining
            hit = tier.lookup(tokens, have)
            if hit is None:
                return cache, remaining
            n, layers = hit
            if cache is None:  # super() counted a miss: it is a hit now
                self._stats.misses = max(0, self._stats.misses - 1)
                self._stats.hits += 1
                self._stats.tokens_saved += n
            else:
                self._stats.tokens_saved += n - (len(tokens) - len(remaining))
            self._last_match_type, self._last_matched_key = "prefix", None
            return layers, list(tokens[n:])

        def commit_prepared(self, entry: Any, *args: Any, **kwargs: Any) -> bool:
            ok = super().commit_prepared(entry, *args, **kwargs)
            salt = salts.key_salt(entry.tokens)
            if ok and (salt or not salts.keyed(entry.tokens)):  # a forgotten salt: memory only
                tier = self._tier(salt)
                tier.store(salts.unsalted(entry.tokens), _plain_layers(list(entry.cache)))
            return ok

        def get_stats(self) -> dict[str, Any]:
            out = super().get_stats()
            out["mlxcache"] = self.mlxcache_tier.stats()
            return out

    return SharedMemoryAwarePrefixCache
