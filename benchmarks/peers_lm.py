"""mlx-lm's server prompt cache and prompt-cache files against ours, on a TinyLlama-shaped cache.

The cache: 22 layers of mlx-lm ``KVCache``, 4 KV heads, head dim 64, bf16 (TinyLlama-1.1B's
``config.json``: ``num_hidden_layers`` 22, ``num_key_value_heads`` 4, ``hidden_size`` 2048 /
``num_attention_heads`` 32), 2048 tokens of random data (46 MB).

- **hot cache**: mlx-lm 0.32's ``LRUPromptCache`` (``mlx_lm/server.py`` uses it) against
  ``mlxcache.integrations.mlx_lm.prompt_cache.SharedPromptCache`` (its hot tier plus a
  ``PrefixCache`` on ``memory://``, ``file://`` or ``redis://``): ``insert_cache`` of the
  2k-token cache (ours stores on a writer thread; it is flushed, untimed, between runs) and
  ``fetch_nearest_cache`` of a request that extends it by 16 tokens (the nearest prefix), with
  ``mx.eval`` of the returned cache (both return a copy a model can extend); and a
  ``PrefixCache`` hot hit (its in-process tier, ``hot_bytes``) for the same request on each
  backend, which also asks the backend (one ``contains_many``) whether it has a longer prefix;
- **another worker**: the same fetch in a second ``SharedPromptCache`` whose hot tier is empty
  (restored from the shared tier) against mlx-lm ``load_prompt_cache`` of a saved file;
- **files**: ``save_prompt_cache`` (+ fsync) / ``load_prompt_cache`` + eval against our
  ``file://`` put of ``dump_prompt_cache`` / get + ``load_prompt_cache`` + eval, alternating,
  MLX's buffer cache kept between runs (a warm allocator, as in a server).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import numpy as np

from benchmarks.common import (
    Row,
    Stats,
    evaluate,
    fsync_file,
    have,
    kv_cache,
    time_alternating,
    time_runs,
)

SECTION = "peers"
LAYERS, KV_HEADS, HEAD_DIM = 22, 4, 64  # TinyLlama-1.1B-Chat-v1.0 config.json
MODEL_KEY = ("tinyllama-shaped", None, None)


def tinyllama_cache(tokens: int, seed: int = 0) -> list[Any]:
    """22 evaluated mlx-lm KVCache layers of ``tokens`` random bf16 keys/values."""
    return kv_cache(tokens, LAYERS, KV_HEADS, HEAD_DIM, seed)


def _nbytes(cache: list[Any]) -> int:
    return sum(c.keys.nbytes + c.values.nbytes for c in cache)


def _row(
    name: str,
    n: int,
    nbytes: int,
    st: Stats,
    base: str | None = None,
    base_st: Stats | None = None,
    note: str = "",
) -> Row:
    ratio = base_st.median / st.median if base_st is not None and st.median > 0 else None
    return Row(
        SECTION,
        name,
        n,
        nbytes,
        "s",
        st,
        baseline=base,
        ratio=ratio,
        ratio_kind="baseline / ours (>1 = ours faster)" if base else "",
        note=note,
    )


def run(tokens: int, ctx: Any) -> list[Row]:
    if not have("mlx_lm") or not have("mlxcache.integrations.mlx_lm.prompt_cache"):
        ctx.note("mlx-lm or the SharedPromptCache integration is missing: LM peer rows left out.")
        return []
    from mlx_lm.models.cache import LRUPromptCache, load_prompt_cache, save_prompt_cache

    from mlxcache import open_backend
    from mlxcache.integrations.mlx_lm.prompt_cache import SharedPromptCache
    from mlxcache.serializers.prompt_cache import dump_prompt_cache
    from mlxcache.serializers.prompt_cache import load_prompt_cache as our_load

    cache = tinyllama_cache(tokens)
    nbytes = _nbytes(cache)
    ids = np.random.default_rng(3).integers(1, 32000, size=tokens + 16).tolist()
    prompt, request = ids[:tokens], ids
    repeat = max(ctx.repeat, 5)
    rows: list[Row] = []

    # hot cache: insert, then fetch of the nearest prefix
    lru = LRUPromptCache(max_size=10)
    ins = time_runs(
        lambda: lru.insert_cache(MODEL_KEY, prompt, cache),
        repeat,
        setup=lambda: lru.__init__(max_size=10),
        warmup=1,
        clear=False,
    )
    rows.append(
        _row("mlx-lm LRUPromptCache insert_cache", tokens, nbytes, ins, note="keeps a reference")
    )

    def fetch(pc: Any) -> None:
        got, rest = pc.fetch_nearest_cache(MODEL_KEY, request)
        if got is None or len(rest) != len(request) - tokens:
            raise RuntimeError(f"{type(pc).__name__}: nearest prefix not found ({len(rest)})")
        evaluate([[c.keys, c.values] for c in got])

    lru_fetch = time_runs(lambda: fetch(lru), repeat, warmup=1, clear=False)
    rows.append(
        _row(
            "mlx-lm LRUPromptCache fetch_nearest_cache",
            tokens,
            nbytes,
            lru_fetch,
            note="2048 stored, request 2064: copy of the cache + eval",
        )
    )

    backends = {"memory://": "memory://", "file://": f"file://{ctx.tmpdir / 'peers-lm'}"}
    if getattr(ctx, "redis_url", None):
        backends["redis://"] = ctx.redis_url
    for label, uri in backends.items():
        backend = open_backend(uri)
        holder: dict[str, Any] = {}

        def fresh(backend: Any = backend, holder: dict = holder) -> None:
            if "pc" in holder:  # the previous run's background store, finished untimed
                holder["pc"].close()
            pc = SharedPromptCache(max_size=10, backend=backend, salt=uuid.uuid4().hex)
            if pc._writer is not None:  # a server's writer thread is already running: start
                pc._writer.submit(lambda: None)  # this one here, untimed
                pc.flush()
            holder["pc"] = pc

        try:
            st = time_runs(
                lambda h=holder: h["pc"].insert_cache(MODEL_KEY, prompt, cache),
                repeat,
                setup=fresh,
                warmup=1,
                clear=False,
            )
            rows.append(
                _row(
                    f"SharedPromptCache ({label}) insert_cache",
                    tokens,
                    nbytes,
                    st,
                    "mlx-lm LRUPromptCache insert_cache",
                    ins,
                    note="hot tier + PrefixCache.store queued (256-token blocks)",
                )
            )
            pc = holder["pc"]
            pc.flush()
            st = time_runs(lambda pc=pc: fetch(pc), repeat, warmup=1, clear=False)
            rows.append(
                _row(
                    f"SharedPromptCache ({label}) fetch_nearest_cache",
                    tokens,
                    nbytes,
                    st,
                    "mlx-lm LRUPromptCache fetch_nearest_cache",
                    lru_fetch,
                    note="hot hit + one contains_many for a longer shared prefix",
                )
            )
            rows.append(_prefix_hot(backend, label, prompt, request, cache, repeat, lru_fetch))
            if label == "redis://":  # where the probe is a round trip: without it too
                final = SharedPromptCache(max_size=10, backend=backend, hot_probe=False)
                final.insert_cache(MODEL_KEY, prompt, cache)
                final.flush()
                st = time_runs(lambda pc=final: fetch(pc), repeat, warmup=1, clear=False)
                final.close()
                rows.append(
                    _row(
                        f"SharedPromptCache ({label}) fetch_nearest_cache, hot_probe=False",
                        tokens,
                        nbytes,
                        st,
                        "mlx-lm LRUPromptCache fetch_nearest_cache",
                        lru_fetch,
                        note="hot hit, final: no backend call",
                    )
                )
                rows.append(
                    _prefix_hot(
                        backend, label, prompt, request, cache, repeat, lru_fetch, probe=False
                    )
                )
            if label == "file://":
                rows += _other_worker(
                    pc,
                    backend,
                    prompt,
                    request,
                    tokens,
                    nbytes,
                    repeat,
                    ctx,
                    cache,
                    load_prompt_cache,
                    save_prompt_cache,
                )
        finally:
            backend.clear()
            backend.close()

    # prompt-cache files: mlx-lm's functions against file:// put/get, warm allocator
    path = str(ctx.tmpdir / "peers-lm.safetensors")
    disk = open_backend(f"file://{ctx.tmpdir / 'peers-lm-files'}")
    try:

        def lm_save() -> None:
            save_prompt_cache(path, cache)
            fsync_file(path)

        puts = time_alternating(
            {"save": lm_save, "put": lambda: disk.put("pc", dump_prompt_cache(cache))},
            repeat,
            setup={"put": lambda: disk.delete("pc")},
            clear=False,
        )
        gets = time_alternating(
            {
                "load": lambda: evaluate(load_prompt_cache(path)),
                "get": lambda: evaluate(our_load(disk.get("pc"))),
            },
            repeat,
            clear=False,
        )
    finally:
        disk.clear()
        disk.close()
    rows.append(_row("mlx-lm save_prompt_cache + fsync", tokens, nbytes, puts["save"]))
    rows.append(
        _row(
            "file:// put (dump_prompt_cache)",
            tokens,
            nbytes,
            puts["put"],
            "mlx-lm save_prompt_cache + fsync",
            puts["save"],
        )
    )
    rows.append(_row("mlx-lm load_prompt_cache + eval", tokens, nbytes, gets["load"]))
    rows.append(
        _row(
            "file:// get + load_prompt_cache + eval",
            tokens,
            nbytes,
            gets["get"],
            "mlx-lm load_prompt_cache + eval",
            gets["load"],
            note="checksum verified",
        )
    )
    return rows


def _prefix_hot(
    backend: Any,
    label: str,
    prompt: list[int],
    request: list[int],
    cache: Any,
    repeat: int,
    lru_fetch: Stats,
    probe: bool = True,
) -> Row:
    """A ``PrefixCache`` hot hit of the nearest prefix, as mlx-lm's fetch, on ``backend``
    (``probe=False``: ``hot_probe=False``, no question to the backend)."""
    from mlxcache import PrefixCache

    salt = uuid.uuid4().hex
    pc = PrefixCache(backend, model="tinyllama-shaped", salt=salt, hot_probe=probe)
    pc.store(prompt, cache)

    def lookup() -> None:
        hit = pc.lookup(request)
        if hit is None or hit.num_tokens != len(prompt):
            raise RuntimeError(f"PrefixCache ({label}): not a hot hit of the stored prompt")
        evaluate([[c.keys, c.values] for c in hit.prompt_cache])

    st = time_runs(lookup, repeat, warmup=1, clear=False)
    if pc.stats()["hot"]["hits"] < repeat:
        raise RuntimeError(f"PrefixCache ({label}): lookups were not served by the hot tier")
    pc.clear()
    asked = "one contains_many" if probe else "no backend call"
    return _row(
        f"PrefixCache ({label}) hot lookup" + ("" if probe else ", hot_probe=False"),
        len(prompt),
        _nbytes(cache),
        st,
        "mlx-lm LRUPromptCache fetch_nearest_cache",
        lru_fetch,
        note=f"{len(prompt)} stored, request {len(request)}: hot tier + {asked}",
    )


def _other_worker(
    pc: Any,
    backend: Any,
    prompt: list[int],
    request: list[int],
    tokens: int,
    nbytes: int,
    repeat: int,
    ctx: Any,
    cache: Any,
    load_fn: Any,
    save_fn: Any,
) -> list[Row]:
    """A second SharedPromptCache with an empty hot tier restores from the shared tier."""
    from mlxcache.integrations.mlx_lm.prompt_cache import SharedPromptCache

    path = str(ctx.tmpdir / "peers-lm-worker.safetensors")
    save_fn(path, cache)
    salt = pc.salt

    def other() -> None:
        worker = SharedPromptCache(max_size=10, backend=backend, salt=salt)
        got, rest = worker.fetch_nearest_cache(MODEL_KEY, request)
        if got is None:
            raise RuntimeError("another worker did not find the shared prefix")
        evaluate([[c.keys, c.values] for c in got])

    st = time_alternating(
        {"load": lambda: evaluate(load_fn(path)), "other": other}, repeat, clear=False
    )
    os.unlink(path)
    return [
        _row(
            "mlx-lm load_prompt_cache + eval (another worker's file)",
            tokens,
            nbytes,
            st["load"],
            note="what mlx-lm offers a second worker: a file it must be given",
        ),
        _row(
            "SharedPromptCache (file://) fetch, another worker",
            tokens,
            nbytes,
            st["other"],
            "mlx-lm load_prompt_cache + eval (another worker's file)",
            st["load"],
            note="empty hot tier: restored from the shared tier (2047 tokens)",
        ),
    ]
