"""Growth curves: lookup latency vs stored blocks, restore time vs prompt length, break-even.

1. ``PrefixCache.lookup`` (hit of a 512-token prompt in 32 blocks of 16, and a miss) while the
   store grows through 1k / 10k / 100k / 1M tiny blocks, on ``memory://``, ``file://`` and
   ``redis://``. Each backend is filled by ``put_many`` batches (``file://``: one sync and one
   transaction per batch) under a time budget; a size the budget cannot reach is cut and said
   so.
2. Restore time (``PrefixCache.lookup`` of a stored prompt, arrays evaluated) vs prompt length,
   with the KV shapes of real models (``MODELS``: layers, KV heads and head dim from their
   ``config.json``; bf16; random data), on each backend.
3. From 2, the prompt length above which a restore beats recomputing the prefix at the
   published Apple-silicon prefill speeds in ``PREFILL_SPEEDS``: where the restore already wins
   at the shortest length measured, that length is the bound; otherwise a line
   ``a + b * tokens`` fitted to the shortest restore times is solved for ``a + b * L = L / speed``.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import mlx.core as mx

from benchmarks.common import Row, Stats, evaluate, have, kv_cache, time_runs

SECTION = "growth"
RESTORE = "restore"
BLOCK = 16
PROMPT = 512

# name: (layers, kv heads, head dim, source). bf16 keys + values: 2 * 2 * layers * heads * dim
MODELS: dict[str, tuple[int, int, int, str]] = {
    "Qwen2-VL-2B": (
        28,
        2,
        128,
        "Qwen/Qwen2-VL-2B-Instruct config.json: 28 layers, 2 KV heads, hidden 1536 / 12 heads",
    ),
    "Llama-3.2-3B": (
        28,
        8,
        128,
        "meta-llama/Llama-3.2-3B-Instruct config.json: 28 layers, 8 KV heads, head_dim 128",
    ),
    "Qwen2.5-7B": (
        28,
        4,
        128,
        "Qwen/Qwen2.5-7B-Instruct config.json: 28 layers, 4 KV heads, hidden 3584 / 28 heads",
    ),
}

# tokens/s of prompt processing (pp512, llama.cpp on Metal), with where they were published
PREFILL_SPEEDS: dict[str, tuple[float, str]] = {
    "M2 Max, 7B Q4_0": (433.0, "llama.cpp PR #2959 (30-core M2 Max, LLaMA 7B Q4_0, pp512)"),
    "M2 Ultra, 7B F16": (1265.0, "llama.cpp PR #3084 (M2 Ultra, LLaMA 7B F16, pp512)"),
    "M1 Ultra, 3B Q4_K_M": (
        2143.0,
        "geerlingguy/ai-benchmarks #48 (M1 Ultra, Llama-3.2-3B Q4_K_M, pp512)",
    ),
}


def bytes_per_token(model: str) -> int:
    layers, heads, dim, _ = MODELS[model]
    return 2 * 2 * layers * heads * dim


# -- 1. lookup latency vs stored blocks ----------------------------------------------------


def _lookup_rows(label: str, uri: str, sizes: list[int], budget: float, ctx: Any) -> list[Row]:
    from benchmarks.prefix_lookup import _fill, _tiny_cache, _trips
    from mlxcache import open_backend
    from mlxcache.prefix import PrefixCache

    rows: list[Row] = []
    backend = open_backend(uri)  # file:// with its default sync: one sync per put_many batch
    try:
        pc = PrefixCache(backend, model="bench-growth", block_size=BLOCK, hot_bytes=0)
        tokens = list(range(1000, 1000 + PROMPT))
        pc.store(tokens, _tiny_cache(PROMPT))
        unseen = list(range(5000, 5000 + PROMPT))
        spent = 0.0
        for size in sizes:
            need = size - len(backend)
            rate = spent / max(1, len(backend))  # seconds per block so far
            if need > 0 and spent + need * rate > budget:
                ctx.note(
                    f"growth: {label} lookup stopped before {size:,} blocks: filling would take "
                    f"~{need * rate:.0f} s more at {1 / rate:,.0f} puts/s (budget {budget:.0f} s)"
                )
                break
            if need > 0:
                spent += _fill(backend, pc.key_prefix, need)
            hit = pc.lookup(tokens)
            if hit is None or hit.num_tokens != PROMPT:
                raise RuntimeError(f"{label}: the stored prompt was not found at {size} blocks")
            for kind, prompt in (("hit", tokens), ("miss", unseen)):
                note = f"{size:,} blocks stored"
                if label == "redis://":
                    trips = _trips(pc, prompt)
                    note += f"; {trips} round trip{'s' if trips != 1 else ''}"
                st = time_runs(
                    lambda p=prompt: pc.lookup(p), max(ctx.repeat, 10), warmup=2, collect=False
                )
                rows.append(
                    Row(
                        SECTION,
                        f"{label} lookup ({kind})",
                        PROMPT,
                        None,
                        "s",
                        st,
                        note=note,
                        extra={
                            "blocks": len(backend),
                            "fill_puts_per_s": len(backend) / max(spent, 1e-9),
                        },
                    )
                )
    finally:
        backend.clear()
        backend.close()
    return rows


# -- 2. restore time vs prompt length -------------------------------------------------------


def model_cache(model: str, tokens: int, seed: int = 0) -> list[Any]:
    """mlx-lm KVCache layers with the model's KV shape, ``tokens`` long, random bf16."""
    layers, heads, dim, _ = MODELS[model]
    return kv_cache(tokens, layers, heads, dim, seed, scales=(64, 128, 0.25))


