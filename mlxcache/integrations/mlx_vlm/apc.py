"""mlx-vlm's automatic prefix cache (APC) with its prefix tier on an mlxcache ``PrefixCache``.

The seam, read in mlx-vlm 0.7.10's wheel (and the same in 0.7.5): the server builds its APC
with ``mlx_vlm.apc.from_env(model_namespace, overrides)`` at every model load, looked up at call
time, and the generator asks the manager three things of a block-mode (dense KV) model:
``lookup_prefix`` (its in-memory block pool), ``lookup_prefix_disk_cache`` (its disk tier,
a ready prompt cache) and ``store_kv_blocks`` (after prefill). ``SharedAPCManager`` answers the
first with nothing and the other two from a ``PrefixCache`` on any mlxcache backend, so a
repeated image prompt is reused in the process, by a second live server and after a restart.
Of a checkpoint-mode model (sliding-window, hybrid) the generator asks ``lookup_exact_cache``
and ``store_exact_cache`` (its checkpoints: the prompt less its guard token, and stride
lengths): both keep mlx-vlm's in-process entries and go to the same ``PrefixCache`` too
(``checkpoints.py``), so those models are shared and kept over a restart as well; with the
stores after each prefill chunk (``chunk_stores.py``, ``store_prefill``) a prompt that branches
inside a stored one resumes at its last shared block boundary (window layers) or stride
checkpoint (recurrent layers), and on recurrent layers it is checkpointed at its branch point
(``branches.py``) for the next request that branches there.

Why not mlx-vlm's memory pool: ``apc_lookup_plan`` drops a pool hit whose prefix holds image
tokens, and its disk lookup gives way to the pool whenever the pool holds the first block; so
as shipped an image prompt repeated in one process reuses nothing. The
``PrefixCache`` hot tier takes the pool's place.

Images: mlx-vlm salts every block hash with a 64-bit hash of the request's ``pixel_values``.
``hash_image_payload`` is wrapped to remember, for that value, mlxcache's full content digest
of the same pixels (``hashing.image_digest``: bytes, shape and dtype; every image in order), and
the prefix cache keys the request by both. ``cached_tokens`` is the length of the prefix the
``PrefixCache`` verified and handed over, and the generator prefills only the rest.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from mlx_vlm import apc as _apc

from mlxcache import hashing
from mlxcache.integrations.mlx_vlm import checkpoints
from mlxcache.integrations.mlx_vlm.branches import Branches
from mlxcache.integrations.resume import holds_state
from mlxcache.integrations.serve_errors import ServeErrors
from mlxcache.prefix import PrefixCache

log = logging.getLogger("mlxcache")


class ImageDigests:
    """mlx-vlm's 64-bit hash of a request's pixels -> mlxcache's 32-byte digest of them."""

    def __init__(self, size: int = 1024) -> None:
        self._map: OrderedDict[int, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._size = size

    def remember(self, key: int, digest: bytes) -> None:
        with self._lock:
            self._map[key] = digest
            self._map.move_to_end(key)
            while len(self._map) > self._size:
                self._map.popitem(last=False)

    def get(self, key: int) -> bytes | None:
        with self._lock:
            return self._map.get(key)


def request_images(digests: ImageDigests, extra_hash: int) -> list[bytes]:
    """The ``images=`` of a request salted ``extra_hash``: one key for all its media, in order.

    Both parts: mlx-vlm's salt also covers a tenant, audio or video, and the digest makes the
    pixels' key a full SHA-256 (a salt with no digest, e.g. a tenant's, is keyed by itself).
    """
    if not extra_hash:
        return []
    salt = int(extra_hash & ((1 << 64) - 1)).to_bytes(8, "little")
    return [(digests.get(int(extra_hash)) or b"") + salt]


class SharedAPCManager(_apc.APCManager):
    """mlx-vlm's ``APCManager`` with its block pool off and its disk tier a ``PrefixCache``.

    A failing backend is a miss (or an unstored prompt) and a log line, never a failed request;
    ``errors`` counts them for ``/metrics``.
    """

    def __init__(
        self,
        prefix: PrefixCache,
        digests: ImageDigests,
        *,
        overrides: dict | None = None,
        errors: ServeErrors | None = None,
    ) -> None:
        super().__init__(num_blocks=1, disk=None, overrides=overrides)
        self.prefix = prefix
        self.digests = digests
        self.errors = errors if errors is not None else ServeErrors("mlx-vlm")
        # False once the server's self-check found block mode: its exact lookups stay mlx-vlm's
        # (the block path above reads the store); unknown (True) asks the store
        self.checkpoint_mode = True
        # True once the self-check found state layers (ArraysCache): lookups find branch points
        self.states = False
        self.branches = Branches()

    def lookup_prefix(self, token_ids: Sequence[int], extra_hash: int = 0):
        """The block pool is off: the prefix cache (and its hot tier) answers instead."""
        return [], 0

    def lookup_prefix_disk_cache(
        self,
        token_ids: Sequence[int],
        extra_hash: int = 0,
        max_prefix_tokens: int | None = None,
        min_prefix_tokens: int = 0,
        allow_memory_overlap: bool = False,
    ) -> tuple[list[Any] | None, int]:
        """The longest stored prefix, shorter than the prompt and longer than the minimum."""
        limit = len(token_ids) - 1  # at least one token is prefilled: it gives the logits
        if max_prefix_tokens:
            limit = min(limit, int(max_prefix_tokens))
        if limit <= max(0, min_prefix_tokens):
            return None, 0
        try:
            hit = self.prefix.lookup(
                [int(t) for t in token_ids[:limit]],
                images=request_images(self.digests, extra_hash),
            )
        except Exception as exc:  # a dead backend: an uncached request, answered
            log.warning("mlxcache APC: lookup failed, serving uncached: %s", exc)
            self.errors.add("lookup")
            hit = None
        if hit is None or hit.prompt_cache is None or hit.num_tokens <= min_prefix_tokens:
            with self.lock:
                self.stats.misses += 1
            return None, 0
        with self.lock:
            self.stats.hits += 1
            self.stats.disk_hits += 1
            self.stats.matched_tokens += hit.num_tokens
        return hit.prompt_cache, hit.num_tokens

    def store_kv_blocks(
        self,
        token_ids: Sequence[int],
        layer_keys: list[Any],
        layer_values: list[Any],
        *,
        extra_hash: int = 0,
        skip_first_n_tokens: int = 0,
    ) -> list:
        """Store the prompt but its last token (a repeat looks up that prefix); no pool blocks.

        The store is written before it returns (the generator's thread, right after prefill),
        so a server killed once it has answered has lost nothing it answered.
        """
        from mlx_vlm.models.cache import KVCache

        n = min(len(token_ids), int(layer_keys[0].shape[2]) if layer_keys else 0) - 1
        if n <= 0:
            return []
        caches = []
        for k, v in zip(layer_keys, layer_values, strict=True):
            c = KVCache()
            c.state = (k[..., :n, :], v[..., :n, :])
            caches.append(c)
        try:
            written = self.prefix.store(
                [int(t) for t in token_ids[:n]],
                caches,
                images=request_images(self.digests, extra_hash),
            )
        except Exception as exc:  # a store failure never fails the request
            log.warning("mlxcache APC: store failed: %s", exc)
            self.errors.add("store")
            return []
        with self.lock:
            self.stats.stores += 1
            self.stats.stored_tokens += written
        return []

    def lookup_exact_cache(
        self,
        token_ids: Sequence[int],
        extra_hash: int = 0,
        max_prefix_tokens: int | None = None,
        min_prefix_tokens: int = 0,
    ) -> tuple[list[Any] | None, int]:
        """mlx-vlm's in-process checkpoint, else a longer prefix the shared store rebuilds
        (another server's, or this one's before a restart): a stored length, or a block boundary
        or stride checkpoint stored after a prefill chunk (``checkpoints.lookup``).

        With state layers, the prompt's branch point past the answer is found and kept for its
        prefill (``branches.py``; one ``longest``, only when the answer falls short of it).
        """
        cache, n = super().lookup_exact_cache(
            token_ids, extra_hash, max_prefix_tokens, min_prefix_tokens
        )
        if not self.checkpoint_mode:
            return cache, n
        images = request_images(self.digests, extra_hash)
        shared = checkpoints.lookup(
            self.prefix,
            token_ids,
            images,
            max_prefix_tokens=max_prefix_tokens,
            above=max(min_prefix_tokens, n),
            errors=self.errors,
        )
        if shared is not None:
            with self.lock:  # an in-process hit it replaces was counted already
                self.stats.hits += 0 if n else 1
                self.stats.exact_hits += 0 if n else 1
                self.stats.disk_hits += 1
                self.stats.matched_tokens += shared[1] - n
            cache, n = shared
        if self.states and not max_prefix_tokens:
            # past the hit and the shortest hit mlx-vlm takes (the end of the last image)
            self.branches.find(
                self.prefix, token_ids, images, extra_hash, max(n, min_prefix_tokens)
            )
        return cache, n

    def store_exact_cache(
        self, token_ids: Sequence[int], prompt_cache: Sequence[Any], *, extra_hash: int = 0
    ) -> bool:
        """mlx-vlm's in-process checkpoint, and the same state in the shared prefix cache.

        A branch point's checkpoint (``branches.py``) goes to the shared store only, as a
        mid-prefill store (its blocks and state; no hot entry), and returns False, so mlx-vlm's
        in-process entries and bookkeeping stay as they are without it.
        """
        if self.branches.is_store(token_ids, extra_hash):
            self._store_mid_prefill(token_ids, prompt_cache, extra_hash)
            return False
        kept = super().store_exact_cache(token_ids, prompt_cache, extra_hash=extra_hash)
        written = checkpoints.store(
            self.prefix,
            token_ids,
            prompt_cache,
            request_images(self.digests, extra_hash),
            min_tokens=self.exact_cache_min_tokens,
            errors=self.errors,
        )
        with self.lock:
            self.stats.stored_tokens += written
        return kept or written > 0

    def store_prefill(
        self,
        token_ids: Sequence[int],
        prompt_cache: Sequence[Any],
        *,
        extra_hash: int = 0,
        step: int | None = None,
    ) -> int:
        """Store a cache mid-prefill, after one of mlx-vlm's chunks (of ``step`` tokens).

        A window layer drops its old tokens in the next chunk: its whole blocks are written
        after every chunk, while it holds them (``chunk_stores.py``); a state layer
        (``ArraysCache``) is checkpointed at chunk ends on its stride only (a multiple of the
        block and the step, its bytes bounded: ``prefix/checkpoints.py``). A later prompt that
        branches off this one restores there. Returns the new tokens the backend kept.
        """
        if not checkpoints.prefill_store_due(self.prefix, len(token_ids), prompt_cache, step):
            return 0
        return self._store_mid_prefill(token_ids, prompt_cache, extra_hash)

    def _store_mid_prefill(
        self, token_ids: Sequence[int], prompt_cache: Sequence[Any], extra_hash: int
    ) -> int:
        """A mid-prefill store (whole blocks, state at a block-aligned length) in the shared
        prefix cache only; the new tokens the backend kept."""
        written = checkpoints.store(
            self.prefix,
            token_ids,
            prompt_cache,
            request_images(self.digests, extra_hash),
            min_tokens=self.prefix.block_size,
            errors=self.errors,
            mid_prefill=True,
        )
        with self.lock:
            self.stats.stored_tokens += written
        return written

    def stats_snapshot(self) -> dict:
        """mlx-vlm's APC stats (``/v1/cache/stats``) plus the prefix cache's under ``mlxcache``."""
        snap = super().stats_snapshot()
        snap["mlxcache"] = self.prefix.stats()
        snap["mlxcache"]["branch_points"] = self.branches.taken
        snap["mlxcache"]["branch_points_stored"] = self.branches.stored
        return snap

    def close(self) -> None:
        self.prefix.close()  # the backend is the server's: it stays open
        super().close()


class Installed:
    """What ``install`` replaced in mlx-vlm, the managers it built, and how to undo it."""

    def __init__(self) -> None:
        self.managers: list[SharedAPCManager] = []
        self.digests = ImageDigests()
        self.errors = ServeErrors("mlx-vlm")  # every manager's failures, for /metrics
        self._undo: list[tuple[Any, str, Any]] = []

    def replace(self, obj: Any, name: str, value: Any) -> None:
        self._undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def prefix_caches(self) -> list[PrefixCache]:
        return [m.prefix for m in self.managers]

    def uninstall(self) -> None:
        for obj, name, value in reversed(self._undo):
            setattr(obj, name, value)
        self._undo.clear()


def install(
    make_prefix: Callable[[str], PrefixCache],
    on_load: Callable[[str], None] | None = None,
    refusal: Callable[[str], str | None] | None = None,
) -> Installed:
    """Replace ``mlx_vlm.apc.from_env`` and wrap ``mlx_vlm.apc.hash_image_payload``.

    ``make_prefix(model_path)`` builds the prefix cache of the model being loaded (the path
    mlx-vlm folds into its namespace); ``on_load(model_path)`` runs at every model load.
    ``refusal(model_path)`` names why a model's family is never resumed (the family table):
    such a model runs mlx-vlm's own path with no prefix cache, said once per load. With
    ``enabled`` false in mlx-vlm's settings (``APC_ENABLED``, ``PATCH /v1/settings``) there is
    no APC, as in mlx-vlm.
    """
    done = Installed()
    original_hash = _apc.hash_image_payload

    def hash_image_payload(pixel_values: Any = None, image_ref: Any = None) -> int:
        out = original_hash(pixel_values=pixel_values, image_ref=image_ref)
        if pixel_values is not None:
            done.digests.remember(int(out), hashing.image_digest(pixel_values))
        return out

    def from_env(model_namespace: str | None = None, overrides: dict | None = None):
        model_path = (model_namespace or "model").rsplit("#", 1)[0]
        if on_load is not None:
            on_load(model_path)
        if overrides is not None and "enabled" in overrides and not overrides["enabled"]:
            return None
        reason = refusal(model_path) if refusal is not None else None
        if reason is not None:
            log.info(
                "mlxcache: %s runs mlx-vlm's own path, no prefix cache: %s", model_path, reason
            )
            return None
        manager = SharedAPCManager(
            make_prefix(model_path), done.digests, overrides=overrides, errors=done.errors
        )
        done.managers.append(manager)
        log.info("mlxcache APC for %s: %r", model_path, manager.prefix)
        return manager

    done.replace(_apc, "hash_image_payload", hash_image_payload)
    done.replace(_apc, "from_env", from_env)

    def on_mode(mode: str | None, states: bool) -> None:  # the model of the newest manager
        if done.managers:
            done.managers[-1].checkpoint_mode = mode != "block"
            done.managers[-1].states = states and mode != "block"

    done.replace(_apc, "self_check_model_apc", _self_check(_apc.self_check_model_apc, on_mode))
    return done


def _self_check(
    original: Callable[..., Any], on_mode: Callable[[str | None, bool], None]
) -> Callable[..., Any]:
    """mlx-vlm's APC self-check without its false alarm, and one line saying what is cached.

    mlx-vlm's check fails every model whose language model has no ``make_cache``, yet its
    generator then builds one default cache per layer (``models.cache.make_prompt_cache``) and
    its APC runs in block mode (``model_apc_mode``): that layout is checked instead. The
    server runs it right after loading the model of its newest manager: ``on_mode`` gets the
    mode found, and whether the cache has state layers (``resume.holds_state``).
    """

    def self_check_model_apc(model: Any, *, kv_bits: Any = None, log: bool = True) -> Any:
        from mlx_vlm.models.cache import make_prompt_cache

        language_model = getattr(model, "language_model", model)
        if hasattr(language_model, "make_cache"):
            result = original(model, kv_bits=kv_bits, log=False)
            caches = language_model.make_cache()
        else:
            caches = make_prompt_cache(language_model)
            result = _apc.validate_prompt_cache_layout(caches, apc_mode="block")
        on_mode(getattr(result, "apc_mode", None), holds_state(caches))
        if log and result.ok:
            kinds = ",".join(sorted(set(result.layer_types))) or "-"
            logging.getLogger("mlxcache").info(
                "mlxcache APC: the prompt cache (%d layers: %s, mode %s) is stored in the "
                "shared prefix cache", result.layer_count, kinds, result.apc_mode,
            )  # fmt: skip
        elif log:
            return original(model, kv_bits=kv_bits, log=True)  # its own error line says why
        return result

    return self_check_model_apc
