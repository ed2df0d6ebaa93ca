"""Time to first token, cold vs warm (filled in once mlxcache.integrations.mlx_vlm lands)."""

from __future__ import annotations

from typing import Any

from benchmarks.common import Row, have


def run(lengths: list[int], ctx: Any) -> list[Row]:
    if not have("mlxcache.integrations.mlx_vlm"):
        ctx.note("mlxcache.integrations.mlx_vlm had not landed: TTFT rows are left out.")
    else:
        ctx.note("TTFT rows are not implemented yet.")
    return []
