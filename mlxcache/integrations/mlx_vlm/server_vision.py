"""The server's vision feature cache with a shared tier, bound to each model as it loads.

mlx-vlm's ``get_cached_model`` makes its ``VisionFeatureCache(max_size=...)`` just before it
calls ``apc.from_env`` for the same model, and never tells the cache which model it serves.
``VisionBinder.make`` stands in for the class: the cache it makes keeps features in the
process only until ``bind(identity)`` (called from ``from_env``) names the model; from then
on content-keyed features are shared too. A cache never bound never shares, so features of one
model can never be served to another. A request with a tenant (mlx-vlm's ``X-APC-Tenant``, or
a ``cache_salt``) reads and writes its features under keys of its own in both tiers
(``vision_tenant.py``); a request without one keeps the keys it always had. In mlx-vlm
0.7.10 the server passes the cache to the models that read it (Gemma 4, Qwen3.5,
DeepSeek-V4); Qwen2-VL's server path does not use it.
"""

from __future__ import annotations

from typing import Any

from mlxcache.backends.base import CacheBackend
from mlxcache.integrations.mlx_vlm.vision import SharedVisionFeatureCache
from mlxcache.integrations.mlx_vlm.vision_tenant import tenant_key


class BindableVisionFeatureCache(SharedVisionFeatureCache):
    """A ``SharedVisionFeatureCache`` that shares nothing until ``bind(model)``."""

    def __init__(self, max_size: int = 20, *, backend: CacheBackend, salt: str = "") -> None:
        super().__init__(max_size, model="unbound", backend=backend, salt=salt)
        self._salt = salt
        self.bound = False

    def bind(self, model: str) -> None:
        """Share this model's content-keyed features from now on (and keep what is cached)."""
        kept = dict(getattr(self, "_cache", {}))
        super().__init__(self.max_size, model=model, backend=self.backend, salt=self._salt)
        getattr(self, "_cache", {}).update(kept)
        self.bound = True

    def _make_key(self, image_source: Any) -> str:
        return tenant_key(super()._make_key(image_source))  # the request's tenant's own

    def _shared_key(self, key: str) -> str | None:
        return super()._shared_key(key) if self.bound else None


class VisionBinder:
    """Makes the server's vision caches and binds the newest one to the model loading."""

    def __init__(self, backend: CacheBackend, salt: str = "") -> None:
        self.backend, self.salt = backend, salt
        self.pending: BindableVisionFeatureCache | None = None

    def make(self, max_size: int = 20, **_: Any) -> BindableVisionFeatureCache:
        self.pending = BindableVisionFeatureCache(max_size, backend=self.backend, salt=self.salt)
        return self.pending

    def bind(self, model: str) -> None:
        if self.pending is not None:
            self.pending.bind(model)
            self.pending = None
