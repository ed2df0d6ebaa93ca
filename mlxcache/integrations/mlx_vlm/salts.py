"""A request's ``cache_salt`` (body) or ``X-Cache-Salt`` (header) in mlx-vlm's server.

mlx-vlm already keys its APC per tenant: ``_read_tenant_id`` takes a tenant from the
``X-APC-Tenant`` header and the generator mixes it into every block's salt (``extra_hash``,
which ``SharedAPCManager`` keys by). The two names its OpenAI routes look up are wrapped so the
request's salt joins that tenant: chat completions and responses read and write only their
salt's blocks.
"""

from __future__ import annotations

import importlib
from typing import Any

from mlxcache.integrations.request_salt import HEADER, join_salt, request_salt


class _Tenant(str):
    """mlx-vlm's tenant (with the salt header joined), remembering the header for the body."""

    own: str | None
    header: str | None


def install(installed: Any) -> None:
    """Wrap ``_read_tenant_id`` and ``_build_gen_args`` of ``mlx_vlm.server.openai``."""
    routes = importlib.import_module("mlx_vlm.server.openai")
    read_tenant, build_args = routes._read_tenant_id, routes._build_gen_args

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
        salt = request_salt({k: v for k, v in body.items() if v is not None}, header)
        joined = join_salt(own or "", salt)
        return build_args(request, processor, tenant_id=joined or None)

    installed.replace(routes, "_read_tenant_id", read_tenant_id)
    installed.replace(routes, "_build_gen_args", build_gen_args)
