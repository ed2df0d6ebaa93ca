"""mlx-lm's server prompt cache (``LRUPromptCache``) with a persistent, shared second tier.

``SharedPromptCache`` is a drop-in ``LRUPromptCache`` (mlx-lm 0.32: same methods, arguments,
return values and ``cache_type`` handling) whose hot tier is mlx-lm's own LRU of live caches,
held to its entry and byte budget, over a ``PrefixCache`` on any mlxcache URI. An insert is
stored to the backend on a writer thread (``flush()`` and ``close()`` wait for it), so it costs
about what mlx-lm's does; a fetch the hot tier cannot answer is looked up there, so a second
worker or a restarted server finds what the first one computed.
A failing backend (a dead Redis, a full disk, a cache class it cannot store) is a miss and a log
line, never an exception into the server.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from mlxcache.backends.base import CacheBackend
from mlxcache.backends.writer import BackgroundWriter
from mlxcache.integrations.request_salt import join_salt
from mlxcache.integrations.resume import branch_point, chunk_store_due
from mlxcache.prefix.cache import PrefixCache
from mlxcache.serializers import kv_quant
from mlxcache.uri import open_backend

log = logging.getLogger("mlxcache")

# cache classes whose trim() only moves counters, so a shallow copy can be trimmed safely
_COUNTER_TRIM = {"KVCache", "QuantizedKVCache", "RotatingKVCache", "ChunkedKVCache"}
_MAX_WAIT = 60.0  # seconds an insert waits for room in the store queue before dropping it
_RECENT_PROMPTS = 64  # prompts remembered (as fingerprints) to store their length minus one
_MID_PREFILL = -1  # a store job's ``prompt`` for a store after one prefill chunk


def default_identity(model_key: Any) -> str:
    """A model identity from mlx-lm's model key ``(model_path, adapter_path, draft_path)``."""
    parts = model_key if isinstance(model_key, tuple | list) else (model_key,)
    return "mlx-lm-key:" + json.dumps([None if p is None else str(p) for p in parts])


