"""Time to first token with the tiny models: uncached, cold, warm, another worker, a restart.

Per generation path (``benchmarks/ttft_engines.py``: mlx-vlm's tiny Qwen2-VL and Gemma 3 with
one image, a tiny mlx-lm llama) and prompt length, through mlxcache's integration
(``max_tokens=1``) on a ``PrefixCache`` (``hot_bytes=0``: every hit is read from the store):

- *uncached*: no cache (the reference);
- *cold*: the first request on an empty cache (a fresh salt): full prefill plus storing the new
  blocks, i.e. what a miss costs;
- *warm*: the same request again in the same process;
- *another worker* (``file://`` only): a second process on the same store, its kernels warmed on
  another prompt, asks for the stored prompt;
- *after a restart* (``file://`` only): a new process whose first request is the stored prompt.

The time is the integration's own ``time_to_first_token`` (lookup and restore included; a
process's start and model load are not). Ratio = cold / warm (> 1 = the cache pays).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import Row, Stats, have
from benchmarks.ttft_engines import ENGINES, Engine, child, open_cache

SECTION = "ttft"
FAMILIES = ("qwen2_vl", "gemma3", "llama")
# the kinds of request, in the order the summary and the chart show them
KINDS = {
    "uncached": "uncached",
    "cold": "cold (a miss)",
    "warm": "warm, same process",
    "worker": "another worker",
    "restart": "after a restart",
}


def _run_child(family: str, mode: str, store: str, n: int, salt: str, folder: Path) -> dict:
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "benchmarks.ttft", family, mode, store, str(n), salt, str(folder)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=root)
    if done.returncode != 0:
        raise RuntimeError(f"ttft child {family} {mode} failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _row(engine: Engine, label: str, kind: str, n: int, st: Stats, **kw: Any) -> Row:
    name = f"{engine.family} uncached" if kind == "uncached" else f"{engine.family} {label} {kind}"
    if kind in ("worker", "restart"):
        name = f"{engine.family} {label} {KINDS[kind]}"
    extra = {"engine": engine.engine, "family": engine.family, "kind": kind, "backend": label}
    return Row(SECTION, name, n, None, "s", st, extra=extra, **kw)


def _engine_rows(engine: Engine, lengths: list[int], uris: list, ctx: Any) -> list[Row]:
    folder = ctx.tmpdir / f"ttft-{engine.family}"
    model = engine.build(folder)
    runs = 1 if ctx.smoke else max(1, min(ctx.repeat, 3))
    rows: list[Row] = []
    for n in lengths:
        inputs = engine.inputs(max(n, 32))
        engine.ttft(model, None, inputs)  # warm up kernels once, untimed
        plain = Stats.of([engine.ttft(model, None, inputs)[0] for _ in range(runs)])
        rows.append(_row(engine, "", "uncached", n, plain, note="reference"))
        for label, uri in uris:
            cold_t, warm_t, salt = [], [], ""
            for _ in range(runs):
                salt = uuid.uuid4().hex
                cache = open_cache(uri, model, salt)
                t, cached = engine.ttft(model, cache, inputs)
                if cached:
                    raise RuntimeError(f"{label}: a cold request found {cached} tokens")
                cold_t.append(t)
                t, cached = engine.ttft(model, cache, inputs)
                if cached < n - 1:
                    raise RuntimeError(f"{label}: a warm request reused only {cached}")
                warm_t.append(t)
            cold, warm = Stats.of(cold_t), Stats.of(warm_t)
            base = f"{engine.family} uncached"
            rows.append(
                _row(
                    engine, label, "cold", n, cold, baseline=base,
                    note=f"{cold.median / plain.median:.2f}x the uncached time",
                )
            )  # fmt: skip
            rows.append(
                _row(
                    engine, label, "warm", n, warm, baseline=f"{engine.family} {label} cold",
                    ratio=cold.median / warm.median, ratio_kind="cold / warm (>1 = faster)",
                    note=f"{plain.median / warm.median:.1f}x faster than uncached",
                )
            )  # fmt: skip
            if label != "file://":
                continue
            for mode in ("worker", "restart"):  # the last salt's entry, read by new processes
                got = [_run_child(engine.family, mode, uri, n, salt, folder) for _ in range(runs)]
                if min(g["cached"] for g in got) < n - 1:
                    raise RuntimeError(f"{mode}: a new process reused only {got}")
                st = Stats.of([g["ttft"] for g in got])
                rows.append(
                    _row(
                        engine, label, mode, n, st, baseline=base,
                        ratio=plain.median / st.median, ratio_kind="uncached / this (>1 = faster)",
                        note=f"new process; reused {got[0]['cached']} tokens",
                    )
                )  # fmt: skip
    return rows


def run(lengths: list[int], ctx: Any) -> list[Row]:
    if not have("mlxcache.prefix"):
        ctx.note("mlxcache.prefix had not landed: TTFT rows are left out.")
        return []
    uris = []
    if have("mlxcache.backends.disk"):
        uris.append(("file://", f"file://{ctx.tmpdir / 'ttft-store'}"))
    if ctx.redis_url and have("mlxcache.backends.redis") and not ctx.smoke:
        uris.append(("redis://", ctx.redis_url))
    families = ("qwen2_vl", "llama") if ctx.smoke else FAMILIES
    rows: list[Row] = []
    for family in families:
        engine = ENGINES[family]
        if not engine.available():
            ctx.note(f"ttft: {engine.engine} ({family}) is not installed: its rows are left out.")
            continue
        rows += _engine_rows(engine, lengths if not ctx.smoke else lengths[:1], uris, ctx)
    for _, uri in uris:
        from mlxcache import open_backend

        backend = open_backend(uri)
        backend.clear()
        backend.close()
    return rows


if __name__ == "__main__":
    family, mode, store, n, salt, folder = sys.argv[1:7]
    print(json.dumps(child(family, mode, store, int(n), salt, folder)))
