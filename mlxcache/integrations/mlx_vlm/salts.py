"""A request's ``cache_salt`` (body) or ``X-Cache-Salt`` (header) in mlx-vlm's server.

mlx-vlm already keys its APC per tenant: ``_read_tenant_id`` takes a tenant from the
``X-APC-Tenant`` header and the generator mixes it into every block's salt (``extra_hash``,
which ``SharedAPCManager`` keys by). The two names its OpenAI and Anthropic routes look up are
wrapped so the request's salt joins that tenant: chat completions, responses and messages read
and write only their salt's blocks.
"""

from __future__ import annotations

import importlib
from typing import Any

from fastapi import HTTPException

from mlxcache.integrations.request_salt import HEADER, SaltError, join_salt, request_salt


class BadSalt(HTTPException, ValueError):
    """A bad salt: a 400 on every route (mlx-vlm's chat completions answers an HTTPException
    as it is, its other routes a ValueError as 400 with this message)."""

    def __init__(self, message: str) -> None:
        super().__init__(status_code=400, detail=message)

    def __str__(self) -> str:
        return str(self.detail)


class _Tenant(str):
    """mlx-vlm's tenant (with the salt header joined), remembering the header for the body."""

    own: str | None
    header: str | None


def install(installed: Any) -> None:
    """Wrap ``_read_tenant_id`` and ``_build_gen_args`` where mlx-vlm's routes look them up:
    its OpenAI routes (chat completions, responses) and its Anthropic Messages route, each of
    which keeps its own module-level copies of the two."""
    for name in ("mlx_vlm.server.openai", "mlx_vlm.server.anthropic"):
        routes = importlib.import_module(name)
        read_tenant_id, build_gen_args = _salted(routes._read_tenant_id, routes._build_gen_args)
        installed.replace(routes, "_read_tenant_id", read_tenant_id)
        installed.replace(routes, "_build_gen_args", build_gen_args)


def _salted(read_tenant: Any, build_args: Any) -> tuple[Any, Any]:
    """The two names wrapped so a request's salt (body or header) joins mlx-vlm's tenant."""

    def read_tenant_id(http_request: Any) -> str | None:
        own = read_tenant(http_request)
        headers = getattr(http_request, "headers", None)
        header = headers.get(HEADER) if headers is not None else None
        tenant = _Tenant(join_salt(own or "", header or ""))
        tenant.own, tenant.header = own, header
        return tenant if (own or header) else None

    def build_gen_args(request: Any, processor: Any = None, tenant_id: Any = None) -> Any:
        own = tenant_id.own if isinstance(tenant_id, _Tenant) else tenant_id
        header = tenant_id.header if isinstance(tenant_id, _Tenant) else None
        body = {"cache_salt": getattr(request, "cache_salt", None)}
        try:
            salt = request_salt({k: v for k, v in body.items() if v is not None}, header)
        except SaltError as exc:  # a 400 on every route (chat completions made it a 500)
            raise BadSalt(str(exc)) from None
        joined = join_salt(own or "", salt)
        return build_args(request, processor, tenant_id=joined or None)

    return read_tenant_id, build_gen_args
