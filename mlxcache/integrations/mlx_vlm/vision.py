"""mlx-vlm's ``VisionFeatureCache`` with a persistent, shared tier (any mlxcache URI).

``SharedVisionFeatureCache`` has mlx-vlm 0.7's interface (``get``, ``put``, ``clear``,
``__contains__``, ``__len__``, ``max_size``) and is passed where mlx-vlm takes one
(``stream_generate(..., vision_cache=...)``). The hot tier is mlx-vlm's own in-process LRU of
feature arrays; features keyed by processed pixel content (mlx-vlm's ``processed:`` keys) are
also stored in the backend under the model's identity, so another process or a restarted one
skips the vision encoder for an image it has seen. Path and object keys stay in the process: a
path names a file, not its content. A failing backend is a miss and a log line.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from mlx_vlm.vision_cache import VisionFeatureCache

from mlxcache.backends.base import CacheBackend
from mlxcache.errors import FormatError
from mlxcache.serializers.prompt_cache import dump_prompt_cache, load_prompt_cache
from mlxcache.uri import open_backend

log = logging.getLogger("mlxcache")

KEY_ROOT = "mlxcache/vlm-vision/v1/"
KIND = "vlm-vision-features"
SHARED_PREFIX = "processed:"  # mlx-vlm's content keys (processed_image_key)


class SharedVisionFeatureCache(VisionFeatureCache):
    """mlx-vlm's vision feature LRU over a shared backend, namespaced by ``model``.

    ``model`` is the model identity (``mlxcache.model_identity(model)``): features of one model
    are never served to another. ``clear()`` empties the hot tier only (mlx-vlm's server calls
    it when it swaps models); ``clear_shared()`` deletes this model's shared entries.
    """

    def __init__(
        self,
        max_size: int = 20,
        *,
        model: str,
        backend: CacheBackend | str | None = None,
        salt: str = "",
    ) -> None:
        if not isinstance(model, str) or not model:
            raise ValueError("model must be a non-empty identity string (see model_identity)")
        super().__init__(max_size=max_size)
        if isinstance(backend, CacheBackend):
            self.backend, self._owns_backend = backend, False
        else:
            self.backend, self._owns_backend = open_backend(backend), True
        ns = hashlib.sha256(f"{model}\0{salt}".encode()).hexdigest()[:16]
        self.key_prefix = f"{KEY_ROOT}{ns}/"
        self.model = model
        self.counts = dict.fromkeys(("hot_hits", "shared_hits", "misses", "stored", "errors"), 0)

    def _shared_key(self, key: str) -> str | None:
        if not key.startswith(SHARED_PREFIX):
            return None
        return self.key_prefix + hashlib.sha256(key.encode()).hexdigest()

    def get(self, image_source: Any) -> Any:
        """Cached features, from this process or the shared tier; None on a miss."""
        found = super().get(image_source)
        if found is not None:
            self.counts["hot_hits"] += 1
            return found
        key = self._make_key(image_source)
        bkey = self._shared_key(key)
        record = self.backend.get(bkey) if bkey is not None else None
        if record is None:
            self.counts["misses"] += 1
            return None
        try:
            features, meta = load_prompt_cache(record, return_metadata=True)
            if (meta or {}).get("kind") != KIND or (meta or {}).get("key") != key:
                raise FormatError("not this image's vision features")
        except (FormatError, ValueError, TypeError) as exc:
            log.warning("vision feature cache: ignoring %s: %s", bkey, exc)
            self.counts["errors"] += 1
            self.counts["misses"] += 1
            return None
        self.counts["shared_hits"] += 1
        super().put(image_source, features)
        return features

    def put(self, image_source: Any, features: Any) -> None:
        """Keep ``features`` here and, for a content key, in the shared tier (never raises)."""
        super().put(image_source, features)
        key = self._make_key(image_source)
        bkey = self._shared_key(key)
        if bkey is None:
            return
        try:
            if bkey not in self.backend:
                self.backend.put(bkey, dump_prompt_cache(features, meta={"kind": KIND, "key": key}))
                self.counts["stored"] += 1
        except Exception as exc:  # a store failure never reaches the vision encoder's caller
            log.warning("vision feature cache: could not store %s: %s", bkey, exc)
            self.counts["errors"] += 1

    def __contains__(self, image_source: Any) -> bool:
        if super().__contains__(image_source):
            return True
        bkey = self._shared_key(self._make_key(image_source))
        return bkey is not None and bkey in self.backend

    def clear_shared(self) -> int:
        """Delete this model's shared entries (a key scan: an admin operation)."""
        return sum(self.backend.delete(k) for k in list(self.backend.keys(self.key_prefix)))

    def close(self) -> None:
        """Close the backend if this object opened it."""
        if self._owns_backend:
            self.backend.close()
