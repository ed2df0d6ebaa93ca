"""The request's tenant while mlx-vlm's server looks up or stores an image's vision features.

mlx-vlm keys its APC blocks per tenant (``X-APC-Tenant``, joined with a request's
``cache_salt`` by ``salts.py``) but its ``VisionFeatureCache`` by image content only, so one
tenant could tell by timing that another sent an image. The server reaches the cache on two
paths, and each is wrapped to hold the request's tenant in a context variable while it runs:
the batched one (``ResponseGenerator._gpu_embed`` on the GPU thread; the tenant rides on the
queued request's inputs, tagged where ``QueuedGenerationRequest`` is made) and the fallback
(``stream_generate`` and ``generate`` with ``apc_tenant=``). ``tenant_key`` then joins a digest
of that tenant to the cache's keys; with no tenant a key is exactly what it was.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

_TENANT: ContextVar[str | None] = ContextVar("mlxcache_vision_tenant", default=None)


def tenant_key(key: str) -> str:
    """``key`` of the tenant being served (a digest joined to it), or ``key`` itself without one."""
    tenant = _TENANT.get()
    if not tenant:
        return key
    return f"{key}|tenant:{hashlib.sha256(tenant.encode()).hexdigest()[:32]}"


def with_tenant(tenant: str | None, call: Any, *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)`` with ``tenant`` as the vision cache's tenant."""
    token = _TENANT.set(tenant or None)
    try:
        return call(*args, **kwargs)
    finally:
        _TENANT.reset(token)


class _TenantInputs(dict[str, Any]):
    """A queued request's preprocessed inputs, carrying its tenant to the GPU thread."""

    tenant: str | None = None


def _tagged_requests(queued: type) -> type:
    """``QueuedGenerationRequest`` whose inputs carry ``args.tenant_id``."""

    class Queued(queued):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            tenant = getattr(self.args, "tenant_id", None)
            inputs: Any = getattr(self, "raw_inputs", None)
            if tenant and isinstance(inputs, dict):
                tagged = _TenantInputs(inputs)
                tagged.tenant = tenant
                self.raw_inputs = tagged

    Queued.__name__ = Queued.__qualname__ = queued.__name__
    return Queued


def _stream_with_tenant(stream: Any) -> Any:
    """``stream_generate`` holding its ``apc_tenant`` each time it runs (never between)."""

    def stream_generate(*args: Any, **kwargs: Any) -> Iterator[Any]:
        inner = stream(*args, **kwargs)
        tenant = kwargs.get("apc_tenant")
        try:
            while True:
                try:
                    item = with_tenant(tenant, next, inner)
                except StopIteration as stop:
                    return stop.value
                yield item
        finally:
            inner.close()

    return stream_generate


def install(installed: Any) -> None:
    """Wrap the server's two paths to the vision cache (see the module docstring)."""
    generation = importlib.import_module("mlx_vlm.server.generation")
    server = importlib.import_module("mlx_vlm.server")
    responder = generation.ResponseGenerator
    gpu_embed = responder._gpu_embed

    def _gpu_embed(self: Any, raw_inputs: Any, *args: Any, **kwargs: Any) -> Any:
        tenant = getattr(raw_inputs, "tenant", None)
        return with_tenant(tenant, gpu_embed, self, raw_inputs, *args, **kwargs)

    def generate(*args: Any, **kwargs: Any) -> Any:
        return with_tenant(kwargs.get("apc_tenant"), whole, *args, **kwargs)

    whole = server.generate
    installed.replace(generation, "QueuedGenerationRequest", _tagged_requests(
        generation.QueuedGenerationRequest
    ))  # fmt: skip
    installed.replace(responder, "_gpu_embed", _gpu_embed)
    installed.replace(server, "stream_generate", _stream_with_tenant(server.stream_generate))
    installed.replace(server, "generate", generate)
