"""TTFT of a repeated long prompt: ``mlx_lm.server`` as shipped vs ``mlxcache serve``.

Both servers run as subprocesses on a local random-weight llama (``build_tiny_lm``, sized so a
2k-token prefill takes a noticeable time on a CPU) and are timed with real HTTP requests: the
time to a one-token chat answer (``max_tokens=1``), which is prefill plus one step.

- ``mlx_lm.server cold``: the first request (reference).
- ``mlx_lm.server warm, same process``: the same request again, from mlx-lm's in-memory cache.
- ``mlx_lm.server after a restart``: a new process knows nothing: cold again.
- ``mlxcache serve warm, new process (file://)``: one process answers the prompt and is killed;
  a new process answers it from the shared tier (and over ``redis://`` when a Redis runs).
Ratios are against the same run's mlx-lm rows (> 1 = ``mlxcache serve`` is faster).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from benchmarks.common import Row, Stats, evaluate, have, time_runs
from benchmarks.http_server import launch

SECTION = "server"
# about 6 M parameters: a 2k-token prefill takes seconds on a busy 2-core CPU; KV 16 MB (fp32)
BENCH_MODEL = {
    "num_layers": 4,
    "hidden_size": 256,
    "num_heads": 4,
    "num_kv_heads": 4,
    "intermediate_size": 512,
}
WORDS = "the cache keeps what the model has already computed so a repeated prompt skips it".split()


class _Server:
    def __init__(self, args: list[str], log: Path) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.proc, self.port, self._log = launch([sys.executable, "-m", *args], env, log)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def ask(self, content: str) -> tuple[float, int, int]:
        """(seconds to a one-token answer, prompt tokens, cached tokens)."""
        body = json.dumps(
            {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
        ).encode()
        req = urllib.request.Request(
            self.url("/v1/chat/completions"), body, {"Content-Type": "application/json"}
        )
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.load(r)
        dt = time.perf_counter() - t0
        usage = out["usage"]
        return dt, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._log.close()


def _prompt(n_words: int, salt: int) -> str:
    return f"Request {salt}. " + " ".join(
        WORDS[(i * 7 + salt) % len(WORDS)] for i in range(n_words)
    )


def _tinyllama_cache(n: int) -> list[Any]:
    """A TinyLlama-shaped prompt cache: 22 KVCache layers, 4 KV heads of 64, fp16."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    mx.random.seed(0)
    base = mx.random.normal((1, 4, n, 64), dtype=mx.float16)
    out = []
    for j in range(22):
        c = KVCache()
        c.update_and_fetch(base + j, base - j)
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def hot_tier_rows(ctx: Any, n: int) -> list[Row]:
    """In one process: fetch and insert on mlx-lm's LRUPromptCache vs SharedPromptCache."""
    from mlx_lm.models.cache import LRUPromptCache

    from mlxcache.integrations.mlx_lm.prompt_cache import SharedPromptCache

    key = ("model", None, None)
    tokens = list(range(1, n + 1))
    cache = _tinyllama_cache(n)
    nbytes = sum(c.nbytes for c in cache)
    repeat = 3 if ctx.smoke else 20
    plain = LRUPromptCache()
    ours = SharedPromptCache(backend=f"file://{ctx.tmpdir / 'hot-store'}")
    fresh = SharedPromptCache(backend=ours.backend)
    rows: list[Row] = []
    inserts: dict[str, Stats] = {}
    for label, pc in (("LRUPromptCache", plain), ("SharedPromptCache (file://)", ours)):
        pc.fetch_nearest_cache(key, tokens)
        inserts[label] = time_runs(lambda pc=pc: pc.insert_cache(key, tokens, cache), 1)
    fetches: dict[str, Stats] = {}
    for label, pc in (("LRUPromptCache", plain), ("SharedPromptCache (file://)", ours)):
        fetches[label] = time_runs(
            lambda pc=pc: evaluate(pc.fetch_nearest_cache(key, tokens)[0]), repeat, warmup=1
        )
    miss = time_runs(lambda: evaluate(fresh.fetch_nearest_cache(key, tokens)[0]), 1)
    base_f, base_i = fetches["LRUPromptCache"], inserts["LRUPromptCache"]
    rows.append(Row(SECTION, "LRUPromptCache hot fetch", n, nbytes, "s", base_f, note="reference"))
    rows.append(
        Row(
            SECTION,
            "SharedPromptCache hot fetch",
            n,
            nbytes,
            "s",
            fetches["SharedPromptCache (file://)"],
            baseline="LRUPromptCache hot fetch",
            ratio=base_f.median / fetches["SharedPromptCache (file://)"].median,
            ratio_kind="LRUPromptCache / ours (>1 = faster)",
        )
    )
    rows.append(Row(SECTION, "LRUPromptCache insert", n, nbytes, "s", base_i, note="reference"))
    rows.append(
        Row(
            SECTION,
            "SharedPromptCache insert (stores to file://)",
            n,
            nbytes,
            "s",
            inserts["SharedPromptCache (file://)"],
            baseline="LRUPromptCache insert",
            note="what a store costs; mlxcache serve runs it on a writer thread",
        )
    )
    rows.append(
        Row(
            SECTION,
            "SharedPromptCache fetch from file:// (hot miss)",
            n,
            nbytes,
            "s",
            miss,
            baseline="LRUPromptCache hot fetch",
            note="another process's entry: longest + lookup + restore",
        )
    )
    ours.close()
    return rows