def _digest(tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def _holds(prompt_cache: Sequence[Any]) -> int | None:
    """How many tokens a prompt cache holds (None if no layer counts them)."""
    for c in prompt_cache:
        n = getattr(c, "offset", None)
        if isinstance(n, int) and not isinstance(n, bool):
            return n
        inner = getattr(c, "caches", None)  # CacheList
        if inner:
            n = _holds(inner)
            if n is not None:
                return n
    return None


def _trimmed_copy(prompt_cache: Sequence[Any], n: int) -> list[Any] | None:
    """A copy of ``prompt_cache`` with its last ``n`` tokens trimmed (None if not trimmable)."""
    if not can_trim_prompt_cache(prompt_cache):
        return None
    out = [
        copy.copy(c) if type(c).__name__ in _COUNTER_TRIM else copy.deepcopy(c)
        for c in prompt_cache
    ]
    return out if trim_prompt_cache(out, n) == n else None


class Salted(NamedTuple):
    """A model key with a request's own salt (``request_salt``): its own hot and shared keys."""

    model: Any
    salt: str


class SharedPromptCache(LRUPromptCache):
    """``LRUPromptCache`` over a persistent, shared ``PrefixCache`` tier.

    ``max_size`` and ``max_bytes`` bound the hot tier (live cache objects in this process, as
    mlx-lm's class). ``backend`` is a URI or a ``CacheBackend`` (None: ``$MLXCACHE_URL``, else
    the embedded default). ``identity(model_key)`` names a model for the shared keys (two
    processes share KV only when it matches; default: the model key's paths). Set
    ``persist=False`` for a plain hot LRU. Stores run on a ``BackgroundWriter`` thread (at
    most ``max_pending`` waiting: the caller waits for room rather than drop an answered
    request's store; ``background=False`` stores before ``insert_cache`` returns); callbacks
    of ``after_next_insert`` run when the store is done, and ``flush()`` waits for all of them.
    ``hot_bytes`` is the ``PrefixCache`` hot tier of each model (default 0: mlx-lm's LRU is
    the hot tier, and ``max_bytes`` stays the whole in-process budget). With
    ``hot_probe=False`` a hot answer is final (the backend is asked only when the hot tier has
    nothing, e.g. after a restart), as in mlx-lm: no round trip, but a longer prefix another
    worker stored is not used.
    ``kv_bits``/``kv_group_size`` store the shared tier's KV quantized (``PrefixCache``; the
    hot tier keeps live caches). ``prefill_step`` is the engine's prefill chunk (mlx-lm's
    ``--prefill-step-size``): ``store_prefill`` checkpoints state layers at the stride it gives.
    """

    def __init__(
        self,
        max_size: int = 10,
        max_bytes: int = 1 << 63,
        *,
        backend: CacheBackend | str | None = None,
        identity: Callable[[Any], str] = default_identity,
        block_size: int = 256,
        salt: str = "",
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        persist: bool = True,
        background: bool = True,
        max_pending: int = 2,
        hot_bytes: int = 0,
        hot_probe: bool = True,
        prefill_step: int = 2048,
    ) -> None:
        if isinstance(hot_bytes, bool) or not isinstance(hot_bytes, int) or hot_bytes < 0:
            raise ValueError(f"hot_bytes must be an int >= 0, got {hot_bytes!r}")
        super().__init__(max_size=max_size, max_bytes=max_bytes)
        self.identity, self.block_size, self.salt = identity, block_size, salt
        self.prefill_step = prefill_step  # the engine's chunk: where state checkpoints may go
        kv_quant.make(kv_bits, kv_group_size)  # a bad setting raises here, not on first use
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.hot_bytes, self.hot_probe = hot_bytes, bool(hot_probe)
        self.backend: CacheBackend | None = None
        self._owns_backend = False
        if persist:
            if isinstance(backend, CacheBackend):
                self.backend = backend
            else:
                self.backend, self._owns_backend = open_backend(backend), True
        self._prefix: dict[str, PrefixCache] = {}
        self._last_lookup: list[int] | None = None  # see last_lookup()
        self._last_key: Any = None  # the model key (salted) of that lookup
        # (model key, length, last token, digest) of recently fetched prompts: a few bytes each
        self._recent: deque[tuple[Any, int, int, bytes]] = deque(maxlen=_RECENT_PROMPTS)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("fetches", "hot_hits", "backend_hits", "misses", "tokens_hot", "tokens_backend",
             "stores", "tokens_stored", "store_errors", "lookup_errors", "branch_points"),
            0)  # fmt: skip
        self._done: list[Callable[[], None]] = []
        self._writer: BackgroundWriter | None = None
        if background:
            self._writer = BackgroundWriter(
                queue=max(1, max_pending),
                full="wait",
                max_wait=_MAX_WAIT,
                name="mlxcache-prompt-store",
            )

    # ---------------------------------------------------------------- the shared tier

    def prefix_cache(self, model: Any) -> PrefixCache | None:
        """The ``PrefixCache`` of a model key (None when the shared tier is off).

        A ``Salted`` key is its model's, with the request's salt joined to ``salt``."""
        if self.backend is None:
            return None
        request = model.salt if isinstance(model, Salted) else ""
        name = self.identity(model.model if isinstance(model, Salted) else model)
        salt = join_salt(self.salt, request)
        pc = self._prefix.get(name if not request else f"{name}\x1f{salt}")
        if pc is None:
            pc = PrefixCache(
                self.backend,
                model=name,
                block_size=self.block_size,
                salt=salt,
                kv_bits=self.kv_bits,
                kv_group_size=self.kv_group_size,
                hot_bytes=self.hot_bytes,
                hot_probe=self.hot_probe,
            )
            self._prefix[name if not request else f"{name}\x1f{salt}"] = pc
        return pc

    def _count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self._counts[k] += v

    def fetch_nearest_cache(self, model: Any, tokens: list[int]):
        """The nearest cache and the tokens it does not cover, as ``LRUPromptCache``.

        The hot tier first (a copy of a live cache, like mlx-lm). Unless it covers the prompt,
        the shared tier is asked whether it has a longer prefix, e.g. one another worker
        computed: with a hot prefix one ``contains_many`` first and a read only if it has
        more; with none, straight away one lookup. It restores at most ``len(tokens) - 1``
        tokens (the last one is always run).
        """
        self._count(fetches=1)
        self._last_lookup, self._last_key = list(tokens), model
        if tokens and self.backend is not None:
            self._recent.append((model, len(tokens), tokens[-1], _digest(tokens)))
        cache, rest = super().fetch_nearest_cache(model, tokens)
        hot = len(tokens) - len(rest) if cache is not None else 0
        ask = hot < len(tokens) - 1 and (self.hot_probe or cache is None)
        hit = self._lookup(model, tokens, hot) if ask else None
        if hit is not None:
            self._count(backend_hits=1, tokens_backend=hit.num_tokens)
            return hit.prompt_cache, tokens[hit.num_tokens :]
        if cache is not None:
            self._count(hot_hits=1, tokens_hot=hot)
            return cache, rest
        self._count(misses=1)
        return None, tokens

    def last_lookup(self) -> list[int] | None:
        """The tokens of the latest ``fetch_nearest_cache`` (None before the first)."""
        return self._last_lookup

    def branch(self, tokens: list[int], have: int) -> tuple[Any, int]:
        """The model key of the latest fetch and its branch point (0: none), for a cache with
        state layers that restored ``have`` of those ``tokens``.

        The last block boundary at or before where ``tokens[:-1]`` stops matching stored blocks,
        past ``have`` (``resume.branch_point``: one ``contains_many``): a checkpoint stored there
        (``store_branch``) lets the next request that branches there resume all of the shared
        blocks. 0 when ``tokens`` is not the latest fetch's prompt or the shared tier is off.
        """
        key = self._last_key
        if self.backend is None or tokens != self._last_lookup or len(tokens) < 2:
            return key, 0
        try:
            pc = self.prefix_cache(key)
        except Exception as e:  # a failing store is a miss, never an error in the server
            log.warning("mlx-lm prompt cache: branch lookup failed: %s", e)
            return key, 0
        at = branch_point(pc, tokens[:-1], (), have) if pc is not None else 0
        return key, at

    def store_branch(self, model: Any, tokens: list[int], prompt_cache: list[Any]) -> None:
        """Store a prompt's cache mid-prefill at its branch point (``branch``): its whole blocks
        and a checkpoint of its state layers (shared tier only, queued as ``store_prefill``).

        ``model`` is the key ``branch`` gave (a request's salt already on it).
        """
        if tokens and self.backend is not None and prompt_cache:
            self._count(branch_points=1)
            self._submit((model, list(tokens), list(prompt_cache), _MID_PREFILL, []))

    def _lookup(self, model: Any, tokens: list[int], have: int):
        """A backend hit longer than ``have`` tokens (at most ``len(tokens) - 1``), or None."""
        try:
            pc = self.prefix_cache(model)
            if pc is None or len(tokens) < 2:
                return None
            # with a hot prefix, one contains_many of the lengths past it first (nothing
            # read unless the backend has more); with none, the lookup's own probe is that
            if have and pc.longest(tokens[:-1], have=have) <= have:
                return None
            hit = pc.lookup(tokens[:-1])
        except Exception as e:  # a failing store is a miss, never an error in the server
            log.warning("mlx-lm prompt cache: lookup failed, running uncached: %s", e)
            self._count(lookup_errors=1)
            return None
        if hit is None or hit.prompt_cache is None or hit.num_tokens <= have:
            return None
        return hit

    def insert_cache(
        self,
        model: Any,
        tokens: list[int],
        prompt_cache: list[Any],
        *,
        cache_type: str = "assistant",
    ):
        """Insert into the hot tier (as ``LRUPromptCache``) and store to the shared tier.

        Stored: the cache at its own length and, when ``tokens`` extends a prompt fetched
        recently, at that prompt's length minus one, so the same prompt in another process
        restores everything but its last token.
        """
        super().insert_cache(model, tokens, prompt_cache, cache_type=cache_type)
        with self._lock:
            done, self._done = self._done, []
        if self.backend is None:  # a plain hot LRU
            self._run((model, [], [], None, done))
            return
        tokens = list(tokens)
        self._submit((model, tokens, list(prompt_cache), self._prompt_of(model, tokens), done))

    def store_prefill(self, model: Any, tokens: list[int], prompt_cache: list[Any]) -> None:
        """Store a prompt's cache mid-prefill, after one of mlx-lm's chunks (shared tier only).

        A window layer (``RotatingKVCache``) drops its old tokens in the next chunk, so its whole
        blocks are stored now, after every chunk; a state layer (``ArraysCache``) is
        checkpointed at chunk ends on its stride (``prefix/checkpoints.py``: a multiple of the
        block and the prefill step, its state bytes bounded by the default share of its KV's);
        a cache with neither is left to the insert at the prompt's end. Queued on the writer
        thread like an insert, and before it.
        """
        if tokens and self.prefill_store_due(len(tokens), prompt_cache):
            self._submit((model, list(tokens), list(prompt_cache), _MID_PREFILL, []))

    def prefill_store_due(self, num_tokens: int, prompt_cache: Sequence[Any]) -> bool:
        """Whether ``store_prefill`` stores a cache of this class mix holding ``num_tokens``."""
        if self.backend is None or not prompt_cache:
            return False
        return chunk_store_due(prompt_cache, num_tokens, self.block_size, self.prefill_step)

    def _submit(self, job: tuple) -> None:
        """Run a store job on the writer thread (at once without one); a dropped job is counted
        and its callbacks still run."""
        model, _, layers, _, done = job
        if self._writer is None:
            self._run(job)
            return
        try:  # what the writer thread reads must be evaluated on this thread (MLX streams)
            self.prefix_cache(model)
            mx.eval([a for _, a in tree_flatten([c.state for c in layers])
                     if isinstance(a, mx.array)])  # fmt: skip
        except Exception as e:
            log.warning("mlx-lm prompt cache: cannot store this cache: %s", e)
        nbytes = sum(getattr(c, "nbytes", 0) for c in layers)
        if not self._writer.submit(lambda: self._run(job), nbytes):
            self._count(store_errors=1)  # dropped (the queue stayed full, or closed)
            self._run((model, [], [], None, done))  # its callbacks still run

    def _run(self, job: tuple) -> None:
        model, tokens, layers, prompt, done = job
        try:
            self._store(model, tokens, layers, prompt)
        finally:
            for cb in done:
                try:
                    cb()
                except Exception as e:
                    log.warning("mlx-lm prompt cache: a completion callback failed: %s", e)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every insert so far is stored (at once without ``background``)."""
        return True if self._writer is None else self._writer.flush(timeout)

    def _store(self, model: Any, tokens: list[int], layers: list[Any], prompt: int | None) -> None:
        """Store ``layers`` (holding ``tokens``, or their start); ``prompt`` is the length of a
        prompt ``tokens`` extends (stored too, trimmed), or ``_MID_PREFILL`` (whole blocks)."""
        try:
            pc = self.prefix_cache(model)
            if pc is None or not tokens or not layers:
                return
            n = _holds(layers)
            n = len(tokens) if n is None else n
            if n > len(tokens) or n <= 0:
                return
            if prompt == _MID_PREFILL:
                self._count(tokens_stored=pc.store(tokens[:n], layers, mid_prefill=True))
                return
            written = pc.store(tokens[:n], layers)
            if prompt is not None and 1 < prompt < n:
                part = _trimmed_copy(layers, n - (prompt - 1))
                if part is not None:
                    written += pc.store(tokens[: prompt - 1], part)
            self._count(stores=1, tokens_stored=written)
        except Exception as e:  # never into the server: the hot tier still has it
            log.warning("mlx-lm prompt cache: store failed, kept in memory only: %s", e)
            self._count(store_errors=1)

    def _prompt_of(self, model: Any, tokens: list[int]) -> int | None:
        """The length of the longest recently fetched prompt that ``tokens`` extends."""
        best = None
        for m, n, last, digest in self._recent:
            if m != model or n > len(tokens) or (best is not None and n <= best):
                continue
            if tokens[n - 1] == last and _digest(tokens[:n]) == digest:
                best = n
        return best

    # ---------------------------------------------------------------- response gating

    def after_next_insert(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the next ``insert_cache`` has stored (on the storing thread).

        mlx-lm's generation thread ends a response, then inserts its cache: ``mlxcache serve``
        holds the end of the response back until then, so an answered request is stored.
        """
        with self._lock:
            self._done.append(callback)

    # ---------------------------------------------------------------- the rest

    engine = "mlx-lm"  # the engine label of ``serve_errors()`` in mlxcache.metrics

    def serve_errors(self) -> dict[str, int]:
        """Failed shared-tier lookups and stores (each a miss or a prompt kept in memory only)."""
        with self._lock:
            return {"lookup": self._counts["lookup_errors"], "store": self._counts["store_errors"]}

    def prefix_caches(self) -> list[PrefixCache]:
        """The ``PrefixCache`` of every model key used so far (for metrics)."""
        return list(self._prefix.values())

    def stats(self) -> dict[str, Any]:
        """Hot-tier size, hit and store counters, and the backend's stats."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
        out.update(hot_entries=len(self), hot_bytes=self.nbytes, max_bytes=self.max_bytes)
        out["max_size"] = self.max_size
        out["backend"] = self.backend.stats() if self.backend is not None else None
        return out

    def close(self) -> None:
        """Finish pending stores, stop the writer thread, close the backend if it is ours."""
        if self._writer is not None:
            self._writer.close()
        if self._owns_backend and self.backend is not None:
            self.backend.close()

    def __repr__(self) -> str:
        return (
            f"SharedPromptCache(max_size={self.max_size}, max_bytes={self.max_bytes}, "
            f"entries={len(self)}, nbytes={self.nbytes}, backend={self.backend!r})"
        )
