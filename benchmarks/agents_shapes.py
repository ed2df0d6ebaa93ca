"""Bytes of the agent workload (benchmarks/agents.py) on caches of real models' shapes.

What a store holds per token depends on the shapes of a model's caches, not on its weights, so
each group runs the workload through mlxcache's own prefill (``resume.lookup`` and
``resume.finish_prompt``: the checkpoint policy, branch points and stores of generation) with a
stand-in for the model that fills real mlx-lm cache objects of one period of a real model's
layer pattern (the ratio of stored bytes to block bytes does not change with the number of
periods):

- dense: Qwen2.5-7B, one layer (4 KV heads, head dim 128);
- sliding: Gemma 3 4B, one 5:1 period (5 layers with a 1,024-token window, 1 global; 4 KV
  heads, head dim 256);
- chunked: Llama 4 Scout, one 3:1 period (3 layers chunked at 8,192 tokens, 1 global; 8 KV
  heads, head dim 128);
- recurrent: Qwen3-Next-80B-A3B, one 3:1 period (3 gated-delta layers: conv state 3 x 8,192
  bf16 and a 32 x 128 x 128 float32 state; 1 attention layer, 2 KV heads, head dim 256).

Prefill chunks of 2,048 tokens (mlx-lm's default) on blocks of 256 (the workload's).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.common import Row, Stats

SECTION = "agents"
STEP = 2048


def _kv(heads: int, dim: int) -> Callable[[], Any]:
    from mlx_lm.models.cache import KVCache

    return lambda: (KVCache(), heads, dim)


def _window(size: int, heads: int, dim: int) -> Callable[[], Any]:
    from mlx_lm.models.cache import RotatingKVCache

    return lambda: (RotatingKVCache(max_size=size, keep=0), heads, dim)


def _chunked(size: int, heads: int, dim: int) -> Callable[[], Any]:
    from mlx_lm.models.cache import ChunkedKVCache

    return lambda: (ChunkedKVCache(size), heads, dim)


def _state() -> Callable[[], Any]:
    from mlx_lm.models.cache import ArraysCache

    return lambda: (ArraysCache(2), 0, 0)


SHAPES: dict[str, tuple[str, list[Callable[[], Any]]]] = {
    "dense": ("Qwen2.5-7B", [_kv(4, 128)]),
    "sliding": ("Gemma 3 4B", [_window(1024, 4, 256)] * 5 + [_kv(4, 256)]),
    "chunked": ("Llama 4 Scout", [_chunked(8192, 8, 128)] * 3 + [_kv(8, 128)]),
    "recurrent": ("Qwen3-Next-80B-A3B", [_state()] * 3 + [_kv(2, 256)]),
}


def _feed(layer: tuple[Any, int, int], n: int) -> None:
    """What a model's forward pass leaves in one cache after ``n`` more tokens (zeros: a
    store's bytes do not depend on the values)."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, ChunkedKVCache

    cache, heads, dim = layer
    if isinstance(cache, ArraysCache):
        cache[0] = mx.zeros((1, 3, 8192), mx.bfloat16)
        cache[1] = mx.zeros((1, 32, 128, 128), mx.float32)
        return
    if isinstance(cache, ChunkedKVCache):
        cache.maybe_trim_front()
    x = mx.zeros((1, heads, n, dim), mx.bfloat16)
    cache.update_and_fetch(x, x)


class ShapeWorker:
    """A server of the workload whose model is a stand-in filling caches of real shapes."""

    def __init__(self, makers: list[Callable[[], Any]], uri: str, block: int, salt: str) -> None:
        from mlxcache import PrefixCache

        self.makers = makers
        self.pc = PrefixCache(uri, model="agents-shapes", salt=salt, block_size=block, hot_bytes=0)
        self.rng = np.random.default_rng(11)

    def ask(self, prompt: list[int], answer: int) -> tuple[int, list[int]]:
        """(tokens reused, the answer's stand-in tokens) of one request."""
        import mlx.core as mx

        from mlxcache.integrations import resume

        layers = [make() for make in self.makers]
        fresh = [c for c, _, _ in layers]
        found = resume.lookup(self.pc, prompt, fresh)
        if found.hit is not None and found.hit.prompt_cache is not None:
            layers = [
                (c, h, d) for c, (_, h, d) in zip(found.hit.prompt_cache, layers, strict=True)
            ]
        cache = [c for c, _, _ in layers]

        def run(s: int, e: int) -> None:
            for layer in layers:
                _feed(layer, e - s)
            mx.eval([c.state for c in cache])

        resume.finish_prompt(run, cache, prompt, found.num_tokens, cache=self.pc, step_size=STEP,
                             branch=found.branch)  # fmt: skip
        return found.num_tokens, self.rng.integers(1, 1000, size=answer).tolist()

    def close(self) -> None:
        self.pc.close()


def _maker(makers: list[Callable[[], Any]], uri: str, block: int, salt: str) -> Any:
    return lambda: ShapeWorker(makers, uri, block, salt)


def run(size: dict[str, int], ctx: Any, workload: Callable[..., tuple[int, int]],
        stored_bytes: Callable[[str, str, str, int], tuple[int, int]]) -> list[Row]:  # fmt: skip
    """Per group and workload kind: the stored bytes over the block records alone."""
    rows = []
    for group, (model, makers) in SHAPES.items():
        for kind in ("chat", "document"):
            uri, salt = f"file://{ctx.tmpdir / 'agents-shapes'}", uuid.uuid4().hex
            make = _maker(makers, uri, size["block"], salt)
            reused, reusable = workload(make, size, kind, 1)
            total, blocks = stored_bytes(uri, "agents-shapes", salt, size["block"])
            ratio = total / blocks if blocks else 0.0
            rows.append(
                Row(
                    SECTION,
                    f"{group} ({model} shapes), {kind}: bytes stored over the block records alone",
                    reusable,
                    total,
                    "ratio",
                    Stats.of([ratio]),
                    target="<= 1.25x",
                    met=bool(blocks) and ratio <= 1.25,
                    note=f"{reused} of {reusable} reusable tokens reused; "
                    f"{total} bytes in all, {blocks} in block records",
                )
            )
    return rows
