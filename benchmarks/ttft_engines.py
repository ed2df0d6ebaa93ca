"""The generation paths the TTFT section times: one tiny model and one timed request each.

An engine builds its model (nothing downloaded), makes a seeded prompt of ``n`` tokens and
times one request through mlxcache's integration (``max_tokens=1``): the integration's own
``time_to_first_token``, cache lookup and restore included.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# the tiny mlx-lm model: as deep and wide as the tiny Qwen2-VL (4 layers, width 256)
LM_SHAPE = {"num_layers": 4, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 2}


@dataclass(frozen=True)
class Engine:
    """One generation path: ``engine`` names it for users, ``family`` names the model."""

    engine: str  # "mlx-vlm generation" or "mlx-lm generation"
    family: str  # qwen2_vl, gemma3 (mlx-vlm's tiny models) or llama (mlx-lm's)

    def build(self, folder: Path) -> Any:
        """The model, with the same weights in every process (``folder``: the LM's files)."""
        if self.family == "llama":
            from mlx_lm import load

            from mlxcache.tiny_models import build_tiny_lm

            if not (folder / "config.json").exists():
                build_tiny_lm(folder, intermediate_size=512, **LM_SHAPE)
            return load(str(folder))[0]
        from mlxcache.tiny_models import build_model

        return build_model(self.family, 0)[0]

    def inputs(self, n: int, seed: int = 1) -> tuple[Any, ...]:
        """A seeded ``n``-token prompt (the VLMs: with one image, as their README shows)."""
        import mlx.core as mx

        if self.family == "llama":  # its vocabulary: 512 tokens, the first few special
            return (mx.array(np.random.default_rng(seed).integers(8, 500, size=n).tolist()),)
        ids = np.random.default_rng(seed).integers(1, 990, size=n).tolist()
        if self.family == "qwen2_vl":
            ids[5] = 997  # vision start
            ids[6:22] = [999] * 16
            pixels = np.random.default_rng(2).standard_normal((64, 1176)).astype(np.float32)
            return mx.array([ids]), mx.array(pixels), {"image_grid_thw": mx.array([[1, 8, 8]])}
        ids[6:22] = [999] * 16
        pixels = np.random.default_rng(2).standard_normal((1, 3, 112, 112)).astype(np.float32)
        return mx.array([ids]), mx.array(pixels), {}

    def ttft(self, model: Any, cache: Any, inputs: tuple[Any, ...]) -> tuple[float, int]:
        """Time to first token of one request and the prompt tokens it reused."""
        if self.family == "llama":
            from mlxcache.integrations.mlx_lm import generate_tokens as lm_generate

            r = lm_generate(model, inputs[0], cache=cache, max_tokens=1)
        else:
            from mlxcache.integrations.mlx_vlm import generate_tokens

            ids, pixels, kwargs = inputs
            r = generate_tokens(model, ids, pixels, cache=cache, max_tokens=1, **kwargs)
        return r.time_to_first_token, r.cached_tokens

    def available(self) -> bool:
        from benchmarks.common import have

        if self.family == "llama":
            return have("mlx_lm") and have("mlxcache.integrations.mlx_lm")
        return have("mlx_vlm") and have("mlxcache.integrations.mlx_vlm")


ENGINES = {
    "qwen2_vl": Engine("mlx-vlm generation", "qwen2_vl"),
    "gemma3": Engine("mlx-vlm generation", "gemma3"),
    "llama": Engine("mlx-lm generation", "llama"),
}


def open_cache(store: str, model: Any, salt: str) -> Any:
    """A ``PrefixCache`` without the in-process hot tier: every hit is read from the store."""
    from mlxcache.prefix import PrefixCache
    from mlxcache.prefix.model_id import model_identity

    return PrefixCache(store, model=model_identity(model), salt=salt, hot_bytes=0)


def child(family: str, mode: str, store: str, n: int, salt: str, folder: str) -> dict[str, Any]:
    """In a new process: build the model, open the store and ask for the stored prompt.

    ``restart``: the process's first request (kernels and allocator cold, as after a server
    restart). ``worker``: a live second worker, its kernels warmed on another prompt first.
    """
    engine = ENGINES[family]
    model = engine.build(Path(folder))
    cache = open_cache(store, model, salt)
    if mode == "worker":
        engine.ttft(model, None, engine.inputs(64, seed=7))  # kernels warm, untimed
    t, cached = engine.ttft(model, cache, engine.inputs(n))
    return {"ttft": t, "cached": cached}