def run(ctx: Any, prompt_tokens: int = 2048) -> list[Row]:
    if not have("mlx_lm") or not have("mlxcache.integrations.mlx_lm.server"):
        ctx.note("mlx-lm is not installed: the server TTFT rows are left out.")
        return []
    rows = hot_tier_rows(ctx, 64 if ctx.smoke else prompt_tokens)
    from mlxcache.tiny_models import build_tiny_lm

    smoke = ctx.smoke
    n = 96 if smoke else prompt_tokens
    model = str(build_tiny_lm(ctx.tmpdir / "server-lm", **({} if smoke else BENCH_MODEL)))
    runs = 1 if smoke else max(1, min(ctx.repeat, 2))
    logs = ctx.tmpdir / "server-logs"
    logs.mkdir(exist_ok=True)
    words = max(8, n * 3 // 4)  # the tiny tokenizer: about 1.34 tokens per word here

    def log(name: str) -> Path:
        return logs / f"{name}.log"

    base_cold, base_warm, base_restart = [], [], []
    ours: dict[str, list[float]] = {}
    ours_same: list[float] = []
    tokens = 0
    uris = [("file://", f"file://{ctx.tmpdir / 'server-store'}")]
    if ctx.redis_url and not smoke:
        uris.append(("redis://", ctx.redis_url))
    for i in range(runs):
        content = _prompt(words, i)
        s = _Server(["mlx_lm", "server", "--model", model], log("mlx_lm"))
        try:
            s.ask(_prompt(8, 1000 + i))  # load the model and warm the kernels, untimed
            dt, tokens, _ = s.ask(content)
            base_cold.append(dt)
            dt, _, cached = s.ask(content)
            if cached < tokens - 1:
                raise RuntimeError(f"mlx_lm.server reused only {cached} of {tokens}")
            base_warm.append(dt)
        finally:
            s.stop()
        s = _Server(["mlx_lm", "server", "--model", model], log("mlx_lm"))
        try:
            s.ask(_prompt(8, 2000 + i))
            dt, _, cached = s.ask(content)
            base_restart.append(dt)
        finally:
            s.stop()
        for label, uri in uris:
            first = _Server(["mlxcache", "serve", "--model", model, "--cache", uri], log("a"))
            try:
                first.ask(content)
                dt, _, cached = first.ask(content)
                if label == "file://":
                    ours_same.append(dt)
            finally:
                first.stop()
            second = _Server(["mlxcache", "serve", "--model", model, "--cache", uri], log("b"))
            try:
                second.ask(_prompt(8, 3000 + i))
                dt, _, cached = second.ask(content)
                if cached < tokens - 1:
                    raise RuntimeError(f"mlxcache serve ({label}) reused only {cached}")
                ours.setdefault(label, []).append(dt)
            finally:
                second.stop()

    cold, warm, restart = Stats.of(base_cold), Stats.of(base_warm), Stats.of(base_restart)
    rows.append(Row(SECTION, "mlx_lm.server cold", tokens, None, "s", cold, note="reference"))
    rows.append(
        Row(
            SECTION,
            "mlx_lm.server warm, same process",
            tokens,
            None,
            "s",
            warm,
            baseline="mlx_lm.server cold",
            ratio=cold.median / warm.median,
            ratio_kind="cold / warm (>1 = faster)",
        )
    )
    rows.append(
        Row(
            SECTION,
            "mlx_lm.server after a restart",
            tokens,
            None,
            "s",
            restart,
            baseline="mlx_lm.server cold",
            note="a new process starts cold",
        )
    )
    same = Stats.of(ours_same)
    rows.append(
        Row(
            SECTION,
            "mlxcache serve warm, same process",
            tokens,
            None,
            "s",
            same,
            baseline="mlx_lm.server warm, same process",
            ratio=warm.median / same.median,
            ratio_kind="mlx_lm.server warm / ours (>1 = faster)",
        )
    )
    for label, times in ours.items():
        st = Stats.of(times)
        rows.append(
            Row(
                SECTION,
                f"mlxcache serve warm, new process ({label})",
                tokens,
                None,
                "s",
                st,
                baseline="mlx_lm.server warm, same process",
                ratio=warm.median / st.median,
                ratio_kind="mlx_lm.server warm (same process) / ours (>1 = faster)",
                note=f"{restart.median / st.median:.1f}x faster than mlx_lm.server after a restart",
            )
        )
    return rows