def _restore_rows(
    uris: dict[str, str], lengths: list[int], max_bytes: float, ctx: Any
) -> list[Row]:
    from mlxcache import open_backend
    from mlxcache.prefix import PrefixCache

    rows: list[Row] = []
    repeat = 1 if ctx.smoke else max(2, min(ctx.repeat, 3))
    for model in MODELS:
        bpt = bytes_per_token(model)
        for n in lengths:
            if n * bpt > max_bytes:
                ctx.note(
                    f"growth: {model} at {n:,} tokens ({n * bpt / 1e9:.2f} GB) was cut "
                    f"(over --restore-max-gb {max_bytes / 1e9:g})."
                )
                continue
            cache = model_cache(model, n)
            tokens = list(range(7, 7 + n + 1))
            for label, uri in uris.items():
                backend = open_backend(uri + ("?timeout=300" if label == "redis://" else ""))
                try:
                    pc = PrefixCache(
                        backend, model=f"bench-{model}", salt=uuid.uuid4().hex, hot_bytes=0
                    )
                    t0 = time.perf_counter()
                    pc.store(tokens[:n], cache)
                    put_s = time.perf_counter() - t0

                    def restore(
                        pc: Any = pc, tokens: list = tokens, n: int = n, label: str = label
                    ) -> None:
                        hit = pc.lookup(tokens)
                        if hit is None or hit.num_tokens != n:
                            raise RuntimeError(f"{label}: restore of {n} tokens missed")
                        evaluate([[c.keys, c.values] for c in hit.prompt_cache])

                    st = time_runs(restore, repeat, warmup=1, clear=False)
                    rows.append(
                        Row(
                            SECTION,
                            f"{RESTORE} {model} {label}",
                            n,
                            n * bpt,
                            "s",
                            st,
                            note=f"{bpt:,} B/token; store took {put_s:.2f} s",
                            extra={
                                "model": model,
                                "backend": label,
                                "bytes_per_token": bpt,
                                "store_s": put_s,
                            },
                        )
                    )
                finally:
                    backend.clear()
                    backend.close()
            del cache
            mx.clear_cache()
    return rows


