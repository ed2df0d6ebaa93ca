"""One family's scenarios against mlx-vlm's own uncached ``generate_step``, bit for bit.

Every mlxcache run (cold, warm, extended, branched, another image, a new process) must give the
engine's greedy tokens and the bytes of every step's log-probabilities. Where a family's numerics
depend on where the prompt is split (``Spec.split_sensitive``: recurrent layers), the reference is
the engine resumed at the same splits: its chunked prefill stopped at the hit's length and at the
branch point a branched prompt checkpoints (docs/prefix.md "Checkpoints"); a cold run splits
where the engine does (the stride, 2,048 at the default prefill step, lies past these prompts).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PROMPT = 96
BLOCK = 32
BRANCH = 64  # the branched prompt shares this many tokens
MAX_TOKENS = 4


@dataclass
class Spec:
    """A family in the matrix: how to build its tiny model and one prompt with an image.

    ``config``: the ``config.json`` dict. ``image(seed)``: ``(pixel_values, model_kwargs,
    image_token_ids)`` for one image; the tokens are placed at ``IMAGE_AT``. ``text_ids``: the
    range text tokens are drawn from. ``token_kwargs(ids)``: per-token model inputs the
    processor derives from each prompt's ids (e.g. Gemma 4's ``mm_token_type_ids``).
    ``unbuilt``: top-level submodules the spec never runs (a text-only spec's fixed-size vision
    tower), whose random weights are never evaluated. ``expect``: "cached" (any block boundary),
    "refused" (the engine's own path; ``reason`` in its one log line),
    "repeat" (prefilled in one pass by the engine: only an exact repeat of a whole prompt hits).
    ``building``: a context the model is constructed in (e.g. a smaller fixed sub-config the
    family hard-codes).
    """

    name: str
    config: dict[str, Any]
    image: Callable[[int], tuple[Any, dict[str, Any], list[int]]] | None = None
    text_ids: tuple[int, int] = (1, 900)
    expect: str = "cached"
    reason: str = ""
    split_sensitive: bool = False
    token_kwargs: Callable[[list[int]], dict[str, Any]] | None = None
    unbuilt: tuple[str, ...] = ()
    group: str = "vlm"
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    building: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


IMAGE_AT = 8


def build(spec: Spec, seed: int = 0) -> Any:
    """The tiny model with reproducible random weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    cfg = json.loads(json.dumps(spec.config))  # from_dict fills in the dict it is given
    arch, _ = get_model_and_args(cfg)
    model_config = update_module_configs(
        arch.ModelConfig.from_dict(cfg), arch, cfg, ["text", "vision", "audio"]
    )
    mx.random.seed(seed)
    with spec.building():
        model = arch.Model(model_config)
    params = tree_flatten(model.parameters())
    mx.eval([a for name, a in params if name.split(".")[0] not in spec.unbuilt])
    model.eval()
    return model


def text(spec: Spec, n: int, seed: int) -> list[int]:
    lo, hi = spec.text_ids
    return np.random.default_rng(seed).integers(lo, hi, size=n).tolist()


def prompt(spec: Spec, image_seed: int | None = 2, n: int = PROMPT) -> tuple[list, Any, dict]:
    """(ids, pixel_values, model_kwargs): seeded text with the image's tokens at IMAGE_AT."""
    ids = text(spec, n, 1)
    if spec.image is None or image_seed is None:
        return ids, None, {}
    pixels, kwargs, image_ids = spec.image(image_seed)
    ids[IMAGE_AT : IMAGE_AT + len(image_ids)] = image_ids
    return ids, pixels, kwargs


def digest(arrays: list[Any]) -> str:
    import mlx.core as mx

    h = hashlib.sha256()
    for a in arrays:
        h.update(bytes(memoryview(mx.contiguous(a.reshape(-1)))))
    return h.hexdigest()


def reference(model: Any, ids: list[int], pixels: Any, kwargs: dict, splits=()) -> tuple:
    """mlx-vlm's uncached greedy generate_step: (tokens, logprobs digest); with ``splits``, its
    chunked prefill stops at each first (the engine resumed at those splits)."""
    import mlx.core as mx
    from mlx_vlm.generate.ar import generate_step

    x = mx.array([ids])
    more: dict[str, Any] = {}
    if splits:
        more = {
            "prompt_cache_checkpoint": lambda n, cache: None,
            "prompt_cache_checkpoint_lengths": list(splits),
        }
    tokens, logprobs = [], []
    for tok, lp in generate_step(
        x, model, pixels, mx.ones_like(x), max_tokens=MAX_TOKENS, temperature=0.0, **kwargs, **more
    ):
        tokens.append(int(tok))
        logprobs.append(lp)
    return tokens, digest(logprobs)


def ours(model: Any, ids: list[int], pixels: Any, kwargs: dict, cache: Any) -> tuple:
    """mlxcache's generation: (tokens, logprobs digest, the GenerationResult)."""
    from mlxcache.integrations.mlx_vlm import stream_generate_tokens

    steps = list(
        stream_generate_tokens(model, ids, pixels, cache=cache, max_tokens=MAX_TOKENS, **kwargs)
    )
    return steps[-1].result.tokens, digest([s.logprobs for s in steps]), steps[-1].result


def open_cache(model: Any, uri: str) -> Any:
    from mlxcache.prefix import PrefixCache
    from mlxcache.prefix.model_id import model_identity

    return PrefixCache(uri, model=model_identity(model), block_size=BLOCK, hot_bytes=0)


def check(
    spec: Spec, model: Any, ids: list, pixels: Any, kwargs: dict, cache: Any, branch: int = 0
) -> dict:
    """One request through mlxcache against the engine: what a test asserts on; ``branch``:
    where the prompt branches off a stored one (a checkpoint with state layers)."""
    if spec.token_kwargs is not None:
        kwargs = {**kwargs, **spec.token_kwargs(ids)}
    tokens, got, result = ours(model, ids, pixels, kwargs, cache)
    splits: list[int] = []
    if spec.split_sensitive:  # mlxcache's chunks end on the hit and the branch point
        splits = sorted({branch, result.cached_tokens} - {0})
    ref_tokens, ref = reference(model, ids, pixels, kwargs, splits)
    return {
        "tokens": tokens,
        "ref_tokens": ref_tokens,
        "exact": tokens == ref_tokens and got == ref,
        "cached": result.cached_tokens,
        "cached_flag": result.cached,
        "prompt": len(ids),
        "positions": result.prompt_tokens,  # KV cache positions (more when an image expands)
        "vision_cached": result.vision_cached,
    }


def scenarios(spec: Spec, uri: str) -> dict[str, dict]:
    """cold, warm, extended, branched (again, with state layers) and (with an image) image B,
    in this process."""
    model = build(spec)
    cache = open_cache(model, uri)
    ids, pixels, kwargs = prompt(spec)
    out = {"cold": check(spec, model, ids, pixels, kwargs, cache)}
    out["warm"] = check(spec, model, ids, pixels, kwargs, cache)
    question = text(spec, 24, 3)
    extended = ids + out["warm"]["tokens"] + question
    out["extended"] = check(spec, model, extended, pixels, kwargs, cache)
    branched = ids[:BRANCH] + text(spec, PROMPT - BRANCH, 4)
    out["branched"] = check(spec, model, branched, pixels, kwargs, cache, BRANCH)
    if spec.expect == "exact":  # state layers: the next branch there resumes at its checkpoint
        again = ids[:BRANCH] + text(spec, PROMPT - BRANCH, 5)
        out["branched_again"] = check(spec, model, again, pixels, kwargs, cache, BRANCH)
    if spec.image is not None:
        ids_b, pixels_b, kwargs_b = prompt(spec, image_seed=5)
        out["image_b"] = check(spec, model, ids_b, pixels_b, kwargs_b, cache)
    return out


def new_process(spec: Spec, uri: str) -> dict:
    """The warm repeat from a process that never saw the prompt (run in a subprocess)."""
    model = build(spec)
    ids, pixels, kwargs = prompt(spec)
    return check(spec, model, ids, pixels, kwargs, open_cache(model, uri))
