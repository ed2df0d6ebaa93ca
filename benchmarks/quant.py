"""Quantized KV storage (``PrefixCache(kv_bits=...)``) against exact storage, in one run.

1. Store and restore (``PrefixCache.store`` / ``lookup`` + eval) of a Qwen2.5-7B-shaped bf16
   cache on ``file://`` and ``redis://``, exact vs 8-bit vs 4-bit (group 64), timed in
   alternating order; bytes stored per token. Ratio = exact time / quantized time (> 1: the
   quantized one is faster).
2. When it pays: a restore costs about ``local time + bytes / link speed``. The quantized
   restore moves fewer bytes but dequantizes; from the loopback times and the bytes of both,
   the link speed below which the quantized restore is the faster one (or "always" when it is
   faster even on loopback). Reported as the link's seconds per GB at the tie (unit ``s/GB``,
   0 = pays on any link) with the speed in the note.
3. What it costs in answers, on the tiny models: the largest |logit| difference of the first
   step after a restore from quantized KV against a restore from exact KV (which is bit-exact
   with no cache), and how many of the next greedy tokens agree.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import mlx.core as mx
import numpy as np

from benchmarks.common import Row, Stats, evaluate, have, time_alternating

SECTION = "quant"
MODEL = "Qwen2.5-7B"  # benchmarks.growth.MODELS: 28 layers, 4 KV heads, head dim 128
MODES: dict[str, int | None] = {"exact": None, "q8": 8, "q4": 4}
GROUP = 64
GREEDY = 16  # greedy tokens compared after the restore


def _caches(backend: Any, tag: str) -> dict[str, Any]:
    from mlxcache.prefix import PrefixCache

    salt = f"{tag}-{uuid.uuid4().hex}"
    return {
        mode: PrefixCache(
            backend, model=f"bench-{MODEL}", salt=salt, kv_bits=b, kv_group_size=GROUP, hot_bytes=0
        )
        for mode, b in MODES.items()
    }


def _stored_bytes(pc: Any) -> int:
    keys = list(pc.backend.keys(pc.key_prefix))
    return sum(r.nbytes for r in pc.backend.get_many(keys) if r is not None)


def _io_rows(label: str, uri: str, n: int, cache: list[Any], ctx: Any) -> list[Row]:
    """Store, restore and bytes of one prompt in each mode, on one backend."""
    from benchmarks.growth import bytes_per_token
    from mlxcache import open_backend

    repeat = 1 if ctx.smoke else max(2, min(ctx.repeat, 3))
    tokens = list(range(7, 7 + n + 1))
    backend = open_backend(uri + ("?timeout=300" if label == "redis://" else ""))
    rows: list[Row] = []
    try:
        pcs = _caches(backend, label)

        def store(pc: Any) -> None:
            if pc.store(tokens[:n], cache) != n:
                raise RuntimeError(f"{label}: the store of {n} tokens was not kept")

        def restore(pc: Any) -> None:
            hit = pc.lookup(tokens)
            if hit is None or hit.num_tokens != n:
                raise RuntimeError(f"{label}: restore of {n} tokens missed")
            evaluate([[c.keys, c.values] for c in hit.prompt_cache])

        put = time_alternating(
            {m: (lambda pc=pc: store(pc)) for m, pc in pcs.items()},
            repeat,
            setup={m: pc.clear for m, pc in pcs.items()},
            clear=False,
        )
        nbytes = {m: _stored_bytes(pc) for m, pc in pcs.items()}
        get = time_alternating(
            {m: (lambda pc=pc: restore(pc)) for m, pc in pcs.items()}, repeat, clear=False
        )
        exact_b = nbytes["exact"]
        for m in MODES:
            extra = {"backend": label, "mode": m, "bytes_per_token": nbytes[m] / n}
            for op, st in (("store", put[m]), ("restore", get[m])):
                base = None if m == "exact" else f"exact {label} {op}"
                rows.append(
                    Row(
                        SECTION,
                        f"{m} {label} {op}",
                        n,
                        nbytes[m],
                        "s",
                        st,
                        baseline=base,
                        ratio=None
                        if base is None
                        else (put if op == "store" else get)["exact"].median / st.median,
                        ratio_kind="exact time / quantized time" if base else "",
                        note=f"{nbytes[m] / n:,.0f} B/token stored "
                        f"(exact {exact_b / n:,.0f}; raw bf16 KV {bytes_per_token(MODEL):,})",
                        extra=extra,
                    )
                )
            rows.append(
                Row(
                    SECTION,
                    f"{m} {label} bytes per token",
                    n,
                    nbytes[m],
                    "B",
                    Stats.of([nbytes[m] / n]),
                    baseline=None if m == "exact" else f"exact {label} bytes per token",
                    ratio=None if m == "exact" else exact_b / nbytes[m],
                    ratio_kind="exact bytes / quantized bytes" if m != "exact" else "",
                    extra=extra,
                )
            )
            if m != "exact":
                rows.append(_pays(label, m, n, nbytes, get))
    finally:
        backend.clear()
        backend.close()
    return rows


def _pays(label: str, mode: str, n: int, nbytes: dict[str, int], get: dict[str, Stats]) -> Row:
    """The link cost (s/GB) at which the quantized restore ties the exact one (best of N of
    each: on a loaded machine the minimum is the steadiest estimate of the work itself)."""
    saved = (nbytes["exact"] - nbytes[mode]) / 1e9  # GB fewer moved
    extra_s = get[mode].min - get["exact"].min  # extra local time (dequantize)
    tie = max(0.0, extra_s / saved) if saved > 0 else 0.0
    if extra_s <= 0:
        note = "pays on any link: faster than exact even on this machine's loopback"
    else:
        note = (
            f"pays on links slower than {1 / tie:.2f} GB/s ({8 / tie:.1f} Gbit/s): "
            f"dequantizing costs {extra_s * 1e3:.1f} ms for {saved * 1e3:.0f} MB fewer moved"
        )
    return Row(
        SECTION,
        f"{mode} {label} restore: link cost at the tie",
        n,
        nbytes[mode],
        "s/GB",
        Stats.of([tie]),
        note=note,
        extra={"backend": label, "mode": mode, "tie_s_per_gb": tie, "extra_s": extra_s},
    )


def _codec_rows(n: int, cache: list[Any], ctx: Any) -> list[Row]:
    """Quantize and dequantize alone (every layer's keys and values), what the store and the
    restore pay on top of moving the bytes."""
    from mlxcache.serializers import kv_quant

    repeat = 1 if ctx.smoke else max(2, min(ctx.repeat, 3))
    arrays = [a for c in cache for a in (c.keys[..., :n, :], c.values[..., :n, :])]
    raw = sum(a.nbytes for a in arrays)
    fns: dict[str, Any] = {}
    for mode, b in MODES.items():
        if b is None:
            continue
        q = kv_quant.KVQuant(b, GROUP)
        packed = [mx.quantize(a, group_size=GROUP, bits=b) for a in arrays]
        mx.eval(packed)
        fns[f"{mode} quantize"] = lambda q=q: mx.eval(
            [mx.quantize(a, group_size=q.group_size, bits=q.bits) for a in arrays]
        )
        fns[f"{mode} dequantize"] = lambda q=q, packed=packed: mx.eval(
            [kv_quant.dequantize(*p, q) for p in packed]
        )
    times = time_alternating(fns, repeat, clear=False)
    return [
        Row(
            SECTION,
            f"{name} (every layer's KV)",
            n,
            raw,
            "s",
            st,
            note=f"{raw / st.min / 1e9:.2f} GB/s of bf16 KV (best of {st.runs}); "
            f"device {mx.default_device()}",
        )
        for name, st in times.items()
    ]


# -- 3. the tiny models ----------------------------------------------------------------------


def _vlm_step(model: Any, ids: list[int], cache: Any) -> tuple[mx.array, Any]:
    from mlx_vlm.models.cache import make_prompt_cache

    lm = model.language_model
    kw = {}
    if hasattr(lm, "_rope_deltas"):  # Qwen2-VL keeps M-RoPE state between calls
        lm._rope_deltas, lm._position_ids = None, None
        if cache is not None:
            kw["rope_deltas"] = mx.array(0)
    cache = make_prompt_cache(lm) if cache is None else cache
    logits = lm(mx.array([ids]), cache=cache, **kw).logits[0, -1]
    mx.eval(logits)
    return logits, cache


def _lm_step(model: Any, ids: list[int], cache: Any) -> tuple[mx.array, Any]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model) if cache is None else cache
    logits = model(mx.array([ids]), cache=cache)[0, -1]
    mx.eval(logits)
    return logits, cache


def _greedy(
    step: Any, model: Any, ids: list[int], cache: Any, count: int
) -> tuple[mx.array, list[int]]:
    logits, cache = step(model, ids, cache)
    first, out = logits, []
    for _ in range(count):
        out.append(int(mx.argmax(logits).item()))
        logits, cache = step(model, out[-1:], cache)
    return first, out


def _models(ctx: Any) -> list[tuple[str, Any, Any, int]]:
    """(name, model, step, group size): group 32 where the head dim is 32."""
    out = []
    if have("mlx_vlm"):
        from mlxcache.tiny_models import build_model

        for name in ("qwen2_vl", "gemma3"):
            out.append((name, build_model(name)[0], _vlm_step, 32))
    if have("mlx_lm"):
        import mlx_lm

        from mlxcache.tiny_models import build_tiny_lm

        path = build_tiny_lm(ctx.tmpdir / "quant-lm", hidden_size=256, num_heads=4)
        out.append(("tiny llama (head dim 64)", mlx_lm.load(str(path))[0], _lm_step, GROUP))
    return out


def _logit_rows(ctx: Any) -> list[Row]:
    from mlxcache.prefix import PrefixCache

    rows: list[Row] = []
    n, count = (64, 4) if ctx.smoke else (480, GREEDY)
    ids = np.random.default_rng(1).integers(1, 400, n + 8).tolist()
    prefix, rest = ids[:n], ids[n:]
    for name, model, step, group in _models(ctx):
        _, cache = step(model, prefix, None)
        ref_logits, ref_tokens = _greedy(step, model, rest, step(model, prefix, None)[1], count)
        spread = (ref_logits.max() - ref_logits.min()).item()
        for mode, b in MODES.items():
            pc = PrefixCache(
                "memory://", model=name, block_size=64, kv_bits=b, kv_group_size=group, hot_bytes=0
            )
            pc.store(prefix, cache)
            hit = pc.lookup(prefix)
            if hit is None or hit.num_tokens != n:
                raise RuntimeError(f"{name} {mode}: the restore missed")
            logits, tokens = _greedy(step, model, rest, hit.prompt_cache, count)
            diff = mx.abs(logits - ref_logits).max().item()
            agree = next(
                (i for i, (a, c) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != c),
                count,
            )
            extra = {"model": name, "mode": mode, "group_size": group, "logit_spread": spread}
            rows.append(
                Row(
                    SECTION,
                    f"{name} {mode}: max |logit diff| vs exact",
                    n,
                    unit="logit",
                    stats=Stats.of([diff]),
                    note=f"{diff / spread:.2%} of the logits' spread ({spread:.3g}); group {group}",
                    extra=extra,
                )
            )
            rows.append(
                Row(
                    SECTION,
                    f"{name} {mode}: greedy tokens equal to uncached",
                    n,
                    unit="tokens",
                    stats=Stats.of([float(agree)]),
                    note=f"{agree} of {count} before the first difference",
                    extra=extra,
                )
            )
    return rows


def run(lengths: list[int], ctx: Any) -> list[Row]:
    if not have("mlxcache.prefix") or not have("mlx_lm"):
        ctx.note("mlxcache.prefix or mlx-lm is missing: quant rows are left out.")
        return []
    from benchmarks.growth import model_cache

    uris = {}
    if have("mlxcache.backends.disk"):
        uris["file://"] = f"file://{ctx.tmpdir / f'quant-{os.getpid()}'}"
    if ctx.redis_url and have("mlxcache.backends.redis"):
        uris["redis://"] = ctx.redis_url
    rows: list[Row] = []
    for n in lengths:
        cache = model_cache(MODEL, n)
        for label, uri in uris.items():
            rows += _io_rows(label, uri, n, cache, ctx)
        rows += _codec_rows(n, cache, ctx)
        del cache
        mx.clear_cache()
    rows += _logit_rows(ctx)
    ctx.note(
        "quant: Redis here is loopback on the same machine; over a network the bytes move "
        "slower and the quantized rows gain (see the link-cost rows)."
    )
    return rows


def _x(row: Row | None) -> str:
    return f"{row.ratio:.2f}x" if row is not None and row.ratio is not None else ""


def summary(rows: list[Row]) -> str:
    """A short table for docs/performance.md: bytes, restore ratio and where it pays."""
    q = [r for r in rows if r.section == SECTION]
    if not q:
        return ""
    out = [
        "| mode | backend | tokens | B/token | fewer bytes | store ratio | restore ratio | pays |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in q:
        if not r.name.endswith("bytes per token") or r.extra.get("mode") == "exact":
            continue
        mode, label, n = r.extra["mode"], r.extra["backend"], r.tokens

        def find(suffix: str, mode=mode, label=label, n=n) -> Row | None:
            name = f"{mode} {label} {suffix}"
            return next((x for x in q if x.name == name and x.tokens == n), None)

        st, rs, pays = find("store"), find("restore"), find("restore: link cost at the tie")
        out.append(
            f"| {mode} | {label} | {n} | {r.stats.median:,.0f} | {_x(r)} | {_x(st)} | {_x(rs)} "
            f"| {pays.note if pays else ''} |"
        )
    for r in q:
        if r.unit == "logit":
            out.append(f"\n- {r.name}: {r.stats.median:.3g} ({r.note})")
        elif r.unit == "tokens":
            out.append(f"- {r.name}: {r.note}")
    return "\n".join(out)