# -- 3. break-even vs recomputing -----------------------------------------------------------


def fit_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares ``a + b * x`` through (x, y) points (a single point: through the origin)."""
    if len(points) == 1:
        x, y = points[0]
        return 0.0, y / x
    n = len(points)
    mx_ = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx_) ** 2 for x, _ in points)
    b = sum((x - mx_) * (y - my) for x, y in points) / sxx
    return my - b * mx_, b


def breakeven(a: float, b: float, speed: float) -> float | None:
    """Prompt length above which ``a + b * L`` (restore) < ``L / speed`` (prefill); None: never."""
    per_token = 1.0 / speed - b
    if per_token <= 0:
        return None
    return max(0.0, a / per_token)


def breakeven_rows(rows: list[Row]) -> list[Row]:
    """One row per model, backend and prefill speed: the prompt length above which a restore
    beats recomputing. Where the restore already wins at the shortest length measured, the
    break-even lies below it and only that bound is given (``extra["bound"] == "below"``): a
    line through longer prompts says nothing reliable about shorter ones."""
    out: list[Row] = []
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in rows:
        if r.section == SECTION and r.name.startswith(RESTORE) and r.stats is not None:
            key = (r.extra["model"], r.extra["backend"])
            series.setdefault(key, []).append((r.tokens or 0, r.stats.median))
    for (model, label), pts in series.items():
        pts.sort()
        # the break-even lies at short prompts: fit the three shortest points
        a, b = fit_line(pts[:3])
        if a < 0:  # no fixed cost resolved: the per-token cost alone, through the origin
            a, b = fit_line(pts[:1])
        (n0, t0), (n1, t1) = pts[0], pts[-1]
        for speed_name, (speed, _) in PREFILL_SPEEDS.items():
            if t0 < n0 / speed:
                value, bound = float(n0), "below"
                note = (
                    f"restore already faster at the shortest length measured ({n0:,} tokens: "
                    f"{t0 * 1e3:.1f} ms vs {n0 / speed * 1e3:,.0f} ms of prefill)"
                )
            else:
                length = breakeven(a, b, speed)
                value, bound = (float("inf"), "never") if length is None else (length, "fit")
                note = f"restore ~ {a * 1e3:.1f} ms + {b * 1e6:.1f} µs/token"
            out.append(
                Row(
                    SECTION,
                    f"break-even {model} {label} vs {speed_name}",
                    None,
                    None,
                    "tokens",
                    Stats.of([value]),
                    note=f"{note}; prefill {1e6 / speed:.0f} µs/token ({speed:g} tok/s)",
                    extra={
                        "model": model,
                        "backend": label,
                        "speed": speed,
                        "bound": bound,
                        "fixed_s": a,
                        "per_token_s": b,
                        "shortest": [n0, t0],
                        "longest": [n1, t1],
                        "restore_gbps": bytes_per_token(model) / b / 1e9 if b > 0 else None,
                    },
                )
            )
    return out


def run(
    block_sizes: list[int], lengths: list[int], budget: float, max_gb: float, ctx: Any
) -> list[Row]:
    if not have("mlxcache.prefix") or not have("mlx_lm"):
        ctx.note("mlxcache.prefix or mlx-lm is missing: growth rows are left out.")
        return []
    uris = {"memory://": "memory://"}
    if have("mlxcache.backends.disk"):
        uris["file://"] = f"file://{ctx.tmpdir / f'growth-{os.getpid()}'}"
    if ctx.redis_url and have("mlxcache.backends.redis"):
        uris["redis://"] = ctx.redis_url
    rows: list[Row] = []
    for label, uri in uris.items():
        rows += _lookup_rows(
            label, uri if label != "file://" else uri + "-lookup", block_sizes, budget, ctx
        )
    rows += _restore_rows(uris, lengths, max_gb * 1e9, ctx)
    rows += breakeven_rows(rows)
    return rows
