"""The mlx-lm side of the family matrix: mlxcache's generation against mlx-lm's ``generate_step``.

Tiny random-weight models from the configs in ``mlx_lm_configs.json`` (taken from
``test_all_models`` in mlx-lm 0.32.2's tests/test_models.py; gpt_oss from its ``test_gpt_oss`` at
the others' width: hidden 128, 16 experts of 128, a vocabulary of 1,000, its window of 128 kept).
Every answer must equal mlx-lm's uncached ``generate_step`` (greedy tokens, the bytes of every
step's log-probabilities); for a split-sensitive model (recurrent layers) the reference is mlx-lm
resumed at the same splits: its own chunk calls ending at each, then ``generate_step`` on the rest
with that cache.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from families.harness import BLOCK, BRANCH, MAX_TOKENS, PROMPT, digest

CONFIGS = json.loads((Path(__file__).with_name("mlx_lm_configs.json")).read_text())


def build(name: str, seed: int = 0) -> Any:
    import mlx.core as mx

    config = json.loads(json.dumps(CONFIGS[name]))
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def text(name: str, n: int, seed: int) -> list[int]:
    import numpy as np

    vocab = int(CONFIGS[name].get("vocab_size", 1000))
    return np.random.default_rng(seed).integers(1, min(vocab, 1000), size=n).tolist()


def split_sensitive(model: Any) -> bool:
    """Recurrent layers (ArraysCache state): numerics depend on where the prompt is split."""
    from mlx_lm.models.cache import make_prompt_cache

    return any(type(c).__name__ == "ArraysCache" for c in make_prompt_cache(model))


def reference(model: Any, ids: list[int], splits=(), step: int = 2048) -> tuple[list[int], str]:
    """mlx-lm's greedy generate_step with ``prefill_step_size=step``; with ``splits``, resumed
    at each (its own chunk calls, ``step`` tokens at most)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prompt = mx.array(ids)
    start = 0
    for split in splits:
        for s in range(start, split, step):  # mlx-lm's own chunk calls
            model(prompt[s : min(s + step, split)][None], cache=cache)
            mx.eval([c.state for c in cache])
        start = split
    prompt = prompt[start:]
    tokens, logprobs = [], []
    greedy = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    for tok, lp in generate_step(
        prompt,
        model,
        max_tokens=MAX_TOKENS,
        sampler=greedy,
        prompt_cache=cache,
        prefill_step_size=step,
    ):
        tokens.append(int(tok))
        logprobs.append(lp)
    return tokens, digest(logprobs)


def stride(model: Any) -> int:
    """The checkpoint stride mlxcache measures for ``model`` at ``BLOCK`` and the default share."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcache.prefix import checkpoints

    cache = make_prompt_cache(model)
    model(mx.array([[1] * 8]), cache=cache)
    got = checkpoints.stride(cache, BLOCK, checkpoints.DEFAULT_SHARE, 2048)
    assert got is not None
    return got


def check(model: Any, ids: list[int], cache: Any, every: int, branch: int = 0) -> dict:
    """One request against mlx-lm; with a stride ``every`` (recurrent layers), mlx-lm resumed
    at mlxcache's splits: the stride's multiples (2,048 here: none in these prompts, a cold run
    splits where mlx-lm does), ``branch`` (the branch point these prompts share) and the hit's
    length."""
    from mlxcache.integrations.mlx_lm import stream_generate_tokens

    steps = list(stream_generate_tokens(model, ids, cache=cache, max_tokens=MAX_TOKENS))
    result = steps[-1].result
    got = digest([s.logprobs for s in steps])
    n = len(ids)
    splits = (
        []
        if not every
        else sorted({branch, result.cached_tokens, *range(every, n - 1, every)} - {0})
    )
    ref_tokens, ref = reference(model, ids, splits)
    return {
        "exact": result.tokens == ref_tokens and got == ref,
        "tokens": result.tokens,
        "ref_tokens": ref_tokens,
        "cached": result.cached_tokens,
        "cached_flag": result.cached,
    }


def scenarios(name: str, uri: str) -> dict[str, dict]:
    from mlxcache.prefix import PrefixCache
    from mlxcache.prefix.model_id import model_identity

    model = build(name)
    every = stride(model) if split_sensitive(model) else 0
    cache = PrefixCache(uri, model=model_identity(model), block_size=BLOCK, hot_bytes=0)
    ids = text(name, PROMPT, 1)
    out = {"cold": check(model, ids, cache, every)}
    out["warm"] = check(model, ids, cache, every)
    extended = ids + out["warm"]["tokens"] + text(name, 24, 3)
    out["extended"] = check(model, extended, cache, every)
    branched = ids[:BRANCH] + text(name, PROMPT - BRANCH, 4)
    out["branched"] = check(model, branched, cache, every, BRANCH)
    again = ids[:BRANCH] + text(name, PROMPT - BRANCH, 5)  # branches where the last one did
    out["branched_again"] = check(model, again, cache, every, BRANCH)
    return out
