"""Time to first token with the tiny models: uncached, cold cache and warm cache.

Uses ``mlxcache.integrations.mlx_vlm.generate_tokens`` (one token) on a ``PrefixCache`` over
``file://`` and ``redis://``. *Cold* is a first request on an empty cache (a fresh salt per
run): full prefill plus storing the new blocks. *Warm* repeats the same request: the prefix is
restored and one token is prefilled. The time is the integration's own ``time_to_first_token``
(lookup and restore included). Ratio = cold / warm (> 1 = the cache pays).
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np

from benchmarks.common import Row, Stats, have

SECTION = "ttft"
MODELS = ("qwen2_vl", "gemma3")


def _inputs(family: str, n: int, seed: int = 1) -> tuple[Any, Any, dict[str, Any]]:
    """A seeded ``n``-token prompt with one image, as the tiny models expect (see their README)."""
    import mlx.core as mx

    ids = np.random.default_rng(seed).integers(1, 990, size=n).tolist()
    if family == "qwen2_vl":
        ids[5] = 997  # vision start
        ids[6:22] = [999] * 16
        pixels = np.random.default_rng(2).standard_normal((64, 1176)).astype(np.float32)
        return mx.array([ids]), mx.array(pixels), {"image_grid_thw": mx.array([[1, 8, 8]])}
    ids[6:22] = [999] * 16
    pixels = np.random.default_rng(2).standard_normal((1, 3, 112, 112)).astype(np.float32)
    return mx.array([ids]), mx.array(pixels), {}


def _ttft(model: Any, cache: Any, inputs: tuple[Any, Any, dict[str, Any]]) -> tuple[float, int]:
    from mlxcache.integrations.mlx_vlm import generate_tokens

    ids, pixels, kwargs = inputs
    r = generate_tokens(model, ids, pixels, cache=cache, max_tokens=1, **kwargs)
    return r.time_to_first_token, r.cached_tokens


def run(lengths: list[int], ctx: Any) -> list[Row]:
    if not have("mlxcache.integrations.mlx_vlm") or not have("mlxcache.prefix"):
        ctx.note("mlxcache.integrations.mlx_vlm had not landed: TTFT rows are left out.")
        return []
    if not have("mlx_vlm"):
        ctx.note("mlx-vlm is not installed: TTFT rows are left out.")
        return []
    from mlxcache import open_backend
    from mlxcache.prefix import PrefixCache
    from mlxcache.prefix.model_id import model_identity
    from mlxcache.tiny_models import build_model

    uris = []
    if have("mlxcache.backends.disk"):
        uris.append(("file://", f"file://{ctx.tmpdir / 'ttft-store'}"))
    if ctx.redis_url and have("mlxcache.backends.redis") and not ctx.smoke:
        uris.append(("redis://", ctx.redis_url))
    models = MODELS[:1] if ctx.smoke else MODELS
    runs = 1 if ctx.smoke else max(1, min(ctx.repeat, 3))
    rows: list[Row] = []
    for family in models:
        model, _ = build_model(family, 0)
        ident = model_identity(model)
        for n in lengths:
            inputs = _inputs(family, max(n, 32))
            _ttft(model, None, inputs)  # warm up kernels once, untimed
            plain = Stats.of([_ttft(model, None, inputs)[0] for _ in range(runs)])
            rows.append(Row(SECTION, f"{family} uncached", n, None, "s", plain, note="reference"))
            for label, uri in uris:
                backend = open_backend(uri)
                try:
                    cold_t, warm_t = [], []
                    for _ in range(runs):
                        cache = PrefixCache(
                            backend, model=ident, salt=uuid.uuid4().hex, hot_bytes=0
                        )
                        t, cached = _ttft(model, cache, inputs)
                        if cached:
                            raise RuntimeError(f"{label}: a cold request found {cached} tokens")
                        cold_t.append(t)
                        t, cached = _ttft(model, cache, inputs)
                        if cached < n - 1:
                            raise RuntimeError(f"{label}: a warm request reused only {cached}")
                        warm_t.append(t)
                    cold, warm = Stats.of(cold_t), Stats.of(warm_t)
                    rows.append(
                        Row(
                            SECTION,
                            f"{family} {label} cold",
                            n,
                            None,
                            "s",
                            cold,
                            baseline=f"{family} uncached",
                            note=f"{cold.median / plain.median:.2f}x the uncached time",
                        )
                    )
                    rows.append(
                        Row(
                            SECTION,
                            f"{family} {label} warm",
                            n,
                            None,
                            "s",
                            warm,
                            baseline=f"{family} {label} cold",
                            ratio=cold.median / warm.median,
                            ratio_kind="cold / warm (>1 = faster)",
                            note=f"{plain.median / warm.median:.1f}x faster than uncached",
                        )
                    )
                finally:
                    backend.clear()
                    backend.close()
    return rows
